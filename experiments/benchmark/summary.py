"""``summary.md`` from the benchmark's CSV: solved counts, profiles, times, reference check."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from experiments.benchmark import profiles
from experiments import solvers as solvers_lib
from experiments.benchmark import suites as suites_lib
from experiments.runner import ENV_ERROR

REFERENCE_TSV = suites_lib.CUTEST_DEV_LIST.parent / "cutest_dev_reference.tsv"
# Our solver names -> the reference file's.
REFERENCE_NAMES = {
  "optax.lbfgs()": "optax.lbfgs()",
  "scipy-lbfgsb-m5": "scipy L-BFGS-B m=5",
  "scipy-lbfgsb-m10": "scipy L-BFGS-B m=10",
  "scipy-bfgs": "scipy BFGS",
  "hdm_best()": "hdm_optax.hdm_best()",
}
PROTOCOL = (
  "Budget {budget} gradient calls, every call counted; solved: finite f and gradient, "
  "f >= -1e20, `||grad f||_inf <= {tol:g}` with fewer than the budget less one calls. The "
  "suites, the solvers and how each one is run and counted: docs/benchmark.md."
)
DETERMINISTIC = ("optax.lbfgs()", "scipy-lbfgsb-m5", "scipy-lbfgsb-m10", "scipy-bfgs")


def read_rows(path: Path) -> list[dict]:
  """The CSV's rows; of the rows of one (suite, problem, solver, seed) the last (a re-run
  appends the retry of an ``env_error`` row after it)."""
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  last = {(r["suite"], r["problem"], r["solver"], r["seed"]): r for r in rows}
  return [r for r in rows if last[(r["suite"], r["problem"], r["solver"], r["seed"])] is r]


def _float(text, default=math.inf):
  try:
    return float(text)
  except (TypeError, ValueError):
    return default


def _by_suite(rows):
  suites = defaultdict(list)
  for r in rows:
    suites[r["suite"]].append(r)
  return suites


def _solvers(rows):
  """The solvers of ``rows``: registered ones in the registry's order, then the others."""
  order = {name: i for i, name in enumerate(solvers_lib.REGISTERED)}
  seen = list(dict.fromkeys(r["solver"] for r in rows))
  return sorted(seen, key=lambda s: order.get(s, len(order)))


def cost_matrix(rows, solvers, field="grad_calls"):
  """(problem-seed keys, costs (P, S)): ``field`` where solved, inf otherwise or if missing."""
  keys = list(dict.fromkeys((r["problem"], r["seed"]) for r in rows))
  index = {k: i for i, k in enumerate(keys)}
  costs = np.full((len(keys), len(solvers)), np.inf)
  column = {s: j for j, s in enumerate(solvers)}
  for r in rows:
    if r["solved"] == "1" and r["solver"] in column:
      value = _float(r[field])
      if field == "run_seconds":
        value = max(value, 1e-6)
      costs[index[(r["problem"], r["seed"])], column[r["solver"]]] = value
  return keys, costs


def solved_table(suites: dict) -> list[str]:
  """Solvers x suites: solved / rows run (LIBSVM suites: the mean over seeds); rows the
  solver skips (``skipped: ...``, e.g. a dense n x n matrix past its size cap) and rows the
  machine failed (``env_error: ...``, e.g. a GPU held by another process) are named beside
  the count, not counted as unsolved."""
  names = list(suites)
  all_solvers = list(dict.fromkeys(s for rows in suites.values() for s in _solvers(rows)))
  lines = [
    "| solver | " + " | ".join(names) + " |",
    "|---|" + "---|" * len(names),
  ]
  for solver in all_solvers:
    cells = []
    for suite in names:
      every = [r for r in suites[suite] if r["solver"] == solver]
      mine = [r for r in every if not r["status"].startswith(("skipped", ENV_ERROR))]
      if not every:
        cells.append("n/a")
        continue
      seeds = sorted({r["seed"] for r in mine}) or [None]
      solved = sum(r["solved"] == "1" for r in mine)
      if len(seeds) > 1:
        per = len(mine) / len(seeds)
        cell = f"{solved / len(seeds):.1f}/{per:g}"
      else:
        cell = f"{solved}/{len(mine)}"
      env = sum(r["status"].startswith(ENV_ERROR) for r in every)
      apart = [(len(every) - len(mine) - env, "skipped"), (env, "env errors")]
      notes = ", ".join(f"{k} {what}" for k, what in apart if k)
      cells.append(cell + (f" ({notes})" if notes else ""))
    lines.append(f"| `{solver}` | " + " | ".join(cells) + " |")
  return lines


# The bounded suites' reference row: median calls are compared on the problems both solve.
BOUNDED_REFERENCE = "scipy-lbfgsb-m10"


