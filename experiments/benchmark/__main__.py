"""Runs the benchmark and writes its summary.

    python -m experiments.benchmark --suite cutest libsvm libsvm32 user [cutest_scale_dev] [--seeds 5]
        [--solvers 'hdm_best()' 'hdm_best(lipschitz=L)' osgm_best ...] [--out results/benchmark]
        [--jobs 2]

Rows go to ``<out>/results.csv`` (appended; a re-run resumes), the summary to
``<out>/summary.md`` with profile PNGs beside it. ``--solvers`` takes registered names
(``experiments/solvers.py``: the default list) or optax expressions, where ``L`` is
the problem's Lipschitz constant. ``--jobs N`` runs the solvers in N processes (solver i in
process i mod N; each compiles its own programs, so no count changes) and merges their rows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments import runner
from experiments import solvers as solvers_lib
from experiments.benchmark import suites as suites_lib
from experiments.benchmark import summary as summary_lib
from experiments import protocol


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--suite", nargs="+", default=list(suites_lib.SUITES))
  p.add_argument("--solvers", nargs="+", default=list(solvers_lib.DEFAULT))
  p.add_argument("--seeds", type=int, default=1, help="starting points of the LIBSVM suites")
  p.add_argument(
    "--scipy-seeds", type=int, default=None, help="SciPy rows only for the first seeds"
  )
  p.add_argument("--budget", type=int, default=runner.BUDGET)
  p.add_argument("--tol", type=float, default=runner.TOL)
  p.add_argument("--problems", nargs="+", default=None, help="only these (names or datasets)")
  p.add_argument("--datasets", nargs="+", default=None, help="LIBSVM datasets (default: all)")
  p.add_argument("--data-dir", default=None)
  p.add_argument(
    "--max-n", type=int, default=None, help="also run the cutest_scale suite: 1000 < n <= MAX_N"
  )
  p.add_argument("--out", default="results/benchmark")
  p.add_argument("--csv", default=None, help="default: <out>/results.csv")
  p.add_argument("--summary-only", action="store_true")
  p.add_argument("--no-summary", action="store_true", help="rows only (no summary.md)")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--jobs", type=int, default=1, help="processes; solvers split among them")
  p.add_argument("--also-done", nargs="*", default=[], help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  for suite in args.suite:
    if suite not in suites_lib.SUITES + suites_lib.EXTRA_SUITES:
      known = ", ".join(suites_lib.SUITES + suites_lib.EXTRA_SUITES)
      p.error(f"--suite: unknown suite {suite!r}; choose from {known}")
  if args.max_n is not None and "cutest_scale" not in args.suite:
    args.suite.append("cutest_scale")
  return args


def _child_argv(args, solvers, csv_path, part):
  argv = ["--suite", *args.suite, "--solvers", *solvers, "--csv", str(part)]
  argv += ["--out", str(part.parent), "--also-done", str(csv_path), "--no-summary"]
  argv += ["--seeds", str(args.seeds), "--budget", str(args.budget), "--tol", repr(args.tol)]
  for flag, value in (
    ("--scipy-seeds", args.scipy_seeds),
    ("--data-dir", args.data_dir),
    ("--max-n", args.max_n),
  ):
    if value is not None:
      argv += [flag, str(value)]
  for flag, values in (("--problems", args.problems), ("--datasets", args.datasets)):
    if values:
      argv += [flag, *values]
  if args.no_progress:
    argv.append("--no-progress")
  return argv


def child_environment(environ) -> dict:
  """The environment of the ``--jobs`` processes: JAX allocates GPU memory as it needs it
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, unless set) instead of taking 75% of the card
  in each process, which left the others "Unable to initialize backend" or
  RESOURCE_EXHAUSTED (10 of 810 libsvm32 rows with 4 processes on one H100)."""
  env = dict(environ)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  return env


def run_in_processes(args, out: Path, csv_path: Path) -> None:
  """Solver i runs in process i mod ``args.jobs``; their CSVs are merged into ``csv_path``."""
  parts_dir = out / "parts"
  parts_dir.mkdir(parents=True, exist_ok=True)
  groups = [args.solvers[i :: args.jobs] for i in range(args.jobs)]
  parts = [parts_dir / f"part{i}.csv" for i in range(len(groups))]
  start = time.perf_counter()
  env = child_environment(os.environ)
  children = [
    subprocess.Popen(
      [sys.executable, "-m", "experiments.benchmark", *_child_argv(args, group, csv_path, part)],
      env=env,
    )
    for group, part in zip(groups, parts)
    if group
  ]
  codes, cpu = [], []
  for child in children:  # CPU seconds of each process: its wall time on an idle core
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    codes.append(child.returncode)
    cpu.append(usage.ru_utime + usage.ru_stime)
  seconds = time.perf_counter() - start
  written = runner.merge(parts, csv_path)
  suites = "+".join(args.suite)
  print(
    f"{suites}: {written} rows in {seconds:.1f} s ({len(children)} processes, CPU seconds "
    f"{', '.join(f'{c:.0f}' for c in cpu)})",
    flush=True,
  )
  if written:
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with open(out / "timings.tsv", "a") as f:
      f.write(f"{suites} ({len(children)} processes)\t{seconds:.1f}\t{written}\t{when}\n")
  if any(codes):
    raise SystemExit(f"a benchmark process failed (exit codes {codes}); rows kept in {parts_dir}")
  for part in parts:
    part.unlink(missing_ok=True)
    part.with_name("timings.tsv").unlink(missing_ok=True)


def main(argv=None):
  protocol.enable_float64()
  args = parse_args(argv)
  out = Path(args.out)
  csv_path = Path(args.csv) if args.csv else out / "results.csv"
  solvers = [solvers_lib.get(name) for name in args.solvers]
  if args.jobs > 1 and not args.summary_only:
    run_in_processes(args, out, csv_path)
  elif not args.summary_only:
    for suite in args.suite:
      tasks = suites_lib.tasks(
        suite,
        tol=args.tol,
        num_seeds=args.seeds,
        datasets=args.datasets,
        data_dir=args.data_dir,
        problems=args.problems,
        max_n=args.max_n,
      )
      start = time.perf_counter()
      written = runner.run_suite(
        tasks,
        solvers,
        csv_path,
        budget=args.budget,
        scipy_seeds=args.scipy_seeds,
        progress=not args.no_progress,
        desc=suite,
        also_done=[Path(p) for p in args.also_done],
      )
      seconds = time.perf_counter() - start
      print(f"{suite}: {written} rows in {seconds:.1f} s", flush=True)
      if written:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "timings.tsv", "a") as f:
          when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
          f.write(f"{suite}\t{seconds:.1f}\t{written}\t{when}\n")
  if csv_path.exists() and not args.no_summary:
    path = summary_lib.write_summary(csv_path, out, args.budget, args.tol)
    print(f"summary: {path}")


if __name__ == "__main__":
  main()
