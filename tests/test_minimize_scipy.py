"""hdm_optax.minimize as SciPy's minimize(method="L-BFGS-B"): signature, jac, options,
callback, the result's fields, x0 as SciPy reads it, bounds (NaN, pytrees, models)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hdm_optax

scipy_optimize = pytest.importorskip("scipy.optimize")

TARGET = np.array([2.0, -1.0, 0.5])


def quadratic(x, t):
  return jnp.sum((x - t) ** 2) + 0.1 * jnp.sum(x**4)


def quadratic_and_grad(x, t):
  return quadratic(x, t), jax.grad(quadratic)(x, t)


def quadratic_grad(x, t):
  return jax.grad(quadratic)(x, t)


def numpy_quadratic(x, t):
  x = np.asarray(x)  # NumPy code: JAX cannot trace it, so it runs on the host
  return float(np.sum((x - t) ** 2) + 0.1 * np.sum(x**4))


def numpy_grad(x, t):
  return 2 * (x - t) + 0.4 * x**3


def test_positional_signature_and_scipy_fields():
  """minimize(fun, x0, args, method, jac, hess, hessp, bounds) as SciPy's, with its result."""
  bounds = [(0, 1), (0, None), (None, None)]
  ours = hdm_optax.minimize(
    quadratic, [0.0, 0.0, 0.0], (TARGET,), "L-BFGS-B", None, None, None, bounds
  )
  ref = scipy_optimize.minimize(
    numpy_quadratic, np.zeros(3), (TARGET,), "L-BFGS-B", numpy_grad, None, None, bounds
  )
  np.testing.assert_allclose(ours.x, ref.x, atol=1e-5)
  assert isinstance(ours.x, np.ndarray) and isinstance(ours.fun, float)
  assert ours.success is True and isinstance(ours.nit, int)
  assert ours.nfev == int(ours.num_value_evals) and ours.njev == int(ours.num_grad_evals)
  assert ours.fun == pytest.approx(float(quadratic(jnp.asarray(ours.x), TARGET)))
  np.testing.assert_allclose(ours.jac, numpy_grad(ours.x, TARGET), atol=1e-12)
  assert ours["x"] is ours.x and "nfev" in ours.keys()
  assert hdm_optax.Status(ours.status) in (
    hdm_optax.Status.CONVERGED_IN_BOX,
    hdm_optax.Status.CONVERGED_FTOL,
  )


def test_the_result_reads_and_prints_as_scipys():
  """``"x" in res``, ``items``, ``get`` and ``dict(res)`` as for SciPy's result (a dict), and
  ``print(res)`` a few lines, SciPy's fields first, arrays summarised, also inside ``jit``."""
  fun = lambda x: (float(np.sum((x - 1.0) ** 2)), 2 * (x - 1.0))
  res = hdm_optax.minimize(fun, np.zeros(300), jac=True)
  assert "x" in res and "nfev" in res and "hess_inv" in res and 1.0 not in res
  assert dict(res)["nit"] == res.nit == res.get("nit") and res.get("x_opt", 7) == 7
  assert [name for name, _ in res.items()] == list(res.keys())
  text = repr(res)
  assert len(text.splitlines()) <= 14 and len(text) < 1200, text
  assert text.startswith("message: converged") and "state" in text.splitlines()[-1]
  assert "    x: [1., 1., 1., ..., 1., 1., 1.]" in text, text
  seen = []
  jax.jit(lambda x0: seen.append(repr(hdm_optax.minimize(lambda x: jnp.sum(x**2), x0))))(
    jnp.ones(3)
  )
  assert "message: (known outside jit)" in seen[0]


