"""SciPy's door with a NumPy ``fun``: forward differences, ``args`` and ``maxfun`` as SciPy has
them, and the user's own exception from ``fun`` whichever program ran before."""

import warnings

import jax
import numpy as np
import pytest
import scipy.optimize

import hdm_optax

C = np.linspace(1000.0, 1010.0, 5)


def _far_quadratic(x):
  """A NumPy objective (JAX cannot trace ``float()``) whose minimum is far from the start."""
  return float(np.sum((x - C) ** 2))


def _minimize(*args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the forward differences' and 32-bit notes
    return hdm_optax.minimize(*args, **kwargs)


def test_a_float32_start_with_forward_differences_leaves_it_as_scipy_does():
  """eps = 1e-8 does not move a float32 x of order 1: the difference reads a zero gradient
  (the run reported a converged x0). SciPy's relative step takes over there, and a 32-bit x
  gets no step below float32's square-root resolution."""
  x0 = np.ones(5, np.float32)
  ours = _minimize(_far_quadratic, x0)
  theirs = scipy.optimize.minimize(_far_quadratic, x0, method="L-BFGS-B")
  assert ours.nit > 1 and np.max(np.abs(ours.x - C)) < 1.0, (ours.x, ours.message)
  assert np.max(np.abs(theirs.x - C)) < 1.0
  assert ours.fun == np.float32(_far_quadratic(np.asarray(ours.x)))  # f at x, in x's dtype


def test_the_difference_divides_by_the_step_as_x_holds_it():
  """In float64 the gradient is SciPy's: (f(x + h e_i) - f(x)) / ((x_i + h) - x_i)."""
  from hdm_optax.adapters import objective  # pylint: disable=import-outside-toplevel

  numdiff = pytest.importorskip("scipy.optimize._numdiff", reason="SciPy's differences")
  x = np.array([0.3, -7.0, 2e9, 0.0])
  f = lambda x: float(np.sum(np.sin(x) + x**2))
  _, ours = objective._forward_differences(f, x, 1e-8)
  theirs = numdiff.approx_derivative(f, x, method="2-point", abs_step=1e-8)
  np.testing.assert_array_equal(ours, theirs)


def test_args_that_are_not_a_tuple_are_one_argument():
  """SciPy: ``args=a`` calls ``fun(x, a)`` (it was unpacked into ``fun(x, 3.0, 1.0)``)."""
  a = np.array([3.0, 1.0])

  def fun(x, a, weight=0.0):
    return float(np.sum((x - a) ** 2) + weight * np.sum(x**2))

  res = _minimize(fun, np.zeros(2), args=a, jac="2-point")
  np.testing.assert_allclose(res.x, [3.0, 1.0], atol=1e-5)


def test_maxfun_caps_the_calls_of_fun_with_forward_differences():
  calls = []

  def fun(x):
    calls.append(1)
    return _far_quadratic(x)

  res = _minimize(fun, np.zeros(5), options={"maxfun": 20})
  assert res.nfev <= 20 and len(calls) <= 21, (res.nfev, len(calls))  # + the traceability try
  assert res.status == hdm_optax.Status.MAX_STEPS and not res.success


class _Mine(Exception):
  pass


def test_fun_s_own_exception_reaches_the_caller_after_another_objective_ran():
  """The method's program serves every objective of its shapes; once it has run (JAX then
  calls it on its C++ dispatch, where XLA's error is another type), an exception of fun's is
  still the user's own, not XLA's error that quotes it."""
  jac = lambda x: 2 * (x - 1.0)
  good = lambda x: float(np.sum((x - 1.0) ** 2))

  def bad(x):
    if x[0] > 0.5:
      raise _Mine("fun failed on purpose")
    return good(x)

  for fun in (good, good, bad, bad):
    try:
      assert _minimize(fun, np.zeros(2), jac=jac).success
    except _Mine:
      assert fun is bad
    else:
      assert fun is good


@pytest.mark.skipif(jax.config.jax_enable_x64 is False, reason="the float64 start needs x64")
def test_scipy_s_float64_steps_are_kept():
  """Where eps moves x (float64), the step is eps, as SciPy's: the same first calls."""
  seen = {"ours": [], "scipy": []}

  def logged(name):
    def fun(x):
      seen[name].append(np.array(x, np.float64))
      return _far_quadratic(x)

    return fun

  _minimize(logged("ours"), np.full(5, 0.5), options={"maxiter": 1})
  scipy.optimize.minimize(
    logged("scipy"), np.full(5, 0.5), method="L-BFGS-B", options={"maxiter": 1}
  )
  ours = [x for x in seen["ours"] if x.shape == (5,)][-6:]  # the start's value and its 5 steps
  np.testing.assert_array_equal(
    np.stack(ours[1:]) - ours[0], np.stack(seen["scipy"][1:6]) - seen["scipy"][0]
  )


def test_the_differences_stay_in_the_box_as_scipy_s_do():
  """A step that would leave the box is turned as SciPy's approx_derivative turns it (back,
  or to the farther bound), so fun is read only inside; f = (x - 2)^2 + (1 - x)^1.5 is NaN
  beyond its bound x <= 1, where the minimum lies."""
  numdiff = pytest.importorskip("scipy.optimize._numdiff", reason="SciPy's differences")
  from hdm_optax.adapters import objective  # pylint: disable=import-outside-toplevel

  f = lambda x: float(np.sum(np.sin(x) * x))
  x = np.array([1.0, 0.0, -1.0, 0.5, 0.25])
  lower = np.array([-5.0, -5.0, -1.0, 0.5 - 1e-9, -np.inf])
  upper = np.array([1.0, 5.0, 5.0, 0.5 + 1e-9, np.inf])
  _, ours = objective._forward_differences(f, x, 1e-8, (lower, upper))
  theirs = numdiff.approx_derivative(f, x, method="2-point", abs_step=1e-8, bounds=(lower, upper))
  np.testing.assert_array_equal(ours, theirs)

  def edge(x):
    with np.errstate(invalid="ignore"):
      return float(np.sum((x - 2.0) ** 2 + (1.0 - x) ** 1.5))

  bounds = [(None, 1.0)] * 3
  ours = _minimize(edge, np.zeros(3), bounds=bounds)
  theirs = scipy.optimize.minimize(edge, np.zeros(3), method="L-BFGS-B", bounds=bounds)
  np.testing.assert_array_equal(ours.x, [1.0, 1.0, 1.0])
  assert ours.success and ours.fun == edge(ours.x) and ours.nfev <= 2 * theirs.nfev


def test_the_differences_take_a_box_shaped_like_a_two_dimensional_x0():
  """Bounds shaped like an x0 of two axes reach the differences flat, as x does."""
  lower, upper = np.zeros((2, 3)), np.ones((2, 3))
  res = _minimize(lambda x: float(np.sum((x - 2.0) ** 2)), np.zeros((2, 3)), bounds=(lower, upper))
  np.testing.assert_array_equal(res.x, upper)
  assert res.success


def _forgot_return(x):
  float(np.sum((np.asarray(x) - 1.0) ** 2))  # the value is computed, not returned


@pytest.mark.parametrize("jac", [None, "given"])
def test_a_fun_that_returns_none_is_named_not_read_as_nan(jac):
  """A NumPy fun without its return statement returns None; it was read as NaN and reported
  as "f is not finite at x0". SciPy raises a TypeError, and so does minimize, naming it."""
  jac = None if jac is None else (lambda x: 2 * (x - 1.0))
  with pytest.raises(TypeError, match=r"fun returned None, not a number.*return statement"):
    _minimize(_forgot_return, np.zeros(3), jac=jac)


def test_a_fun_that_returns_none_only_past_x0_stops_the_run_with_the_reason():
  """Where fun returns None only in part of the domain, the run does not go on reading NaN
  there (it ran to max_steps): the first None raises."""

  def fun(x):
    if x[0] < 0.5:
      return float(np.sum((x - 1.0) ** 2))
    return _forgot_return(x)

  with pytest.raises(TypeError, match=r"fun returned None"):
    _minimize(fun, np.zeros(3), jac=lambda x: 2 * (x - 1.0))


def _rescales_its_argument(x):
  """A NumPy objective that works in place on its argument (allowed: docs/scipy.md)."""
  x *= 0.5  # its own variables are x / 2
  return float(np.sum((x - 1.0) ** 2))


@pytest.mark.parametrize("jac", [None, "given"])
def test_a_fun_that_writes_into_its_argument_leaves_jac_and_the_differences_their_x(jac):
  """fun got the same copy of x that jac (or the forward differences' base point) then
  read: its write moved their x, and the run ended at maxfun far from the minimum. Each
  call now gets its own copy, as SciPy's do: the run is the one of a fun that copies."""
  grad = None if jac is None else (lambda x: 0.5 * (x - 2.0))
  copying = lambda x: _rescales_its_argument(np.array(x))
  ref = _minimize(copying, np.zeros(3), jac=grad)
  res = _minimize(_rescales_its_argument, np.zeros(3), jac=grad)
  assert res.success and (res.nfev, res.nit) == (ref.nfev, ref.nit)
  np.testing.assert_array_equal(res.x, ref.x)
  np.testing.assert_allclose(res.x, 2.0, atol=1e-3)


def _complex_past_x0(x):
  """A quadratic whose value turns complex once x[0] passes 0.5 (a complex root, say)."""
  value = float(np.sum((x - 1.0) ** 2))
  return value if x[0] < 0.5 else complex(value, 1.0)


@pytest.mark.parametrize("jac", [None, "given"])
def test_a_complex_value_of_a_numpy_fun_is_refused_not_cut_to_its_real_part(jac):
  """Casting fun's complex value to x's dtype dropped its imaginary part: the run converged
  on the real part without a word. SciPy refuses a complex value, and so does minimize,
  naming it (the traced path already did)."""
  jac = None if jac is None else (lambda x: 2 * (x - 1.0))
  with pytest.raises(TypeError, match=r"fun returned a complex value .*real part \(np.real\)"):
    _minimize(_complex_past_x0, np.zeros(3), jac=jac)


def test_a_complex_gradient_is_refused_not_cut_to_its_real_part():
  jac = lambda x: 2 * (x - 1.0) + (1j if x[0] >= 0.5 else 0)
  fun = lambda x: float(np.sum((x - 1.0) ** 2))
  with pytest.raises(TypeError, match=r"the gradient .* is a complex value"):
    _minimize(fun, np.zeros(3), jac=jac)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_fun_that_turns_non_finite_for_good_stalls_with_that_reason(bad):
  """fun returns NaN (or inf) from its third call on: every trial is non-finite and
  rejected, and the run ends at maxiter at the last finite point. The message said the
  steps were below the rounding of x (advising to scale f); it names the non-finite trials."""
  calls = []

  def fun(x):
    calls.append(1)
    return float(np.sum((x - 1.0) ** 2)) if len(calls) < 3 else bad

  res = _minimize(fun, np.zeros(3), jac=lambda x: 2 * (x - 1.0), options={"maxiter": 300})
  nulls = int(res.null_run)
  assert res.status == hdm_optax.Status.MAX_STEPS and nulls >= 290  # one early step or two
  assert f"{nulls} of the {nulls} trials since the last accepted update met a non-finite f" in (
    res.message
  )
  assert "rounding" not in res.message
  assert np.isfinite(res.fun)


@pytest.mark.parametrize("value", [{"f": 1.0}, "3.0"], ids=["dict", "str"])
def test_a_fun_that_returns_no_number_is_named(value):
  with pytest.raises(TypeError, match=r"fun returned a value of dtype \S+, not a number"):
    _minimize(lambda x: value if float(np.sum(x)) >= 0 else 0.0, np.zeros(3))


def test_differences_asked_for_by_jac_2_point_are_not_warned_about():
  """The note on forward differences is for ``jac=None``, where the caller did not choose
  them; ``jac="2-point"`` asks for them, as in SciPy, which says nothing."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    res = hdm_optax.minimize(_far_quadratic, np.zeros(5), jac="2-point")
  np.testing.assert_allclose(res.x, C, atol=1e-3)
  with pytest.warns(UserWarning, match="forward difference"):
    hdm_optax.minimize(_far_quadratic, np.zeros(5))
