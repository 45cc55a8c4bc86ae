"""The speed targets of the experiments, measured in one process per dataset.

    python -m experiments.perf.speed [--datasets all | a9a w8a ...] [--problems ...]

For every dataset and problem it prints

(a) the time of one value-and-gradient call of the objective inside a
    compiled loop (as ``solve`` and ``sweep`` make them: no per-call dispatch)
    in the representation used by Table 1 (dense, or CSR with the kernel of
    ``experiments.sparse.host_csr``), and in the other representations (dense, BCOO,
    host CSR), each
    divided by the time of the same two products (A w and A^T r) done with
    ``scipy.sparse`` CSR from Python (target: <= 1.5);
(b) the wall time of the whole 20-point HDM-Best sweep (one vmapped compiled
    program; every point runs until it converges or spends the 1000-call
    budget), in lockstep (``sweep s``) and compacted (``compact``: finished
    points leave the batch, ``sweep(compact=True)``), the faster of the two
    divided by the time of one solve with the winning configuration
    (target: <= 4); ``floor`` is the longest run's steps / the winner's, the
    ratio a sweep would reach if 20 points cost no more per step than one;
    ``1st-stop`` is the ratio for the sweep that stops when its first point
    converges (``stop_at_first_converged=True``, as Table 1 runs the grids of
    the baselines); ``steps`` is the winner's steps / the longest run's.

Every timing is the best of several runs after a warm-up (compilation excluded);
those of (a) are interleaved with the SciPy reference (``perf.timing.best_times``).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax
from experiments import data as data_lib
from experiments import problems as problems_lib
from experiments import protocol
from experiments import table1
from experiments.perf import timing


PAIRS = 20  # product pairs per call of scipy_products' function
CALLS = 100  # value-and-gradient calls per call of value_and_grad_loop's function


def scipy_products(problem):
  """The two SciPy CSR products A w and A^T r, 20 pairs per call."""
  A = problem.A.tocsr()
  AT = A.T.tocsr()
  w = np.asarray(problem.x0)
  r = np.ones(A.shape[0])

  def run():
    for _ in range(PAIRS):
      A @ w
      AT @ r

  return run


def value_and_grad_loop(problem, calls=CALLS):
  """``calls`` value-and-gradient calls inside a compiled loop (as a solve makes them)."""
  vg = jax.value_and_grad(problem.fun)

  @jax.jit
  def run(w, *args):
    def body(_, w):
      _, g = vg(w, *args)
      return w - 1e-12 * g  # each call depends on the previous one

    return jax.lax.fori_loop(0, calls, body, w)

  w = jnp.asarray(problem.x0)
  return lambda: run(w, *problem.fun_args)


def sweep_ratio(problem, budget=protocol.BUDGET, tol=protocol.TOL):
  """Times of the 20-point HDM-Best sweep (lockstep, compacted, stop-at-first) and the winner's solve."""
  inst = problems_lib.libsvm_instance(problem, pad=False)
  lip = float(problem.L)
  points = [dict(pm=pm, mb=mb, lip=lip) for pm in table1.HDM_BEST_PM for mb in table1.HDM_BEST_MB]

  def sweep(first=False, compact=False):
    out = hdm_optax.sweep(
      table1.make_hdm_best,
      points,
      inst.fun,
      inst.x0[0],
      max_steps=budget - 1,
      tol=tol,
      fun_args=inst.fun_args,
      stop_at_first_converged=first,
      compact=compact,
    )
    jax.block_until_ready(out.results.value)
    return out

  out = sweep()
  winner = points[out.best]
  opt = table1.make_hdm_best(**winner)

  def single():
    res = hdm_optax.solve(
      opt, inst.fun, inst.x0[0], max_steps=budget - 1, tol=tol, fun_args=inst.fun_args
    )
    jax.block_until_ready(res.value)

  steps = np.asarray(out.results.num_steps)
  return dict(
    sweep=timing.best_time(sweep, repeats=2),
    compact=timing.best_time(lambda: sweep(compact=True), repeats=2),
    first=timing.best_time(lambda: sweep(True), repeats=2),
    single=timing.best_time(single, repeats=3),
    best_steps=int(steps[out.best]),
    max_steps=int(steps.max()),
  )


def main(argv=None):
  protocol.enable_float64()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--datasets", nargs="+", default=["all"])
  parser.add_argument("--problems", nargs="+", default=["svm", "logistic"])
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--skip-sweep", action="store_true")
  args = parser.parse_args(argv)
  data_dir = args.data_dir or data_lib.default_data_dir()
  names = data_lib.list_datasets(data_dir) if args.datasets == ["all"] else args.datasets
  print(
    f"{'dataset':>20} {'problem':>8} {'m x n':>12} {'repr':>6} {'scipy 2 prod':>12} "
    f"{'(a) used':>9} {'dense':>7} {'bcoo':>7} {'host':>7} "
    f"{'sweep s':>8} {'compact':>8} {'solve s':>8} {'(b) ratio':>9} {'floor':>6} "
    f"{'1st-stop':>9} {'steps':>9}"
  )
  for name in names:
    for kind in args.problems:
      try:
        used = problems_lib.load_problem(name, kind, data_dir=data_dir)
      except FileNotFoundError as e:
        print(f"skipping {name}: {e}")
        break
      variants = {rep: _rebuild(used, rep) for rep in ("dense", "sparse", "host")}
      loops = {rep: value_and_grad_loop(p) for rep, p in variants.items()}
      times, _ = timing.best_times({"scipy": scipy_products(used), **loops}, repeats=15)
      t_ref = times.pop("scipy") / PAIRS
      ratios = {rep: t / CALLS / t_ref for rep, t in times.items()}
      line = (
        f"{name:>20} {kind:>8} {used.m:>6}x{used.n:<5} {used.representation[:6]:>6} "
        f"{t_ref * 1e3:>9.3f} ms {ratios[used.representation]:>9.2f} "
        f"{ratios['dense']:>7.2f} {ratios['sparse']:>7.2f} {ratios['host']:>7.2f}"
      )
      if not args.skip_sweep:
        r = sweep_ratio(used)
        t_sweep = min(r["sweep"], r["compact"])
        line += (
          f" {r['sweep']:>8.3f} {r['compact']:>8.3f} {r['single']:>8.3f} "
          f"{t_sweep / r['single']:>9.2f} {r['max_steps'] / r['best_steps']:>6.2f} "
          f"{r['first'] / r['single']:>9.2f} {r['best_steps']:>4}/{r['max_steps']:<4}"
        )
      print(line, flush=True)
    jax.clear_caches()  # every dataset compiles new programs: do not keep them all mapped


def _rebuild(problem, representation):
  """The same problem in another representation (same A, y, L, x0)."""
  if representation == problem.representation:
    return problem
  fun, args = problems_lib.objective(problem.A, problem.y, problem.kind, representation)
  return dataclasses.replace(problem, fun=fun, fun_args=args, representation=representation)


if __name__ == "__main__":
  main()