def median_table(rows, reference: str = BOUNDED_REFERENCE) -> list[str]:
  """Per solver: solved, and the median calls where it and ``reference`` both solve."""
  solvers = _solvers(rows)
  keys, costs = cost_matrix(rows, solvers)
  if reference not in solvers:
    return []
  ref = costs[:, solvers.index(reference)]
  lines = [
    f"| solver | solved | problems it and `{reference}` both solve | median calls there "
    f"(it / `{reference}`) |",
    "|---|---|---|---|",
  ]
  for j, solver in enumerate(solvers):
    both = np.isfinite(costs[:, j]) & np.isfinite(ref)
    medians = f"{np.median(costs[both, j]):g} / {np.median(ref[both]):g}" if both.any() else "-"
    solved = int(np.isfinite(costs[:, j]).sum())
    lines.append(f"| `{solver}` | {solved}/{len(keys)} | {int(both.sum())} | {medians} |")
  return lines


# The frontier table names the problems a solver leaves to the others up to this many.
FRONTIER_NAMES = 25


def frontier_table(rows) -> list[str]:
  """Per solver: solved, what the other solvers of the suite solve together, what all solve
  together, and the problem-starts some other solver solves and it does not (named up to
  ``FRONTIER_NAMES``). A user picks one solver, not the best per problem: the union of the
  others is what it is measured against."""
  solvers = _solvers(rows)
  keys, costs = cost_matrix(rows, solvers)
  solved = np.isfinite(costs)
  label = lambda k: k[0] if not k[1] else f"{k[0]}#{k[1]}"
  lines = [
    "| solver | solved | the others together | all together | solved by another, not by it |",
    "|---|---|---|---|---|",
  ]
  every = int(solved.any(axis=1).sum())
  for j, solver in enumerate(solvers):
    others = np.delete(solved, j, axis=1).any(axis=1)
    left = [label(k) for k, o, mine in zip(keys, others, solved[:, j]) if o and not mine]
    named = ", ".join(left) if len(left) <= FRONTIER_NAMES else f"{len(left)} problem-starts"
    lines.append(
      f"| `{solver}` | {int(solved[:, j].sum())}/{len(keys)} | {int(others.sum())} | {every} "
      f"| {named or '-'} |"
    )
  return lines


def per_seed_table(rows) -> list[str]:
  seeds = sorted({r["seed"] for r in rows})
  lines = [
    "| solver | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
    "|---|" + "---|" * (len(seeds) + 1),
  ]
  for solver in _solvers(rows):
    counts = []
    for s in seeds:
      mine = [r for r in rows if r["solver"] == solver and r["seed"] == s]
      counts.append((sum(r["solved"] == "1" for r in mine), len(mine)))
    present = [c for c, n in counts if n]
    mean = f"{np.mean(present):.1f}" if present else ""
    cells = [f"{c}/{n}" if n else "-" for c, n in counts]
    lines.append(f"| `{solver}` | " + " | ".join(cells) + f" | {mean} |")
  return lines


