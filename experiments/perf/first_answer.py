"""The first answer: ``minimize`` against SciPy's L-BFGS-B, call by call, in one process.

    python -m experiments.perf.first_answer [--rounds 3] [--only numpy,numpy_loop,jax,fresh,warm,leaves,memory]

Every case times hdm_optax and SciPy on the same function, interleaved, and prints the
ratio hdm_optax / SciPy of each call (float64, CPU):

- ``numpy``: a NumPy logistic regression (2000 x 200, ``jac=True``), a new function, new
  data and a new x0 at every call (calls 2 and later: the method's program exists);
- ``numpy_loop``: the same, ``8 x rounds`` calls in a loop, SciPy's and hdm_optax's
  interleaved call by call: the medians (the first three calls, which compile, excluded);
- ``jax``: a JAX logistic regression (4000 x 300), a new objective of the same shapes at
  every call; SciPy's side jits ``value_and_grad`` of each afresh;
- ``fresh``: the first call in a new process (imports excluded), SciPy's against
  hdm_optax's with an empty program store and with the store holding the method's program,
  and against optax's documented L-BFGS loop under ``jax.jit`` (what compiling an L-BFGS
  program costs a JAX user);
- ``warm``: the same objective again, after the first calls, on the problems of
  ``experiments.perf.compile`` (a logistic regression, 8000 x 800, the same in a box, and a
  nonnegative least squares, 3000 x 1500; data in ``args``);
- ``leaves``: the first call on a dict of 1000 3-vectors, against the first call of
  ``jax.jit(jax.value_and_grad(f))`` plus SciPy's run on it;
- ``memory``: 200 objectives that differ by a float, the resident memory after them over
  the memory after the first, and after ``hdm_optax.clear_caches()``;
- ``crossover``: the time per iteration of a compiled run on the separate path against the
  fused program, by n (``solve(trial_lbfgs())`` on a chained quadratic, 50 steps, warm).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.flatten_util  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.optimize  # noqa: E402

import hdm_optax  # noqa: E402


def _numpy_logistic(seed: int, rows: int = 2000, cols: int = 200):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(rows, cols)) / np.sqrt(cols)
  y = np.sign(a @ rng.normal(size=cols) + 0.1 * rng.normal(size=rows))
  scale = 1.0 + 0.01 * seed

  def fun(w):
    z = -y * (a @ w)
    value = np.sum(np.logaddexp(0.0, z)) + 0.5 * scale * w @ w
    return value, a.T @ (-y / (1.0 + np.exp(-z))) + scale * w

  return fun, rng.normal(size=cols) * 0.1


def _jax_logistic(seed: int, rows: int = 4000, cols: int = 300):
  rng = np.random.default_rng(seed)
  a = jnp.asarray(rng.normal(size=(rows, cols)) / np.sqrt(cols))
  y = jnp.asarray(np.sign(rng.normal(size=rows)))
  scale = 1e-3 * (1.0 + seed)

  def fun(w):  # a new function object (and a new constant) per seed: a new objective
    return jnp.mean(jnp.logaddexp(0.0, -y * (a @ w))) + scale * jnp.sum(w**2)

  return fun, jnp.zeros(cols)


def _scipy_numpy(fun, x0):
  return scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B")


def _scipy_jax(fun, x0):
  vg = jax.jit(jax.value_and_grad(fun))
  host = lambda w: tuple(np.asarray(v) for v in vg(jnp.asarray(w)))
  return scipy.optimize.minimize(host, np.asarray(x0), jac=True, method="L-BFGS-B")


def _timed(call):
  start = time.perf_counter()
  out = call()
  jax.block_until_ready(getattr(out, "x", out))
  return time.perf_counter() - start, out


def _row(name, ours, theirs, extra=""):
  print(
    f"  {name:<28} hdm_optax {ours:9.4f} s  SciPy {theirs:9.4f} s  ratio {ours / theirs:6.2f}{extra}"
  )


def case_numpy(rounds: int) -> None:
  print("numpy: a NumPy fun with jac=True, new function, data and x0 at each call")
  for call in range(1, rounds + 2):
    fun, x0 = _numpy_logistic(100 + call)
    theirs, ref = _timed(lambda: _scipy_numpy(fun, x0))
    ours, res = _timed(lambda: hdm_optax.minimize(fun, x0, jac=True))
    _row(
      f"call {call}",
      ours,
      theirs,
      f"  f {res.fun:.8g} vs {ref.fun:.8g}, nfev {res.nfev} vs {ref.nfev}",
    )


def case_numpy_loop(rounds: int) -> None:
  calls = 8 * rounds
  print(f"numpy_loop: the numpy case, {calls} calls in a loop, interleaved (medians)")
  problems = [_numpy_logistic(300 + i) for i in range(calls + 3)]
  times = {"hdm_optax": [], "SciPy": []}
  for i, (fun, x0) in enumerate(problems):
    theirs = _timed(lambda: _scipy_numpy(fun, x0))[0]
    ours = _timed(lambda: hdm_optax.minimize(fun, x0, jac=True))[0]
    if i >= 3:
      times["SciPy"].append(theirs)
      times["hdm_optax"].append(ours)
  ours, theirs = (float(np.median(times[k])) for k in ("hdm_optax", "SciPy"))
  _row(f"calls 4-{calls + 3}, medians", ours, theirs)


def case_jax(rounds: int) -> None:
  print("jax: a new JAX objective of the same shapes at each call")
  for call in range(1, rounds + 2):
    fun, x0 = _jax_logistic(200 + call)
    theirs, ref = _timed(lambda: _scipy_jax(fun, x0))
    fun, x0 = _jax_logistic(200 + call)  # a fresh function object for hdm_optax too
    ours, res = _timed(lambda: hdm_optax.minimize(fun, x0))
    _row(f"call {call}", ours, theirs, f"  f {float(res.fun):.10g} vs {ref.fun:.10g}")


_FRESH = """
import os, sys, time
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, scipy.optimize
import hdm_optax
sys.path.insert(0, {root!r})
from experiments.perf.first_answer import _jax_logistic, _scipy_jax
from experiments.perf.compile import _optax_loop
fun, x0 = _jax_logistic(7)
jnp.zeros(()).block_until_ready()
start = time.perf_counter()
side = {side!r}
if side == "scipy":
  out = _scipy_jax(fun, x0).x
