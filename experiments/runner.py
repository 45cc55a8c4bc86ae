"""Runs every algorithm of Table 1 on one problem instance (the paper's protocol).

Each JAX algorithm is one vmapped, compiled ``hdm_optax.sweep`` over its grid.
The optimizer factories below are module-level functions that take L as a
grid column, and dense problems are zero-padded to a few shape buckets, so a
compiled program is reused across datasets: padded rows carry weight 0 and
padded columns have zero gradient, so their coordinates stay at 0 and the
padded problem is the same problem (up to rounding order in the sums).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.sparse as sp

import hdm_optax

from experiments.baselines import first_order
from experiments.baselines import quasi_newton
from experiments import problems as problems_lib
from experiments import protocol

# Dense problems up to 16384 rows are padded to these shapes (larger ones run
# as they are: padding would cost more than the compile it saves).
ROW_BUCKETS = (4096, 8192, 16384)
COL_BUCKETS = (64, 128, 320)
HDM_BEST_PM = (0.1, 1.0, 10.0, 100.0)  # eta_p * L
HDM_BEST_MB = (1.0, 3.0, 5.0, 10.0, 100.0)  # eta_b
LR_GRID = ("1/L", 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # Adam and AdaGrad


def _bucket(size, buckets):
  for b in buckets:
    if size <= b:
      return b
  return size


def prepare(problem: problems_lib.Problem, pad: bool = True) -> protocol.Instance:
  """The problem as a ``protocol.Instance`` from the paper's x0 (one start), with its L.

  A dense problem is padded to a shape bucket; sparse problems run as they are.
  """
  m, n = problem.A.shape
  args, x0 = problem.fun_args, np.asarray(problem.x0)
  if problem.representation == "dense" and pad and m <= ROW_BUCKETS[-1]:
    mb, nb = _bucket(m, ROW_BUCKETS), _bucket(n, COL_BUCKETS)
    A = sp.hstack([problem.A, sp.csr_matrix((m, nb - n))], format="csr")
    _, args = problems_lib.objective(A, problem.y, problem.kind, "dense", rows=mb)
    x0 = np.zeros(nb)
    x0[:n] = problem.x0
  return protocol.Instance(
    n=n,
    fun=problem.fun,
    fun_args=args,
    x0=jnp.asarray(x0)[None],
    lipschitz=float(problem.L),
    fun_np=problem.fun_np,
    x0_np=np.asarray(problem.x0)[None],
  )


# --- optimizer factories (module level: their compiled sweeps are cached) ---


def make_first_order(lr, momentum, nesterov, lambda_schedule):
  return first_order.first_order_family(lr, momentum, nesterov, lambda_schedule)


def make_adam(lr):
  return optax.adam(lr, b1=0.9, b2=0.999, eps=1e-8)


def make_adagrad(lr):
  return optax.adagrad(lr, initial_accumulator_value=0.0, eps=1e-8)


def make_hdm_best(pm, mb, lip):
  # The paper's null step, f(x+) < f(x) (hdm_best's default accepts float ties).
  return hdm_optax.hdm_best(
    lipschitz=lip,
    precond_lr=pm / lip,
    momentum_lr=mb,
    acceptance=hdm_optax.pieces.acceptance.strict_decrease(),
  )


def make_hdm(eta, lip):
  return hdm_optax.hdm(
    candidate="diagonal", learner="adagrad", precond_lr=eta / lip, null_step=True, precond_min=0.0
  )


def make_hdm_hb(eta, mb, lip):
  return hdm_optax.hdm_hb(
    candidate="diagonal",
    momentum_candidate="scalar",
    learner="adagrad",
    precond_lr=eta / lip,
    momentum_lr=mb,
    omega=0.0,
    tau=lip**2 / 2,
    init_momentum=0.95,
    precond_min=0.0,
  )


def make_hdm_agd(eta, lip):
  return hdm_optax.hdm_agd(
    lipschitz=lip,
    theta=1.0,
    candidate="diagonal",
    learner="adagrad",
    precond_lr=eta / lip,
    precond_min=0.0,
  )


def make_osgm_best(seed):
  return hdm_optax.osgm_best(seed=seed)


def make_hdm_auto(seed):
  return hdm_optax.hdm_auto(seed=seed)


# Tuning-free rows: no grid, no L. They run on the unpadded problem: their
# random probe directions would otherwise spread over the zero-gradient padded
# coordinates and shorten the probe in the real ones.
TUNING_FREE = (("OSGM-Best", make_osgm_best), ("HDM-Auto", make_hdm_auto))

LBFGS = optax.lbfgs()


def _fmt(point):
  return " ".join(f"{k}={v:.6g}" for k, v in point.items())


def _rows_from_sweep(out, labels, names, budget, seconds, describe):
  """The best point per algorithm name (``protocol.best_point``)."""
  res = jax.tree.map(np.asarray, out.results)
  solved = protocol.is_solved(res.converged, res.num_grad_evals, budget)
  rows = []
  for name in dict.fromkeys(names):
    idx = np.asarray([i for i, nm in enumerate(names) if nm == name])
    i = idx[protocol.best_point(jax.tree.map(lambda a: a[idx], res), solved[idx])]
    point = jax.tree.map(lambda a: a[i], res)
    rows.append(protocol.Row.from_solve(name, point, solved[i], describe(labels[i]), seconds))
  return rows


def _sweep(inst, make, points, max_steps, budget, tol, stop_at_first):
  start = time.perf_counter()
  out = hdm_optax.sweep(
    make,
    points,
    inst.fun,
    inst.x0[0],
    max_steps=max_steps,
    tol=tol,
    fun_args=inst.fun_args,
    max_grad_evals=budget,
    stop_at_first_converged=stop_at_first,
  )
  jax.block_until_ready(out.results.value)
  return out, time.perf_counter() - start


def jax_algorithms(lip):
  """(group, factory, points, names, labels, calls per step) for each sweep."""
  fo = first_order.first_order_grid(lip)
  lrs = [1.0 / lip if v == "1/L" else v for v in LR_GRID]
  lr_labels = [{"lr": v} for v in LR_GRID]
  best = [dict(pm=pm, mb=mb, lip=lip) for pm in HDM_BEST_PM for mb in HDM_BEST_MB]
  default = dict(
    pm=hdm_optax.methods.DEFAULT_PRECOND_LR_TIMES_L,
    mb=hdm_optax.methods.DEFAULT_MOMENTUM_LR,
    lip=lip,
  )
  return [
    (
      "first-order",
      make_first_order,
      [p for _, p in fo],
      [n for n, _ in fo],
      [p for _, p in fo],
      1,
    ),
    ("Adam", make_adam, [dict(lr=v) for v in lrs], ["Adam"] * len(lrs), lr_labels, 1),
    ("AdaGrad", make_adagrad, [dict(lr=v) for v in lrs], ["AdaGrad"] * len(lrs), lr_labels, 1),
    (
      "HDM-Best",
      make_hdm_best,
      best + [default],
      ["HDM-Best"] * len(best) + ["HDM-Best-default"],
      best + [default],
      1,
    ),
    ("HDM", make_hdm, [dict(eta=e, lip=lip) for e in (1.0, 10.0, 100.0)], ["HDM"] * 3, None, 1),
    (
      "HDM-HB",
      make_hdm_hb,
      [dict(eta=e, mb=b, lip=lip) for e in (1.0, 10.0, 100.0) for b in (1.0, 3.0, 10.0)],
      ["HDM-HB"] * 9,
      None,
      1,
    ),
    (
      "HDM-AGD",
      make_hdm_agd,
      [dict(eta=e, lip=lip) for e in (1.0, 10.0, 100.0)],
      ["HDM-AGD"] * 3,
      None,
      3,
    ),
  ]


def _describe(label):
  label = dict(label)
  if "lip" in label:
    label.pop("lip")
  return _fmt(label) if label else "defaults"


def run_instance(
  problem,
  *,
  max_grad_calls=protocol.BUDGET,
  tol=protocol.TOL,
  pad=True,
  progress: Optional[Callable[[str], None]] = None,
):
  """Runs every algorithm on ``problem``; returns (rows, hdm_best_grid)."""
  inst = prepare(problem, pad=pad)
  lip = float(problem.L)
  rows, grid = [], None
  for group, make, points, names, labels, calls in jax_algorithms(lip):
    if progress:
      progress(group)
    max_steps = (max_grad_calls - 1) // calls
    # Only the best point of an algorithm's grid is reported, so a grid of one
    # algorithm stops when its first point converges. The first-order group
    # (several algorithms) and the HDM-Best grid (all 20 points are written out
    # for the fidelity check and the choice of the defaults) run to the end.
    out, secs = _sweep(
      inst, make, points, max_steps, max_grad_calls, tol, stop_at_first=len(set(names)) == 1
    )
    labels = labels or points
    rows += _rows_from_sweep(out, labels, names, max_grad_calls, secs, _describe)
    if group == "HDM-Best":
      grid = _grid_table(out, points[:-1], max_grad_calls)
  # One solve each (no vmap: the lookahead's and the probe's control flow would batch the
  # host CSR product, which has no batching rule over its matrix).
  plain = prepare(problem, pad=False)
  singles = [(name, make(seed=0), plain, "defaults") for name, make in TUNING_FREE]
  singles.append(("optax-L-BFGS", LBFGS, inst, "optax.lbfgs() defaults"))
  for name, opt, where, describe in singles:
    if progress:
      progress(name)
    start = time.perf_counter()
    res = hdm_optax.solve(
      opt,
      where.fun,
      where.x0[0],
      max_steps=max_grad_calls - 1,
      tol=tol,
      fun_args=where.fun_args,
      max_grad_evals=max_grad_calls,
    )
    res = jax.tree.map(np.asarray, res)
    solved = protocol.is_solved(res.converged, res.num_grad_evals, max_grad_calls)
    seconds = time.perf_counter() - start
    rows.append(protocol.Row.from_solve(name, res, solved, describe, seconds))
  for name in quasi_newton.ALGORITHMS:
    if progress:
      progress(name)
    rows.append(quasi_newton.run_baseline(problem.fun_np, problem.x0, name, tol=tol))
  return rows, grid


def _grid_table(out, points, budget):
  res = jax.tree.map(np.asarray, out.results)
  table = []
  for i, p in enumerate(points):
    solved = bool(protocol.is_solved(res.converged[i], res.num_grad_evals[i], budget))
    table.append(
      dict(
        eta_p_times_L=p["pm"],
        eta_b=p["mb"],
        solved=int(solved),
        grad_calls=int(res.num_grad_evals[i]) if solved else protocol.unsolved_calls(budget),
        iterations=int(res.num_steps[i]),
      )
    )
  return table
