"""Smoke tests of the accelerator benchmarks (experiments/perf/batched.py, large.py, hlo.py)
on the CPU at tiny sizes: they run and print their rows. Their numbers are measured by the
scripts, never asserted here."""

import importlib.util
import json
import subprocess
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.perf import batched, hlo, large

FAST_COMPILE = {"xla_backend_optimization_level": 0}
# The batched scripts at a tiny size.
TINY = dict(
  dtype=jnp.dtype("float64"),
  rows=20,
  calls=200,
  tol=1e-4,
  repeats=1,
  compiler_options=FAST_COMPILE,
)


def test_batched_throughput_rows(capsys):
  # float64: the suite enables x64, and optimistix 0.1.0's LBFGS then fails on float32 problems
  # (its scan carry mixes float32 and float64); the script runs float32 without x64.
  rows = batched.run(batches=[3], solvers=["hdm_auto()", "optimistix.LBFGS"], cols=5, **TINY)
  assert [(r["batch"], r["solver"]) for r in rows] == [(3, "hdm_auto()"), (3, "optimistix.LBFGS")]
  assert all(r["solved"] == 3 and r["per_second"] > 0 and r["compile_seconds"] > 0 for r in rows)
  out = capsys.readouterr().out
  device = f"device: {batched.device_label()}"
  assert out.startswith(device) and "hdm_auto()" in out and "problems/s" in out


def test_batched_spread_rows(capsys):
  """The heavy-tailed batch: lockstep and retiring rows per solver, every member solved."""
  from experiments.perf import batched_spread

  rows = batched_spread.run([5], jnp.dtype("float64"), 4, 200, 1e-4, 1, 1e1, 1e3)
  assert len(rows) == 4 and all(r["solved"] == 5 and r["per_second"] > 0 for r in rows)
  assert "sweep(compact=True)" in capsys.readouterr().out


def test_batched_bounded_rows(capsys):
  """B problems with a box each: every solver's row, minimize(bounds) solves all, in the box."""
  if importlib.util.find_spec("jaxopt") is None:
    pytest.skip("jaxopt is needed (pip install -e '.[bench]')")
  from experiments.perf import batched_bounded

  rows = batched_bounded.run(batches=[3], solvers=batched_bounded.SOLVERS, cols=6, **TINY)
  assert [r["solver"] for r in rows] == list(batched_bounded.SOLVERS)
  mine = rows[0]
  assert mine["solved"] == 3 and mine["outside"] == 0.0
  assert "outside" in capsys.readouterr().out


def test_batched_rejects_an_unknown_solver(capsys):
  with pytest.raises(SystemExit):
    batched.main(["--solvers", "hdm_auto(),adam"])
  assert "unknown ['adam']" in capsys.readouterr().err


@pytest.mark.parametrize("problem", ["sparse", "free"])
def test_large_run_one_measures_time_and_memory(problem):
  out = large.run_one("hdm_auto()", 2000, problem, 50, 1e-2, 1, FAST_COMPILE)
  assert out["grad_calls"] >= 1 and out["seconds"] > 0 and out["peak_bytes"] > 0
  assert out["program_bytes"] is None or out["program_bytes"] >= 4 * 2000
  if problem == "sparse":
    assert out["converged"]


def test_ceiling_doubles_then_bisects(monkeypatch):
  """A fake child that fails from n = 50: doubling 10, 20, 40, 80, then bisection 60, 50."""
  tried = []

  def child(args, memory_gib, timeout):
    n = int(args[1])
    tried.append(n)
    return ({"n": n}, "") if n < 50 else (None, "RESOURCE_EXHAUSTED: Out of memory")

  monkeypatch.setattr(large, "_child", child)
  assert large.ceiling("hdm_auto()", 10, 1000, 5, 2, None, 60) == (
    40,
    50,
    "RESOURCE_EXHAUSTED: Out of memory",
  )
  assert tried == [10, 20, 40, 80, 60, 50]
  tried.clear()
  assert large.ceiling("hdm_auto()", 400, 1000, 5, 0, None, 60)[:2] == (25, 50)  # halves down
  assert tried == [400, 200, 100, 50, 25]
  tried.clear()
  assert large.ceiling("hdm_auto()", 10, 30, 5, 2, None, 60) == (20, None, "")  # bounded
  assert tried == [10, 20]


