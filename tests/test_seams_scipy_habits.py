"""What a user with SciPy's habits is told at three seams: ``minimize``'s bounds written as
``least_squares`` takes them (or one pair short), a float32 run at its rounding floor, and
``solve_batch`` given one start for a batch of data (the default in_axes maps both).

Each test reproduces a user's example; where the right answer is an error or a note, it
checks that the text names what went wrong and the fix.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import hdm_optax


def _fun(x):
  return jnp.sum((x - 1.0) ** 2)


# --- 1. a list or tuple as a side of (lower, upper) for an x0 of one array ---------------------


def test_least_squares_style_bounds_name_the_side_and_the_fix():
  """``least_squares(bounds=([0, 0, 0], [1, 1, 1]))`` is how SciPy's other solvers take
  bounds; here the lists were refused with pytree structures (``PyTreeDef(*)``)."""
  with pytest.raises(ValueError) as caught:
    hdm_optax.minimize(_fun, np.zeros(3), bounds=([0, 0, 0], [0.5, 0.5, 0.5]))
  message = str(caught.value)
  assert "its lower, the list [0, 0, 0], is a Python sequence" in message
  assert "np.asarray" in message and "scipy.optimize.Bounds(lower, upper)" in message
  assert "PyTreeDef" not in message


def test_one_scipy_pair_short_says_how_many_and_the_fix():
  """Two (min, max) pairs for three entries: SciPy says the number of bounds does not fit."""
  with pytest.raises(ValueError) as caught:
    hdm_optax.minimize(_fun, np.zeros(3), bounds=[(0, 1), (0, 1)])
  message = str(caught.value)
  assert "has 2 entries for x0's 3" in message
  assert "The number of bounds is not compatible with the length of `x0`." in message
  assert "3 (min, max) pairs" in message and "PyTreeDef" not in message


def test_the_accepted_forms_still_run():
  box = np.full(3, 0.5)
  for bounds in [
    (np.zeros(3), box),
    scipy.optimize.Bounds([0, 0, 0], [0.5, 0.5, 0.5]),
    [(0, 0.5)] * 3,
    (0.0, 0.5),
  ]:
    res = hdm_optax.minimize(_fun, np.zeros(3), bounds=bounds)
    np.testing.assert_allclose(res.x, box, err_msg=str(bounds))
  res = hdm_optax.minimize(_fun, np.zeros(2), bounds=([0, 0], [0.5, 0.5]))  # SciPy's 2 pairs
  np.testing.assert_allclose(res.x, [0.0, 0.5])
  tree = lambda p: _fun(p[0]) + _fun(p[1])  # a pytree x0: tuples are its structure
  res = hdm_optax.minimize(tree, (np.zeros(2), np.zeros(2)), bounds=((0.0, 0.0), (0.5, 0.5)))
  np.testing.assert_allclose(np.concatenate(res.x), np.full(4, 0.5))


# --- 2. a float32 run that cycles within f's rounding until maxiter ---------------------------


def _least_squares_float32():
  rng = np.random.default_rng(0)
  A = rng.normal(size=(500, 8))
  b = A @ np.linspace(-1, 1, 8) + 0.01 * rng.normal(size=500)
  return A.astype(np.float32), b.astype(np.float32)


def _ls(x, A, b):
  return 0.5 * jnp.sum((A @ x - b) ** 2)


def test_a_float32_run_at_its_rounding_floor_says_so_and_the_fix():
  """SciPy's gtol 1e-5 lies below float32's floor here (||grad f|| is 1.8e-5 at the float32
  point nearest the solution): with ftol off, nothing but maxiter stops the run, which
  accepts steps within f's rounding, and its message said only that maxiter was reached.
  (With SciPy's ftol the run stops on it, as SciPy's does.)"""
  A, b = _least_squares_float32()
  options = {"maxiter": 200, "ftol": 0.0}
  res = hdm_optax.minimize(_ls, np.zeros(8, np.float32), args=(A, b), options=options)
  assert res.status == hdm_optax.Status.MAX_STEPS and not res.success
  assert "f moved only within its float32 rounding over the last 100 steps" in res.message
  assert "rtol=" in res.message and "float64" in res.message
  fixed = hdm_optax.minimize(_ls, np.zeros(8, np.float32), args=(A, b), rtol=1e-6)
  assert fixed.success and fixed.nit < 50
  solution = np.linalg.lstsq(A.astype(np.float64), b.astype(np.float64), rcond=None)[0]
  np.testing.assert_allclose(fixed.x, solution, atol=1e-4)


def test_a_run_still_moving_f_has_no_rounding_note():
  """A float64 run cut short by maxiter while f still falls: no rounding note."""
  rosen = lambda x: jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)
  res = hdm_optax.minimize(rosen, np.tile([-1.2, 1.0], 10), options={"maxiter": 120})
  assert res.status == hdm_optax.Status.MAX_STEPS
  assert "rounding" not in res.message


# --- 3. solve_batch with an unbatched start: which argument has which size, and the fix -------


def test_solve_batch_sizes_name_the_arguments_and_in_axes_fix():
  """One start for five problems under the default in_axes: the error said only
  'got sizes [3, 5]', not that 3 is the start's length or that in_axes=(None, 0) shares it."""
  fun = lambda w, c: jnp.sum((w - c) ** 2)
  opt, data = hdm_optax.trial_lbfgs(), jnp.ones((5, 3))
  with pytest.raises(ValueError) as caught:
    hdm_optax.solve_batch(opt, fun, jnp.zeros(3), fun_args=(data,))
  message = str(caught.value)
  assert "3 on axis 0 of init_params, of shape (3,)" in message
  assert "5 on axis 0 of fun_args[0], of shape (5, 3)" in message
  assert "in_axes=(None, 0)" in message
  out = hdm_optax.solve_batch(opt, fun, jnp.zeros(3), fun_args=(data,), in_axes=(None, 0))
  np.testing.assert_allclose(out.params, data, atol=1e-8)
  with pytest.raises(ValueError, match="axes of size 0"):
    hdm_optax.solve_batch(opt, fun, jnp.zeros((0, 3)), fun_args=(jnp.ones((0, 3)),))
