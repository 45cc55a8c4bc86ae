"""The benchmark runner: CSV schema, the solved rule, resume, error rows, profiles, registry."""

import csv
import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse as jsparse

import backends
from experiments import data as data_lib
from fast_jit import FAST_COMPILE
from experiments import memory
from experiments import problems
from experiments import protocol
from experiments.benchmark import __main__ as cli
from experiments.benchmark import profiles
from experiments import runner
from experiments import solvers
from experiments.benchmark import suites
from experiments.benchmark import summary

HEADER = (
  "suite,problem,n,dtype,solver,seed,solved,grad_calls,value_calls,"
  "final_value,final_grad_inf,status,compile_seconds,run_seconds"
)
CUTEST = ("AKIVA", "HILBERTB", "BOX3")
# ../shared/benchmarks/cutest_dev_reference.tsv (measured independently): calls, all solved.
REFERENCE = {
  ("AKIVA", "optax.lbfgs()"): 28,
  ("HILBERTB", "optax.lbfgs()"): 6,
  ("BOX3", "optax.lbfgs()"): 10,
  ("AKIVA", "scipy-lbfgsb-m5"): 22,
  ("HILBERTB", "scipy-lbfgsb-m5"): 6,
  ("BOX3", "scipy-lbfgsb-m5"): 12,
}
DATASET = "heart_scale"
# The rows a JAX user would pick instead of HDM (optimistix, optax's tuning-free family,
# gradient descent with optax's line searches).
PEER_ROWS = (
  "optax.contrib.prodigy()",
  "optax.contrib.dog()",
  "optax.contrib.dadapt_adamw()",
  "optax.contrib.cocob()",
  "optax.polyak_sgd(f_min=F_STAR)",
  "optax-gd-zoom",
  "optax-gd-backtracking",
  "optx.BFGS",
  "optx.LBFGS",
)


def _counted_rosenbrock(seen):
  """Rosenbrock-2 from (-1.2, 1) whose every evaluation appends to ``seen`` (a callback)."""

  def rosenbrock(x):
    jax.debug.callback(lambda: seen.append(1))
    return problems.rosenbrock(x)

  return problems.instance(rosenbrock, (), [-1.2, 1.0], runner.TOL)


def test_profile_of_a_hand_made_3x3_example():
  inf = math.inf
  # Problem 0: solver 0 best, solver 1 twice its cost, solver 2 fails.
  # Problem 1: solver 1 best, solver 0 at 2x, solver 2 at 4x. Problem 2: nobody solves it.
  costs = [[10, 20, inf], [8, 4, 16], [inf, inf, inf]]
  np.testing.assert_array_equal(
    profiles.performance_ratios(costs), [[1, 2, inf], [2, 1, 4], [inf, inf, inf]]
  )
  rho = profiles.performance_profile(costs, [1, 1.5, 2, 4, 1e9])
  np.testing.assert_allclose(
    rho,
    np.array([[1, 1, 0], [1, 1, 0], [2, 2, 0], [2, 2, 1], [2, 2, 1]]) / 3,
  )


def test_registry_names_and_expressions():
  assert solvers.get("hdm_best()") is solvers.get("hdm_best()")
  assert solvers.get("hdm_best(lipschitz=L)").needs_lipschitz
  assert not solvers.get("optax.lbfgs()").needs_lipschitz
  bare = solvers.get("hdm_best")  # a bare name is NAME()
  assert bare.name == "hdm_best" and bare.make(None) is not None
  assert solvers.get("scipy-bfgs").is_scipy
  with pytest.raises(ValueError, match="neither a registered name"):
    solvers.get("hdm_best(")
  with pytest.raises(ValueError, match="not an optax transformation"):
    solvers.get("jnp.zeros(3)")


def test_initial_points_are_the_papers_for_the_first_seed():
  x0 = protocol.initial_points(7, [suites.SEED0, suites.SEED0 + 1])
  np.testing.assert_array_equal(x0[0], protocol.initial_point(7))
  np.testing.assert_array_equal(
    x0[0],
    np.random.RandomState(20250128).randn(7)
    / np.linalg.norm(np.random.RandomState(20250128).randn(7)),
  )
  assert not np.allclose(x0[0], x0[1])
  np.testing.assert_allclose(np.linalg.norm(x0, axis=1), 1.0)


