"""Smoke tests of the accelerator benchmarks (experiments/perf/batched.py, overhead.py)
on the CPU at tiny sizes: they run and print their rows. Their numbers are measured by the
scripts, never asserted here."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.perf import batched

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
  names = ["hdm_auto()", "optimistix.LBFGS", "trial_lbfgs() sb"]
  rows = batched.run(batches=[3], solvers=names, cols=5, **TINY)
  assert [(r["batch"], r["solver"]) for r in rows] == [(3, name) for name in names]
  assert all(r["solved"] == 3 and r["per_second"] > 0 and r["compile_seconds"] > 0 for r in rows)
  out = capsys.readouterr().out
  device = f"device: {batched.device_label()}"
  assert out.startswith(device) and "hdm_auto()" in out and "problems/s" in out


def test_batched_spread_rows(capsys):
  """The heavy-tailed batch: lockstep and retiring rows per solver, every member solved."""
  from experiments.perf import batched_spread

  rows = batched_spread.run([5], jnp.dtype("float64"), 4, 200, 1e-4, 1, 1e1, 1e3)
  assert len(rows) == 4 and all(r["solved"] == 5 and r["per_second"] > 0 for r in rows)
  assert "solve_batch" in capsys.readouterr().out


def test_batched_rejects_an_unknown_solver(capsys):
  with pytest.raises(SystemExit):
    batched.main(["--solvers", "hdm_auto(),adam"])
  assert "unknown ['adam']" in capsys.readouterr().err


def test_overhead_rows_are_per_oracle_call():
  """experiments/perf/overhead.py at a tiny size: each time is per value-and-gradient call
  (solve's K + 1 calls and hdm_auto's 3 probes counted)."""
  from experiments.perf import overhead

  r = overhead.measure(1000, np.float32, 5, 1, 0, "hdm_auto")
  assert r["ratio_solve"] == pytest.approx(r["t_solve"] / r["t_vg"])
  assert r["ratio_update"] == pytest.approx(r["t_update"] / r["t_vg"])
  assert r["n_vectors"] == 4
  assert np.isfinite(r["f_end"]) and r["f_end"] < r["f0"]


def test_overhead_runs_peers_in_the_same_rounds(capsys):
  """trial_lbfgs beside optax.lbfgs() and optx.LBFGS in one run, per oracle call (the
  peers' line-search calls counted)."""
  if importlib.util.find_spec("optimistix") is None:
    pytest.skip("optimistix is not installed (pip install -e '.[bench]')")
  from experiments.perf import overhead

  argv = ["--optimizer", "trial_lbfgs", "--sizes", "1000", "--steps", "4", "--repeats", "1"]
  argv += ["--dtype", "float64"]  # the tests run with x64 (optx.LBFGS fails on float32 there)
  (row,) = overhead.main(argv + ["--peers", "optax.lbfgs(),optx.LBFGS"])
  (t_lbfgs, calls_lbfgs), (t_optx, calls_optx) = (
    row["peers"]["optax.lbfgs()"],
    row["peers"]["optx.LBFGS"],
  )
  assert calls_lbfgs >= 5 and calls_optx == 4 and t_lbfgs > 0 and t_optx > 0
  # every optax.lbfgs() call computes a gradient; optx.LBFGS's at most one per step
  assert row["peer_gradients"]["optax.lbfgs()"] == calls_lbfgs
  assert 1 <= row["peer_gradients"]["optx.LBFGS"] <= calls_optx
  assert row["device"] == batched.device_label()
  assert "optax.lbfgs(): " in capsys.readouterr().out