def test_the_result_s_keys_are_its_attributes():
  """Every SciPy attribute of L-BFGS-B's result is a key, as on SciPy's ``OptimizeResult`` (a
  dict): ``message`` and ``hess_inv`` too, in ``keys``, ``items``, ``get``, ``in`` and
  ``dict(res)``; ``hess_inv`` is computed when read, not when the keys are listed."""
  rosen, rosen_der = scipy_optimize.rosen, scipy_optimize.rosen_der
  x0 = np.array([-1.2, 1.0, 0.5])
  ours = hdm_optax.minimize(rosen, x0, method="L-BFGS-B", jac=rosen_der)
  theirs = scipy_optimize.minimize(rosen, x0, method="L-BFGS-B", jac=rosen_der)
  assert set(theirs.keys()) <= set(ours.keys()), set(theirs.keys()) - set(ours.keys())
  for name in theirs.keys():
    assert name in ours and ours.get(name) is not None, name
  assert ours.get("message") == ours["message"] == ours.message
  mapping = dict(ours)
  assert set(mapping) == set(ours.keys()) and mapping["message"] == ours.message
  assert isinstance(mapping["hess_inv"], scipy_optimize.LbfgsInvHessProduct)
  np.testing.assert_allclose(mapping["hess_inv"].todense(), ours.hess_inv.todense())
  assert [name for name, _ in ours.items()] == list(ours.keys())
  assert ours.get("not_a_field", 7) == 7 and "not_a_field" not in ours
  built = []
  original = hdm_optax.adapters.scipy_api._inverse_hessian
  try:
    hdm_optax.adapters.scipy_api._inverse_hessian = lambda *a: built.append(1) or original(*a)
    assert "hess_inv" in ours and "hess_inv" in ours.keys() and not built  # lazy
    ours.get("hess_inv")
    assert built == [1]
  finally:
    hdm_optax.adapters.scipy_api._inverse_hessian = original
  seen = []

  def inside(x0):
    res = hdm_optax.minimize(lambda x: jnp.sum((x - 1.0) ** 2), x0)
    seen.append(dict(res))  # inside jit: the keys that have a value there
    return res.x

  jax.jit(inside)(jnp.zeros(3))
  assert seen[0]["hess_inv"] is None and "message" not in seen[0]


def test_hess_inv_is_l_bfgs_b_s_operator_on_the_method_s_pairs():
  """``res.hess_inv`` is SciPy's ``LbfgsInvHessProduct`` of the run's secant pairs, the
  newest applied last: it satisfies the newest pair's secant equation H y = s (pairs taken
  in another order would not), and is ``None`` for a pytree x0."""
  a = np.random.default_rng(0).normal(size=(20, 5))
  q = a.T @ a
  fun = lambda x: (0.5 * x @ q @ x - np.sum(x), q @ x - 1.0)
  res = hdm_optax.minimize(fun, np.zeros(5), jac=True, options=dict(maxcor=3))
  h = res.hess_inv
  assert isinstance(h, scipy_optimize.LbfgsInvHessProduct) and h.shape == (5, 5)
  assert h.n_corrs == 3 and res.nit > 3  # a full memory, wrapped around
  memory = res.state.direction.memory
  newest = (int(memory.head) - 1) % 3
  s_new, y_new = np.asarray(memory.s[0][newest]), np.asarray(memory.y[0][newest])
  scale = np.linalg.norm(h.todense(), 2) * np.linalg.norm(y_new)
  np.testing.assert_allclose(h.matvec(y_new), s_new, atol=100 * np.finfo(float).eps * scale)
  np.testing.assert_allclose(h.todense(), h.todense().T, atol=100 * np.finfo(float).eps * scale)
  pytree = hdm_optax.minimize(lambda p: jnp.sum((p["a"] - 1.0) ** 2), {"a": jnp.zeros(2)})
  assert pytree.hess_inv is None


@pytest.mark.parametrize("form", ["jax", "jac_true", "jac_callable", "numpy_jac", "numpy_fd"])
def test_jac_forms_agree(form):
  """jac=None (JAX's gradient), jac=True, a callable jac, NumPy code with its jac or with
  SciPy's forward differences: one answer."""
  fun, jac = {
    "jax": (quadratic, None),
    "jac_true": (quadratic_and_grad, True),
    "jac_callable": (quadratic, quadratic_grad),
    "numpy_jac": (numpy_quadratic, numpy_grad),
    "numpy_fd": (numpy_quadratic, None),
  }[form]
  res = hdm_optax.minimize(fun, np.zeros(3), args=(TARGET,), jac=jac, method="l-bfgs-b")
  ref = scipy_optimize.minimize(numpy_quadratic, np.zeros(3), args=(TARGET,), jac=numpy_grad)
  assert res.success
  np.testing.assert_allclose(res.x, ref.x, atol=1e-4 if form == "numpy_fd" else 1e-5)
  if form == "numpy_fd":  # SciPy's count: n + 1 evaluations of fun per gradient
    assert res.nfev == 4 * int(res.num_value_evals)


