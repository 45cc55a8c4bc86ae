"""Batched solves: B independent small problems as one vmapped program, per solver.

    python -m experiments.perf.batched [--batches 1,1024,16384] [--dtype float32]
                                       [--solvers all] [--calls 1000] [--tol 1e-4]

B independent ridge-logistic regressions ``f_b(w) = mean_i log(1 + exp(-y_bi <a_bi, w>))
+ RIDGE / 2 ||w||^2`` with ``--rows`` x ``--cols`` (200 x 50) Gaussian data and
labels from a planted logistic model (``experiments.problems.synthetic_logistic``), solved by one ``jax.jit(jax.vmap(solve))``
(each problem its own data, start 0 and, for ``hdm_best(L)``, its own
``L = sigma_max(A_b)^2 / (4 rows) + RIDGE``) within ``--calls`` gradient
calls to ``||grad f_b||_inf <= --tol``. The optax transformations run through
``hdm_optax.solve(max_steps=calls, max_grad_evals=calls)``; optimistix's BFGS
and LBFGS through ``optimistix.minimise(max_steps=calls, throw=False)`` with
their Cauchy test off and the same gradient test
(``experiments.benchmark.solvers.GradientStop``, as the benchmark runs them;
their calls column is steps). Every problem counts as solved by
``||grad f_b||_inf <= tol`` at the returned point.

For each B and solver it prints one row: the compile time of the vmapped
program (``lower`` + ``compile``, seconds), the best wall time of one batched
solve (compilation excluded, ``--repeats`` interleaved runs), how many of the
B problems were solved, problems solved per second (solved / time), and the
mean and the largest gradient calls per problem (the vmapped loop runs until
its slowest problem stops). ``--dtype float64`` enables x64.

The rows ``trial_lbfgs() sb`` and ``optax.lbfgs() sb`` solve the same batch by
``hdm_optax.solve_batch``, which retires the members that have stopped (a batch a
quarter the size once three quarters have stopped); their compile column is the first
call, which compiles the stages and runs the batch once.

``--spread`` runs ``experiments.perf.batched_spread`` instead (its own options): a batch
whose condition numbers spread over 1e1..1e6, solved in lockstep and by ``solve_batch``,
which retires converged members.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments import problems
from experiments import protocol
from experiments.perf import timing

__all__ = ["SOLVERS", "device_label", "make_batch", "batched_solve", "main"]

RIDGE = 1e-2


def device_label() -> str:
  """The device the default backend runs on, in words (CPU: with its core count)."""
  d = jax.devices()[0]
  if d.platform == "cpu":
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
  return f"{d.device_kind} ({d.platform})"


def make_batch(batch: int, rows: int, cols: int, dtype, seed: int = 0):
  """``(A, y, L)``: B problems' data (B, rows, cols), labels (B, rows) and L (B,)
  (``experiments.problems.synthetic_logistic``, a mean with the ridge)."""
  inst = problems.synthetic_logistic(
    rows, cols, batch=batch, mean=True, ridge=RIDGE, dtype=dtype, seed=seed
  )
  return (*inst.fun_args[:2], jnp.asarray(inst.lipschitz, dtype))


def ridge_logistic(w, a, y):
  """f_b: ``problems.logistic_objective`` as a mean with the ridge (a, y one problem's)."""
  weight, ridge = (jnp.asarray(v, w.dtype) for v in (1.0 / a.shape[0], RIDGE))
  return problems.logistic_objective(w, a, y, weight, ridge)


def _optax(make: Callable) -> Callable:
  """One problem's solve by the optax transformation ``make(L)``: (calls, solved, grad calls)."""
  import hdm_optax

  def one(a, y, lip, tol, calls):
    x0 = jnp.zeros(a.shape[1], a.dtype)
    res = hdm_optax.solve(
      make(lip),
      ridge_logistic,
      x0,
      max_steps=calls,
      max_grad_evals=calls,
      tol=tol,
      fun_args=(a, y),
    )
    return res.converged, res.num_grad_evals

  return one


def _optimistix(name: str) -> Callable:
  """One problem's solve by optimistix's ``name`` (its Cauchy test off), stopped on the gradient."""
  import optimistix as optx

  from experiments.solvers import GradientStop

  def one(a, y, lip, tol, calls):
    del lip
    solver = GradientStop(getattr(optx, name)(rtol=0.0, atol=0.0), jnp.asarray(tol, a.dtype))
    fn = lambda w, args: ridge_logistic(w, *args)
    x0 = jnp.zeros(a.shape[1], a.dtype)
    sol = optx.minimise(fn, solver, x0, args=(a, y), max_steps=calls, throw=False)
    grad = jax.grad(ridge_logistic)(sol.value, a, y)
    return jnp.max(jnp.abs(grad)) <= tol, sol.stats["num_steps"]

  return one


def _solvers() -> dict[str, Callable]:
  import optax

  import hdm_optax

  return {
    "hdm_auto()": _optax(lambda lip: hdm_optax.hdm_auto()),
    "osgm_best()": _optax(lambda lip: hdm_optax.osgm_best()),
    "trial_lbfgs()": _optax(lambda lip: hdm_optax.trial_lbfgs()),
    "optax.lbfgs()": _optax(lambda lip: optax.lbfgs()),
    "hdm_best(L)": _optax(lambda lip: hdm_optax.hdm_best(lipschitz=lip)),
    "optimistix.BFGS": _optimistix("BFGS"),
    "optimistix.LBFGS": _optimistix("LBFGS"),
  }


def _retiring(make: Callable) -> Callable:
  """``build(data, tol, calls) -> thunk``: the batch by ``hdm_optax.solve_batch(make())``,
  which retires the members that have stopped."""
  import hdm_optax

  def build(data, tol, calls):
    a, y, _ = data
    x0 = jnp.zeros((a.shape[0], a.shape[2]), a.dtype)
    optimizer = make()

    def go():
      res = hdm_optax.solve_batch(
        optimizer,
        ridge_logistic,
        x0,
        fun_args=(a, y),
        max_steps=calls,
        max_grad_evals=calls,
        tol=tol,
      )
      return res.converged, res.num_grad_evals

    return go

  return build


def _retiring_solvers() -> dict[str, Callable]:
  import optax

  import hdm_optax

  return {
    "trial_lbfgs() sb": _retiring(hdm_optax.trial_lbfgs),
    "optax.lbfgs() sb": _retiring(optax.lbfgs),
  }


SOLVERS = tuple(_solvers()) + tuple(_retiring_solvers())


def batched_solve(one: Callable, tol: float, calls: int) -> Callable:
  """``jax.jit`` of ``jax.vmap(one)`` over the problems (tol and calls fixed)."""
  return jax.jit(jax.vmap(lambda *data: one(*data, tol, calls)))


def run(
  batches,
  solvers,
  dtype,
  rows,
  cols,
  calls,
  tol,
  repeats,
  compiler_options=None,
  table=None,
  make_data=None,
) -> list[dict]:
  """Prints and returns one row per (B, solver) (``compiler_options``: XLA's, for the tests).

  ``table`` (name -> ``one(*data, tol, calls)``, default these solvers) and ``make_data``
  (``(B, rows, cols, dtype) -> data``, default :func:`make_batch`) let another batch of
  problems reuse the loop (``experiments.perf.batched_bounded``); where ``one`` returns a
  third value, its largest is printed as ``outside``.
  """
  retiring = _retiring_solvers() if table is None else {}
  table = _solvers() if table is None else table
  make_data = make_batch if make_data is None else make_data
  print(f"device: {device_label()}; jax {jax.__version__}; {dtype}, {rows} x {cols}, ")
  print(f"  {calls} calls, tol {tol:g}, ridge {RIDGE:g}")
  print(
    f"{'B':>6} {'solver':<17} {'compile s':>9} {'solve s':>9} {'solved':>12} "
    f"{'problems/s':>11} {'mean calls':>10} {'max calls':>9} {'outside':>8}"
  )
  rows_out = []
  for batch in batches:
    data = make_data(batch, rows, cols, dtype)
    compiled = {}
    compile_s = {}
    for name in solvers:
      start = time.perf_counter()
      if name in retiring:  # compiled at its first call, which is timed with it
        compiled[name] = retiring[name](data, tol, calls)
        jax.block_until_ready(compiled[name]())
      else:
        fn = batched_solve(table[name], tol, calls).lower(*data).compile(compiler_options)
        compiled[name] = lambda fn=fn: fn(*data)
      compile_s[name] = time.perf_counter() - start
    seconds, outputs = timing.best_times(compiled, repeats=repeats)
    for name in solvers:
      solved, num_calls, *extra = (np.asarray(v) for v in outputs[name])
      row = dict(
        batch=batch,
        solver=name,
        compile_seconds=compile_s[name],
        seconds=seconds[name],
        solved=int(solved.sum()),
        per_second=float(solved.sum()) / seconds[name],
        mean_calls=float(num_calls.mean()),
        max_calls=int(num_calls.max()),
      )
      if extra:
        row["outside"] = float(extra[0].max())
      rows_out.append(row)
      print(
        f"{batch:>6} {name:<17} {row['compile_seconds']:>9.2f} {row['seconds']:>9.4f} "
        f"{row['solved']:>6}/{batch:<5} {row['per_second']:>11,.0f} {row['mean_calls']:>10.1f} "
        f"{row['max_calls']:>9}" + (f" {row['outside']:>8.2g}" if extra else ""),
        flush=True,
      )
  return rows_out


def parse_args(argv, names, description):
  """The command line of a batched script whose solvers are ``names``."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--batches", default="1,1024,16384")
  p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
  p.add_argument("--solvers", default="all", help=f"comma-separated of {', '.join(names)}")
  p.add_argument("--rows", type=int, default=200)
  p.add_argument("--cols", type=int, default=50)
  p.add_argument("--calls", type=int, default=1000)
  p.add_argument("--tol", type=float, default=1e-4)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default=None, help="also write the rows to this JSON file")
  args = p.parse_args(argv)
  protocol.float32_products()
  if args.dtype == "float64":
    jax.config.update("jax_enable_x64", True)
  args.solvers = names if args.solvers == "all" else tuple(args.solvers.split(","))
  unknown = set(args.solvers) - set(names)
  if unknown:
    p.error(f"--solvers: unknown {sorted(unknown)}; choose from {', '.join(names)}")
  args.batches = [int(float(b)) for b in args.batches.split(",")]
  return args


def run_args(args, run_fn=None) -> list[dict]:
  """``run_fn`` (default :func:`run`) with the command line's numbers (and ``--json``)."""
  rows = (run if run_fn is None else run_fn)(
    args.batches,
    args.solvers,
    jnp.dtype(args.dtype),
    args.rows,
    args.cols,
    args.calls,
    args.tol,
    args.repeats,
  )
  if args.json:
    device = device_label()
    with open(args.json, "w") as f:
      json.dump([dict(row, device=device) for row in rows], f, indent=1)
  return rows


def main(argv=None) -> list[dict]:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--spread" in argv:  # the heavy-tailed batch, lockstep against retiring members
    from experiments.perf import batched_spread

    return batched_spread.main([a for a in argv if a != "--spread"])
  return run_args(parse_args(argv, SOLVERS, __doc__.split("\n")[0]))


if __name__ == "__main__":
  main()
