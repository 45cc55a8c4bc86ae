"""Reproduces Table 1 of the paper (solved problems per algorithm).

    python -m experiments.table1 [--problems svm logistic] [--datasets all | a1a w8a ...]
        [--data-dir DIR] [--max-grad-calls 1000] [--tol 1e-4] [--out results] [--grid-seconds]

For every dataset and problem it runs every algorithm of the table (below: the paper's
grids as ``runner.Grid`` sweeps, the tuning-free methods, ``optax.lbfgs`` and SciPy's
quasi-Newton methods) under the paper's protocol through ``experiments.runner.run`` and
writes

- ``<out>/<problem>/<dataset>.csv``: one row per algorithm (its best grid point);
- ``<out>/<problem>/<dataset>.npz``: the traces (value, ||g||_inf against
  gradient calls) of those rows, read by ``experiments.figures``;
- ``<out>/<problem>/<dataset>_hdm_best_grid.csv``: all 20 HDM-Best grid points;
- ``<out>/table1.md``: solved counts beside the paper's published column.

It prints each problem's solved count with the HDM-Best grid's wall time (compilation
included where the problem's shapes are new), each dataset's wall time and the total.
``--grid-seconds`` runs only the 20-point HDM-Best grid of each problem, warm: the best of
three runs of the whole grid in lockstep and compacted (``sweep(compact=True)``).

A dataset that is not on disk is skipped with a message that says how to get it; without a
data directory (``--data-dir``, ``$HDM_DATA_DIR``, ``../shared/datasets/libsvm``) ``all`` is
the bundled a9a alone, and a message lists what is missing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import optax
from tqdm import tqdm

import hdm_optax
from experiments import data as data_lib
from experiments import memory
from experiments import problems as problems_lib
from experiments import protocol
from experiments import runner
from experiments.baselines import first_order
from experiments.baselines import quasi_newton
from experiments import solvers as solvers_lib
from experiments.perf import timing

# Table 1 of the paper (SVM, logistic regression; out of 33 each).
PAPER = {
  "GD": (5, 2),
  "GD-HB": (9, 7),
  "AGD-CVX": (8, 3),
  "AGD-SCVX": (7, 6),
  "Adam": (26, 11),
  "AdaGrad": (9, 8),
  "L-BFGS-M1": (13, 11),
  "L-BFGS-M3": (20, 14),
  "L-BFGS-M5": (26, 16),
  "L-BFGS-M10": (31, 18),
  "BFGS": (32, 26),
  "HDM-Best": (32, 21),
}
# Row order of the table (the paper's rows first).
ORDER = (
  "GD GD-HB AGD-CVX AGD-SCVX Adam AdaGrad L-BFGS-M1 L-BFGS-M3 L-BFGS-M5 L-BFGS-M10 BFGS "
  "HDM-Best HDM-Best-default HDM-Auto OSGM-Best optax-L-BFGS HDM HDM-HB HDM-AGD"
).split()
FIELDS = (
  "algorithm solved iterations value_calls grad_calls hyperparams final_value final_grad_inf "
  "seconds"
).split()
PAPER_DATASETS = data_lib.PAPER_DATASETS
HDM_BEST_PM = (0.1, 1.0, 10.0, 100.0)  # eta_p * L
HDM_BEST_MB = (1.0, 3.0, 5.0, 10.0, 100.0)  # eta_b
LR_GRID = ("1/L", 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # Adam and AdaGrad


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


def _describe(label):
  label = {k: v for k, v in label.items() if k != "lip"}
  text = lambda v: v if isinstance(v, str) else f"{v:.6g}"
  return " ".join(f"{k}={text(v)}" for k, v in label.items()) if label else "defaults"


def _grid(make, points, names, labels=None, calls=1):
  """A ``runner.Grid``; a grid of one algorithm stops when its first point converges (only
  its best point is reported; the first-order group and the HDM-Best grid, whose 20 points
  are all written out, run to the end)."""
  labels = [_describe(label) for label in labels or points]
  return runner.Grid(make, points, names, labels, calls, stop_at_first=len(set(names)) == 1)


def jax_algorithms(lip):
  """(group, ``runner.Grid``) for each sweep of Table 1 on a problem with L = ``lip``."""
  fo = first_order.first_order_grid(lip)
  lrs = [dict(lr=1.0 / lip if v == "1/L" else v) for v in LR_GRID]
  lr_labels = [{"lr": v} for v in LR_GRID]
  best = [dict(pm=pm, mb=mb, lip=lip) for pm in HDM_BEST_PM for mb in HDM_BEST_MB]
  best.append(
    dict(
      pm=hdm_optax.methods.DEFAULT_PRECOND_LR_TIMES_L,
      mb=hdm_optax.methods.DEFAULT_MOMENTUM_LR,
      lip=lip,
    )
  )
  etas = (1.0, 10.0, 100.0)
  return [
    ("first-order", _grid(make_first_order, [p for _, p in fo], [n for n, _ in fo])),
    ("Adam", _grid(make_adam, lrs, ["Adam"] * len(lrs), lr_labels)),
    ("AdaGrad", _grid(make_adagrad, lrs, ["AdaGrad"] * len(lrs), lr_labels)),
    ("HDM-Best", _grid(make_hdm_best, best, ["HDM-Best"] * (len(best) - 1) + ["HDM-Best-default"])),
    ("HDM", _grid(make_hdm, [dict(eta=e, lip=lip) for e in etas], ["HDM"] * 3)),
    (
      "HDM-HB",
      _grid(
        make_hdm_hb,
        [dict(eta=e, mb=b, lip=lip) for e in etas for b in (1.0, 3.0, 10.0)],
        ["HDM-HB"] * 9,
      ),
    ),
    (
      "HDM-AGD",
      _grid(make_hdm_agd, [dict(eta=e, lip=lip) for e in etas], ["HDM-AGD"] * 3, calls=3),
    ),
  ]


def grid_seconds(problem, budget=protocol.BUDGET, tol=protocol.TOL, repeats=3):
  """Warm wall seconds of the 20-point HDM-Best grid on ``problem`` from the paper's x0:
  {"lockstep": ..., "compact": ...}, each the best of ``repeats`` runs to the end."""
  inst = problems_lib.libsvm_instance(problem, tol=tol, pad=False)
  lip = float(problem.L)
  points = [dict(pm=pm, mb=mb, lip=lip) for pm in HDM_BEST_PM for mb in HDM_BEST_MB]

  def run(compact):
    out = hdm_optax.sweep(
      make_hdm_best,
      points,
      inst.fun,
      inst.x0[0],
      max_steps=budget - 1,
      tol=tol,
      fun_args=inst.fun_args,
      max_grad_evals=budget,
      compact=compact,
    )
    return out.results.value

  runs = {"lockstep": lambda: run(False), "compact": lambda: run(True)}
  return timing.best_times(runs, repeats=repeats)[0]


def _fixed(name, make):
  """A solver without settings (module level: its compiled programs are reused)."""
  return solvers_lib.Solver(name=name, make=lambda *args: make())


# Tuning-free rows: no grid, no L. They run on the unpadded problem: their random probe
# directions would otherwise spread over the zero-gradient padded coordinates and shorten
# the probe in the real ones. (One solve each, no vmap: the lookahead's and the probe's
# control flow would batch the host CSR product, which has no batching rule over its matrix.)
TUNING_FREE = (
  _fixed("OSGM-Best", lambda: hdm_optax.osgm_best(seed=0)),
  _fixed("HDM-Auto", lambda: hdm_optax.hdm_auto(seed=0)),
)
LBFGS = _fixed("optax-L-BFGS", optax.lbfgs)
SCIPY = tuple(
  solvers_lib.Solver(name=a, scipy_algorithm=a, scipy_paper=True) for a in quasi_newton.ALGORITHMS
)


def run_instance(
  problem,
  *,
  max_grad_calls=protocol.BUDGET,
  tol=protocol.TOL,
  pad=True,
  progress: Optional[Callable[[str], None]] = None,
):
  """Runs every algorithm on ``problem``; returns (rows, hdm_best_grid)."""
  inst = problems_lib.libsvm_instance(problem, tol=tol, pad=pad)
  plain = problems_lib.libsvm_instance(problem, tol=tol, pad=False)
  note = progress or (lambda label: None)
  rows, grid = [], None
  for group, sweep in jax_algorithms(float(problem.L)):
    note(group)
    points = runner.run(sweep, inst, max_grad_calls)
    for name in dict.fromkeys(sweep.names):
      rows.append(protocol.best_row([r for r in points if r.algorithm == name]))
    if group == "HDM-Best":
      grid = _grid_table(sweep.points[:-1], points[:-1], max_grad_calls)
  singles = [(s, plain, "defaults") for s in TUNING_FREE] + [
    (LBFGS, inst, "optax.lbfgs() defaults")
  ]
  for solver, where, text in singles:
    note(solver.name)
    run = runner.run(solver, where, max_grad_calls)
    rows += [dataclasses.replace(r, hyperparams=text) for r in run]
  for solver in SCIPY:
    note(solver.name)
    rows += runner.run(solver, inst, max_grad_calls)
  return rows, grid


def _grid_table(points, rows, budget):
  return [
    dict(
      eta_p_times_L=p["pm"],
      eta_b=p["mb"],
      solved=int(r.solved),
      grad_calls=r.grad_calls if r.solved else protocol.unsolved_calls(budget),
      iterations=r.iterations,
    )
    for p, r in zip(points, rows)
  ]


def write_instance(out: Path, problem: str, dataset: str, rows, grid):
  folder = out / problem
  folder.mkdir(parents=True, exist_ok=True)
  with open(folder / f"{dataset}.csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(FIELDS)
    for r in rows:
      writer.writerow(
        [
          r.algorithm,
          int(r.solved),
          r.iterations,
          r.value_calls,
          r.grad_calls,
          r.hyperparams,
          f"{r.final_value:.17g}",
          f"{r.final_grad_inf:.6e}",
          f"{r.seconds:.3f}",
        ]
      )
  traces = {}
  for r in rows:
    traces[f"{r.algorithm}/grad_calls"] = np.asarray(r.trace_grad_calls, np.int32)
    traces[f"{r.algorithm}/value"] = np.asarray(r.trace_values, np.float64)
    traces[f"{r.algorithm}/grad_inf"] = np.asarray(r.trace_grad_inf, np.float32)
  np.savez_compressed(folder / f"{dataset}.npz", **traces)
  if grid:
    with open(folder / f"{dataset}_hdm_best_grid.csv", "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=list(grid[0]))
      writer.writeheader()
      writer.writerows(grid)


def read_counts(out: Path, problem: str, datasets=None):
  """{algorithm: (solved, instances)} from the CSVs in ``out/problem``."""
  counts = {}
  folder = out / problem
  for path in sorted(folder.glob("*.csv")):
    if path.name.endswith("_hdm_best_grid.csv"):
      continue
    if datasets is not None and path.stem not in datasets:
      continue
    with open(path) as f:
      for row in csv.DictReader(f):
        s, n = counts.get(row["algorithm"], (0, 0))
        counts[row["algorithm"]] = (s + int(row["solved"]), n + 1)
  return counts


def write_table(out: Path, datasets_paper):
  svm, log = read_counts(out, "svm"), read_counts(out, "logistic")
  svm_p, log_p = (
    read_counts(out, "svm", datasets_paper),
    read_counts(out, "logistic", datasets_paper),
  )
  lines = [
    "# Table 1: solved problems (||grad f||_inf <= 1e-4 within 1000 gradient calls)",
    "",
    "`all` counts every dataset in the folder; `paper's datasets` only those of the",
    "paper's list that are present; `paper` is the published column (out of 33).",
    "",
    "| Algorithm | SVM (all) | Logistic (all) | SVM (paper's datasets) | "
    "Logistic (paper's datasets) | paper SVM | paper logistic |",
    "|---|---|---|---|---|---|---|",
  ]
  fmt = lambda c, a: f"{c[a][0]}/{c[a][1]}" if a in c else "-"
  for alg in ORDER:
    if alg not in svm and alg not in log:
      continue
    p = PAPER.get(alg)
    lines.append(
      f"| {alg} | {fmt(svm, alg)} | {fmt(log, alg)} | {fmt(svm_p, alg)} | "
      f"{fmt(log_p, alg)} | {p[0] if p else ''} | {p[1] if p else ''} |"
    )
  out.mkdir(parents=True, exist_ok=True)
  (out / "table1.md").write_text("\n".join(lines) + "\n")
  return "\n".join(lines)


def _seconds(times):
  return " ".join(f"{k} {v:.2f} s" for k, v in times.items())


def main(argv=None):
  protocol.enable_float64()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--problems", nargs="+", default=["svm", "logistic"], choices=["svm", "logistic"]
  )
  parser.add_argument("--datasets", nargs="+", default=["all"])
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--max-grad-calls", type=int, default=1000)
  parser.add_argument("--tol", type=float, default=1e-4)
  parser.add_argument("--out", default="results")
  parser.add_argument(
    "--no-pad", action="store_true", help="do not pad dense problems to shared shape buckets"
  )
  parser.add_argument(
    "--grid-seconds", action="store_true", help="only time the HDM-Best grid, warm"
  )
  args = parser.parse_args(argv)
  data_dir = args.data_dir or data_lib.default_data_dir()
  names = data_lib.list_datasets(data_dir) if args.datasets == ["all"] else args.datasets
  note = data_lib.data_dir_note(data_dir) if args.datasets == ["all"] else None
  if note:
    print(f"table1: {note}", file=sys.stderr)
  out = Path(args.out)
  total = time.perf_counter()
  for name in names:
    start = time.perf_counter()
    for kind in args.problems:
      try:
        problem = problems_lib.load_problem(name, kind, data_dir=data_dir)
      except FileNotFoundError as e:
        print(f"skipping {name}: {e}", file=sys.stderr)
        break
      if args.grid_seconds:
        secs = grid_seconds(problem, args.max_grad_calls, args.tol)
        print(f"{name:>20} {kind:>8}: HDM-Best grid warm " + _seconds(secs), flush=True)
        continue
      bar = tqdm(
        total=len(jax_algorithms(1.0)) + len(TUNING_FREE) + 1 + len(SCIPY),
        desc=f"{name}/{kind}",
        leave=False,
        file=sys.stderr,
      )

      def progress(label, bar=bar):
        bar.set_postfix_str(label)
        bar.update(1)

      rows, grid = run_instance(
        problem,
        max_grad_calls=args.max_grad_calls,
        tol=args.tol,
        pad=not args.no_pad,
        progress=progress,
      )
      bar.close()
      write_instance(out, kind, name, rows, grid)
      solved = [r.algorithm for r in rows if r.solved]
      grid_s = next(r.seconds for r in rows if r.algorithm == "HDM-Best")
      print(
        f"{name:>20} {kind:>8}: solved by {len(solved)}/{len(rows)} "
        f"(HDM-Best: {'yes' if 'HDM-Best' in solved else 'no'}; its grid {grid_s:.2f} s)",
        flush=True,
      )
    print(f"{name:>20} wall time {time.perf_counter() - start:7.1f} s", flush=True)
    memory.release_compiled_programs()
  if not args.grid_seconds:
    print(write_table(out, PAPER_DATASETS))
  print(f"total wall time {time.perf_counter() - total:.1f} s")


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()
