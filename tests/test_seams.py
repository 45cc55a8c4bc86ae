"""No silent wrong answer at the seams (issue 45): one test (or a few) per item.

Each test reproduces the issue's example and checks the answer a fresh process, a closed form
or finite differences give, or, where the right answer is an error, its type and that its
message names the argument and the fix. The drivers' cache policy these tests hold is the
one docs/guide.md states: a compiled program is reused only where a fresh one would give the
same answer.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from helpers import ROOT

TRIAL = hdm_optax.trial_lbfgs()
FIRST, SECOND = np.array([1.0, 2.0, 3.0]), np.array([-1.0, 5.0, 0.5])
X0 = np.zeros(3)


def _status(res) -> hdm_optax.Status:
  return hdm_optax.Status(int(res.status))


# --- 1. minimize with jac= reads fun's and jac's data at each call ------------------------

JAC_TARGET = jnp.asarray(FIRST)


def _sq_distance(x):
  return jnp.sum((x - JAC_TARGET) ** 2)


def _sq_distance_jac(x):
  return 2 * (x - JAC_TARGET)


def _sq_distance_and_jac(x):
  return jnp.sum((x - JAC_TARGET) ** 2), 2 * (x - JAC_TARGET)


def _rebind_jac_target(value):
  global JAC_TARGET  # pylint: disable=global-statement
  JAC_TARGET = jnp.asarray(value)


@pytest.mark.parametrize("jac", ["callable", "true"])
def test_minimize_with_jac_reads_a_rebound_global_at_each_call(jac):
  """Issue 45.1: fun and jac read a global that changed between two calls: the second call
  answers for the new data (today: x = the old target, success=True)."""
  fun, jac_arg = (
    (_sq_distance, _sq_distance_jac) if jac == "callable" else (_sq_distance_and_jac, True)
  )
  _rebind_jac_target(FIRST)
  first = hdm_optax.minimize(fun, X0, jac=jac_arg)
  np.testing.assert_allclose(first.x, FIRST, atol=1e-6)
  _rebind_jac_target(SECOND)
  second = hdm_optax.minimize(fun, X0, jac=jac_arg)
  assert second.success
  np.testing.assert_allclose(second.x, SECOND, atol=1e-6)


class _SciPyStyleProblem:
  """A SciPy user's class: fun and jac are bound methods reading ``self.target``."""

  def __init__(self, target):
    self.target = jnp.asarray(target)

  def fun(self, x):
    return jnp.sum((x - self.target) ** 2)

  def jac(self, x):
    return 2 * (x - self.target)


def test_minimize_with_jac_of_a_scipy_style_class_reads_a_reassigned_attribute():
  """Issue 45.1: ``minimize(p.fun, x0, jac=p.jac)``, then ``p.target = new``: the new answer."""
  problem = _SciPyStyleProblem(FIRST)
  np.testing.assert_allclose(hdm_optax.minimize(problem.fun, X0, jac=problem.jac).x, FIRST)
  problem.target = jnp.asarray(SECOND)
  second = hdm_optax.minimize(problem.fun, X0, jac=problem.jac)
  np.testing.assert_allclose(second.x, SECOND, atol=1e-6)


# --- 2. custom derivative rules are compared by what they compute, not by name ------------

RULE_TARGET = jnp.asarray(FIRST)


@jax.custom_jvp
def _custom_jvp_distance(x):
  return 0.5 * jnp.sum((x - RULE_TARGET) ** 2)


@_custom_jvp_distance.defjvp
def _custom_jvp_distance_rule(primals, tangents):
  (x,), (dx,) = primals, tangents
  return _custom_jvp_distance(x), jnp.sum((x - RULE_TARGET) * dx)


@jax.custom_vjp
def _custom_vjp_distance(x):
  return 0.5 * jnp.sum((x - RULE_TARGET) ** 2)


def _custom_vjp_forward(x):
  return _custom_vjp_distance(x), x


def _custom_vjp_backward(x, cotangent):
  return (cotangent * (x - RULE_TARGET),)


_custom_vjp_distance.defvjp(_custom_vjp_forward, _custom_vjp_backward)


def _rebind_rule_target(value):
  global RULE_TARGET  # pylint: disable=global-statement
  RULE_TARGET = jnp.asarray(value)


