"""Compares hdm_best's grid with the authors' published HDM-Best, and picks the defaults.

    python -m experiments.fidelity [--results results]
        [--reference ../shared/reference/published_hdm_best_grid.tsv]

Reads ``<results>/<problem>/<dataset>_hdm_best_grid.csv`` (written by
``experiments.table1``) and

1. for the datasets in the reference file, prints both gradient-call counts per
   grid point (eta_p L, eta_b), how many are equal, and the median relative
   difference among the points both solved;
2. over every dataset and problem in the results, prints the number of
   instances each grid point solves (and its total gradient calls): the
   default of ``hdm_best`` is the point that solves the most (ties: fewest
   calls), see ``hdm_optax.methods.DEFAULT_PRECOND_LR_TIMES_L`` / ``DEFAULT_MOMENTUM_LR``.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

import hdm_optax
from experiments import data as data_lib
from experiments import protocol


def read_reference(path):
  ref = {}
  with open(path) as f:
    for row in csv.DictReader(f, delimiter="\t"):
      key = (row["problem"], row["dataset"], float(row["eta_p_times_L"]), float(row["eta_b"]))
      ref[key] = int(row["grad_calls"])
  return ref


def read_grids(results: Path):
  grids = {}
  for problem in ("svm", "logistic"):
    for path in sorted((results / problem).glob("*_hdm_best_grid.csv")):
      dataset = path.name[: -len("_hdm_best_grid.csv")]
      with open(path) as f:
        for row in csv.DictReader(f):
          key = (problem, dataset, float(row["eta_p_times_L"]), float(row["eta_b"]))
          grids[key] = (int(row["solved"]), int(row["grad_calls"]))
  return grids


def compare(grids, ref):
  pairs = defaultdict(list)
  for key, calls in ref.items():
    if key in grids:
      pairs[key[:2]].append((key[2:], grids[key][1], calls))
  lines, agree, total, equal, rel = [], 0, 0, 0, []
  for (problem, dataset), rows in sorted(pairs.items()):
    ours = " ".join(f"{c:>4}" for _, c, _ in rows)
    theirs = " ".join(f"{c:>4}" for _, _, c in rows)
    lines.append(f"{dataset}/{problem}\n  ours:      {ours}\n  published: {theirs}")
    for _, c, r in rows:
      total += 1
      solved = c < protocol.unsolved_calls(), r < protocol.unsolved_calls()
      agree += solved[0] == solved[1]
      if all(solved):
        equal += c == r
        rel.append(abs(c - r) / r)
  summary = (
    f"solved/unsolved agree on {agree}/{total} grid points; of the {len(rel)} "
    f"points both solved, {equal} have equal counts and the median relative "
    f"difference is {100 * np.median(rel) if rel else float('nan'):.1f}%"
  )
  return "\n".join(lines), summary


def rank_points(grids):
  score = defaultdict(lambda: [0, 0, 0])
  for (problem, dataset, pm, mb), (solved, calls) in grids.items():
    s = score[(pm, mb)]
    s[0] += solved
    s[1] += calls
    s[2] += 1
  return sorted(score.items(), key=lambda kv: (-kv[1][0], kv[1][1]))


def leave_one_out(grids):
  """Solved instances when each dataset's point is chosen on the other datasets."""
  datasets = sorted({key[1] for key in grids})
  total = 0
  for held_out in datasets:
    rest = {k: v for k, v in grids.items() if k[1] != held_out}
    point = rank_points(rest)[0][0]
    total += sum(v[0] for k, v in grids.items() if k[1] == held_out and k[2:] == point)
  return total, sum(1 for k in grids if k[2:] == rank_points(grids)[0][0])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default="results")
  default_ref = data_lib.repo_root().parent / "shared/reference/published_hdm_best_grid.tsv"
  parser.add_argument("--reference", default=str(default_ref))
  args = parser.parse_args(argv)
  grids = read_grids(Path(args.results))
  if not grids:
    raise SystemExit(f"no *_hdm_best_grid.csv under {args.results}: run experiments.table1")
  if Path(args.reference).exists():
    detail, summary = compare(grids, read_reference(args.reference))
    print(
      "gradient calls per grid point (eta_p L, eta_b) in row-major order "
      f"of eta_p L in {{0.1, 1, 10, 100}} x eta_b in {{1, 3, 5, 10, 100}}; "
      f"{protocol.unsolved_calls()} = not solved"
    )
    print(detail)
    print(summary)
  else:
    print(f"no reference file at {args.reference}")
  print("\ninstances solved by each grid point over all datasets and problems:")
  print(f"{'eta_p L':>8} {'eta_b':>6} {'solved':>8} {'grad calls':>11}")
  for (pm, mb), (solved, calls, n) in rank_points(grids):
    mark = ""
    if (pm, mb) == (
      hdm_optax.methods.DEFAULT_PRECOND_LR_TIMES_L,
      hdm_optax.methods.DEFAULT_MOMENTUM_LR,
    ):
      mark = "  <- hdm_best default"
    print(f"{pm:>8g} {mb:>6g} {solved:>4}/{n:<3} {calls:>11}{mark}")
  loo, n = leave_one_out(grids)
  print(
    f"leave one dataset out (choose the point on the other datasets, count the held-out "
    f"one's instances): {loo}/{n} solved"
  )


if __name__ == "__main__":
  main()
