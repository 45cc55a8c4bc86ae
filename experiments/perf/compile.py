"""Cold (compile included) and warm seconds of a first solve, against optax.lbfgs and SciPy.

    python -m experiments.perf.compile [--rounds 5]           # side by side, one process
    python -m experiments.perf.compile --fresh [--repeats 3] [--cache]

What a user waits for the first answer of a one-off problem, float64 on the CPU, each
solver called as its users call it (imports and data excluded, the first call's tracing,
lowering, XLA compile and run included).

By default the solvers run side by side in one process: ``--rounds`` rounds, each calling
every solver once on every problem after ``jax.clear_caches()`` (so every call traces and
compiles anew), in an order that turns with the round; it prints each solver's median
cold call and XLA compile over the rounds and, round by round, the ratios the targets are
about (``minimize``'s cold call over SciPy's, ``minimize``'s XLA compile over optax's
loop's), so that the load of a shared machine falls on both sides of a ratio alike. With
``--fresh`` each cold time is a fresh process's instead (JAX's start-up included, on both
sides), and ``--cache`` adds a row per JAX solver whose process finds the programs in
JAX's persistent compilation cache (``hdm_optax.enable_compilation_cache``),
filled by an earlier process. The solvers:

- ``minimize``: ``hdm_optax.minimize(f, x0, args=data[, bounds=(0, None)])``;
- ``solve``: ``hdm_optax.solve(trial_lbfgs(), f, x0, max_steps=15000, tol=1e-5,
  fun_args=data)``;
- ``optax.lbfgs``: optax's documented L-BFGS loop (``optax.value_and_grad_from_state``,
  ``lax.while_loop`` until ``||grad||_2 < 1e-5`` or 15000 steps, under ``jax.jit``);
- ``scipy``: ``scipy.optimize.minimize(method="L-BFGS-B", jac=True)`` on the jitted
  ``jax.value_and_grad(f)`` (its default ``gtol=1e-5``).

Problems: logistic regression (8000 x 800 Gaussian data, noisy labels, the summed loss,
as in the paper), the same in the box ``-0.5 <= x <= 0.5`` (``box_logistic``) and
nonnegative least squares (3000 x 1500, ``0.5 ||A x - b||^2 / m`` with ``x >= 0``);
optax.lbfgs has no bounds and is left out of the bounded ones. ``warm`` is the best of
``--repeats`` further calls in that process. ``trace``, ``lower`` and ``xla`` split the
cold call's compile into JAX's tracing to a jaxpr, lowering to StableHLO and XLA's
compile (summed over the call's jitted functions, from ``jax.monitoring``). ``--cache``
adds a row per JAX solver run with JAX's persistent compilation cache
(``jax_compilation_cache_dir``), filled by an earlier process (docs/speed.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

PROBLEMS = ("logistic", "nnls", "box_logistic")
BOUNDS = {"nnls": (0.0, None), "box_logistic": (-0.5, 0.5)}
SOLVERS = ("minimize", "solve", "optax.lbfgs", "scipy")
MAX_STEPS = 15000
TOL = 1e-5


def _data(problem):
  import jax
  import jax.numpy as jnp

  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  if problem in ("logistic", "box_logistic"):
    m, n = 8000, 800
    A = jax.random.normal(k1, (m, n)) / jnp.sqrt(n)
    w = jax.random.normal(k2, (n,))
    y = jnp.sign(A @ w + 0.5 * jax.random.normal(k3, (m,)))

    def f(x, A, y):
      return jnp.sum(jnp.logaddexp(0.0, -y * (A @ x)))

    return f, jnp.zeros(n), (A, y)
  m, n = 3000, 1500
  A = jax.random.normal(k1, (m, n))
  x = jnp.maximum(jax.random.normal(k2, (n,)), 0.0)
  b = A @ x + 0.1 * jax.random.normal(k3, (m,))

  def f(x, A, b):
    r = A @ x - b
    return 0.5 * jnp.dot(r, r) / A.shape[0]

  return f, jnp.zeros(n), (A, b)


def _optax_loop(f):
  """optax's documented L-BFGS loop (the "L-BFGS" section of optax's docs), jitted."""
  import jax
  import optax
  import optax.tree_utils as otu

  opt = optax.lbfgs()

  @jax.jit
  def run(x0, *data):
    fun = lambda x: f(x, *data)
    value_and_grad = optax.value_and_grad_from_state(fun)

    def step(carry):
      params, state = carry
      value, grad = value_and_grad(params, state=state)
      updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=fun)
      return optax.apply_updates(params, updates), state

    def more(carry):
      _, state = carry
      count = otu.tree_get(state, "count")
      err = otu.tree_norm(otu.tree_get(state, "grad"))
      return (count == 0) | ((count < MAX_STEPS) & (err >= TOL))

    return jax.lax.while_loop(more, step, (x0, opt.init(x0)))

  return lambda x0, data: run(x0, *data)


def _call(solver, problem):
  """A function of no argument that solves ``problem`` as ``solver``'s users call it."""
  import jax
  import numpy as np

  import hdm_optax

  f, x0, data = _data(problem)
  bounds = BOUNDS.get(problem)
  if solver == "minimize":
    return lambda: hdm_optax.minimize(f, x0, args=data, bounds=bounds)
  if solver == "solve":
    lower, upper = (None, None) if bounds is None else bounds
    opt = hdm_optax.trial_lbfgs(lower=lower, upper=upper)
    return lambda: hdm_optax.solve(opt, f, x0, max_steps=MAX_STEPS, tol=TOL, fun_args=data)
  if solver == "optax.lbfgs":
    run = _optax_loop(f)
    return lambda: run(x0, data)
  import scipy.optimize

  oracle = jax.jit(jax.value_and_grad(f))

  def fun(x):
    value, grad = oracle(x, *data)
    return float(value), np.asarray(grad, np.float64)

  scipy_bounds = [bounds] * x0.size if bounds is not None else None
  return lambda: scipy.optimize.minimize(
    fun, np.zeros(x0.size), jac=True, method="L-BFGS-B", bounds=scipy_bounds
  )