def test_child_reports_the_last_error_line(monkeypatch):
  stderr = "Traceback ...\njax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n"
  fake = types.SimpleNamespace(stdout="", stderr=stderr, returncode=1)
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: fake)
  out, err = large._child(["hdm_auto()", "10", "free", "5"], 1.0, 60)
  assert out is None and err.endswith("RESOURCE_EXHAUSTED: Out of memory")
  fake.stdout = 'noise\n{"n": 10}\n'
  assert large._child(["hdm_auto()", "10", "free", "5"], None, 60) == ({"n": 10}, "")


def test_loop_kernels_counts_the_loop_body_and_the_passes_over_n():
  n = 4096

  def program(x, k):
    def body(_, x):
      return jnp.sin(x) * k + jnp.sum(x)  # a reduction over n and an elementwise pass

    return jax.lax.fori_loop(0, 5, body, x)

  text = jax.jit(program).lower(jnp.ones(n), 2.0).compile().as_text()
  counts = hlo.loop_kernels(text, n)
  assert 1 <= counts.over_n <= counts.total and sum(counts.kinds.values()) == counts.total
  assert hlo.loop_kernels(text, 10 * n).over_n == 0  # nothing holds 10 n elements
  assert "kernels" in str(counts)
  with pytest.raises(ValueError, match="no while loop"):
    hlo.loop_kernels(jax.jit(jnp.sin).lower(jnp.ones(n)).compile().as_text(), n)


def test_overhead_rows_are_per_oracle_call():
  """experiments/perf/overhead.py at a tiny size: each time is per value-and-gradient call
  (solve's K + 1 calls and hdm_auto's 3 probes counted), solve@k beside solve."""
  from experiments.perf import overhead

  r = overhead.measure(1000, np.float32, 5, 1, 0, "hdm_auto", (1, 3))
  assert r["ratio_solve"] == pytest.approx(r["t_solve"] / r["t_vg"])
  assert r["ratio_update"] == pytest.approx(r["t_update"] / r["t_vg"])
  assert set(r["t_solve_k"]) == {3} and r["n_vectors"] == 4
  assert np.isfinite(r["f_end"]) and r["f_end"] < r["f0"]


def test_overhead_peers_and_the_targets_of_issue_28(tmp_path, capsys):
  """trial_lbfgs beside optax.lbfgs() and optx.LBFGS in one run (per oracle call, the
  peers' line-search calls counted), written as JSON that experiments/perf/targets.py reads."""
  if importlib.util.find_spec("optimistix") is None:
    pytest.skip("optimistix is not installed (pip install -e '.[bench]')")
  from experiments.perf import overhead, targets

  path = tmp_path / "overhead.json"
  argv = ["--optimizer", "trial_lbfgs", "--sizes", "1000", "--steps", "4", "--repeats", "1"]
  argv += ["--dtype", "float64"]  # the tests run with x64 (optx.LBFGS fails on float32 there)
  overhead.main(argv + ["--peers", "optax.lbfgs(),optx.LBFGS", "--kernels", "--json", str(path)])
  (row,) = json.loads(path.read_text())
  (t_lbfgs, calls_lbfgs), (t_optx, calls_optx) = (
    row["peers"]["optax.lbfgs()"],
    row["peers"]["optx.LBFGS"],
  )
  assert calls_lbfgs >= 5 and calls_optx == 4 and t_lbfgs > 0 and t_optx > 0
  assert row["kernels"]["update"]["total"] > 0 and row["device"] == batched.device_label()
  assert "optax.lbfgs(): " in capsys.readouterr().out
  cpu = dict(row, n=100_000, device="CPU (x86_64, 2 cores)")  # the CPU's targets on any backend
  (met,) = [r for r in targets.check([cpu]) if r["target"].endswith("1e+05")]
  assert met["value"] == pytest.approx(row["t_solve"] / t_lbfgs) and met["limit"] == 1.0
  gpu = [dict(row, n=10_000_000, device="NVIDIA H100 (gpu)", ratio_update=1.2)]
  batched_rows = [
    dict(batch=1024, solver="trial_lbfgs()", per_second=300.0),
    dict(batch=1024, solver="optax.lbfgs()", per_second=100.0),
  ]
  verdicts = {r["target"]: r["met"] for r in targets.check(gpu, batched_rows)}
  assert verdicts["update / vg at n = 1e+07"] is True
  assert verdicts["update / vg at n = 1e+06"] is None  # not measured
  assert verdicts["batched problems/s / optax.lbfgs()'s at B = 1024"] is True
  assert verdicts["batched problems/s / optax.lbfgs()'s at B = 16384"] is None