def test_options_and_tol():
  res = hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), options={"maxiter": 3})
  assert res.nit == 3 and res.status == hdm_optax.Status.MAX_STEPS and not res.success
  res = hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), options={"maxfun": 4})
  assert res.njev == 4 and res.status == hdm_optax.Status.MAX_STEPS
  loose = hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), tol=1e-2)
  tight = hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), tol=1e-10)
  assert loose.nit < tight.nit and tight.fun < loose.fun and float(tight.grad_norm) <= 1e-7
  assert hdm_optax.minimize(
    quadratic, np.zeros(3), args=(TARGET,), options={"maxcor": 3, "gtol": 1e-9}
  ).state.direction.memory.rho.shape == (3,)  # maxcor is the memory
  with pytest.raises(ValueError, match="maxls"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), options={"maxls": 20})
  with pytest.raises(ValueError, match="unknown options"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), options={"xtol": 1e-3})
  with pytest.raises(ValueError, match="eps"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), options={"eps": 1e-6})
  with pytest.warns(DeprecationWarning, match="disp"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), options={"disp": True})
  with pytest.raises(ValueError, match="unknown method"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), method="BFGS")


def test_ftol_stops_on_the_relative_decrease():
  """SciPy's ftol: a loose ftol stops before the gradient test, with its own status."""
  res = hdm_optax.minimize(
    quadratic, np.zeros(3), args=(TARGET,), options={"ftol": 1e-3, "gtol": 1e-12}
  )
  assert res.status == hdm_optax.Status.CONVERGED_FTOL and res.success
  assert "relative decrease" in res.message
  trace = np.asarray(res.trace.value)
  k = res.nit
  assert (trace[k - 1] - trace[k]) / max(abs(trace[k - 1]), abs(trace[k]), 1) <= 1e-3


def test_callback_both_signatures_and_stop_iteration():
  seen, legacy = [], []

  def new_style(intermediate_result):
    seen.append((np.copy(intermediate_result.x), float(intermediate_result.fun)))

  res = hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), callback=new_style)
  assert len(seen) == res.nit
  np.testing.assert_array_equal(seen[-1][0], res.x)
  assert seen[-1][1] == res.fun == pytest.approx(float(quadratic(jnp.asarray(seen[-1][0]), TARGET)))
  res = hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), callback=legacy.append)
  assert len(legacy) == res.nit and isinstance(legacy[0], np.ndarray)

  def stop(intermediate_result):
    if len(seen) >= 2:
      raise StopIteration
    seen.append(intermediate_result.x)

  seen.clear()
  res = hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), callback=stop)
  assert res.nit == 3 and res.status == hdm_optax.Status.STOPPED and not res.success


def test_a_callbacks_intermediate_result_holds_python_numbers():
  """As SciPy's (and as the result's ``fun`` and ``nit``): ``fun`` a float, the counts ints,
  so that a callback may format, compare or serialise them as it would SciPy's."""
  seen = []
  res = hdm_optax.minimize(
    quadratic,
    np.zeros(3),
    args=(TARGET,),
    callback=lambda intermediate_result: seen.append(dict(intermediate_result)),
  )
  last = seen[-1]
  assert type(last["fun"]) is float and last["fun"] == res.fun
  assert all(type(last[k]) is int for k in ("nit", "nfev", "njev")) and last["nit"] == res.nit
  assert isinstance(last["x"], np.ndarray)


def test_a_callback_that_is_not_callable_is_named():
  """As solve's: the error names ``callback`` and the value (it was inspect's "3 is not a
  callable object")."""
  with pytest.raises(TypeError, match=r"callback must be callable or None, got 3\."):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), callback=3)


