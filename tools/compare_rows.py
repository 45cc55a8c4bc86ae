"""Compares benchmark rows with the committed ones: same calls, status and digits.

``python -m tools.compare_rows NEW.csv [--against results/benchmark/results.csv]`` prints, for
the (suite, problem, solver, seed) rows of NEW, how many match the committed rows bit for bit
(grad_calls, value_calls, final_value, final_grad_inf, status, solved) and lists the others.
"""

from __future__ import annotations

import argparse
import csv

KEY = ("suite", "problem", "dtype", "solver", "seed")
SAME = ("solved", "grad_calls", "value_calls", "final_value", "final_grad_inf", "status")


def rows(path) -> dict:
  with open(path, newline="") as f:
    return {tuple(r[k] for k in KEY): r for r in csv.DictReader(f)}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("new")
  p.add_argument("--against", default="results/benchmark/results.csv")
  args = p.parse_args(argv)
  new, old = rows(args.new), rows(args.against)
  same = calls = 0
  for key, row in sorted(new.items()):
    ref = old.get(key)
    if ref is None:
      print("  not committed:", key)
      continue
    if all(row[k] == ref[k] for k in SAME):
      same += 1
      continue
    if all(row[k] == ref[k] for k in ("grad_calls", "value_calls", "status", "solved")):
      calls += 1
    diff = {k: (ref[k], row[k]) for k in SAME if row[k] != ref[k]}
    print("  differs:", "/".join(key), diff)
  print(f"{same} of {len(new)} rows bit for bit; {calls} more with the same calls and status")


if __name__ == "__main__":
  main()