def test_loop_kernels_by_trips_and_vectors_moved():
  """A nested loop of 3 trips over a 4 x n buffer: by trips it counts 3 times; each trip
  reads one row (a dynamic slice, 1 vector) and writes the accumulator."""
  n = 4096

  def program(buf, x):
    def body(_, x):
      inner = lambda i, acc: acc + jnp.sin(jax.lax.dynamic_index_in_dim(buf, i, 0, False))
      return jax.lax.fori_loop(0, 3, inner, x)

    return jax.lax.fori_loop(0, 5, body, x)

  text = jax.jit(program).lower(jnp.ones((4, n)), jnp.ones(n)).compile().as_text()
  once, by_trips = hlo.loop_kernels(text, n), hlo.loop_kernels(text, n, by_trips=True)
  assert by_trips.total > once.total and by_trips.vectors > once.vectors > 0
  assert once.vectors < 4 * once.total  # the 4 x n buffer is read a row at a time


def test_gpu_hlo_compiles_for_a_gpu_without_one():
  """experiments/perf/gpu_hlo.py: a target with no spec is refused by name; without JAX's
  CUDA plugin the error names the install command; with it, the value-and-gradient loop
  compiles for an H100 here and its kernels are counted."""
  from experiments.perf import gpu_hlo

  assert {"h100", "h200"} <= set(gpu_hlo.TARGETS)
  with pytest.raises(ValueError, match=r"target='a100'.*choose from h100, h200"):
    gpu_hlo.compile_only_device("a100")
  try:
    device = gpu_hlo.compile_only_device("h100")
  except RuntimeError as e:
    assert f"jax-cuda12-plugin=={jax.__version__}" in str(e) and "JAX_PLATFORMS=cpu" in str(e)
    return
  assert device.device_kind == "NVIDIA H100 80GB HBM3"
  counts = gpu_hlo.count("hdm_best", 1000, device, steps=3)
  assert counts["vg"][0].total > 0 and counts["update"][0].total > counts["vg"][0].total


def test_targets_read_kernel_counts_compiled_without_a_device(tmp_path, capsys):
  """experiments/perf/targets.py --compiled: the kernels-per-update target from
  experiments/perf/gpu_hlo.py's rows (the most over the sizes), named by the card."""
  from experiments.perf import targets

  rows = [
    dict(n=n, device="NVIDIA H100 80GB HBM3 (compiled, no device)", kernels={"update": k})
    for n, k in ((100_000, dict(total=57)), (1_000_000, dict(total=24)))
  ]
  (row,) = targets.check([], None, rows)
  assert row["value"] == 57 and row["met"] is False and "H100" in row["target"]
  path = tmp_path / "compiled.json"
  path.write_text(json.dumps(rows))
  assert targets.main(["--compiled", str(path)]) == [row]
  assert "NOT met" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    targets.main([])