def test_a_callback_may_keep_what_it_is_given():
  """A NumPy ``fun``'s run (the separate path, whose host calls hand over the program's
  buffers): the x a callback keeps without copying, and the x ``fun`` keeps, stay the
  values they were at their call."""
  kept, copies, points = [], [], []

  def fun(x):
    points.append((x, np.copy(x)))
    return float(np.sum((x - 1.0) ** 4)), 4 * (x - 1.0) ** 3

  def callback(intermediate_result):
    kept.append(intermediate_result.x)
    copies.append(np.copy(intermediate_result.x))

  res = hdm_optax.minimize(fun, np.zeros(5), jac=True, callback=callback)
  assert len(kept) == res.nit > 5 and len(points) == res.nfev
  for x, copy in zip(kept, copies):
    np.testing.assert_array_equal(x, copy)
  for x, copy in points:
    np.testing.assert_array_equal(x, copy)
  assert len({x.tobytes() for x in copies}) > 1


def test_list_x0_and_bad_bounds():
  seen = []

  def fun(x):
    value = float(np.dot(x - 1.0, x - 1.0))  # NumPy code (it needs a concrete x)
    seen.append(type(x))
    return value

  res = hdm_optax.minimize(fun, [3, 4], jac=lambda x: 2 * (x - 1.0))
  assert set(seen) == {np.ndarray} and res.x.dtype == np.float64
  np.testing.assert_allclose(res.x, [1.0, 1.0], atol=1e-6)
  with pytest.raises(ValueError, match="bounds' lower contains NaN"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), bounds=[(np.nan, 1)] * 3)
  with pytest.raises(ValueError, match="bounds' upper contains NaN"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), bounds=(0.0, jnp.full(3, jnp.nan)))
  with pytest.raises(ValueError, match="read as a pair"):
    hdm_optax.minimize(quadratic, np.zeros(3), args=(TARGET,), bounds=(np.zeros(2), None))
  mixed = {"a": jnp.zeros(3, jnp.float32), "b": jnp.zeros(2, jnp.float64)}
  with pytest.raises(TypeError, match=r"x0: all params leaves must share one dtype.*cast them"):
    hdm_optax.minimize(lambda p: jnp.sum(p["a"] ** 2) + jnp.sum(p["b"] ** 2), mixed)
  with pytest.raises(TypeError, match="x0: params must be real floating-point"):
    hdm_optax.minimize(lambda p: jnp.sum(p["a"] ** 2), {"a": jnp.zeros(3, jnp.int32)})


def test_a_numpy_scalar_x0_is_one_entry_as_a_number_is():
  """SciPy reads x0 with np.atleast_1d: a NumPy scalar (np.float32(5.0), np.int64(5)) is a
  1-d x of one entry, as 5 and 5.0 are (it stayed a 0-d x); its dtype kept, ints as floats."""
  for x0, dtype in [(np.float32(5.0), np.float32), (np.int64(5), np.float64), (5.0, np.float64)]:
    seen = []

    def fun(x):
      seen.append(np.shape(x))
      return jnp.sum((x - 3.0) ** 2)

    res = hdm_optax.minimize(fun, x0)
    assert res.x.shape == (1,) and res.x.dtype == dtype, (x0, res.x)
    assert set(seen) == {(1,)}
    np.testing.assert_allclose(res.x, [3.0], rtol=1e-6)


_CENTER = np.array([1.0, 2.0, 3.0], np.float32)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
@pytest.mark.parametrize("has_aux", [False, True])
def test_a_jax_value_that_is_not_floating_is_refused_not_converged_at_x0(dtype, has_aux):
  """An integer (or bool) value of a JAX fun was cast to x0's dtype inside the differentiated
  function: its gradient read zero, and the run reported success at x0 (the minimiser is
  _CENTER). The value's dtype is refused by name; solve refuses it with the same words."""
  value = lambda x: jnp.sum((x - _CENTER) ** 2).astype(dtype)
  fun = (lambda x: (value(x), x)) if has_aux else value
  message = rf"fun's value has dtype {jnp.dtype(dtype)}, which has no gradient.*floating value"
  with pytest.raises(TypeError, match=message):
    hdm_optax.minimize(fun, np.zeros(3, np.float32), has_aux=has_aux)
  with pytest.raises(TypeError, match=message):
    hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(3), has_aux=has_aux)


