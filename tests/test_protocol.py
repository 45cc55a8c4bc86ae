"""Tests of experiments/protocol.py: x0, the solved rule and the best grid point."""

import dataclasses
import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import hdm_optax
from experiments import problems, protocol, runner

ROOT = Path(__file__).resolve().parents[1]


def test_initial_point_is_the_protocol():
  np.random.seed(20250128)
  expected = np.random.randn(7)
  expected /= np.linalg.norm(expected)
  np.testing.assert_array_equal(protocol.initial_point(7), expected)
  x = problems.make_problem(np.eye(6), np.ones(6) * [1, -1, 1, -1, 1, -1], "svm").x0
  np.testing.assert_array_equal(x, protocol.initial_point(7))


def test_initial_point_other_seeds():
  np.random.seed(20250129)
  expected = np.random.randn(5)
  expected /= np.linalg.norm(expected)
  np.testing.assert_array_equal(protocol.initial_point(5, seed=20250129), expected)
  assert not np.allclose(protocol.initial_point(5), protocol.initial_point(5, seed=20250129))


def test_is_solved_needs_fewer_than_budget_minus_one_calls():
  conv = np.array([True, True, True, False])
  calls = np.array([10, 998, 999, 10])
  np.testing.assert_array_equal(protocol.is_solved(conv, calls), [True, True, False, False])
  assert protocol.is_solved(True, 98, budget=100) and not protocol.is_solved(True, 99, budget=100)
  assert protocol.unsolved_calls() == 1001 and protocol.unsolved_calls(200) == 201


def _make(lr):
  return hdm_optax.hdm_best(lipschitz=200.0, precond_lr=lr)


def _quadratic_rows():
  """A four-point grid on a quadratic as runner.Grid rows (60 steps, a budget of 61 calls)."""
  fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x**2)
  lrs = (1e-4, 1e-2, 1e-1, 1.0)
  grid = runner.Grid(_make, [dict(lr=v) for v in lrs], ["HDM-Best"] * 4, [f"lr={v}" for v in lrs])
  return runner.run(grid, problems.instance(fun, (), np.ones(3), 1e-6), budget=61)


def test_best_row_prefers_solved_then_fewest_steps():
  rows = _quadratic_rows()
  solved = [r.solved for r in rows]
  assert any(solved) and not all(solved)
  best = protocol.best_row(rows)
  assert best.solved and best.iterations == min(r.iterations for r in rows if r.solved)
  # Nothing solved: the lowest final value.
  none = [dataclasses.replace(r, solved=False) for r in rows]
  assert protocol.best_row(none) is none[int(np.argmin([r.final_value for r in rows]))]
  # A point that converged but is not solved (too many calls) is not preferred.
  j = solved.index(False)
  only = [dataclasses.replace(r, solved=i == j) for i, r in enumerate(rows)]
  assert protocol.best_row(only) is only[j]


def test_grid_rows_are_the_reported_points():
  for row in _quadratic_rows():
    k = row.iterations
    assert len(row.trace_values) == len(row.trace_grad_calls) == k + 1
    assert row.trace_values[-1] == row.final_value
    assert row.trace_grad_calls[-1] == row.grad_calls and row.hyperparams.startswith("lr=")


def test_outcome_is_the_one_solved_rule():
  assert protocol.outcome(1.0, 1e-4, 997, 1e-4) == (True, "converged")
  assert protocol.outcome(1.0, 1e-4, 999, 1e-4) == (False, "budget")  # is_solved
  assert protocol.outcome(1.0, 2e-4, 1000, 1e-4) == (False, "budget")
  assert protocol.outcome(1.0, 2e-4, 10, 1e-4) == (False, "")
  assert protocol.outcome(-1e21, 0.0, 10, 1e-4) == (False, "unbounded")
  assert protocol.outcome(math.nan, 0.0, 10, 1e-4) == (False, "non_finite")
  assert protocol.outcome(1.0, math.inf, 10, 1e-4) == (False, "non_finite")
  # The unbounded threshold is the library's (solve's min_value).
  assert protocol.UNBOUNDED == inspect.signature(hdm_optax.solve).parameters["min_value"].default


def test_importing_the_experiments_leaves_jax_in_its_precision():
  """float64 is switched on by the entry points (protocol.enable_float64), not by imports."""
  code = (
    "import jax, importlib\n"
    "for m in ('experiments.problems', 'experiments.runner', 'experiments.demo', "
    "'experiments.table1', 'experiments.benchmark.suites', "
    "'experiments.benchmark.__main__'):\n"
    "  importlib.import_module(m)\n"
    "assert not jax.config.jax_enable_x64\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def test_entry_points_compute_float32_products_in_float32():
  """enable_float64 also asks for float32 matrix products in float32 (HIGHEST precision):
  JAX's default lets an NVIDIA GPU round their inputs to TF32."""
  code = (
    "import jax, jax.numpy as jnp\n"
    "from experiments import protocol\n"
    "a, w = jnp.ones((3, 2), jnp.float32), jnp.ones(2, jnp.float32)\n"
    "before = jax.jit(lambda a, w: a @ w).lower(a, w).as_text()\n"
    "protocol.enable_float64()\n"
    "after = jax.jit(lambda a, w: a @ w).lower(a, w).as_text()\n"
    "assert 'HIGHEST' not in before and 'HIGHEST' in after, (before, after)\n"
    "assert jax.config.jax_enable_x64\n"
  )
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("JAX_ENABLE_X64", "JAX_DEFAULT_MATMUL_PRECISION")
  }
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
