"""What the Ctrl-C check costs: a front door's call with the check against without, interleaved.

    python -m experiments.perf.interrupt_cost [--repeats 7]

``hdm_optax.driver.interrupts`` makes a run that has no callback ask the host, between
chunks of steps, whether a SIGINT came (one host call about every 0.2 s, the chunk sized
from the time per step that the program's last call measured). This script times calls
with the check compiled in (``interrupts.ENABLED = True``, the default) and without
(``False``), each configuration compiled first and then the two called in turn,
``--repeats`` times; it prints the best time of each and the ratio, per problem:

- ``readme``: the README's 30-second logistic regression (200 x 10, ``trial_lbfgs()``,
  ``tol=1e-6``): a call of a few milliseconds, where a per-call cost would show;
- ``quadratic n``: ``trial_lbfgs()`` for exactly ``--steps`` updates (``tol=0``) on a
  diagonal quadratic of n variables (n = 10, 1e3, 1e5): the per-step cost;
- ``minimize``: ``minimize`` on the same logistic regression at SciPy's defaults;
- ``solve_batch``: 64 logistic regressions (``compact=True``, the staged batch).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax
from hdm_optax.driver import interrupts


def _logistic(w, A, y):
  return jnp.sum(jnp.logaddexp(0.0, -y * (A @ w)))


def _problems(steps: int) -> dict:
  rng = np.random.default_rng(0)
  A = jnp.asarray(rng.standard_normal((200, 10)))
  y = jnp.sign(A @ jnp.ones(10) + 0.1)
  As = jnp.asarray(rng.standard_normal((64, 200, 10)))
  ys = jnp.sign(As @ jnp.ones(10) + 0.1)
  opt = hdm_optax.trial_lbfgs()
  calls = {
    "readme": lambda: hdm_optax.solve(
      opt, _logistic, jnp.zeros(10), max_steps=500, tol=1e-6, fun_args=(A, y)
    ),
    "minimize": lambda: hdm_optax.minimize(_logistic, jnp.zeros(10), args=(A, y)),
    "solve_batch": lambda: hdm_optax.solve_batch(
      opt, _logistic, jnp.zeros((64, 10)), fun_args=(As, ys), tol=1e-6
    ),
  }
  for n in (10, 1_000, 100_000):
    d = jnp.asarray(np.geomspace(1.0, 1e3, n))
    calls[f"quadratic {n}"] = lambda d=d, n=n: hdm_optax.solve(
      opt,
      lambda x, d: 0.5 * jnp.sum(d * (x - 1.0) ** 2),
      jnp.zeros(n),
      fun_args=(d,),
      max_steps=steps,
      tol=0.0,
    )
  return calls


def _timed(call, enabled: bool) -> float:
  interrupts.ENABLED = enabled
  start = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--steps", type=int, default=2000)
  args = parser.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  print(f"{jax.default_backend()}, float64, best of {args.repeats}, interleaved")
  print(f"{'call':16s} {'with check':>12s} {'without':>12s} {'ratio':>7s}")
  for name, call in _problems(args.steps).items():
    best = {True: np.inf, False: np.inf}
    for enabled in (True, False):  # compile both, and learn the chunk size
      _timed(call, enabled)
      _timed(call, enabled)
    for _ in range(args.repeats):
      for enabled in (True, False):
        best[enabled] = min(best[enabled], _timed(call, enabled))
    print(
      f"{name:16s} {1e3 * best[True]:10.3f} ms {1e3 * best[False]:10.3f} ms "
      f"{best[True] / best[False]:7.3f}"
    )
  interrupts.ENABLED = True


if __name__ == "__main__":
  main()
