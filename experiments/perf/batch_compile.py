"""The first call of a batch: ``solve_batch`` against ``jax.jit(jax.vmap(solve))``.

    python -m experiments.perf.batch_compile [--rounds 3] [--batches 64] [--cols 8]

B rotated quadratics of ``--cols`` variables (:mod:`experiments.perf.batched_spread`'s
heavy-tailed batch), each solved by ``trial_lbfgs`` from 0 to ``||grad f||_inf <= 1e-6``.
Each row is the first call (trace, compile and run) from cleared caches, the best of
``--rounds`` interleaved rounds, in one process:

- ``solve_batch``: the default (``compact=None``: lockstep for batches of at most 65,536
  entries, the stages that retire members above);
- ``solve_batch(compact=True)``: the stages that retire members (B, B/4, ...);
- ``solve_batch(compact=False)``: the lockstep loop;
- ``jit(vmap(solve))``: ``jax.jit(jax.vmap(hdm_optax.solve))``, the reference.

Then the warm call of each (its compiled program), for what retiring members buys at run time.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import hdm_optax  # noqa: E402
from experiments.perf import batched_spread  # noqa: E402

__all__ = ["main"]


def _ways(q, c):
  x0 = jnp.zeros_like(c)
  kw = dict(fun_args=(q, c), tol=1e-6, max_steps=2000)
  fun = batched_spread.quadratic
  solve = lambda q_, c_: hdm_optax.solve(
    hdm_optax.trial_lbfgs(), fun, jnp.zeros_like(c_), fun_args=(q_, c_), tol=1e-6, max_steps=2000
  )
  return {
    "solve_batch": lambda: hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), fun, x0, **kw).params,
    "solve_batch(compact=True)": lambda: (
      hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), fun, x0, compact=True, **kw).params
    ),
    "solve_batch(compact=False)": lambda: (
      hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), fun, x0, compact=False, **kw).params
    ),
    "jit(vmap(solve))": functools.partial(_lockstep, jax.jit(jax.vmap(solve)), q, c),
  }


def _lockstep(program, q, c):
  return program(q, c).params


def _timed(thunk) -> float:
  start = time.perf_counter()
  jax.block_until_ready(thunk())
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batches", type=int, default=64)
  parser.add_argument("--cols", type=int, default=8)
  options = parser.parse_args()
  q, c, _ = batched_spread.make_spread_batch(options.batches, options.cols, jnp.float64)
  ways = _ways(q, c)
  first = dict.fromkeys(ways, float("inf"))
  warm = dict.fromkeys(ways, float("inf"))
  for _ in range(options.rounds):
    for name, thunk in ways.items():
      jax.clear_caches()
      hdm_optax.clear_caches()
      first[name] = min(first[name], _timed(thunk))
      warm[name] = min(warm[name], _timed(thunk))
  entries = q.size + 2 * c.size
  print(f"B = {options.batches} quadratics of {options.cols} variables ({entries} entries)")
  reference = first["jit(vmap(solve))"]
  for name in ways:
    print(
      f"  {name:<28} first call {first[name]:7.2f} s ({first[name] / reference:4.2f}x "
      f"jit(vmap(solve))), warm {1e3 * warm[name]:8.2f} ms"
    )


if __name__ == "__main__":
  main()
