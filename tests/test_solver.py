"""solve and sweep: budgets, status codes and the early-stopping sweep."""

import jax.numpy as jnp
import numpy as np
import optax

import hdm_optax
from hdm_optax import solver


A = jnp.array([1.0, 10.0, 100.0])


def quadratic(x, a):
  return jnp.sum(a * x**2)


def make_best(precond_lr, momentum_lr):
  return hdm_optax.hdm_best(lipschitz=200.0, precond_lr=precond_lr, momentum_lr=momentum_lr)


GRID = {"precond_lr": [1e-4, 1e-3, 1e-2], "momentum_lr": [1.0, 3.0]}


def test_stop_at_first_converged_keeps_the_best_point():
  full = hdm_optax.sweep(
    make_best, GRID, quadratic, jnp.ones(3), max_steps=400, tol=1e-6, fun_args=(A,)
  )
  first = hdm_optax.sweep(
    make_best,
    GRID,
    quadratic,
    jnp.ones(3),
    max_steps=400,
    tol=1e-6,
    fun_args=(A,),
    stop_at_first_converged=True,
  )
  # The two sweeps are different compiled programs, so their trajectories agree
  # to rounding, and a point that meets tol at the last step in one may need
  # one more step in the other.
  b = first.best
  full_steps = np.asarray(full.results.num_steps)
  k = int(first.results.num_steps[b])
  assert abs(k - full_steps[full.best]) <= 1 and abs(k - full_steps[b]) <= 1
  np.testing.assert_allclose(
    first.results.trace.value[b, :k], full.results.trace.value[b, :k], rtol=1e-8
  )
  steps = np.asarray(first.results.num_steps)
  assert np.all(steps <= steps[b])  # everyone stopped with the winner
  status = np.asarray(first.results.status)
  assert status[b] == solver.CONVERGED
  assert np.any(status == solver.STOPPED)  # the test can fail: someone was cut short
  assert np.asarray(full.results.num_steps).max() > steps[b]


def test_max_grad_evals_budget_and_status():
  res = hdm_optax.solve(
    optax.lbfgs(),
    quadratic,
    jnp.ones(3) * 5,
    max_steps=100,
    tol=0.0,
    fun_args=(A,),
    max_grad_evals=12,
  )
  assert int(res.status) == solver.MAX_STEPS
  assert 12 <= int(res.num_grad_evals) <= 12 + 30  # a linesearch step may overshoot
  assert not bool(res.converged)
  grad_evals = np.asarray(res.trace.grad_evals)
  assert grad_evals[int(res.num_steps)] == int(res.num_grad_evals)
  assert np.all(np.diff(grad_evals) >= 0)


def test_trace_is_frozen_after_the_last_step():
  res = hdm_optax.solve(
    make_best(1e-2, 3.0), quadratic, jnp.ones(3), max_steps=300, tol=1e-6, fun_args=(A,)
  )
  k = int(res.num_steps)
  assert bool(res.converged) and 0 < k < 300
  assert np.all(np.asarray(res.trace.value)[k:] == float(res.value))
  assert np.all(np.asarray(res.trace.grad_norm)[k:] == float(res.grad_norm))
  assert not np.any(np.asarray(res.trace.accepted)[k + 1 :])
  assert int(res.num_grad_evals) == k + 1  # one oracle call per HDM-Best iteration


def test_compact_sweep_gives_the_same_results():
  """Moving the active points into smaller batches (6 -> 2 -> 1) changes no result."""
  assert solver._stages(6, True) == (6, 2, 1) and solver._stages(6, False) == (6,)
  kw = dict(max_steps=400, tol=1e-6, fun_args=(A,))
  full = hdm_optax.sweep(make_best, GRID, quadratic, jnp.ones(3), **kw)
  compact = hdm_optax.sweep(make_best, GRID, quadratic, jnp.ones(3), compact=True, **kw)
  steps = np.asarray(full.results.num_steps)
  assert len(set(steps.tolist())) >= 4  # points finish at different times: stages run
  np.testing.assert_array_equal(np.asarray(compact.results.status), np.asarray(full.results.status))
  assert np.max(np.abs(np.asarray(compact.results.num_steps) - steps)) <= 1
  assert compact.best == full.best
  for i, k in enumerate(steps):
    np.testing.assert_allclose(
      compact.results.trace.value[i, :k], full.results.trace.value[i, :k], rtol=1e-8
    )
    np.testing.assert_allclose(
      compact.results.trace.grad_evals[i, :k], full.results.trace.grad_evals[i, :k]
    )
  np.testing.assert_allclose(compact.results.params, full.results.params, rtol=1e-6, atol=1e-9)
  first = hdm_optax.sweep(
    make_best, GRID, quadratic, jnp.ones(3), compact=True, stop_at_first_converged=True, **kw
  )
  assert first.best == full.best
  assert np.all(np.asarray(first.results.num_steps) <= steps[full.best] + 1)


def test_value_fn_returning_aux_gets_a_clear_error_in_update():
  """A (loss, aux) value_fn: a TypeError naming has_aux, not JAX's conversion error."""
  opt = hdm_optax.hdm_best(lipschitz=200.0)
  x = jnp.ones(3)
  fun = lambda p: (quadratic(p, A), p)
  with np.testing.assert_raises_regex(TypeError, "has_aux=True"):
    opt.update(2 * A * x, opt.init(x), x, value=quadratic(x, A), grad=2 * A * x, value_fn=fun)
