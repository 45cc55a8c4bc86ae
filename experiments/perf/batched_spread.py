"""Batched solves of a heavy-tailed batch: what retiring converged members buys.

    python -m experiments.perf.batched_spread [--batches 1024] [--dtype float32]
                                              [--cols 50] [--calls 2000] [--tol 1e-4]

B quadratics ``f_b(w) = 1/2 (w - c_b)^T Q_b (w - c_b)``, ``Q_b = V diag(d_b) V^T`` with one
random rotation V (``--cols`` x ``--cols``) and eigenvalues ``d_b`` log-spaced over
``[1 / kappa_b, 1]``, the condition numbers ``kappa_b`` log-uniform over
``[--kappa-min, --kappa-max]`` (1e1..1e6): most members converge in a few steps, a few take
hundreds. Each member starts at 0 and stops at ``||grad f_b||_inf <= --tol`` or ``--calls``
gradient calls. One row per way of solving the batch:

- ``jax.vmap(solve)``: one lockstep vmapped loop (``jax.jit(jax.vmap(hdm_optax.solve))``), as
  for ``optax.lbfgs()`` (its linesearch's calls counted);
- ``solve_batch``: ``hdm_optax.solve_batch(optimizer, f, x0s, fun_args=(Q, c))``, whose
  batch shrinks to a quarter once three quarters of its members have stopped (B, B/4, ...,
  16): converged members are retired.

Columns: the first call (compile included, seconds), the best of ``--repeats`` interleaved
warm calls, members solved, problems solved per second, mean and largest calls per member.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import protocol
from experiments.perf import batched as batched_lib
from experiments.perf import timing

__all__ = ["make_spread_batch", "quadratic", "main"]


def make_spread_batch(batch, cols, dtype, kappa_min=1e1, kappa_max=1e6, seed=0):
  """``(Q, c, kappa)``: B rotated quadratics with condition numbers log-uniform in range."""
  rng = np.random.default_rng(seed)
  rotation, _ = np.linalg.qr(rng.standard_normal((cols, cols)))
  kappa = np.exp(rng.uniform(np.log(kappa_min), np.log(kappa_max), batch))
  eig = kappa[:, None] ** -np.linspace(0.0, 1.0, cols)[None, :]  # [1/kappa, 1]
  q = np.einsum("ij,bj,kj->bik", rotation, eig, rotation)
  c = rng.standard_normal((batch, cols)) / np.sqrt(cols)
  return jnp.asarray(q, dtype), jnp.asarray(c, dtype), kappa


def quadratic(w, q, c):
  """``1/2 (w - c)^T Q (w - c)`` for one member."""
  d = w - c
  return 0.5 * d @ (q @ d)


def _ways(factory, q, c, tol, calls):
  """name suffix -> a thunk solving the batch, returning (converged, grad calls) per member."""
  import hdm_optax

  x0 = jnp.zeros_like(c)

  def one(x, qb, cb):
    res = hdm_optax.solve(
      factory(), quadratic, x, fun_args=(qb, cb), max_steps=calls, max_grad_evals=calls, tol=tol
    )
    return res.converged, res.num_grad_evals

  lockstep = jax.jit(jax.vmap(one))

  optimizer = factory()

  def retiring():
    out = hdm_optax.solve_batch(
      optimizer, quadratic, x0, fun_args=(q, c), max_steps=calls, max_grad_evals=calls, tol=tol
    )
    return out.converged, out.num_grad_evals

  return {"jax.vmap(solve)": lambda: lockstep(x0, q, c), "solve_batch": retiring}


def run(batches, dtype, cols, calls, tol, repeats, kappa_min, kappa_max):
  import optax

  import hdm_optax

  factories = {"trial_lbfgs()": hdm_optax.trial_lbfgs, "optax.lbfgs()": optax.lbfgs}
  print(
    f"device: {batched_lib.device_label()}; jax {jax.__version__}; {dtype}, n = {cols}, "
    f"kappa log-uniform in [{kappa_min:g}, {kappa_max:g}], {calls} calls, tol {tol:g}"
  )
  print(
    f"{'B':>6} {'solver':<14} {'batched as':<20} {'first s':>8} {'solve s':>8} "
    f"{'solved':>11} {'problems/s':>11} {'mean calls':>10} {'max calls':>9}"
  )
  rows = []
  for batch in batches:
    q, c, _ = make_spread_batch(batch, cols, dtype, kappa_min, kappa_max)
    thunks, first = {}, {}
    for name, factory in factories.items():
      for way, fn in _ways(factory, q, c, tol, calls).items():
        key = (name, way)
        start = time.perf_counter()
        jax.block_until_ready(fn())
        first[key] = time.perf_counter() - start
        thunks[key] = fn
    seconds, outputs = timing.best_times(thunks, repeats=repeats, warmup=False)
    for (name, way), secs in seconds.items():
      solved, num_calls = (np.asarray(v) for v in outputs[(name, way)])
      row = dict(
        batch=batch,
        solver=name,
        batched=way,
        first_seconds=first[(name, way)],
        seconds=secs,
        solved=int(solved.sum()),
        per_second=solved.sum() / secs,
        mean_calls=float(num_calls.mean()),
        max_calls=int(num_calls.max()),
      )
      rows.append(row)
      print(
        f"{batch:>6} {name:<14} {way:<20} {row['first_seconds']:>8.2f} {secs:>8.4f} "
        f"{row['solved']:>5}/{batch:<5} {row['per_second']:>11,.0f} "
        f"{row['mean_calls']:>10.1f} {row['max_calls']:>9}",
        flush=True,
      )
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batches", default="1024")
  p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
  p.add_argument("--cols", type=int, default=50)
  p.add_argument("--calls", type=int, default=2000)
  p.add_argument("--tol", type=float, default=1e-4)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--kappa-min", type=float, default=1e1)
  p.add_argument("--kappa-max", type=float, default=1e6)
  args = p.parse_args(argv)
  protocol.float32_products()
  if args.dtype == "float64":
    jax.config.update("jax_enable_x64", True)
  batches = [int(float(b)) for b in args.batches.split(",")]
  return run(
    batches,
    jnp.dtype(args.dtype),
    args.cols,
    args.calls,
    args.tol,
    args.repeats,
    args.kappa_min,
    args.kappa_max,
  )


if __name__ == "__main__":
  main()
