"""Derivatives through solve and minimize (hdm_optax.driver.adjoint) against finite differences.

Central differences in float64 with step 1e-5 (relative error <= 1e-4 required); the runs
solve to tol=1e-12 so that the differenced function is the solution map, not a run's
rounding. Each differentiated function is jitted once and reused.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from hdm_optax.pieces.lbfgs import memory as memory_lib
from hdm_optax.driver import adjoint as adjoint_lib

STEP = 1e-5
RTOL = 1e-4


def _directional_fd(f, x, direction):
  return (f(x + STEP * direction) - f(x - STEP * direction)) / (2 * STEP)


def _close(derivative, reference):
  derivative, reference = float(derivative), float(reference)
  assert abs(derivative - reference) <= RTOL * max(abs(reference), 1e-8), (derivative, reference)


def _logistic(w, A, y, lam):
  return jnp.mean(jnp.logaddexp(0.0, -y * (A @ w))) + 0.5 * lam * jnp.sum(w**2)


def _data(seed, m, n=6):
  A = jax.random.normal(jax.random.key(seed), (m, n))
  y = jnp.sign(A @ jnp.linspace(-1.0, 1.0, n) + 0.3 * jax.random.normal(jax.random.key(seed), (m,)))
  return A, y


A_TRAIN, Y_TRAIN = _data(0, 40)
A_VALID, Y_VALID = _data(1, 30)


def _ridge_fit(lam, A, adjoint=None, max_steps=200, tol=1e-12):
  return hdm_optax.solve(
    hdm_optax.trial_lbfgs(),
    _logistic,
    jnp.zeros(A.shape[1]),
    max_steps=max_steps,
    tol=tol,
    fun_args=(A, Y_TRAIN, lam),
    adjoint=adjoint,
  )


@jax.jit
def _validation(lam, A):
  w = _ridge_fit(lam, A).params
  return jnp.mean(jnp.logaddexp(0.0, -Y_VALID * (A_VALID @ w)))


_GRAD_VALIDATION = jax.jit(jax.grad(_validation))


def test_ridge_logistic_gradient_wrt_penalty_and_data():
  lam = 0.1
  grad_lam, grad_A = jax.jit(jax.grad(_validation, argnums=(0, 1)))(lam, A_TRAIN)
  _close(grad_lam, _directional_fd(lambda t: _validation(t, A_TRAIN), lam, 1.0))
  direction = jax.random.normal(jax.random.key(7), A_TRAIN.shape)
  fd = _directional_fd(lambda a: _validation(lam, a), A_TRAIN, direction)
  _close(jnp.vdot(grad_A, direction), fd)
  # forward mode: the same derivative by jax.jvp
  _, tangent = jax.jit(lambda t: jax.jvp(lambda s: _validation(s, A_TRAIN), (t,), (1.0,)))(lam)
  _close(tangent, grad_lam)


def test_vmapped_grid_of_penalties_in_one_program():
  lams = jnp.array([0.01, 0.1, 1.0])
  grads = jax.jit(jax.vmap(jax.grad(_validation), in_axes=(0, None)))(lams, A_TRAIN)
  for lam, grad in zip(lams, grads):
    _close(grad, _directional_fd(lambda t: _validation(t, A_TRAIN), lam, 1.0))


def _nnls(x, M, b):
  return 0.5 * jnp.sum((M @ x - b) ** 2)


M_LS = jax.random.normal(jax.random.key(2), (30, 8))
B_LS = jax.random.normal(jax.random.key(3), (30,))
WEIGHTS = jnp.arange(1.0, 9.0)


def _bounded_fit(b, adjoint=None, max_steps=15000):
  return hdm_optax.minimize(
    _nnls,
    jnp.zeros(8),
    args=(M_LS, b),
    bounds=(0.0, None),
    tol=1e-12,
    max_steps=max_steps,
    adjoint=adjoint,
  )


def test_nonnegative_least_squares_gradient_wrt_b():
  res = _bounded_fit(B_LS)
  active = np.asarray(res.params) == 0
  assert 0 < active.sum() < 8  # both kinds of variables
  f = jax.jit(lambda b: jnp.vdot(WEIGHTS, _bounded_fit(b).params))
  grad = jax.jit(jax.grad(f))(B_LS)
  direction = jax.random.normal(jax.random.key(4), B_LS.shape)
  _close(jnp.vdot(grad, direction), _directional_fd(f, B_LS, direction))
  jac = jax.jit(jax.jacfwd(lambda b: _bounded_fit(b).params))(B_LS)
  assert np.all(np.asarray(jac)[active] == 0)  # active variables do not move
  np.testing.assert_allclose(jac.T @ WEIGHTS, grad, rtol=1e-8, atol=1e-12)


A_BOX = jnp.array([[3.0, 0.5, 0.2], [0.5, 2.0, 0.3], [0.2, 0.3, 1.5]])
THETA_BOX = jnp.array([1.0, -0.5, 2.0])
LOWER = jnp.array([0.0, 0.1, -1.0])  # x1 is held on its lower bound
UPPER = jnp.array([1.0, 1.0, 1.0])  # x2 on its upper one; x0 strictly inside


def _box_quadratic(x, theta):
  return 0.5 * x @ A_BOX @ x - theta @ x


def _boxed(front, lower, upper, theta, adjoint=None):
  """The solution of the box quadratic through ``front``; the unrolled run makes 40 steps."""
  steps = {"max_steps": 40} if adjoint is not None else {"max_steps": 300}
  if front == "minimize":
    res = hdm_optax.minimize(
      _box_quadratic,
      jnp.zeros(3),
      args=(theta,),
      bounds=(lower, upper),
      tol=1e-12,
      adjoint=adjoint,
      **steps,
    )
    return res.x
  optimizer = hdm_optax.trial_lbfgs(lower=lower, upper=upper)
  res = hdm_optax.solve(
    optimizer, _box_quadratic, jnp.zeros(3), fun_args=(theta,), tol=1e-12, adjoint=adjoint, **steps
  )
  return res.params


@pytest.mark.parametrize("front", ["minimize", "solve"])
def test_derivative_wrt_the_bounds_and_the_arguments(front):
  # A held variable moves with its bound; the free one answers through H_FA. The solution
  # map is piecewise linear, so central differences are exact but for the solves' rounding
  # (tol / STEP).
  point = (LOWER, UPPER, THETA_BOX)
  x = _boxed(front, *point)
  assert float(x[1]) == 0.1 and float(x[2]) == 1.0 and 0.0 < float(x[0]) < 1.0
  of = jax.jit(lambda *p: _boxed(front, *p))
  rev = jax.jit(jax.jacrev(of, argnums=(0, 1, 2)))(*point)
  fwd = jax.jit(jax.jacfwd(of, argnums=(0, 1, 2)))(*point)
  unrolled = jax.jit(
    jax.jacrev(lambda *p: _boxed(front, *p, hdm_optax.UnrolledAdjoint()), argnums=(0, 1, 2))
  )(*point)
  for i, arg in enumerate(point):
    columns = []
    for j in range(3):
      moved = [list(point), list(point)]
      moved[0][i], moved[1][i] = arg.at[j].add(STEP), arg.at[j].add(-STEP)
      columns.append((of(*moved[0]) - of(*moved[1])) / (2 * STEP))
    fd = np.stack(columns, axis=-1)
    np.testing.assert_allclose(rev[i], fd, atol=1e-6)
    np.testing.assert_allclose(fwd[i], rev[i], atol=1e-12)
    np.testing.assert_allclose(unrolled[i], rev[i], atol=1e-8)
  lower_jac, upper_jac = np.asarray(rev[0]), np.asarray(rev[1])
  assert lower_jac[1, 1] == 1.0 and upper_jac[2, 2] == 1.0  # held on its bound
  assert lower_jac[0, 0] == 0.0 and upper_jac[0, 0] == 0.0  # inside: its bounds do nothing
  assert np.all(lower_jac[:, [0, 2]] == 0) and np.all(upper_jac[:, [0, 1]] == 0)
  assert abs(lower_jac[0, 1]) > 0.1 and abs(upper_jac[0, 2]) > 0.05  # through H_FA


def test_derivative_wrt_the_bounds_in_a_batch_and_a_sweep():
  # solve_batch: each member's derivative is its own solve's; sweep: a traced grid column of
  # upper bounds against central differences.
  thetas = jnp.stack([THETA_BOX, THETA_BOX + jnp.array([0.0, 0.1, 0.2])])

  def batch(lower, upper):
    optimizer = hdm_optax.trial_lbfgs(lower=lower, upper=upper)
    res = hdm_optax.solve_batch(
      optimizer, _box_quadratic, jnp.zeros((2, 3)), fun_args=(thetas,), max_steps=300, tol=1e-12
    )
    return res.params

  rev = jax.jacrev(batch, argnums=(0, 1))(LOWER, UPPER)
  fwd = jax.jacfwd(batch, argnums=(0, 1))(LOWER, UPPER)
  assert np.all(np.asarray(rev[0])[:, 1, 1] == 1.0)  # each member's x1 held on its bound
  for k, theta in enumerate(thetas):
    one = jax.jacrev(lambda *p: _boxed("solve", *p), argnums=(0, 1))(LOWER, UPPER, theta)
    for i in range(2):
      np.testing.assert_allclose(rev[i][k], one[i], atol=1e-12)
      np.testing.assert_allclose(fwd[i][k], one[i], atol=1e-12)

  def swept(scale):
    grid = {"upper": scale * jnp.array([1.0, 0.9])}
    make = lambda upper: hdm_optax.trial_lbfgs(upper=upper)
    fun = lambda x: _box_quadratic(x, THETA_BOX)
    return hdm_optax.sweep(make, grid, fun, jnp.zeros(3), max_steps=300, tol=1e-12).results.params

  fd = (swept(1.0 + STEP) - swept(1.0 - STEP)) / (2 * STEP)
  derivative = jax.jacrev(swept)(1.0)
  assert np.all(np.asarray(derivative)[:, 2] > 0.8)  # x2 held on its upper bound
  np.testing.assert_allclose(derivative, fd, atol=1e-6)


def test_pytree_parameters_and_arguments():
  def fun(params, data):
    r = data["X"] @ params["w"] + params["b"] - data["t"]
    return 0.5 * jnp.sum(r**2) + data["lam"] * (jnp.sum(params["w"] ** 2) + params["b"] ** 2)

  data = {
    "X": jax.random.normal(jax.random.key(5), (20, 3)),
    "t": jax.random.normal(jax.random.key(6), (20,)),
    "lam": jnp.asarray(0.3),
  }
  x0 = {"w": jnp.zeros(3), "b": jnp.asarray(0.0)}

  @jax.jit
  def loss(data):
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(), fun, x0, max_steps=100, tol=1e-12, fun_args=(data,)
    )
    return jnp.sum(res.params["w"] ** 3) + res.params["b"] + res.value  # value too

  grad = jax.jit(jax.grad(loss))(data)
  direction = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size).reshape(a.shape) + 1.0), data)
  fd = (
    loss(jax.tree.map(lambda a, d: a + STEP * d, data, direction))
    - loss(jax.tree.map(lambda a, d: a - STEP * d, data, direction))
  ) / (2 * STEP)
  _close(optax.tree.vdot(grad, direction), fd)


def test_arrays_closed_over_are_differentiated_too():
  def loss(lam):
    fun = lambda w: _logistic(w, A_TRAIN, Y_TRAIN, lam)  # lam closed over, not a fun_arg
    res = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(6), max_steps=200, tol=1e-12)
    return jnp.mean(jnp.logaddexp(0.0, -Y_VALID * (A_VALID @ res.params)))

  np.testing.assert_allclose(
    jax.jit(jax.grad(loss))(0.1), _GRAD_VALIDATION(0.1, A_TRAIN), rtol=1e-8
  )


def test_float32_gradient_agrees_with_float64():
  lam = 0.1
  a32, y32 = A_TRAIN.astype(jnp.float32), Y_TRAIN.astype(jnp.float32)

  def loss32(lam):
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(),
      _logistic,
      jnp.zeros(6, jnp.float32),
      max_steps=200,
      tol=1e-6,
      fun_args=(a32, y32, lam),
    )
    return jnp.mean(
      jnp.logaddexp(0.0, -Y_VALID.astype(jnp.float32) * (A_VALID.astype(jnp.float32) @ res.params))
    )

  with warnings.catch_warnings(), jax.numpy_dtype_promotion("strict"):
    warnings.simplefilter("error", hdm_optax.ImplicitGradientWarning)
    g32 = jax.jit(jax.grad(loss32))(jnp.float32(lam))
    jax.effects_barrier()
  assert g32.dtype == jnp.float32
  np.testing.assert_allclose(g32, _GRAD_VALIDATION(lam, A_TRAIN), rtol=1e-3)


def test_agrees_with_optimistix_implicit_adjoint():
  optx = pytest.importorskip("optimistix")
  lam = 0.1

  def ours(lam):
    return _ridge_fit(lam, A_TRAIN).params

  def theirs(lam):
    sol = optx.minimise(
      lambda w, lam: _logistic(w, A_TRAIN, Y_TRAIN, lam),
      optx.BFGS(rtol=1e-12, atol=1e-12),
      jnp.zeros(6),
      args=lam,
      adjoint=optx.ImplicitAdjoint(),
      max_steps=500,
    )
    return sol.value

  np.testing.assert_allclose(
    jax.jit(jax.jacfwd(ours))(lam), jax.jit(jax.jacrev(theirs))(lam), rtol=1e-6, atol=1e-10
  )


def test_unrolled_gradient_of_a_truncated_run_against_finite_differences():
  unrolled = hdm_optax.UnrolledAdjoint()
  f = jax.jit(lambda lam, A: _validation_of(_ridge_fit(lam, A, unrolled, max_steps=6)))
  res = _ridge_fit(0.1, A_TRAIN, unrolled, max_steps=6)
  assert int(res.num_steps) == 6 and not bool(res.converged)  # truncated
  grad_lam, grad_A = jax.jit(jax.grad(f, argnums=(0, 1)))(0.1, A_TRAIN)
  _close(grad_lam, _directional_fd(lambda t: f(t, A_TRAIN), 0.1, 1.0))
  direction = jax.random.normal(jax.random.key(8), A_TRAIN.shape)
  _close(jnp.vdot(grad_A, direction), _directional_fd(lambda a: f(0.1, a), A_TRAIN, direction))


def _validation_of(res):
  return jnp.mean(jnp.logaddexp(0.0, -Y_VALID * (A_VALID @ res.params)))


def test_unrolled_run_is_the_while_loop_run():
  scan = _ridge_fit(0.1, A_TRAIN, hdm_optax.UnrolledAdjoint(), tol=1e-8)
  loop = _ridge_fit(0.1, A_TRAIN, tol=1e-8)
  assert bool(loop.converged) and int(scan.num_steps) == int(loop.num_steps)
  np.testing.assert_allclose(scan.params, loop.params, rtol=1e-12)
  np.testing.assert_array_equal(scan.trace.grad_evals, loop.trace.grad_evals)


def test_unrolled_hypergradient_of_a_step_size_and_in_a_box():
  fun = lambda x: jnp.sum(jnp.array([1.0, 4.0]) * x**2)
  final = jax.jit(
    lambda lr: (
      hdm_optax.solve(
        optax.sgd(lr), fun, jnp.ones(2), max_steps=5, tol=0.0, adjoint=hdm_optax.UnrolledAdjoint()
      ).value
    )
  )
  _close(jax.jit(jax.grad(final))(0.05), _directional_fd(final, 0.05, 1.0))
  boxed = jax.jit(
    lambda b: jnp.vdot(WEIGHTS, _bounded_fit(b, hdm_optax.UnrolledAdjoint(), max_steps=8).params)
  )
  direction = jax.random.normal(jax.random.key(9), B_LS.shape)
  grad = jax.jit(jax.grad(boxed))(B_LS)
  _close(jnp.vdot(grad, direction), _directional_fd(boxed, B_LS, direction))


def _caught(fn, *args):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fn(*args)
    jax.effects_barrier()
  return out, [str(w.message) for w in caught if w.category is hdm_optax.ImplicitGradientWarning]


def test_unconverged_run_warns():
  grad, messages = _caught(
    jax.jit(jax.grad(lambda lam: _validation_of(_ridge_fit(lam, A_TRAIN, max_steps=2)))), 0.1
  )
  assert np.isfinite(grad) and any("did not converge" in m for m in messages)
  assert any("(status MAX_STEPS)" in m for m in messages), messages  # by name, not [1]
  _, messages = _caught(_GRAD_VALIDATION, 0.1, A_TRAIN)
  assert not messages


def test_indefinite_hessian_gives_nan_and_a_warning():
  # A saddle: x1 never moves from 0 (its gradient is -2 x1 + theta = 0 at theta = 0), but
  # the derivative with respect to theta needs the negative curvature along x1.
  fun = lambda x, theta: (x[0] - 1.0) ** 2 - x[1] ** 2 + theta * x[1]
  loss = lambda theta: jnp.sum(
    hdm_optax.solve(
      hdm_optax.trial_lbfgs(), fun, jnp.zeros(2), max_steps=50, fun_args=(theta,)
    ).params
  )
  grad, messages = _caught(jax.jit(jax.grad(loss)), 0.0)
  assert np.isnan(grad) and any("singular or indefinite" in m for m in messages)


def test_cg_out_of_steps_warns():
  adjoint = hdm_optax.ImplicitAdjoint(max_steps=1, precondition=False)
  loss = lambda lam: _validation_of(_ridge_fit(lam, A_TRAIN, adjoint))
  _, messages = _caught(jax.jit(jax.grad(loss)), 0.1)
  assert any("did not reach their tolerance" in m for m in messages)


def test_preconditioned_cg_solves_in_fewer_steps():
  # The Hessian of a badly scaled quadratic, and the L-BFGS pairs a run left.
  scales = jnp.logspace(0, 3, 20)
  fun = lambda x: 0.5 * jnp.sum(scales * x**2)
  res = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.ones(20), max_steps=200, tol=1e-10)
  precond = memory_lib.preconditioner(res.state)
  b = jnp.ones(20)
  plain = adjoint_lib.conjugate_gradient(lambda v: scales * v, b)
  better = adjoint_lib.conjugate_gradient(lambda v: scales * v, b, precond)
  np.testing.assert_allclose(better[0], b / scales, rtol=1e-8)
  assert int(better[1]) < int(plain[1])


def test_adjoint_argument_is_checked():
  with pytest.raises(TypeError, match="adjoint must be"):
    hdm_optax.solve(
      hdm_optax.trial_lbfgs(), lambda x: jnp.sum(x**2), jnp.ones(2), max_steps=5, adjoint="implicit"
    )


def test_unrolled_through_a_converged_run_is_the_implicit_derivative_vmapped():
  # Iterations after convergence are frozen (a select under vmap): their derivative must
  # not turn the converged members' gradients into NaN.
  unrolled = hdm_optax.UnrolledAdjoint()
  loss = lambda lam: _validation_of(_ridge_fit(lam, A_TRAIN, unrolled, max_steps=80, tol=1e-10))
  lams = jnp.array([0.01, 0.1])
  grads = jax.jit(jax.vmap(jax.grad(loss)))(lams)
  for lam, grad in zip(lams, grads):
    np.testing.assert_allclose(grad, _GRAD_VALIDATION(lam, A_TRAIN), rtol=1e-6)


_QUARTIC_A = jnp.array([[3.0, 0.5, 0.0], [0.5, 2.0, 0.3], [0.0, 0.3, 1.5]])


def _quartic(x, th):
  return 0.5 * x @ _QUARTIC_A @ x - th @ x + 0.25 * jnp.sum(x**4) * th[0] ** 2


def _unrolled_params(make, max_steps):
  """th -> the params of ``max_steps`` unrolled steps of ``make()`` on ``_quartic``."""
  return lambda th: (
    hdm_optax.solve(
      make(),
      _quartic,
      jnp.zeros(3),
      fun_args=(th,),
      max_steps=max_steps,
      tol=0.0,
      adjoint=hdm_optax.UnrolledAdjoint(),
    ).params
  )


@pytest.mark.parametrize(
  "make",
  [
    lambda: hdm_optax.hdm_best(lipschitz=10.0),
    hdm_optax.hdm_best,
    hdm_optax.hdm_hb,
    hdm_optax.hdm_auto,
  ],
  ids=["hdm_best_lipschitz", "hdm_best", "hdm_hb", "hdm_auto"],
)
def test_unrolled_jacobian_of_the_learned_methods_against_finite_differences(make):
  # The first step's AdaGrad sum, a null step and an unchanged gradient are exactly 0: the
  # derivative of their square roots and norms there is 0 (not NaN).
  run = jax.jit(_unrolled_params(make, max_steps=5))
  th = jnp.array([1.0, -0.5, 2.0])
  jacobian = jax.jit(jax.jacrev(run))(th)
  assert bool(jnp.all(jnp.isfinite(jacobian)))
  reference = jnp.stack([_directional_fd(run, th, e) for e in jnp.eye(3)], axis=-1)
  # Truncation error of the central difference is O(STEP**2); rounding in the differenced
  # runs leaves entries that are 0 at about 1e-8.
  np.testing.assert_allclose(jacobian, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make", [hdm_optax.osgm_best, optax.lbfgs], ids=["osgm_best", "lbfgs"])
def test_unrolled_reverse_mode_through_an_inner_loop_is_refused_clearly(make):
  # Their updates enter while loops (probes, a zoom line search) that reverse mode cannot
  # transpose; forward mode goes through them.
  run = _unrolled_params(make, max_steps=3)
  th = jnp.array([1.0, -0.5, 2.0])
  with pytest.raises(ValueError, match="UnrolledAdjoint.*while_loop.*ImplicitAdjoint"):
    jax.grad(lambda t: jnp.sum(run(t)))(th)
  forward = jax.jacfwd(run)(th)
  assert bool(jnp.all(jnp.isfinite(forward)))
  if make is hdm_optax.osgm_best:  # optax's line search picks its step by comparisons
    reference = jnp.stack([_directional_fd(run, th, e) for e in jnp.eye(3)], axis=-1)
    np.testing.assert_allclose(forward, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
  "setting, value",
  [("rtol", -1.0), ("rtol", float("nan")), ("rtol", 0.0), ("max_steps", 2.5)]
  + [("max_steps", 0), ("max_steps", -1), ("max_steps", True)],
)
def test_implicit_adjoint_settings_are_checked_at_construction(setting, value):
  # A negative or NaN rtol stopped conjugate gradients at once: zero derivatives, no warning.
  with pytest.raises(ValueError, match=rf"ImplicitAdjoint\({setting}=.*{setting}.*pass"):
    hdm_optax.ImplicitAdjoint(**{setting: value})


def test_implicit_adjoint_stays_a_hashable_named_tuple():
  adjoint = hdm_optax.ImplicitAdjoint(max_steps=50, rtol=1e-8)
  assert adjoint == hdm_optax.ImplicitAdjoint(50, 1e-8, True)
  assert hash(adjoint) == hash(hdm_optax.ImplicitAdjoint(50, 1e-8))
  assert adjoint._replace(precondition=False).precondition is False
  assert hdm_optax.ImplicitAdjoint() == (1000, None, True)
  assert repr(adjoint) == "ImplicitAdjoint(max_steps=50, rtol=1e-08, precondition=True)"


def test_unrolled_adjoint_names_max_steps_none():
  with pytest.raises(ValueError, match=r"got max_steps=None.*e\.g\. max_steps=100"):
    hdm_optax.solve(
      optax.sgd(0.1),
      _quartic,
      jnp.zeros(3),
      fun_args=(jnp.ones(3),),
      max_steps=None,
      adjoint=hdm_optax.UnrolledAdjoint(),
    )