elif side == "optax.lbfgs":
  out = _optax_loop(fun)(jnp.asarray(x0), ())[0]
else:
  out = hdm_optax.minimize(fun, x0).x
jax.block_until_ready(out)
print(time.perf_counter() - start)
"""


def _fresh(side: str, store: str) -> float:
  """Seconds of the first call of ``side`` (scipy, optax.lbfgs, hdm_optax) in a new process."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, HDM_OPTAX_PROGRAM_CACHE=store)
  code = _FRESH.format(root=root, side=side)
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(out.stderr)
  return float(out.stdout.strip().splitlines()[-1])


def case_fresh(rounds: int) -> None:
  print("fresh: the first minimize of a new process (imports excluded)")
  with tempfile.TemporaryDirectory() as folder:
    store = os.path.join(folder, "programs")
    for r in range(1, rounds + 1):
      empty = os.path.join(folder, f"empty{r}")
      theirs = _fresh("scipy", empty)
      loop = _fresh("optax.lbfgs", empty)
      cold = _fresh("hdm_optax", empty)
      warm = _fresh("hdm_optax", store if r > 1 else empty)
      if r == 1:
        _fresh("hdm_optax", store)  # fills the store
        warm = _fresh("hdm_optax", store)
      print(
        f"  round {r}: SciPy {theirs:.3f} s, empty store {cold:.3f} s ({cold / theirs:.2f}x), "
        f"store holding the program {warm:.3f} s ({warm / theirs:.2f}x); "
        f"optax.lbfgs's jitted loop {loop:.3f} s ({loop / theirs:.2f}x)"
      )


def case_warm(rounds: int) -> None:
  from experiments.perf import compile as compile_lib  # pylint: disable=import-outside-toplevel

  print("warm: the same objective again (after two calls), the problems of perf.compile")
  for name in compile_lib.PROBLEMS:
    fun, x0, data = compile_lib._data(name)  # pylint: disable=protected-access
    bounds = compile_lib.BOUNDS.get(name)
    vg = jax.jit(jax.value_and_grad(fun))
    host = lambda w, vg=vg, data=data: tuple(np.asarray(v) for v in vg(jnp.asarray(w), *data))
    scipy_bounds = None if bounds is None else [bounds] * x0.size
    scipy_call = lambda: scipy.optimize.minimize(
      host, np.asarray(x0), jac=True, method="L-BFGS-B", bounds=scipy_bounds
    )
    ours_call = lambda: hdm_optax.minimize(fun, x0, args=data, bounds=bounds)
    for _ in range(3):  # the separate runs, then the fused program
      scipy_call(), jax.block_until_ready(ours_call().x)
    best_ours = best_theirs = np.inf
    for _ in range(max(rounds, 3)):
      best_theirs = min(best_theirs, _timed(scipy_call)[0])
      best_ours = min(best_ours, _timed(ours_call)[0])
    _row(name, best_ours, best_theirs)


