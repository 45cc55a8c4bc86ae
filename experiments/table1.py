"""Reproduces Table 1 of the paper (solved problems per algorithm).

    python -m experiments.table1 [--problems svm logistic] [--datasets all | a1a w8a ...]
        [--data-dir DIR] [--max-grad-calls 1000] [--tol 1e-4] [--out results]

For every dataset and problem it runs all algorithms under the paper's
protocol (see ``experiments/runner.py``) and writes

- ``<out>/<problem>/<dataset>.csv``: one row per algorithm (its best grid point);
- ``<out>/<problem>/<dataset>.npz``: the traces (value, ||g||_inf against
  gradient calls) of those rows, read by ``experiments.figures``;
- ``<out>/<problem>/<dataset>_hdm_best_grid.csv``: all 20 HDM-Best grid points;
- ``<out>/table1.md``: solved counts beside the paper's published column.

A dataset that is not on disk is skipped with a message.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments import data as data_lib
from experiments import memory
from experiments import problems as problems_lib
from experiments import runner
from experiments import protocol

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
ORDER = [
  "GD",
  "GD-HB",
  "AGD-CVX",
  "AGD-SCVX",
  "Adam",
  "AdaGrad",
  "L-BFGS-M1",
  "L-BFGS-M3",
  "L-BFGS-M5",
  "L-BFGS-M10",
  "BFGS",
  "HDM-Best",
  "HDM-Best-default",
  "HDM-Auto",
  "OSGM-Best",
  "optax-L-BFGS",
  "HDM",
  "HDM-HB",
  "HDM-AGD",
]
FIELDS = [
  "algorithm",
  "solved",
  "iterations",
  "value_calls",
  "grad_calls",
  "hyperparams",
  "final_value",
  "final_grad_inf",
  "seconds",
]
# The datasets of the paper's experiments that are in the shared folder.
PAPER_DATASETS = (
  "a1a",
  "a2a",
  "a3a",
  "a4a",
  "a7a",
  "a8a",
  "a9a",
  "australian_scale",
  "fourclass_scale",
  "german.numer_scale",
  "heart_scale",
  "ijcnn1",
  "ionosphere_scale",
  "mushrooms",
  "phishing",
  "sonar_scale",
  "splice_scale",
  "svmguide1",
  "svmguide3",
  "w1a",
  "w4a",
  "w6a",
  "w7a",
  "w8a",
)


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
  (out / "table1.md").write_text("\n".join(lines) + "\n")
  return "\n".join(lines)


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
  args = parser.parse_args(argv)
  data_dir = args.data_dir or data_lib.default_data_dir()
  names = data_lib.list_datasets(data_dir) if args.datasets == ["all"] else args.datasets
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
      bar = tqdm(
        total=len(runner.jax_algorithms(1.0)) + 6,
        desc=f"{name}/{kind}",
        leave=False,
        file=sys.stderr,
      )

      def progress(label, bar=bar):
        bar.set_postfix_str(label)
        bar.update(1)

      rows, grid = runner.run_instance(
        problem,
        max_grad_calls=args.max_grad_calls,
        tol=args.tol,
        pad=not args.no_pad,
        progress=progress,
      )
      bar.close()
      write_instance(out, kind, name, rows, grid)
      solved = [r.algorithm for r in rows if r.solved]
      print(
        f"{name:>20} {kind:>8}: solved by {len(solved)}/{len(rows)} "
        f"(HDM-Best: {'yes' if 'HDM-Best' in solved else 'no'})",
        flush=True,
      )
    print(f"{name:>20} wall time {time.perf_counter() - start:7.1f} s", flush=True)
    memory.release_compiled_programs()
  print(write_table(out, PAPER_DATASETS))
  print(f"total wall time {time.perf_counter() - total:.1f} s")


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main()