@pytest.mark.parametrize("form", ["numpy", "jax"])
def test_a_pair_returned_without_jac_or_has_aux_names_both(form):
  """``fun`` returning ``(f, aux)`` or ``(f, grad)`` with neither flag read as a value of
  shape (2,); the message says what to pass."""
  if form == "numpy":
    fun = lambda x: (float(np.sum((np.asarray(x) - 1.0) ** 2)), 2 * (np.asarray(x) - 1.0))
  else:
    fun = lambda x: (jnp.sum((x - 1.0) ** 2), 1.0)
  message = r"fun returned a tuple of length 2, not a scalar: .*pass jac=True.*pass has_aux=True"
  with pytest.raises(TypeError, match=message), warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the forward differences' note
    hdm_optax.minimize(fun, np.zeros(3, np.float32))


@pytest.mark.parametrize("form", ["numpy", "jax"])
def test_a_gradient_or_value_of_the_wrong_shape_is_named(form):
  """A ``fun`` whose gradient has the wrong number of entries, or whose value is not a
  scalar, gets an error that names the gradient and both shapes, on the host (NumPy ``fun``)
  as when traced."""
  xp = np if form == "numpy" else jnp
  short = lambda x: (
    float(np.sum(np.asarray(x) ** 2)) if form == "numpy" else xp.sum(x**2),
    2 * x[:-1],
  )
  wide = lambda x: (
    xp.stack([xp.sum(x**2)] * 3) if form == "jax" else np.full(3, np.sum(x**2)),
    2 * x,
  )
  with pytest.raises(ValueError, match=r"the gradient .* has shape \(3,\) for x of shape \(4,\)"):
    hdm_optax.minimize(short, np.ones(4), jac=True)
  with pytest.raises(ValueError, match=r"fun must return a scalar .* got shape \(3,\)"):
    hdm_optax.minimize(wide, np.ones(4), jac=True)


def test_a_vector_value_is_named_for_a_two_dimensional_x0():
  """A host ``fun`` that returns a vector (``rosen`` of a 2-D x0 sums over the first axis) gets
  the message a 1-D x0 gets, also on the forward-difference path (``jac=None``)."""
  x0 = np.array([[-1.2, 1.0], [0.5, 0.5]])
  message = r"fun must return a scalar .* got shape \(2,\)"
  with pytest.raises(ValueError, match=message), pytest.warns(UserWarning, match="cannot trace"):
    hdm_optax.minimize(scipy_optimize.rosen, x0)
  with pytest.raises(ValueError, match=message), pytest.warns(UserWarning, match="cannot trace"):
    hdm_optax.minimize(lambda x: np.asarray(x) ** 2, np.array([1.0, 2.0]))


def test_scipy_bounds_broadcast_as_scipy_broadcasts_them():
  """``Bounds(0, 1)`` (one entry a side) bounds every entry, as in SciPy; a side that does
  not broadcast to x0 is refused with SciPy's words."""
  fun = lambda x: (np.sum((x - 2.0) ** 2), 2 * (x - 2.0))
  for bounds in (scipy_optimize.Bounds(0, 1), scipy_optimize.Bounds([0.0], [1.0])):
    ours = hdm_optax.minimize(fun, np.full(5, 0.5), jac=True, bounds=bounds)
    theirs = scipy_optimize.minimize(fun, np.full(5, 0.5), jac=True, bounds=bounds)
    np.testing.assert_allclose(ours.x, theirs.x, atol=1e-8)
    np.testing.assert_array_equal(ours.x, np.ones(5))
  with pytest.raises(ValueError, match=r"of shape \(2,\) for x0 of shape \(5,\).*not compatible"):
    hdm_optax.minimize(fun, np.zeros(5), jac=True, bounds=scipy_optimize.Bounds([0, 0], [1, 1]))


