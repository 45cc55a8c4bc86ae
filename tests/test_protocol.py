"""Tests of experiments/protocol.py: x0, the solved rule and the best grid point."""

import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax
from experiments import problems, protocol

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


def _quadratic_sweep():
  fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x**2)
  out = hdm_optax.sweep(
    lambda lr: hdm_optax.hdm_best(lipschitz=200.0, precond_lr=lr),
    {"lr": [1e-4, 1e-2, 1e-1, 1.0]},
    fun,
    jnp.ones(3),
    max_steps=60,
    tol=1e-6,
  )
  return jax.tree.map(np.asarray, out.results)


def test_best_point_prefers_solved_then_fewest_steps():
  res = _quadratic_sweep()
  solved = protocol.is_solved(res.converged, res.num_grad_evals, budget=61)
  assert solved.any() and not solved.all()
  i = protocol.best_point(res, solved)
  assert solved[i] and res.num_steps[i] == res.num_steps[solved].min()
  # Nothing solved: the lowest final value.
  none = np.zeros_like(solved)
  assert protocol.best_point(res, none) == int(np.argmin(res.value))
  # A point that converged but is not solved (too many calls) is not preferred.
  only = np.zeros_like(solved)
  j = int(np.flatnonzero(~solved)[0])
  only[j] = True
  assert protocol.best_point(res, only) == j


def test_row_from_solve_is_the_reported_point():
  res = _quadratic_sweep()
  i = 3
  point = jax.tree.map(lambda a: a[i], res)
  row = protocol.Row.from_solve("HDM-Best", point, True, "lr=1", 0.5)
  k = int(point.num_steps)
  assert row.iterations == k and row.grad_calls == int(point.num_grad_evals)
  assert row.final_value == float(point.value) and len(row.trace_values) == k + 1
  assert row.trace_values[-1] == row.final_value


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
    "'experiments.table1', 'experiments.perf.speed', 'experiments.benchmark.suites', "
    "'experiments.benchmark.__main__'):\n"
    "  importlib.import_module(m)\n"
    "assert not jax.config.jax_enable_x64\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def test_entry_points_compute_float32_products_in_float32():
  """enable_float64 also asks for float32 matrix products in float32 (HIGHEST precision):
  JAX's default lets an NVIDIA GPU round their inputs to TF32 (experiments/tf32.py)."""
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


def test_tf32_rounding_keeps_ten_bits_of_mantissa():
  from experiments import tf32

  x = jnp.asarray([1.0 + 2.0**-10, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-12], jnp.float32)
  # representable; a tie rounds to even (1.0); a tie rounds to even (1 + 2^-9); below half
  np.testing.assert_array_equal(tf32.tf32(x), [1.0 + 2.0**-10, 1.0, 1.0 + 2.0**-9, 1.0])
  assert tf32.tf32(jnp.ones(2, jnp.float64)).dtype == jnp.float64  # other dtypes pass through


def test_float32_rtol_prints_the_threshold_of_each_run():
  from experiments import float32_rtol

  lines = list(float32_rtol.rows(300))
  assert len(lines) == 6 and all("threshold" in line and "CONVERGED" in line for line in lines)