@pytest.mark.parametrize("rule", ["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize("driver", ["solve", "minimize"])
def test_a_custom_rule_reading_a_rebound_global_answers_for_the_new_data(rule, driver):
  """Issue 45.2: the rule and its primal read a global that is rebound between two calls
  (today: the old target, converged=True)."""
  fun = _custom_jvp_distance if rule == "custom_jvp" else _custom_vjp_distance

  def run():
    if driver == "solve":
      return np.asarray(hdm_optax.solve(TRIAL, fun, jnp.zeros(3), tol=1e-8).params)
    return hdm_optax.minimize(fun, X0, tol=1e-8).x

  _rebind_rule_target(FIRST)
  np.testing.assert_allclose(run(), FIRST, atol=1e-6)
  _rebind_rule_target(SECOND)
  np.testing.assert_allclose(run(), SECOND, atol=1e-6)


def _distance_with_own_rule(target):
  """A custom_vjp function whose primal and rule close over ``target``."""

  @jax.custom_vjp
  def distance(x):
    return 0.5 * jnp.sum((x - target) ** 2)

  def forward(x):
    return distance(x), x

  def backward(x, cotangent):
    return (cotangent * (x - target),)

  distance.defvjp(forward, backward)
  return distance


REBOUND = _distance_with_own_rule(jnp.asarray(FIRST))


def _calls_rebound(x):
  return REBOUND(x)


def test_a_custom_rule_rebound_under_the_same_name_is_seen():
  """Issue 45.2: the global name ``REBOUND`` is bound to a new custom_vjp function (same
  name, same code, other data): the second solve answers for the new one."""
  global REBOUND  # pylint: disable=global-statement
  REBOUND = _distance_with_own_rule(jnp.asarray(FIRST))
  first = hdm_optax.solve(TRIAL, _calls_rebound, jnp.zeros(3), tol=1e-8)
  np.testing.assert_allclose(first.params, FIRST, atol=1e-6)
  REBOUND = _distance_with_own_rule(jnp.asarray(SECOND))
  second = hdm_optax.solve(TRIAL, _calls_rebound, jnp.zeros(3), tol=1e-8)
  np.testing.assert_allclose(second.params, SECOND, atol=1e-6)


# --- 3. a NumPy bound edited in place is read at each call ---------------------------------


def _far_target(x):
  return jnp.sum((x - 5.0) ** 2)


def test_a_numpy_upper_bound_edited_in_place_is_read_at_the_next_call():
  """Issue 45.3: ``hi = np.ones(3)``, solve, ``hi[:] = 2``, solve with the same
  transformation and with a new equal one: x = 2 (today [1, 1, 1], CONVERGED_IN_BOX)."""
  hi = np.ones(3)
  opt = hdm_optax.trial_lbfgs(upper=hi)
  first = hdm_optax.solve(opt, _far_target, jnp.zeros(3))
  np.testing.assert_array_equal(first.params, 1.0)
  hi[:] = 2.0
  for again in (opt, hdm_optax.trial_lbfgs(upper=hi)):
    res = hdm_optax.solve(again, _far_target, jnp.zeros(3))
    assert _status(res) == hdm_optax.Status.CONVERGED_IN_BOX
    np.testing.assert_array_equal(res.params, 2.0)


def test_a_numpy_bound_of_minimize_edited_in_place_is_read_at_the_next_call():
  """Issue 45.3's control: minimize(bounds=...) reads the edited array (right today)."""
  hi = np.ones(3)
  np.testing.assert_allclose(hdm_optax.minimize(_far_target, X0, bounds=(None, hi)).x, 1.0)
  hi[:] = 2.0
  np.testing.assert_allclose(hdm_optax.minimize(_far_target, X0, bounds=(None, hi)).x, 2.0)


# --- 4. the box belongs to the optimizer, not to init_state --------------------------------


def _below_zero(x):
  return jnp.sum((x + 1.0) ** 2)


def test_init_state_of_an_unbounded_run_is_run_in_the_new_box():
  """Issue 45.4: ``solve(trial_lbfgs(lower=0.), ..., init_state=unbounded state)`` keeps
  x >= 0 (today x = -1, CONVERGED: the box is read from the state)."""
  start = hdm_optax.solve(hdm_optax.trial_lbfgs(), _below_zero, jnp.ones(3), max_steps=3)
  res = hdm_optax.solve(
    hdm_optax.trial_lbfgs(lower=0.0), _below_zero, start.params, init_state=start.state
  )
  assert _status(res) == hdm_optax.Status.CONVERGED_IN_BOX
  np.testing.assert_allclose(res.params, 0.0, atol=1e-8)


def test_init_state_of_a_bounded_run_is_run_without_the_box():
  """Issue 45.4, the reverse: an unbounded transformation from a bounded run's state
  reaches the unconstrained minimiser (today x = 0, CONVERGED_IN_BOX)."""
  start = hdm_optax.solve(hdm_optax.trial_lbfgs(lower=0.0), _below_zero, jnp.ones(3), max_steps=3)
  res = hdm_optax.solve(hdm_optax.trial_lbfgs(), _below_zero, start.params, init_state=start.state)
  assert _status(res) == hdm_optax.Status.CONVERGED
  np.testing.assert_allclose(res.params, -1.0, atol=1e-4)


# --- 5. second derivatives through a solve are exact, or refused naming UnrolledAdjoint ----


def _scaled_quadratic(x, t):
  """argmin_x 0.5 t x^2 - x = 1/t: d^2 x*/dt^2 = 2/t^3 (0.593 at t = 1.5)."""
  return jnp.sum(0.5 * t * x**2 - x)


def _exp_linear(x, t):
  """argmin_x exp(x) - t x = log t per entry: d^2 sum x*/dt^2 = -2/t^2 (2 entries)."""
  return jnp.sum(jnp.exp(x) - t * x)


SECOND_ORDER = {
  "grad(grad)": lambda g: jax.grad(jax.grad(g)),
  "hessian": jax.hessian,
  "jacfwd(grad)": lambda g: jax.jacfwd(jax.grad(g)),
}
CURVED = {
  # the numbers: 0.296 today where the exact value is 0.593
  "scaled_quadratic": (_scaled_quadratic, jnp.zeros(1), 2 / 1.5**3),
  # 0.0 today where the exact value is -0.889
  "exp_linear": (_exp_linear, jnp.zeros(2), -2 / 1.5**2),
}


def _solution_sum(driver, fun, x0):
  steps = 50  # a few are enough here: each problem converges in under 10

  def of(t):
    if driver == "solve":
      res = hdm_optax.solve(TRIAL, fun, x0, fun_args=(t,), tol=1e-10, max_steps=steps)
      return jnp.sum(res.params)
    return jnp.sum(hdm_optax.minimize(fun, x0, args=(t,), tol=1e-10, max_steps=steps).x)

  return of


@pytest.mark.parametrize(
  "problem, driver, order",
  [
    ("scaled_quadratic", "solve", "hessian"),
    ("scaled_quadratic", "minimize", "grad(grad)"),
    ("exp_linear", "solve", "jacfwd(grad)"),
  ],
)
def test_second_derivatives_through_a_solve_are_exact_or_refused(problem, driver, order):
  """Issue 45.5: jax.hessian, jacfwd(grad) and grad(grad) through solve/minimize with the
  default (implicit) adjoint give the exact value, or an error that names UnrolledAdjoint."""
  fun, x0, exact = CURVED[problem]
  try:
    got = SECOND_ORDER[order](_solution_sum(driver, fun, x0))(1.5)
  except (ValueError, NotImplementedError, TypeError) as error:
    assert "UnrolledAdjoint" in str(error), str(error)
    return
  np.testing.assert_allclose(float(got), exact, rtol=1e-5)


# --- 6. derivatives near a bound follow the active set of the projected gradient ----------


def _exp_minus_linear(x, c):
  """argmin_{x >= 0} exp(x) - c x = max(log c, 0) per entry."""
  return jnp.sum(jnp.exp(x) - c * x)


def test_a_variable_within_tol_of_its_bound_is_held_there_by_the_derivative():
  """Issue 45.6: from x0 = 1e-4 (within tol of the bound 0, grad f = 0.5 > 0 pushing out),
  the run stops at once and the point does not depend on c: d(sum x)/dc = 0 (finite
  differences: 0.0), not 3.0 (the variables taken as free)."""

  def total(c):
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(lower=0.0), _exp_minus_linear, jnp.full(3, 1e-4), fun_args=(c,)
    )
    return jnp.sum(res.params)

  h = 1e-3
  central = (float(total(0.5 + h)) - float(total(0.5 - h))) / (2 * h)
  assert central == pytest.approx(0.0, abs=1e-9)
  assert float(jax.grad(total)(0.5)) == pytest.approx(central, abs=1e-6)


@pytest.mark.parametrize("driver", ["solve", "minimize"])
def test_a_zero_gradient_on_the_bound_warns_that_the_derivative_is_one_sided(driver):
  """Issue 45.6: c = 1 puts x* = 0 on the bound with grad f = 0 there: x*(c) = max(log c, 0)
  has the one-sided derivatives 3 and 0 (central difference 1.5). The derivative returned is
  one of them, and a warning says the active set is degenerate (today: 3.0, no warning)."""

  def total(c):
    if driver == "solve":
      opt = hdm_optax.trial_lbfgs(lower=0.0)
      return jnp.sum(hdm_optax.solve(opt, _exp_minus_linear, jnp.ones(3), fun_args=(c,)).params)
    res = hdm_optax.minimize(_exp_minus_linear, jnp.ones(3), args=(c,), bounds=(0.0, None))
    return jnp.sum(res.x)

  with pytest.warns(UserWarning, match="(?i)bound"):
    got = float(jax.grad(total)(1.0))
  assert got == pytest.approx(0.0, abs=1e-3) or got == pytest.approx(3.0, rel=1e-3)


# --- 7. optax.lbfgs through solve with x64 on and float32 params ---------------------------


def _logistic_ridge(w, X, y, lam):
  return jnp.mean(jnp.logaddexp(0.0, -y * (X @ w))) + lam * jnp.sum(w**2)


def test_optax_lbfgs_through_solve_runs_on_float32_params_with_x64_on():
  """Issue 45.7: optax's line search evaluates f at a promoted dtype; solve must not fix the
  objective to the traced dtypes (today: TypeError lax.mul requires the same dtypes)."""
  assert jax.config.jax_enable_x64
  rng = np.random.default_rng(0)
  X = jnp.asarray(rng.standard_normal((40, 5)), jnp.float32)
  y = jnp.asarray(np.sign(rng.standard_normal(40)), jnp.float32)
  x0 = jnp.zeros(5, jnp.float32)
  res = hdm_optax.solve(optax.lbfgs(), _logistic_ridge, x0, fun_args=(X, y, 0.05))
  assert res.params.dtype == jnp.float32
  wide = (jnp.asarray(X, jnp.float64), jnp.asarray(y, jnp.float64), 0.05)
  exact = hdm_optax.solve(TRIAL, _logistic_ridge, jnp.zeros(5), fun_args=wide, tol=1e-10)
  np.testing.assert_allclose(res.params, exact.params, atol=1e-3)


# --- 8. Python ints in args are static (like jax.jit's static_argnums) --------------------


def _first_k_at_one(x, k):
  """sum_{i<k} (x_i - 1)^2 + ||x||^2, with k a size (range(k)): x_i = 1/2 for i < k."""
  return sum((x[i] - 1.0) ** 2 for i in range(k)) + jnp.sum(x**2)


def _sliced(x, k):
  """The same with a slice x[:k]."""
  return jnp.sum((x[:k] - 1.0) ** 2) + jnp.sum(x**2)


def _half_on_first(k, n=30):
  return np.where(np.arange(n) < k, 0.5, 0.0)


@pytest.mark.parametrize("fun", [_first_k_at_one, _sliced], ids=["range", "slice"])
def test_minimize_treats_a_python_int_in_args_as_static(fun):
  """Issue 45.8: ``minimize(f, x0, args=(20,))`` with k a size: JAX's gradient (a few
  calls), not host finite differences without a word (today nfev 93, or an IndexError);
  a new k compiles its own program and answers for it."""
  for k in (20, 10):
    res = hdm_optax.minimize(fun, jnp.zeros(30), args=(k,))
    np.testing.assert_allclose(res.x, _half_on_first(k), atol=1e-6)
    assert res.nfev <= 10, res.nfev  # JAX's gradient: no finite differences


@pytest.mark.parametrize("fun", [_first_k_at_one, _sliced], ids=["range", "slice"])
def test_solve_treats_a_python_int_in_fun_args_as_static(fun):
  """Issue 45.8: ``solve(..., fun_args=(20,))`` (today TracerIntegerConversionError from
  closure.py, or an IndexError)."""
  for k in (20, 10):
    res = hdm_optax.solve(TRIAL, fun, jnp.zeros(30), fun_args=(k,))
    assert bool(res.converged)
    np.testing.assert_allclose(res.params, _half_on_first(k), atol=1e-4)


def test_grad_through_minimize_with_an_int_in_args():
  """Issue 45.8: jax.grad through minimize whose args hold a size k and a traced t:
  sum_{i<k} (x_i - t)^2 + ||x||^2 has x_i = t/2 (i < k), d(sum x)/dt = k/2."""

  def fun(x, k, t):
    return jnp.sum((x[:k] - t) ** 2) + jnp.sum(x**2)

  total = lambda t: jnp.sum(hdm_optax.minimize(fun, jnp.zeros(30), args=(20, t)).x)
  assert float(jax.grad(total)(1.0)) == pytest.approx(10.0, rel=1e-6)


# --- 9. README's test command on a fresh machine -------------------------------------------


def test_the_benchmark_tests_skip_without_the_shared_benchmark_lists(tmp_path):
  """Issue 45.9: without ../shared/benchmarks (here: HDM_BENCHMARKS_DIR names an empty
  directory) the tests that read the CUTEst dev list skip with a reason (today: 3
  FileNotFoundError failures)."""
  tests = [
    "test_scale_suite_lists_the_other_problems_in_its_size_range",
    "test_cutest32_is_the_dev_list_in_float32_with_a_relative_tolerance",
    "test_hard_suite_is_the_dev_list_from_far_starts_and_rescaled",
    "test_scale_dev_suite_is_the_shared_list",
  ]
  command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs"]
  command += [f"tests/test_benchmark.py::{name}" for name in tests]
  env = {"HDM_BENCHMARKS_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
  out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and "failed" not in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


# --- 10. a weight decay before an HDM method is detected, and the fix named ----------------


def _logistic_data():
  rng = np.random.default_rng(0)
  A = jnp.asarray(rng.standard_normal((100, 10)))
  return A, jnp.asarray(np.sign(rng.standard_normal(100)))


def _mean_logistic(w, A, y):
  return jnp.mean(jnp.logaddexp(0.0, -y * (A @ w)))


def _own_loop(opt, fun, x, steps):
  """The user's optax loop (f and grad f at each new point), compiled as a scan."""
  state = opt.init(x)
  value, grad = jax.value_and_grad(fun)(x)

  def body(carry, _):
    x, state, value, grad = carry
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    x = optax.apply_updates(x, updates)
    value, grad = jax.value_and_grad(fun)(x)
    return (x, state, value, grad), None

  (x, state, _, _), _ = jax.lax.scan(body, (x, state, value, grad), None, length=steps)
  return x, state


def _uphill_trials(state) -> int:
  return sum(int(v) for _, v in optax.tree.get_all_with_path(state, "num_uphill_trials"))


@pytest.mark.parametrize(
  "method", [hdm_optax.hdm_auto, hdm_optax.trial_lbfgs], ids=["hdm_auto", "trial_lbfgs"]
)
def test_a_weight_decay_before_an_hdm_method_is_detected_in_the_users_loop(method):
  """Issue 45.10: ``optax.chain(optax.add_decayed_weights(1e-3), method())`` stalls (the
  value leaves the decay out): the method counts the rejected trials that went down the
  updates it received but up f, and the advice names the fix (put the decay in f)."""
  A, y = _logistic_data()
  fun = lambda w: _mean_logistic(w, A, y)
  opt = optax.chain(optax.add_decayed_weights(1e-3), method())
  _, state = _own_loop(opt, fun, jnp.ones(10), 300)
  assert _uphill_trials(state) > 100
  advice = hdm_optax._info.uphill_advice(state)  # pylint: disable=protected-access
  assert "put the term in f" in advice and "add_decayed_weights" in advice
  _, clipped = _own_loop(
    optax.chain(optax.clip_by_global_norm(0.1), method()), fun, jnp.ones(10), 50
  )
  assert _uphill_trials(clipped) == 0  # a clip keeps the direction: no false alarm


def test_a_weight_decay_before_an_hdm_method_is_named_in_solves_message():
  """Issue 45.10: solve reports the stall with the fix (today only "P has collapsed")."""
  A, y = _logistic_data()
  opt = optax.chain(optax.add_decayed_weights(1e-3), hdm_optax.hdm_auto())
  res = hdm_optax.solve(opt, _mean_logistic, jnp.ones(10), fun_args=(A, y), max_steps=300)
  assert not bool(res.converged)
  assert "in f" in res.message and "decay" in res.message, res.message
  in_f = lambda w, A, y: _mean_logistic(w, A, y) + 0.5e-3 * jnp.sum(w**2)
  fixed = hdm_optax.solve(hdm_optax.hdm_auto(), in_f, jnp.ones(10), fun_args=(A, y), max_steps=300)
  assert bool(fixed.converged)


def test_a_stall_of_rejected_uphill_trials_is_not_called_a_rounding_stall():
  """Where f stays put because the method rejects the trials a transformation before it
  asks for, x did not move: the message gives the advice, not "the steps are below the
  rounding of x", which would send the user to rescale a problem that needs no rescaling."""
  A, y = _logistic_data()
  opt = optax.chain(optax.add_decayed_weights(0.1), hdm_optax.trial_lbfgs())
  res = hdm_optax.solve(opt, _mean_logistic, jnp.zeros(10), fun_args=(A, y), max_steps=300)
  assert int(res.null_run) >= 100, res.message  # the last 100 values are equal
  assert "put the term in f" in res.message, res.message
  assert "rounding of x" not in res.message, res.message


def test_pitfalls_page_no_longer_says_a_weight_decay_is_honoured():
  """Issue 45.10: docs/pitfalls.md and trial_lbfgs's docstring say to put the decay in f."""
  page = (ROOT / "docs" / "pitfalls.md").read_text()
  assert "weight decay is honoured" not in page and "or weight decay is honoured" not in page
  assert "add_decayed_weights" in page and "Put the term in f" in page
  doc = hdm_optax.trial_lbfgs.__doc__
  assert "weight decay before it in a chain is honoured" not in doc and "put such a term in" in doc


# --- 11. statuses and messages that say what happened and what to do ----------------------


def _distance_to_one(x):
  return jnp.sum((x - 1.0) ** 2)


@pytest.mark.parametrize("driver", ["solve", "minimize"])
def test_nan_in_x0_is_named(driver):
  """Issue 45.11: NaN in x0: the message names x0 (today: "f or grad f is not finite at the
  current iterate")."""
  x0 = jnp.array([1.0, jnp.nan])
  try:
    if driver == "solve":
      message = hdm_optax.solve(TRIAL, _distance_to_one, x0).message
    else:
      message = hdm_optax.minimize(_distance_to_one, x0).message
  except ValueError as error:
    message = str(error)
  assert "x0" in message or "init_params" in message, message
  assert "nan" in message.lower(), message


def test_a_non_finite_gradient_at_x0_is_told_apart_from_f():
  """Issue 45.11: f(x0) = 0 is finite, grad f(x0) (sqrt at 0) is not: the message says the
  gradient is at fault, not "f or grad f"."""
  res = hdm_optax.solve(TRIAL, lambda x: jnp.sum(jnp.sqrt(x)), jnp.zeros(2))
  assert _status(res) == hdm_optax.Status.NON_FINITE
  assert "grad" in res.message and "f or grad f" not in res.message, res.message


def test_fun_returning_shape_1_names_fun_not_value_fn():
  """Issue 45.11: a fun returning shape (1,): the error names fun and the shape (today it
  names value_fn, which the user never passed)."""
  with pytest.raises((TypeError, ValueError)) as error:
    hdm_optax.solve(TRIAL, lambda x: jnp.sum((x - 1.0) ** 2, keepdims=True), jnp.zeros(2))
  message = str(error.value)
  assert "value_fn" not in message and "fun" in message and "(1,)" in message, message


def test_a_list_x0_reaches_fun_as_an_array_or_is_refused_by_name():
  """Issue 45.11: ``solve(opt, fun, [0.0, 0.0])`` hands fun a list today. Either fun gets an
  array (as minimize does, and SciPy), or the error names init_params and the fix."""
  seen = []

  def fun(x):
    seen.append(type(x))
    return jnp.sum((jnp.asarray(x) - 1.0) ** 2)

  try:
    res = hdm_optax.solve(TRIAL, fun, [0.0, 0.0])
  except (TypeError, ValueError) as error:
    assert "init_params" in str(error) and "jnp.asarray" in str(error), str(error)
    return
  assert all(issubclass(kind, (jax.Array, jax.core.Tracer)) for kind in seen), seen
  assert isinstance(res.params, jax.Array)
  np.testing.assert_allclose(res.params, 1.0, atol=1e-6)


class _CallbackError(Exception):
  pass


def _raising_callback(snapshot):
  del snapshot
  raise _CallbackError("the user's own error")


@pytest.mark.parametrize("driver", ["solve", "minimize"])
def test_a_callbacks_exception_keeps_its_type(driver):
  """Issue 45.11: an exception raised in the callback reaches the caller with its own type
  (today: JaxRuntimeError INTERNAL)."""
  with pytest.raises(_CallbackError, match="the user's own error"):
    if driver == "solve":
      hdm_optax.solve(TRIAL, _distance_to_one, jnp.zeros(2), callback=_raising_callback)
    else:
      hdm_optax.minimize(_distance_to_one, X0, callback=_raising_callback)


@pytest.mark.parametrize("maxiter", [np.inf, 2**31], ids=["inf", "2**31"])
def test_a_huge_maxiter_runs_or_is_refused_by_name(maxiter):
  """Issue 45.11: ``options={"maxiter": np.inf}`` or ``2**31`` (today OverflowError)."""
  try:
    res = hdm_optax.minimize(_distance_to_one, X0, options={"maxiter": maxiter})
  except ValueError as error:
    assert "maxiter" in str(error), str(error)
    return
  assert res.success
  np.testing.assert_allclose(res.x, 1.0, atol=1e-6)


def test_a_huge_max_steps_runs_or_is_refused_by_name():
  """Issue 45.11: ``solve(max_steps=2**31)`` (today OverflowError)."""
  try:
    res = hdm_optax.solve(TRIAL, _distance_to_one, jnp.zeros(2), max_steps=2**31)
  except ValueError as error:
    assert "max_steps" in str(error), str(error)
    return
  assert bool(res.converged)


def test_init_state_of_another_optimizer_is_refused_by_name():
  """Issue 45.11: init_state from optax.adam given to trial_lbfgs (today AttributeError
  'tuple' object has no attribute 'grad')."""
  other = hdm_optax.solve(optax.adam(0.1), _distance_to_one, jnp.zeros(2), max_steps=3)
  with pytest.raises((TypeError, ValueError)) as error:
    hdm_optax.solve(TRIAL, _distance_to_one, other.params, init_state=other.state)
  assert "init_state" in str(error.value), str(error.value)


@pytest.mark.parametrize("driver", ["solve", "minimize"])
def test_empty_params_are_refused(driver):
  """Issue 45.11: params with no entries (today NON_FINITE with grad_norm = -inf)."""
  with pytest.raises(ValueError, match="no entries|empty"):
    if driver == "solve":
      hdm_optax.solve(TRIAL, lambda x: jnp.sum(x**2), jnp.zeros(0))
    else:
      hdm_optax.minimize(lambda x: jnp.sum(x**2), np.zeros(0))


def _half_distance(x, a):
  return 0.5 * jnp.sum((x - a) ** 2)


def test_grad_through_solve_batch_is_the_members_gradients():
  """Issue 45.11: jax.grad through solve_batch (today a raw JAX error). Each member's x* = a,
  so d(sum x*)/da = 1 (the implicit adjoint, as each member's solve gives)."""
  total = lambda a: jnp.sum(
    hdm_optax.solve_batch(TRIAL, _half_distance, jnp.zeros((2, 3)), fun_args=(a,)).params
  )
  np.testing.assert_allclose(jax.grad(total)(jnp.ones((2, 3))), 1.0, rtol=1e-6)


def test_grad_through_sweep_is_the_points_gradients():
  """Issue 45.11: jax.grad through sweep (today TracerArrayConversionError): two grid
  points, each x* = a, so d(sum over points of sum x*)/da = 2."""
  total = lambda a: jnp.sum(
    hdm_optax.sweep(
      hdm_optax.trial_lbfgs,
      {"pair_tol": [1e-10, 1e-8]},
      _half_distance,
      jnp.zeros(3),
      fun_args=(a,),
    ).results.params
  )
  np.testing.assert_allclose(jax.grad(total)(jnp.ones(3)), 2.0, rtol=1e-6)


HUGE = {"float32": (jnp.float32, 1e19), "float64": (jnp.float64, 1e160)}


@pytest.mark.parametrize("dtype", list(HUGE))
def test_huge_gradients_make_progress_with_trial_lbfgs(dtype):
  """Issue 45.11: f = s ||x - 1||^2 with s = 1e19 in float32 (1e160 in float64): ||grad f||^2
  overflows. trial_lbfgs reaches x = 1 (today: x stays at 0 for 1000 calls while info says
  accepted and the message says null steps)."""
  kind, scale = HUGE[dtype]
  fun = lambda x: jnp.asarray(scale, kind) * jnp.sum((x - 1.0) ** 2)
  res = hdm_optax.solve(TRIAL, fun, jnp.zeros(3, kind))
  assert bool(res.converged), res.message
  np.testing.assert_allclose(np.asarray(res.params, np.float64), 1.0, rtol=1e-6)


@pytest.mark.parametrize(
  "method",
  [hdm_optax.hdm_best, hdm_optax.hdm_auto, hdm_optax.trial_lbfgs],
  ids=["hdm_best", "hdm_auto", "trial_lbfgs"],
)
def test_huge_gradients_converge_or_the_message_says_what_to_do(method):
  """Issue 45.11: with gradients of 1e160 in float64, a run converges or its message says to
  scale f; the loop's ``accepted`` and the method's ``info.accepted`` agree."""
  fun = lambda x: 1e160 * jnp.sum((x - 1.0) ** 2)
  res = hdm_optax.solve(method(), fun, jnp.zeros(3), max_steps=200)
  info = res.state.info
  assert bool(res.trace.accepted[int(res.num_steps)]) == bool(info.accepted)
  if not bool(res.converged):
    assert "scale" in res.message, res.message


def test_progress_without_a_terminal_writes_lines_not_carriage_returns(capfd):
  """Issue 45.11: where stderr is not a terminal (here captured), the progress line is not
  redrawn with a carriage return (a log got one 130 KB line)."""
  hdm_optax.solve(TRIAL, _distance_to_one, jnp.zeros(2), progress=True)
  err = capfd.readouterr().err
  assert err and "\r" not in err, repr(err[:300])


def test_progress_under_vmap_labels_the_median(capfd):
  """Issue 45.11: under jax.vmap the f column of the progress line is the batch's median,
  and says so."""
  run = lambda a: hdm_optax.solve(TRIAL, _half_distance, jnp.zeros(3), fun_args=(a,), progress=True)
  jax.vmap(run)(jnp.arange(6.0).reshape(2, 3))
  err = capfd.readouterr().err
  assert "median" in err, repr(err[:300])


# --- found by the adversarial suite --------------------------------------------------------


def _box_quadratic(x):
  return 0.5 * jnp.sum(jnp.array([1.0, 10.0, 100.0]) * (x - jnp.array([1.0, -2.0, 3.0])) ** 2)


def test_minimize_does_not_stop_on_ftol_after_a_step_to_the_mirror_point():
  """minimize at SciPy's defaults on a separable quadratic in a box: trial_lbfgs's step from
  x_0 = 0.0297 to its mirror point 1.9703 about the minimiser 1 leaves f equal to 2e-11
  relative, and ftol (2.2e-9) stopped the run there with success=True (x_0 off by 0.97,
  f 20.47 against 20.0). SciPy's L-BFGS-B returns [1, 0, 3]."""
  lower, upper = np.array([-1.0, 0.0, 0.0]), np.array([2.0, 1.0, np.inf])
  res = hdm_optax.minimize(_box_quadratic, X0, bounds=(lower, upper))
  np.testing.assert_allclose(res.x, [1.0, 0.0, 3.0], atol=1e-4)