def _steps(out) -> str:
  if hasattr(out, "num_grad_evals"):
    return f"{int(out.num_grad_evals)} calls, |g| {float(out.grad_norm):.1e}"
  if hasattr(out, "nfev"):
    return f"{out.nfev} calls"
  import optax.tree_utils as otu

  return f"{int(otu.tree_get(out[1], 'count'))} steps"


def one(solver, problem, repeats, cache_dir=None) -> dict:
  """Times ``solver`` on ``problem`` in this process (call it in a fresh one)."""
  import jax

  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_platforms", "cpu")
  if cache_dir:
    from hdm_optax.compilation_cache import enable_compilation_cache

    enable_compilation_cache(cache_dir)
  split = _listen()
  fn = _call(solver, problem)
  jax.block_until_ready(jax.tree.leaves(_data(problem)[2]))
  split.clear()
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  cold = time.perf_counter() - start
  parts = dict(split)
  warm = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    warm.append(time.perf_counter() - start)
  return dict(cold=cold, warm=min(warm, default=float("nan")), result=_steps(out), **parts)


_PHASES = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "xla",
}


def _listen() -> collections.Counter:
  """A counter of the seconds JAX spends tracing, lowering and compiling, from now on."""
  from jax import monitoring

  split = collections.Counter()

  def listen(event, seconds, **_):
    if event in _PHASES:
      split[_PHASES[event]] += seconds

  monitoring.register_event_duration_secs_listener(listen)
  return split


def _pairs(problems, solvers):
  return [(p, s) for p in problems for s in solvers if not (p in BOUNDS and s == "optax.lbfgs")]


def side_by_side(problems, solvers, rounds) -> dict:
  """(problem, solver) -> the rounds' cold calls in this process (see the docstring)."""
  import jax

  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_platforms", "cpu")
  split = _listen()
  pairs = _pairs(problems, solvers)
  calls = {pair: _call(pair[1], pair[0]) for pair in pairs}
  for problem in problems:
    jax.block_until_ready(jax.tree.leaves(_data(problem)[2]))
  jax.block_until_ready(calls[pairs[0]]())  # JAX's own start-up, on no solver's account
  out = {pair: [] for pair in pairs}
  for r in range(rounds):
    for pair in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
      jax.clear_caches()
      split.clear()
      start = time.perf_counter()
      result = jax.block_until_ready(calls[pair]())
      out[pair].append(dict(cold=time.perf_counter() - start, result=_steps(result), **split))
  return out


def _report(runs, problems) -> None:
  median = lambda xs: sorted(xs)[len(xs) // 2]
  print(f"{'problem':<13} {'solver':<12} {'cold':>7} {'xla':>7}   (medians)   result")
  for (problem, solver), rs in runs.items():
    cold, xla = median([r["cold"] for r in rs]), median([r.get("xla", 0.0) for r in rs])
    print(f"{problem:<13} {solver:<12} {cold:7.2f} {xla:7.2f}   {rs[-1]['result']}")
  print("round by round:")
  for problem in problems:
    rows = []
    for solver, other, key in (("minimize", "scipy", "cold"), ("minimize", "optax.lbfgs", "xla")):
      mine, theirs = runs.get((problem, solver)), runs.get((problem, other))
      if mine and theirs:
        ratios = [a.get(key, 0.0) / b.get(key, float("nan")) for a, b in zip(mine, theirs)]
        rows.append(f"{solver} {key} / {other}'s: " + " ".join(f"{x:.2f}" for x in ratios))
    print(f"  {problem}: " + "; ".join(rows))


def _child(solver, problem, repeats, cache_dir=None) -> dict:
  cmd = [sys.executable, "-m", "experiments.perf.compile", "--one", solver, problem]
  cmd += ["--repeats", str(repeats)] + (["--cache-dir", cache_dir] if cache_dir else [])
  out = subprocess.run(cmd, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _row(problem, label, r):
  split = " ".join(f"{k} {r.get(k, 0.0):5.2f}" for k in ("trace", "lower", "xla"))
  print(
    f"{problem:<9} {label:<18} {r['cold']:7.2f} {r['warm']:7.3f}   {split}   {r['result']}",
    flush=True,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--one", nargs=2, metavar=("SOLVER", "PROBLEM"), help=argparse.SUPPRESS)
  parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
  parser.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=SOLVERS)
  parser.add_argument("--rounds", type=int, default=5, help="side by side: rounds")
  parser.add_argument("--fresh", action="store_true", help="a fresh process per cold call")
  parser.add_argument("--cache", action="store_true", help="also time a warm persistent cache")
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(one(*args.one, args.repeats, args.cache_dir)))
    return
  import jax

  print(f"jax {jax.__version__}, float64, CPU ({os.cpu_count()} cores); seconds")
  if not args.fresh:
    _report(side_by_side(args.problems, args.solvers, args.rounds), args.problems)
    return
  print(f"{'problem':<9} {'solver':<18} {'cold':>7} {'warm':>7}   compile split of the cold call")
  for problem, solver in _pairs(args.problems, args.solvers):
    _row(problem, solver, _child(solver, problem, args.repeats))
    if args.cache and solver != "scipy":
      with tempfile.TemporaryDirectory() as cache_dir:
        _child(solver, problem, 0, cache_dir)  # fills the cache
        _row(problem, solver + " +cache", _child(solver, problem, args.repeats, cache_dir))


if __name__ == "__main__":
  main()
