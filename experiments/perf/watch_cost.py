"""What watching a solve costs: ``solve`` with ``progress=True`` or a ``callback`` against without.

    python -m experiments.perf.watch_cost [--n 100000] [--steps 200] [--repeats 5]

A least-squares problem with n variables and n/10 rows of a random sparse-like operator
(``0.5 ||A x - b||^2 + 0.5 ||x||^2``, A dense of n/10 x 100 mapped onto x by blocks, so
that one oracle call costs about 2 passes over x), solved with ``trial_lbfgs()`` for
exactly ``--steps`` updates (``tol=0``): plain, ``progress=True`` (the line goes to a
null stream), and a ``callback`` that keeps the step count (its snapshot brings the
params, n floats, to the host each step). Each configuration is compiled first, then the
three are timed in turn, ``--repeats`` times; the best time of each and the ratio to the
plain run are printed, with the time per step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax


def problem(n: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  rows = max(n // 100, 1)
  a = jnp.asarray(rng.standard_normal((rows, 100)) / 10.0)
  b = jnp.asarray(rng.standard_normal(rows))

  def fun(x, a, b):
    blocks = x[: rows * 100].reshape(rows, 100)
    r = jnp.sum(a * blocks, axis=1) - b
    return 0.5 * jnp.sum(r**2) + 0.5 * jnp.sum(x**2)

  return fun, (a, b)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--n", type=int, default=100_000)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  fun, data = problem(args.n)
  x0 = jnp.ones(args.n)
  count = []
  variants = {
    "plain": {},
    "progress": {"progress": True},
    "callback": {"callback": lambda s: count.append(int(s.num_steps))},
  }

  def run(kwargs):
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(), fun, x0, max_steps=args.steps, tol=0.0, fun_args=data, **kwargs
    )
    res.params.block_until_ready()
    return res

  best = {}
  with contextlib.redirect_stderr(io.StringIO()):
    for kwargs in variants.values():  # compile
      run(kwargs)
    for _ in range(args.repeats):
      for name, kwargs in variants.items():
        start = time.perf_counter()
        res = run(kwargs)
        best[name] = min(best.get(name, np.inf), time.perf_counter() - start)
        assert int(res.num_steps) == args.steps
  print(f"n = {args.n}, {args.steps} steps, {jax.default_backend()}, best of {args.repeats}")
  for name in variants:
    ratio = best[name] / best["plain"]
    per_step = 1e6 * best[name] / args.steps
    extra = 1e6 * (best[name] - best["plain"]) / args.steps
    print(
      f"{name:9s} {best[name]:.4f} s  {per_step:8.1f} us/step  x{ratio:.3f}  (+{extra:.1f} us/step)"
    )
  sys.stdout.flush()


if __name__ == "__main__":
  main()
