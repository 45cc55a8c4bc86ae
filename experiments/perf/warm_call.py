"""The time of a warm ``solve`` / ``minimize`` call, in two checkouts, interleaved in one process.

    python -m experiments.perf.warm_call --baseline ../main [--rounds 7] [--calls 50]

A warm call is one whose program is compiled already: what a user pays per call when
solving many problems of one shape. The problem is a logistic regression with n = 10
parameters and 200 rows (float64, CPU by default), solved to ``tol=1e-6`` by
``solve(trial_lbfgs(), ...)`` with the data in ``fun_args``, the same with the data
closed over in ``fun``, ``minimize(fun, x0, args=...)``, and one call of
``value_and_grad_from_state(fun)`` (a step of one's own loop). Both checkouts'
``hdm_optax`` are imported into this process (each under its own modules), and each
round times ``--calls`` calls of each case with one and then the other, so both see the
same machine; the tables give the median and the minimum over rounds of the per-call mean
(ms), the difference and the ratio this checkout / baseline.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parents[2]


def load(tree: pathlib.Path):
  """The ``hdm_optax`` package of ``tree``, imported under its own module objects."""
  sys.path.insert(0, str(tree))
  try:
    import hdm_optax  # pylint: disable=import-outside-toplevel

    assert pathlib.Path(hdm_optax.__file__).resolve().is_relative_to(tree.resolve())
    return hdm_optax
  finally:
    sys.path.remove(str(tree))
    for name in [m for m in sys.modules if m == "hdm_optax" or m.startswith("hdm_optax.")]:
      del sys.modules[name]


def logistic(w, a, y):
  return jnp.sum(jnp.logaddexp(0.0, -y * (a @ w)))


def cases(lib, a, y):
  """name -> a call that solves the problem once and waits for the result."""
  closed = lambda w: logistic(w, a, y)
  x0 = jnp.zeros(a.shape[1])
  vg = lib.value_and_grad_from_state(logistic)
  state = lib.trial_lbfgs().init(x0)
  solve = lambda fun, args: lib.solve(
    lib.trial_lbfgs(), fun, x0, max_steps=500, tol=1e-6, fun_args=args
  )
  return {
    "solve, fun_args": lambda: solve(logistic, (a, y)).params.block_until_ready(),
    "solve, closure": lambda: solve(closed, ()).params.block_until_ready(),
    "minimize, args": lambda: lib.minimize(logistic, x0, args=(a, y)).params.block_until_ready(),
    "value_and_grad_from_state": lambda: vg(x0, a, y, state=state)[0].block_until_ready(),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--baseline", required=True, help="the other checkout's root")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--calls", type=int, default=50)
  args = p.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=(200, 10)))
  y = jnp.sign(a @ jnp.ones(10) + 0.1)
  trees = {"baseline": pathlib.Path(args.baseline), "this": HERE}
  runs = {k: cases(load(tree), a, y) for k, tree in trees.items()}
  times = {(k, c): [] for k in runs for c in runs[k]}
  for run in runs.values():  # compile
    for call in run.values():
      call()
  for _ in range(args.rounds):
    for case in runs["this"]:
      for k, run in runs.items():
        start = time.perf_counter()
        for _ in range(args.calls):
          run[case]()
        times[k, case].append((time.perf_counter() - start) / args.calls * 1e3)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.rounds} rounds")
  for stat in (np.median, np.min):
    print(f"{stat.__name__ + ' (ms)':<26} {'baseline':>9} {'this':>7} {'extra':>7} {'ratio':>6}")
    for case in runs["this"]:
      base, this = (float(stat(times[k, case])) for k in ("baseline", "this"))
      print(f"{case:<26} {base:9.3f} {this:7.3f} {this - base:7.3f} {this / base:6.2f}")


if __name__ == "__main__":
  main()