def per_kind_table(rows) -> list[str]:
  """LIBSVM: solved SVM and logistic instances, at the paper's x0 (the first seed) and the mean."""
  seeds = sorted({r["seed"] for r in rows})
  kinds = sorted({r["problem"].rsplit("/", 1)[-1] for r in rows})
  head = [f"{k} at seed {seeds[0]}" for k in kinds] + [f"{k}, mean over seeds" for k in kinds]
  lines = ["| solver | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
  for solver in _solvers(rows):
    first, mean = [], []
    for kind in kinds:
      mine = [r for r in rows if r["solver"] == solver and r["problem"].endswith("/" + kind)]
      on_first = [r for r in mine if r["seed"] == seeds[0]]
      first.append(f"{sum(r['solved'] == '1' for r in on_first)}/{len(on_first)}")
      used = sorted({r["seed"] for r in mine})
      avg = sum(r["solved"] == "1" for r in mine) / max(len(used), 1)
      mean.append(f"{avg:.1f} ({len(used)} seed{'s' if len(used) != 1 else ''})")
    lines.append(f"| `{solver}` | " + " | ".join(first + mean) + " |")
  return lines


def times_table(rows) -> list[str]:
  lines = ["| solver | compile s | run s | errors |", "|---|---|---|---|"]
  for solver in _solvers(rows):
    mine = [r for r in rows if r["solver"] == solver]
    comp = sum(_float(r["compile_seconds"], 0.0) for r in mine)
    run = sum(_float(r["run_seconds"], 0.0) for r in mine)
    errors = sum(r["status"].startswith("error") for r in mine)
    lines.append(f"| `{solver}` | {comp:.1f} | {run:.1f} | {errors} |")
  return lines


def reference_check(rows, path: Path = REFERENCE_TSV) -> list[str]:
  """Our CUTEst rows against the reference counts: equal solved flag and gradient calls?"""
  if not Path(path).exists():
    return [f"(no reference file at {path})"]
  with open(path, newline="") as f:
    ref = {(r["problem"], r["solver"]): r for r in csv.DictReader(f, delimiter="\t")}
  ours = {(r["problem"], r["solver"]): r for r in rows if r["suite"] == "cutest"}
  lines = [
    "| solver | problems compared | same solved flag | same gradient calls | differences |",
    "|---|---|---|---|---|",
  ]
  for solver, ref_name in REFERENCE_NAMES.items():
    same_flag = same_calls = compared = 0
    diffs = []
    for (problem, name), r in sorted(ref.items()):
      if name != ref_name or (problem, solver) not in ours:
        continue
      o = ours[(problem, solver)]
      compared += 1
      flag = (o["solved"] == "1") == (r["solved"] == "1")
      calls = o["grad_calls"] == r["grad_calls"] or (
        o["solved"] != "1" and r["solved"] != "1"  # unsolved: only the flag matters
      )
      same_flag += flag
      same_calls += calls
      if not (flag and calls):
        diffs.append(
          f"{problem} {r['solved']}/{r['grad_calls']} vs {o['solved']}/{o['grad_calls']}"
        )
    if compared:
      tag = "" if solver in DETERMINISTIC else " (not deterministic across code versions)"
      lines.append(
        f"| `{solver}`{tag} | {compared} | {same_flag} | {same_calls} | "
        + ("; ".join(diffs) if diffs else "none")
        + " |"
      )
  lines += ["", "Why counts differ from the reference: docs/research/benchmark.md."]
  return lines


def _timings(path: Path) -> list[str]:
  if not path.exists():
    return []
  lines = ["| suite | wall seconds | rows written | when (UTC) |", "|---|---|---|---|"]
  for line in path.read_text().splitlines():
    suite, seconds, rows, when = line.split("\t")
    lines.append(f"| {suite} | {float(seconds):.0f} | {rows} | {when} |")
  return lines


def write_summary(
  csv_path: Path, out: Path, budget: int, tol: float, extra: Optional[list[str]] = None
) -> Path:
  """Writes ``out/summary.md`` and the profile PNGs; returns the summary's path."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  rows = read_rows(csv_path)
  suites = _by_suite(rows)
  lines = [
    "# Benchmark: what users get",
    "",
    "`python -m experiments.benchmark` (`experiments/benchmark/`); rows in "
    f"`{Path(csv_path).name}`, one per (problem, solver, seed).",
    "",
    "## Solved (LIBSVM suites: mean over seeds / instances)",
    "",
    *solved_table(suites),
    "",
  ]
  for suite, srows in suites.items():
    solvers = _solvers(srows)
    lines += [f"## {suite}", ""]
    if len({r["seed"] for r in srows}) > 1:
      lines += ["Solved per seed:", "", *per_seed_table(srows), ""]
    if all("/" in r["problem"] for r in srows):
      lines += ["Solved per problem kind:", "", *per_kind_table(srows), ""]
    if suite in suites_lib.BOUNDED_SUITES:
      lines += ["Median gradient calls against SciPy's L-BFGS-B:", "", *median_table(srows), ""]
    if len(solvers) > 1:
      lines += ["Against the other solvers together:", "", *frontier_table(srows), ""]
    for field, label, unit in (
      ("grad_calls", "gradient calls", "calls"),
      ("run_seconds", "wall time", "seconds"),
    ):
      _, costs = cost_matrix(srows, solvers, field)
      name = f"profile_{suite}_{field}.png"
      profiles.plot_profile(
        costs,
        solvers,
        out / name,
        f"{suite}: {costs.shape[0]} problem-starts, {label}",
        f"log2(tau): within a factor tau of the fewest {unit}",
      )
      lines += [f"![{suite} {label}]({name})", ""]
    lines += ["Time spent (seconds, all rows):", "", *times_table(srows), ""]
  if "cutest" in suites:
    lines += ["## Check against the reference counts", "", *reference_check(rows), ""]
  timings = _timings(out / "timings.tsv")
  if timings:
    lines += ["## Wall time of the runs", "", *timings, ""]
  lines += ["## Protocol", "", PROTOCOL.format(budget=budget, tol=tol), ""]
  notes = out / "notes.md"  # what a reader should know about this particular run
  if notes.exists():
    lines += ["## This run", "", notes.read_text().strip(), ""]
  if extra:
    lines += extra
  path = out / "summary.md"
  path.write_text("\n".join(lines) + "\n")
  return path