def case_leaves(rounds: int) -> None:
  del rounds
  print("leaves: the first call on a dict of 1000 3-vectors")
  rng = np.random.default_rng(5)
  targets = {f"w{i:04d}": jnp.asarray(rng.normal(size=3)) for i in range(1000)}
  x0 = {k: jnp.zeros(3) for k in targets}

  def fun(p):
    return sum(jnp.sum((1.0 + 0.1 * i) * (p[k] - targets[k]) ** 2) for i, k in enumerate(p))

  flat, unravel = jax.flatten_util.ravel_pytree(x0)
  start = time.perf_counter()
  vg = jax.jit(jax.value_and_grad(lambda v: fun(unravel(v))))
  host = lambda v: tuple(np.asarray(a) for a in vg(jnp.asarray(v)))
  ref = scipy.optimize.minimize(host, np.asarray(flat), jac=True, method="L-BFGS-B")
  theirs = time.perf_counter() - start
  ours, res = _timed(lambda: hdm_optax.minimize(fun, x0))
  _row("first call", ours, theirs, f"  f {float(res.fun):.6g} vs {ref.fun:.6g}")


def _resident_mb() -> float:
  with open("/proc/self/statm") as file:
    return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def case_memory(rounds: int) -> None:
  del rounds
  print("memory: 200 objectives that differ by a float")
  rng = np.random.default_rng(9)
  a, y = jnp.asarray(rng.normal(size=(200, 20))), jnp.asarray(np.sign(rng.normal(size=200)))
  base = None
  for i in range(200):
    c = 1e-3 * (1 + i)
    fun = lambda w, c=c: jnp.sum(jnp.logaddexp(0.0, -y * (a @ w))) + c * jnp.sum(w**2)
    hdm_optax.minimize(fun, jnp.zeros(20))
    if i == 0:
      gc.collect()
      base = _resident_mb()
  gc.collect()
  after = _resident_mb()
  hdm_optax.clear_caches()
  gc.collect()
  cleared = _resident_mb()
  print(
    f"  after the first {base:.0f} MB, after 200 {after:.0f} MB (+{after - base:.0f} MB), "
    f"after clear_caches() {cleared:.0f} MB (+{cleared - base:.0f} MB)"
  )


def case_crossover(rounds: int) -> None:
  from hdm_optax.driver import separate  # pylint: disable=import-outside-toplevel

  print("crossover: ms per iteration, warm, separate path against the fused program")

  def fun(x, a):
    return 0.5 * jnp.sum(a * (x - 1.0) ** 2) + jnp.sum((x[1:] - x[:-1] ** 2) ** 2)

  default = separate.SEPARATE_RUNS
  try:
    for n in (10, 1000, 100_000, 1_000_000):
      a = jnp.linspace(1.0, 10.0, n)
      call = lambda: (
        hdm_optax.solve(
          hdm_optax.trial_lbfgs(), fun, jnp.zeros(n), fun_args=(a,), max_steps=50, tol=0.0
        ).params
      )
      times = {}
      for path, runs_ in (("separate", 10**9), ("fused", 0)):
        separate.SEPARATE_RUNS = runs_
        call()
        times[path] = min(_timed(call)[0] for _ in range(max(rounds, 3))) / 50 * 1e3
      print(
        f"  n = {n:>9,}: separate {times['separate']:8.3f} ms, fused {times['fused']:8.3f} ms, "
        f"ratio {times['separate'] / times['fused']:5.2f}"
      )
  finally:
    separate.SEPARATE_RUNS = default


CASES = {
  "numpy": case_numpy,
  "numpy_loop": case_numpy_loop,
  "jax": case_jax,
  "fresh": case_fresh,
  "warm": case_warm,
  "leaves": case_leaves,
  "memory": case_memory,
  "crossover": case_crossover,
}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--only", default=",".join(CASES))
  args = parser.parse_args(argv)
  for name in args.only.split(","):
    CASES[name.strip()](args.rounds)


if __name__ == "__main__":
  main()
