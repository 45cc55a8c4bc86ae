"""Runs solvers on suites and appends one CSV row per (problem, solver, seed).

Each (task, solver) is ``experiments.runner.run(solver, task.build())`` under the protocol
(``experiments.protocol``: the budget, the tolerance, the one solved rule); this module is
the suite around it: rows are appended (and flushed) as they finish; a re-run skips the rows
already in the file; a problem or solver that raises gives error rows.
"""

from __future__ import annotations

import csv
import dataclasses
import traceback
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from experiments import memory
from experiments import protocol
from experiments import runner as runner_lib
from experiments.benchmark import solvers as solvers_lib
from experiments.benchmark import suites as suites_lib

BUDGET = protocol.BUDGET
TOL = protocol.TOL
outcome = protocol.outcome
Row = protocol.Row
# The CSV's columns, and the Row attribute of each where the names differ.
FIELDS = (
  "suite",
  "problem",
  "n",
  "dtype",
  "solver",
  "seed",
  "solved",
  "grad_calls",
  "value_calls",
  "final_value",
  "final_grad_inf",
  "status",
  "compile_seconds",
  "run_seconds",
)
ATTRIBUTES = {"solver": "algorithm", "run_seconds": "seconds"}


def cells(row: Row) -> list[str]:
  """The CSV cells of ``row`` in ``FIELDS`` order."""

  def cell(v):
    if v is None:
      return ""
    if isinstance(v, bool):
      return str(int(v))
    if isinstance(v, float):
      return repr(v)
    return str(v)

  values = [getattr(row, ATTRIBUTES.get(f, f)) for f in FIELDS]
  return [f"{v:.4f}" if f.endswith("seconds") else cell(v) for f, v in zip(FIELDS, values)]


# ----------------------------------------------------------------------------
# The run: CSV, resume, errors, progress
# ----------------------------------------------------------------------------


def _seed_cell(seed) -> str:
  return "" if seed is None else str(seed)


def done_keys(path: Path) -> set:
  """(suite, problem, solver, seed) of the rows already in the CSV (an ``env_error`` row is
  not done: a re-run retries it, and the summary reads the newer row)."""
  if not path.exists():
    return set()
  with open(path, newline="") as f:
    return {
      (r["suite"], r["problem"], r["solver"], r["seed"])
      for r in csv.DictReader(f)
      if not r["status"].startswith(ENV_ERROR)
    }


def merge(parts: Sequence[Path], csv_path: Path) -> int:
  """Appends the rows of the CSVs ``parts`` not yet in ``csv_path``; returns rows appended."""
  done = done_keys(Path(csv_path))
  log = CsvLog(csv_path)
  written = 0
  try:
    for part in parts:
      if not Path(part).exists():
        continue
      with open(part, newline="") as f:
        for r in csv.DictReader(f):
          key = (r["suite"], r["problem"], r["solver"], r["seed"])
          if key not in done:
            done.add(key)
            log.write_cells([r[name] for name in FIELDS])
            written += 1
  finally:
    log.close()
  return written


# Errors of the machine, not of the run: a GPU that another process holds ("Unable to
# initialize backend 'cuda'"), memory taken by other processes (RESOURCE_EXHAUSTED).
ENV_ERRORS = ("Unable to initialize backend", "RESOURCE_EXHAUSTED", "CUDA_ERROR_OUT_OF_MEMORY")
ENV_ERROR = "env_error"


def _where(task, inst, seed) -> dict:
  return dict(suite=task.suite, problem=task.name, n=inst.n, dtype=inst.dtype, seed=seed)


def _error(task, solver_name, seed, exc, n=None, dtype="") -> Row:
  """An error row: ``env_error: ...`` where the machine failed (:data:`ENV_ERRORS`; the
  summary names these apart and a re-run retries them), ``error: ...`` otherwise."""
  message = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
  kind = ENV_ERROR if any(e in message for e in ENV_ERRORS) else "error"
  where = dict(suite=task.suite, problem=task.name, n=n, dtype=dtype, seed=seed)
  return Row(solver_name, status=f"{kind}: {message}", **where)