@pytest.mark.parametrize("n", [3, 2])
def test_bounds_as_scipy_reads_a_sequence_of_pairs(n):
  """What SciPy reads as n (min, max) pairs (``zip(*bounds)``): an (n, 2) NumPy array such as
  ``np.column_stack([lo, hi])`` (for n = 2 too: its rows are the pairs), a list of 1-D arrays
  of two entries, an iterator such as ``zip(lo, hi)`` (read once), entries of one entry, and an
  object array with None; each gives SciPy's answer."""
  fun = lambda x: (np.sum((x - np.arange(n) + 0.5) ** 2), 2 * (x - np.arange(n) + 0.5))
  lo, hi = np.zeros(n), np.arange(1.0, n + 1) - 0.5
  forms = {
    "column_stack": lambda: np.column_stack([lo, hi]),
    "int array": lambda: np.column_stack([lo, hi + 0.5]).astype(int),
    "zip": lambda: zip(lo, hi),
    "generator": lambda: ((a, b) for a, b in zip(lo, hi)),
    "one-entry arrays": lambda: [(np.array(a), np.array([b])) for a, b in zip(lo, hi)],
    "object array": lambda: np.array([[None, b] for b in hi], dtype=object),
  }
  if n != 2:  # for n = 2 a sequence of two arrays is (lower, upper), see test_bounds.py
    forms["list of arrays"] = lambda: [np.array([a, b]) for a, b in zip(lo, hi)]
  x0 = np.full(n, 0.25)
  for name, bounds in forms.items():
    ours = hdm_optax.minimize(fun, x0, jac=True, bounds=bounds())
    theirs = scipy_optimize.minimize(fun, x0, method="L-BFGS-B", jac=True, bounds=bounds())
    np.testing.assert_allclose(ours.x, theirs.x, atol=1e-8, err_msg=name)
    assert ours.success, name
  with pytest.raises(TypeError, match=rf"got ndarray of shape \({n + 1}, 2\)"):
    hdm_optax.minimize(fun, x0, jac=True, bounds=np.zeros((n + 1, 2)))
  with pytest.raises(TypeError, match=rf"got ndarray of shape \({n}, 3\)"):
    hdm_optax.minimize(fun, x0, jac=True, bounds=np.zeros((n, 3)))
  with pytest.raises(ValueError, match="An upper bound is less than"):
    hdm_optax.minimize(fun, x0, jac=True, bounds=np.column_stack([hi, lo]))
  with pytest.raises(TypeError, match=rf"not {n} \(min, max\) pairs"):
    hdm_optax.minimize(fun, x0, jac=True, bounds=zip(lo[:1], hi[:1]))


def _pair(p):
  return jnp.sum((p[0] - 2.0) ** 2) + jnp.sum((p[1] + 2.0) ** 2)


def test_bounds_on_a_tuple_of_arrays():
  """params a tuple of arrays, bounds a pair of like tuples; a 0-d bound for a (1, 2) leaf."""
  x0 = (jnp.zeros(3), jnp.zeros((1, 2)))
  lower = (jnp.zeros(3), jnp.asarray(-1.0))
  upper = (jnp.ones(3), jnp.zeros((1, 2)))
  res = hdm_optax.minimize(_pair, x0, bounds=(lower, upper))
  assert res.success
  np.testing.assert_allclose(res.x[0], 1.0)
  np.testing.assert_allclose(res.x[1], -1.0)
  assert res.x[1].shape == (1, 2)


def test_bounds_on_an_equinox_model():
  """eqx.partition's params (None leaves) and bounds of the same structure, in trial_lbfgs
  and minimize."""
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  lower = jax.tree.map(lambda a: jnp.full_like(a, -0.1), params)
  upper = jax.tree.map(lambda a: jnp.full_like(a, 0.1), params)
  x = jnp.arange(3.0)

  def loss(p):
    m = eqx.combine(p, static)
    return jnp.sum((m(x) - 5.0) ** 2)

  res = hdm_optax.solve(
    hdm_optax.trial_lbfgs(lower=lower, upper=upper), loss, params, max_steps=200, tol=1e-8
  )
  assert bool(res.converged)
  assert float(jnp.max(jnp.abs(res.params.weight))) <= 0.1
  other = hdm_optax.minimize(loss, params, bounds=(lower, upper))
  np.testing.assert_allclose(other.x.weight, res.params.weight, atol=1e-6)