def _broken():
  raise RuntimeError("cannot build this one")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  if importlib.util.find_spec("sif2jax") is None:
    pytest.skip("sif2jax is not installed (pip install -e '.[bench]')")
  out = tmp_path_factory.mktemp("benchmark")
  path = out / "results.csv"
  names = ["optax.lbfgs()", "scipy-lbfgsb-m5"]
  tasks = suites.cutest_tasks(runner.TOL, CUTEST)
  tasks.append(suites.Task("cutest", "BROKEN", (None,), _broken))
  written = runner.run_suite(tasks, [solvers.get(n) for n in names], path, progress=False)
  data_dir = data_lib.default_data_dir()
  libsvm = data_dir is not None and DATASET in data_lib.list_datasets(data_dir)
  if libsvm:
    tasks = suites.libsvm_tasks(runner.TOL, 2, datasets=[DATASET], data_dir=data_dir)
    tasks = [t for t in tasks if t.name.endswith("/svm")]
    lip = [solvers.get("hdm_best(lipschitz=L)")]
    written += runner.run_suite(tasks, lip, path, progress=False)
  return out, path, written, libsvm


def _rows(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def test_csv_schema_and_rows(smoke):
  _, path, written, libsvm = smoke
  assert path.read_text().splitlines()[0] == HEADER
  rows = _rows(path)
  assert len(rows) == written == 3 * 2 + 2 + (2 if libsvm else 0)
  for r in rows:
    assert r["suite"] in ("cutest", "libsvm")
    if r["status"].startswith("error"):
      continue
    assert r["dtype"] == "float64"
    tol = runner.TOL
    solved = float(r["final_grad_inf"]) <= tol and int(r["grad_calls"]) < runner.BUDGET - 1
    assert r["solved"] == str(int(solved)), r


def test_reference_counts_are_reproduced(smoke):
  rows = {(r["problem"], r["solver"]): r for r in _rows(smoke[1])}
  for key, calls in REFERENCE.items():
    assert rows[key]["solved"] == "1", rows[key]
    assert int(rows[key]["grad_calls"]) == calls, rows[key]
    assert rows[key]["seed"] == ""


def test_a_problem_that_raises_gives_error_rows(smoke):
  rows = [r for r in _rows(smoke[1]) if r["problem"] == "BROKEN"]
  assert len(rows) == 2
  for r in rows:
    assert r["status"] == "error: RuntimeError: cannot build this one"
    assert r["solved"] == "0" and r["grad_calls"] == ""


def test_seeds_run_as_one_program(smoke):
  if not smoke[3]:
    pytest.skip("the shared LIBSVM datasets are not available")
  rows = [r for r in _rows(smoke[1]) if r["suite"] == "libsvm"]
  assert [r["seed"] for r in rows] == [str(suites.SEED0), str(suites.SEED0 + 1)]
  assert all(r["solved"] == "1" for r in rows), rows
  assert (
    rows[0]["grad_calls"] != rows[1]["grad_calls"]
    or rows[0]["final_value"] != rows[1]["final_value"]
  )
  # One compile, shared by the two rows.
  assert rows[0]["compile_seconds"] == rows[1]["compile_seconds"]


def test_resume_skips_rows_present(smoke):
  out, path, _, _ = smoke
  before = path.read_text()
  tasks = suites.cutest_tasks(runner.TOL, CUTEST)
  tasks.append(suites.Task("cutest", "BROKEN", (None,), _broken))
  names = ["optax.lbfgs()", "scipy-lbfgsb-m5"]
  assert runner.run_suite(tasks, [solvers.get(n) for n in names], path, progress=False) == 0
  assert path.read_text() == before


def test_summary_and_cli(smoke):
  out, path, _, _ = smoke
  cli.main(["--suite", "cutest", "--summary-only", "--out", str(out)])
  text = (out / "summary.md").read_text()
  assert "| `optax.lbfgs()` | 3/4 |" in text
  assert (out / "profile_cutest_grad_calls.png").exists()
  assert (out / "profile_cutest_run_seconds.png").exists()
  check = summary.reference_check(_rows(path))
  if summary.REFERENCE_TSV.exists():
    line = next(ln for ln in check if ln.startswith("| `optax.lbfgs()`"))
    assert line.endswith("| none |"), line


def _two_start_instance():
  import jax.numpy as jnp

  fun = lambda x, a: jnp.sum(a * (x - 1.0) ** 2)
  a = jnp.asarray([1.0, 10.0, 100.0])
  return problems.instance(fun, (a,), [[0.0, 0.0, 0.0], [2.0, -1.0, 0.5]], runner.TOL)


def test_seeds_run_in_turn_where_the_vmapped_program_cannot_be_built(monkeypatch):
  """optax.lbfgs cannot vmap over the host CSR product (NotImplementedError): the
  seeds then run one after another through a single-start program, with the same results."""
  inst = _two_start_instance()
  solver = solvers.get("optax.lbfgs()")
  batched, _, _ = runner.run_optax(solver, inst, runner.BUDGET)
  compiled = runner._compiled
  starts = []

  def no_vmap(statics, args):
    starts.append(args[0].shape[0])
    if args[0].shape[0] > 1:
      raise NotImplementedError("no batching rule")
    return compiled(statics, args)

  monkeypatch.setattr(runner, "_compiled", no_vmap)
  runner._COMPILED.clear()
  in_turn, _, _ = runner.run_optax(solver, inst, runner.BUDGET)
  assert starts == [2, 1]
  np.testing.assert_array_equal(in_turn["grad_calls"], batched["grad_calls"])
  # vmapped and single-start: two programs. f's rounding (3 terms) over the run, with a's
  # condition number 100. f moves by grad f times x's difference (rtol |x|, |x|_1 <= 6),
  # and |grad f| <= 2 sqrt(100 f) on this quadratic
  rtol = backends.rounding_tol(3, int(np.max(batched["grad_calls"])), condition=100.0)
  atol = rtol * 6 * 2 * np.sqrt(100 * np.max(batched["value"]))
  np.testing.assert_allclose(in_turn["value"], batched["value"], rtol=rtol, atol=atol)
  assert in_turn["grad_calls"].shape == (2,)


def test_compiled_programs_are_released_before_the_memory_maps_run_out(monkeypatch, tmp_path):
  """Each compiled program holds ~150 memory maps and JAX keeps them all: the CUTEst
  suite crashed at the kernel's limit, so past MAX_MEMORY_MAPS the caches are dropped."""
  assert memory.memory_maps() > 0  # Linux: /proc/self/maps
  inst = problems.instance(lambda x: jnp.sum((x - 1.0) ** 2), (), [[0.0, 2.0]], runner.TOL)
  task = suites.Task("user", "quadratic", (None,), lambda: inst)
  lbfgs = [solvers.get("optax.lbfgs()")]
  runner._COMPILED.clear()
  runner.run_suite([task], lbfgs, tmp_path / "a.csv", progress=False)
  assert len(runner._COMPILED) == 1  # below the limit: kept for problems of the same shape
  cleared = []
  monkeypatch.setattr(memory, "memory_maps", lambda: memory.MAX_MEMORY_MAPS + 1)
  monkeypatch.setattr(memory.jax, "clear_caches", lambda: cleared.append(True))
  runner.run_suite([task], lbfgs, tmp_path / "b.csv", progress=False)
  assert cleared == [True] and runner._COMPILED == {}


def test_hdm_auto_reaches_the_float32_tolerance_on_heart_scale():
  """In float32 the values of a LIBSVM sum differ by rounding near the minimiser: with
  ties only (f(x+) <= f(x)) hdm_auto rejected trials at random, halved P at each, and
  stopped at ||g||_inf 1.6e-2 after 1000 calls; deciding by the gradients' decrease where
  f's difference is below its rounding solves it."""
  data_dir = data_lib.default_data_dir()
  if data_dir is None or DATASET not in data_lib.list_datasets(data_dir):
    pytest.skip("the shared LIBSVM datasets are not available")
  (task,) = [
    t
    for t in suites.libsvm_tasks(runner.TOL, 1, "float32", [DATASET], data_dir)
    if t.name.endswith("/svm")
  ]
  inst = task.build()
  out, _, _ = runner.run_optax(solvers.get("hdm_auto()"), inst, runner.BUDGET)
  assert inst.x0.dtype == jnp.float32
  assert float(out["grad_inf"][0]) <= inst.tol[0], out
  assert int(out["grad_calls"][0]) < 300, out


def _needs_the_dev_list():
  """Skips where the dev list (../shared/benchmarks, or $HDM_BENCHMARKS_DIR) is not there."""
  if not suites.CUTEST_DEV_LIST.exists():
    pytest.skip(
      f"{suites.CUTEST_DEV_LIST} is not there (a clone without ../shared; "
      "HDM_BENCHMARKS_DIR=DIR names the directory of the benchmark lists)"
    )


def test_scale_suite_lists_the_other_problems_in_its_size_range():
  """--max-n: sif2jax's unconstrained problems off the dev list with min_n < n <= max_n."""
  if importlib.util.find_spec("sif2jax") is None:
    pytest.skip("sif2jax is not installed (pip install -e '.[bench]')")
  _needs_the_dev_list()
  tasks = suites.cutest_scale_tasks(runner.TOL, max_n=3000, min_n=1000)
  assert tasks, "no problem in (1000, 3000]"
  dev = set(suites.cutest_names())
  assert all(t.suite == "cutest_scale" and t.name not in dev for t in tasks)
  inst = tasks[0].build()
  assert 1000 < inst.n <= 3000 and inst.dtype == "float64"


def test_scale_dev_suite_is_the_shared_list():
  """--suite cutest_scale_dev: the 42 names of ../shared/benchmarks/cutest_scale_dev.txt."""
  if not suites.CUTEST_SCALE_DEV_LIST.exists():
    pytest.skip(f"{suites.CUTEST_SCALE_DEV_LIST} is not there")
  tasks = suites.tasks("cutest_scale_dev", tol=runner.TOL)
  names = suites.cutest_names(suites.CUTEST_SCALE_DEV_LIST)
  assert [t.name for t in tasks] == names and len(names) == 42
  assert {t.suite for t in tasks} == {"cutest_scale_dev"}
  assert not set(names) & set(suites.cutest_names())


def test_cutest32_is_the_dev_list_in_float32_with_a_relative_tolerance():
  """x0, args and f in float32; tol max(TOL, FLOAT32_RELATIVE_TOL ||grad f(x0)||_inf)."""
  if importlib.util.find_spec("sif2jax") is None:
    pytest.skip("sif2jax is not installed (pip install -e '.[bench]')")
  _needs_the_dev_list()
  tasks = suites.tasks("cutest32", tol=runner.TOL, problems=["ROSENBR"])
  assert [(t.suite, t.name) for t in tasks] == [("cutest32", "ROSENBR")]
  inst = tasks[0].build()
  assert inst.dtype == "float32" and inst.x0.dtype == jnp.float32
  value = inst.fun(inst.x0[0], *inst.fun_args)
  assert value.dtype == jnp.float32
  g0 = np.max(np.abs(np.asarray(jax.grad(inst.fun)(inst.x0[0], *inst.fun_args))))
  assert inst.tol[0] == pytest.approx(max(runner.TOL, suites.FLOAT32_RELATIVE_TOL * g0), rel=1e-6)


def test_peer_rows_run_on_the_tiny_cutest_problems(tmp_path, monkeypatch):
  """Every peer row runs under the protocol; polyak_sgd only where f* is known (not AKIVA).

  On AKIVA (no f*; dog and gd-zoom run out of budget, gd-backtracking stops early) and BOX3
  (f* known; dog and cocob run out of budget): each of the 17 rows compiles its own program,
  and HILBERTB, where every row solves, would add nine that check no other path."""
  if importlib.util.find_spec("sif2jax") is None or solvers.optx is None:
    pytest.skip("sif2jax and optimistix are needed (pip install -e '.[bench]')")
  monkeypatch.setattr(runner, "COMPILE_OPTIONS", FAST_COMPILE)
  path = tmp_path / "results.csv"
  cutest = ("AKIVA", "BOX3")
  tasks = suites.cutest_tasks(runner.TOL, cutest)
  runner.run_suite(tasks, [solvers.get(n) for n in PEER_ROWS], path, progress=False)
  rows = {(r["problem"], r["solver"]): r for r in _rows(path)}
  expected = {(p, n) for p in cutest for n in PEER_ROWS}
  expected.discard(("AKIVA", "optax.polyak_sgd(f_min=F_STAR)"))  # sif2jax states no f*
  assert set(rows) == expected
  for r in rows.values():
    assert not r["status"].startswith("error"), r
    calls, grad_inf = int(r["grad_calls"]), float(r["final_grad_inf"])
    # The budget is checked before each update, and an update that starts under it
    # finishes: a run that reaches it ends up to one update's calls past it (a line
    # search's trials; on an H200, one AKIVA row ended at 1002). Never solved then.
    assert 1 <= calls <= runner.BUDGET + solvers.LINESEARCH_STEPS, r
    solved = grad_inf <= runner.TOL and calls < runner.BUDGET - 1
    assert r["solved"] == str(int(solved)), r
  for p in cutest:
    assert rows[(p, "optx.BFGS")]["solved"] == rows[(p, "optx.LBFGS")]["solved"] == "1"


def test_optimistix_rows_count_every_objective_call():
  """The optimistix rows count each evaluation the compiled program makes, line-search
  trials it rejects included: the count equals the evaluations seen by the objective's own
  callback, equals optimistix's steps (one evaluation each), exceeds its accepted steps,
  and a second run of the same compiled program counts the same."""
  if solvers.optx is None:
    pytest.skip("optimistix is not installed (pip install -e '.[bench]')")

  seen = []
  inst = _counted_rosenbrock(seen)
  solver = solvers.get("optx.BFGS")
  out, _, _ = runner.run_optimistix(solver, inst, runner.BUDGET)
  calls = int(out["grad_calls"][0])
  assert calls == len(seen) == int(out["num_steps"][0])
  assert float(out["grad_inf"][0]) <= runner.TOL
  minimiser = solvers.GradientStop(solver.make(None), jnp.asarray(runner.TOL))
  sol = solvers.optx.minimise(
    lambda y, args: problems.rosenbrock(y), minimiser, inst.x0[0], max_steps=runner.BUDGET
  )
  assert int(sol.state.num_accepted_steps) < calls  # rejected trials are counted too
  seen.clear()
  again, _, _ = runner.run_optimistix(solver, inst, runner.BUDGET)
  assert int(again["grad_calls"][0]) == calls == len(seen)


def test_optx_bfgs_gives_skipped_rows_above_its_n_cap(tmp_path):
  """optx.BFGS carries a dense n x n matrix: above its cap a skipped row and no run (the
  instance below says n is one past the cap; its x0 has 2 entries, so a run would be quick
  and would show up as a converged row)."""
  if solvers.optx is None:
    pytest.skip("optimistix is not installed (pip install -e '.[bench]')")
  bfgs = solvers.get("optx.BFGS")
  assert bfgs.max_n == solvers.OPTX_BFGS_MAX_N and solvers.get("optx.LBFGS").max_n is None
  n = bfgs.max_n + 1
  inst = problems.instance(lambda x: jnp.sum((x - 1.0) ** 2), (), [[0.0, 2.0]], runner.TOL, n=n)
  task = suites.Task("cutest_scale_dev", "big", (None,), lambda: inst)
  path = tmp_path / "results.csv"
  assert runner.run_suite([task], [bfgs], path, progress=False) == 1
  (row,) = _rows(path)
  assert row["status"] == f"skipped: n = {n} > {bfgs.max_n}", row
  assert row["solved"] == "0" and row["grad_calls"] == "" and row["n"] == str(n)


def test_jobs_split_the_solvers_and_merge_their_rows(tmp_path):
  """--jobs N: solver i in process i mod N, each skipping the rows already in the main CSV;
  merge appends each part's rows once."""
  args = cli.parse_args(["--suite", "user", "--solvers", "a", "b", "c", "--jobs", "2"])
  main, part = tmp_path / "results.csv", tmp_path / "parts" / "part0.csv"
  child = cli.parse_args(cli._child_argv(args, args.solvers[0::2], main, part))
  assert child.solvers == ["a", "c"] and child.csv == str(part) and child.jobs == 1
  assert child.also_done == [str(main)] and child.no_summary
  row = runner.Row("a", True, grad_calls=3, value_calls=3, status="converged", problem="p")
  log = runner.CsvLog(main)
  log.write([row])
  log.close()
  log = runner.CsvLog(part)
  log.write([row, dataclasses.replace(row, algorithm="c")])
  log.close()
  assert runner.merge([part, tmp_path / "missing.csv"], main) == 1
  assert [r["solver"] for r in _rows(main)] == ["a", "c"]


def test_libsvm32_instance_on_an_accelerator_is_float32_bcoo(monkeypatch):
  """Where JAX's default backend is a GPU, w1a (very sparse) is a BCOO matrix, in float32 for
  the libsvm32 suite (evaluated here on the CPU: the same program an accelerator compiles)."""
  data_dir = data_lib.default_data_dir()
  if data_dir is None or "w1a" not in data_lib.list_datasets(data_dir):
    pytest.skip("the shared LIBSVM datasets are not available")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  (task,) = [
    t
    for t in suites.libsvm_tasks(runner.TOL, 1, "float32", ["w1a"], data_dir)
    if t.name.endswith("/logistic")
  ]
  inst = task.build()
  matrix = inst.fun_args[0]
  assert isinstance(matrix, jsparse.BCOO) and matrix.dtype == jnp.float32
  with jax.numpy_dtype_promotion("strict"):
    value, grad = jax.jit(jax.value_and_grad(inst.fun))(inst.x0[0], *inst.fun_args)
  assert value.dtype == grad.dtype == jnp.float32
  assert np.isfinite(float(value))


def test_solved_table_names_skipped_rows_apart():
  row = lambda p, solved, status: dict(problem=p, solver="s", seed="", solved=solved, status=status)
  rows = [row("a", "1", "converged"), row("b", "0", "budget"), row("c", "0", "skipped: n = 9")]
  assert summary.solved_table({"scale": rows})[-1] == "| `s` | 1/2 (1 skipped) |"
  assert summary.solved_table({"scale": rows[:2]})[-1] == "| `s` | 1/2 |"


def test_frontier_table_measures_each_solver_against_the_others_together():
  """b solves p1 and p2, c solves p2 and p3 (the second start of p3 only): against the
  others together, a leaves all three problem-starts, b leaves p3#2."""
  solved = {("b", "p1", ""), ("b", "p2", ""), ("c", "p2", ""), ("c", "p3", "2")}
  rows = [
    dict(problem=p, solver=s, seed=seed, grad_calls="5", solved=str(int((s, p, seed) in solved)))
    for s in "abc"
    for p, seed in (("p1", ""), ("p2", ""), ("p3", "2"))
  ]
  table = summary.frontier_table(rows)
  assert table[2] == "| `a` | 0/3 | 3 | 3 | p1, p2, p3#2 |"
  assert table[3] == "| `b` | 2/3 | 2 | 3 | p3#2 |"
  assert table[4] == "| `c` | 2/3 | 2 | 3 | p1 |"


def test_a_row_the_machine_fails_is_named_apart_and_retried(tmp_path, monkeypatch):
  """A GPU held by another process ("Unable to initialize backend", faked here at build
  time) gives an env_error row: the solved table names it apart instead of counting it
  unsolved, and a re-run retries it; the summary reads the retry."""
  monkeypatch.setattr(runner, "COMPILE_OPTIONS", FAST_COMPILE)
  inst = problems.instance(lambda x: jnp.sum((x - 1.0) ** 2), (), [[0.0, 2.0]], runner.TOL)

  def held():
    raise RuntimeError("Unable to initialize backend 'cuda': INTERNAL: no memory left")

  path = tmp_path / "results.csv"
  lbfgs = [solvers.get("optax.lbfgs()")]
  good = suites.Task("user", "quad", (None,), lambda: inst)
  assert runner.run_suite([suites.Task("user", "quad", (None,), held)], lbfgs, path) == 1
  assert runner.run_suite([good], lbfgs, tmp_path / "other.csv", progress=False) == 1
  (row,) = _rows(path)
  assert row["status"].startswith("env_error: RuntimeError: Unable to initialize backend")
  other = _rows(tmp_path / "other.csv")
  table = summary.solved_table({"user": summary.read_rows(path) + other})
  assert table[-1] == "| `optax.lbfgs()` | 1/1 (1 env errors) |"
  assert runner.run_suite([good], lbfgs, path, progress=False) == 1  # retried
  rows = summary.read_rows(path)
  assert [r["status"] for r in rows] == ["converged"] and len(_rows(path)) == 2
  assert summary.solved_table({"user": rows})[-1] == "| `optax.lbfgs()` | 1/1 |"
  exc = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 18.63GiB")
  assert runner._error(good, "s", None, exc).status.startswith("env_error: ")
  assert runner._error(good, "s", None, ValueError("bad")).status == "error: ValueError: bad"


def test_jobs_share_the_gpu():
  env = cli.child_environment({"PATH": "/bin"})
  assert env == {"PATH": "/bin", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  assert cli.child_environment({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}) == {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "true"
  }


BOUNDED_ROWS = (
  "trial_lbfgs(box)",
  "scipy-lbfgsb-m10",
  "jaxopt-lbfgsb",
  "optax-pgd-box-backtracking",
  "optax.lbfgs()-clip",
  "trial_lbfgs()-clip",
)


def test_bounded_rows_on_two_bounded_problems(tmp_path, monkeypatch):
  """Every bounded row runs on HS3 and HS4 (cutest_bounded); solved by the projected gradient
  at the returned point; the unbounded rows give no row there, the bounded rows none on an
  unbounded problem; the summary compares medians with SciPy's L-BFGS-B."""
  if importlib.util.find_spec("sif2jax") is None or importlib.util.find_spec("jaxopt") is None:
    pytest.skip("sif2jax and jaxopt are needed (pip install -e '.[bench]')")
  monkeypatch.setattr(runner, "COMPILE_OPTIONS", FAST_COMPILE)
  path = tmp_path / "results.csv"
  names = BOUNDED_ROWS + ("hdm_auto()",)
  problems = ("HS3", "HS4")
  tasks = suites.cutest_bounded_tasks(runner.TOL, problems)
  tasks += suites.cutest_tasks(runner.TOL, ["HILBERTB"])
  runner.run_suite(tasks, [solvers.get(n) for n in names], path, progress=False)
  rows = {(r["problem"], r["solver"]): r for r in _rows(path)}
  expected = {(p, n) for p in problems for n in BOUNDED_ROWS}
  expected |= {("HILBERTB", "hdm_auto()"), ("HILBERTB", "scipy-lbfgsb-m10")}
  assert set(rows) == expected
  for p in problems:
    inst = suites.cutest_bounded_tasks(runner.TOL, [p])[0].build()
    assert np.all(inst.x0_np >= inst.lower) and np.all(inst.x0_np <= inst.upper)
    for n in BOUNDED_ROWS:
      r = rows[(p, n)]
      assert not r["status"].startswith("error"), r
      calls, pg = int(r["grad_calls"]), float(r["final_grad_inf"])
      assert r["solved"] == str(int(pg <= runner.TOL and calls < runner.BUDGET - 1)), r
  assert rows[("HS4", "trial_lbfgs(box)")]["solved"] == "1"
  assert rows[("HS4", "scipy-lbfgsb-m10")]["solved"] == "1"
  summary.write_summary(path, tmp_path, runner.BUDGET, runner.TOL)
  text = (tmp_path / "summary.md").read_text()
  assert "Median gradient calls against SciPy's L-BFGS-B" in text


def test_hard_suite_is_the_dev_list_from_far_starts_and_rescaled():
  """cutest_hard: NAME@10x and NAME@100x start at 10 y0 and 100 y0; NAME@D is x -> f(D x)
  with D log-spaced over [1e-2, 1e2], from y0 / D (the same f and D-scaled gradients there)."""
  if importlib.util.find_spec("sif2jax") is None:
    pytest.skip("sif2jax is not installed (pip install -e '.[bench]')")
  _needs_the_dev_list()
  tasks = suites.tasks("cutest_hard", tol=runner.TOL, problems=["BOX3"])
  assert [t.name for t in tasks] == ["BOX3@10x", "BOX3@100x", "BOX3@D"]
  assert {t.suite for t in tasks} == {"cutest_hard"}
  (plain,) = suites.cutest_tasks(runner.TOL, ["BOX3"])
  base = plain.build()
  y0 = np.asarray(base.x0[0])
  far10, far100, scaled = (t.build() for t in tasks)
  np.testing.assert_array_equal(far10.x0[0], 10 * y0)
  np.testing.assert_array_equal(far100.x0[0], 100 * y0)
  d = suites.hard_scaling(y0.size)
  np.testing.assert_allclose(d, [1e-2, 1.0, 1e2])
  np.testing.assert_allclose(scaled.x0[0], y0 / d)
  value, grad = scaled.fun_np(np.asarray(scaled.x0[0]))
  value0, grad0 = base.fun_np(y0)
  np.testing.assert_allclose(value, value0, rtol=1e-12)
  np.testing.assert_allclose(grad, d * grad0, rtol=1e-10)
  assert len(suites.tasks("cutest_hard", tol=runner.TOL)) == 3 * len(suites.cutest_names())


def _rosenbrock_np(x):
  value, grad = jax.value_and_grad(problems.rosenbrock)(jnp.asarray(x, jnp.float64))
  return float(value), np.asarray(grad)


def test_cg_descent_row_counts_every_request_and_stops_at_the_budget():
  """CG_DESCENT asks for f alone, grad f alone or both: each request that evaluates is one
  call (its f-only line-search trials too); the row stops at the call past the budget."""
  pytest.importorskip("pycgdescent")
  from experiments.baselines import quasi_newton

  seen = []

  def counted(x):
    seen.append(1)
    return _rosenbrock_np(x)

  x0 = np.tile([-1.2, 1.0], 5)
  run = lambda budget: quasi_newton.run_baseline(
    counted, x0, "CG_DESCENT", runner.TOL, budget=budget, stop_at_budget=True, maxiter=10**6
  )
  row = run(1000)
  assert row.solved and row.final_grad_inf <= runner.TOL
  assert row.grad_calls == len(seen) - 1  # the last: the reported point, uncounted
  assert row.grad_calls > row.iterations  # line-search trials are counted
  seen.clear()
  short = run(30)
  assert not short.solved and short.status == "budget" and short.grad_calls == len(seen) == 30


def test_jaxopt_row_counts_every_evaluation_of_its_line_search(tmp_path):
  """jaxopt.LBFGS: the calls reported are every evaluation the compiled program made (its
  zoom line search's included, more than its iterations), seen by the objective's callback."""
  pytest.importorskip("jaxopt")
  seen = []
  inst = _counted_rosenbrock(seen)
  solver = solvers.get("jaxopt.LBFGS")
  assert solver.is_jaxopt and "jaxopt.LBFGS" in solvers.REGISTERED
  task = suites.Task("user", "rosenbrock-2", (None,), lambda: inst)
  path = tmp_path / "results.csv"
  runner.run_suite([task], [solver], path, progress=False)
  jax.effects_barrier()
  (row,) = _rows(path)
  assert row["solved"] == "1" and float(row["final_grad_inf"]) <= runner.TOL, row
  assert int(row["grad_calls"]) == len(seen) > 20, row


def test_rows_of_equal_configuration_share_one_program(monkeypatch):
  """'trial_lbfgs', 'trial_lbfgs()' and 'trial_lbfgs(memory_size=None)' are one configuration:
  one compiled program, the same rows; a memory_size given and rows that use L keep their own."""
  monkeypatch.setattr(runner, "COMPILE_OPTIONS", FAST_COMPILE)
  inst = _two_start_instance()
  runner._COMPILED.clear()
  names = ("trial_lbfgs", "trial_lbfgs()", "trial_lbfgs(memory_size=None)")
  outs = [runner.run_optax(solvers.get(name), inst, runner.BUDGET) for name in names]
  assert len(runner._COMPILED) == 1
  assert outs[0][1] > 0 and outs[1][1] == outs[2][1] == 0.0  # compile seconds
  for out, _, _ in outs[1:]:
    np.testing.assert_array_equal(out["grad_calls"], outs[0][0]["grad_calls"])
  runner.run_optax(solvers.get("trial_lbfgs(memory_size=5)"), inst, runner.BUDGET)
  assert len(runner._COMPILED) == 2
  with_l = solvers.get("hdm_best(lipschitz=L)")
  assert runner.program_key(with_l) is with_l