class CsvLog:
  """Appends rows to the CSV (header first if the file is new) and flushes each one."""

  def __init__(self, path: Path):
    self.path = Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    new = not self.path.exists() or self.path.stat().st_size == 0
    self._file = open(self.path, "a", newline="")
    self._writer = csv.writer(self._file)
    if new:
      self._writer.writerow(FIELDS)
      self._file.flush()

  def write_cells(self, cells: Sequence[str]):
    self._writer.writerow(cells)
    self._file.flush()

  def write(self, rows: Sequence[Row]):
    for row in rows:
      self._writer.writerow(cells(row))
    self._file.flush()

  def close(self):
    self._file.close()


def run_suite(
  tasks: Sequence[suites_lib.Task],
  solvers: Sequence[solvers_lib.Solver],
  csv_path: Path,
  *,
  budget: int = BUDGET,
  scipy_seeds: Optional[int] = None,
  progress: bool = True,
  desc: str = "",
  also_done: Sequence[Path] = (),
) -> int:
  """Runs every solver on every task, appending rows to ``csv_path``; returns rows written.

  ``scipy_seeds`` limits the SciPy rows to the first seeds of each problem (None: all).
  Rows present in ``csv_path`` or in the CSVs of ``also_done`` are skipped.
  """
  done = done_keys(Path(csv_path)).union(*(done_keys(Path(p)) for p in also_done))
  log = CsvLog(csv_path)
  written = 0
  bar = tqdm(total=len(tasks) * len(solvers), desc=desc, disable=not progress, mininterval=5)
  try:
    for task in tasks:
      todo = []
      for solver in solvers:
        seeds = task.seeds
        if solver.is_scipy and scipy_seeds is not None and seeds != (None,):
          seeds = seeds[:scipy_seeds]
        missing = [
          s for s in seeds if (task.suite, task.name, solver.name, _seed_cell(s)) not in done
        ]
        if missing:
          todo.append((solver, missing))
        else:
          bar.update(1)
      if not todo:
        continue
      bar.set_postfix_str(task.name)
      try:
        inst = task.build()
      except Exception as exc:  # the run goes on: error rows
        traceback.print_exc()
        rows = [_error(task, s.name, seed, exc) for s, seeds in todo for seed in seeds]
        log.write(rows)
        written += len(rows)
        bar.update(len(todo))
        continue
      for solver, missing in todo:
        bar.set_postfix_str(f"{task.name} {solver.name}")
        if (
          (solver.needs_lipschitz and inst.lipschitz is None)
          or (solver.needs_f_star and inst.f_star is None)
          or not solver.runs_on(inst.lower is not None)
        ):
          bar.update(1)
          continue
        if solver.max_n is not None and inst.n > solver.max_n:
          reason = f"skipped: n = {inst.n} > {solver.max_n}"
          rows = [Row(solver.name, status=reason, **_where(task, inst, seed)) for seed in missing]
          log.write(rows)
          written += len(rows)
          bar.update(1)
          continue
        try:
          rows = runner_lib.run(solver, inst, budget, missing)
          rows = [dataclasses.replace(r, suite=task.suite, problem=task.name) for r in rows]
        except Exception as exc:
          traceback.print_exc()
          rows = [_error(task, solver.name, seed, exc, inst.n, inst.dtype) for seed in missing]
        log.write(rows)
        written += len(rows)
        bar.update(1)
      # The CUTEst suite compiles 66 objectives x 7 solvers, none shared: without this the
      # process runs out of memory maps (a segmentation fault) after about 50 problems.
      memory.release_compiled_programs(also=runner_lib._COMPILED.clear)
  finally:
    bar.close()
    log.close()
  return written
