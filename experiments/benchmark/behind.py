"""Where ``hdm_best()`` is furthest behind ``optax.lbfgs()``, and what its run shows there.

    python -m experiments.benchmark.behind [--csv results/benchmark/results.csv] [--top 5]

Ranks the problems of the ``cutest`` and ``libsvm`` suites (first seed) by the ratio of
gradient calls (an unsolved run counts as twice the budget), re-runs ``hdm_best()`` on the
worst ones and prints its null steps (how many, the longest run of consecutive ones and where
it starts), the smoothness L of its probe, the curvature estimate L_hat, P's scale (median and
max of P times L_hat, or times L before L_hat exists) and beta.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

import hdm_optax
from experiments.benchmark import runner
from experiments.benchmark import suites as suites_lib
from experiments import protocol

SOLVER, BASE = "hdm_best()", "optax.lbfgs()"


def _cost(row, budget):
  return int(row["grad_calls"]) if row["solved"] == "1" else 2 * budget


def furthest_behind(rows, suite, top, budget=runner.BUDGET):
  """[(problem, hdm calls, lbfgs calls, ratio)] of the ``top`` worst problems of ``suite``."""
  first = {}
  for r in rows:
    if r["suite"] == suite and r["solver"] in (SOLVER, BASE) and r["grad_calls"]:
      first.setdefault((r["problem"], r["solver"]), r)  # the first seed
  out = []
  for (problem, solver), r in first.items():
    base = first.get((problem, BASE))
    if solver != SOLVER or base is None:
      continue
    ratio = _cost(r, budget) / _cost(base, budget)
    out.append((problem, _cost(r, budget), _cost(base, budget), ratio))
  return sorted(out, key=lambda t: -t[3])[:top]


def _longest_run(rejected):
  best, start, run = 0, -1, 0
  for i, r in enumerate(rejected):
    run = run + 1 if r else 0
    if run > best:
      best, start = run, i - run + 1
  return best, start


def diagnose(inst, budget=runner.BUDGET) -> str:
  """One line on ``hdm_best()``'s run from the instance's first starting point."""
  res = hdm_optax.solve(
    hdm_optax.hdm_best(),
    inst.fun,
    inst.x0[0],
    max_steps=budget - 1,
    tol=float(inst.tol[0]),
    fun_args=inst.fun_args,
    max_grad_evals=budget,
  )
  steps = int(res.num_steps)
  rejected = ~np.asarray(res.trace.accepted)[1 : steps + 1]
  longest, start = _longest_run(rejected)
  st = res.state.direction  # the iteration state's momentum direction
  smooth, curv = float(st.lipschitz), float(st.curvature.l_hat)
  scale = curv if curv > 0 else smooth
  p = np.abs(np.asarray(st.precond)) * scale
  return (
    f"steps {steps}, null steps {int(rejected.sum())} (longest run {longest} from step "
    f"{start + 1}), L(probe) {smooth:.3g}, L_hat {curv:.3g}, P*{'L_hat' if curv > 0 else 'L'} "
    f"median {np.median(p):.3g} max {p.max():.3g}, beta {float(st.momentum):.3g}, "
    f"||g||_inf {float(res.grad_norm):.2e}"
  )


def main(argv=None):
  protocol.enable_float64()
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--csv", default="results/benchmark/results.csv")
  p.add_argument("--top", type=int, default=5)
  p.add_argument("--data-dir", default=None)
  args = p.parse_args(argv)
  with open(Path(args.csv), newline="") as f:
    rows = list(csv.DictReader(f))
  for suite in ("cutest", "libsvm"):
    print(f"{suite}: {SOLVER} vs {BASE} (gradient calls; unsolved = {2 * runner.BUDGET})")
    for problem, mine, base, ratio in furthest_behind(rows, suite, args.top):
      if suite == "cutest":
        task = suites_lib.cutest_tasks(runner.TOL, [problem])[0]
      else:
        task = suites_lib.tasks(suite, tol=runner.TOL, data_dir=args.data_dir, problems=[problem])
        task = next(t for t in task if t.name == problem)
      print(f"  {problem}: {mine} vs {base} ({ratio:.1f}x): {diagnose(task.build())}", flush=True)


if __name__ == "__main__":
  main()
