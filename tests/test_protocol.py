"""Tests of experiments/protocol.py: x0, the solved rule and the best grid point."""

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax
from experiments import problems, protocol


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
