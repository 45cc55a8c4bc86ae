"""Arrays an objective closes over are read at each call (driver/closure.py).

``solve``, ``minimize`` and ``sweep`` compile one program per configuration; the arrays
``fun`` reads from outside its arguments (closure cells, module globals, a bound method's
object, an equinox Module, a pytree, a NumPy array changed in place) enter it as
arguments, so rebinding them to new data of the same shapes gives the new data's answer,
without a new compile.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from helpers import Compilations, settled
from hdm_optax.driver import programs
from hdm_optax.driver import protocol

X0 = jnp.zeros(3)
FIRST, SECOND = jnp.array([1.0, -2.0, 3.0]), jnp.array([-4.0, 5.0, 0.5])
SGD = optax.sgd(1.0)  # one step from X0 to the target of f(x) = ||x - c||^2 / 2


def _half_square(x, c):
  return 0.5 * jnp.sum((x - c) ** 2)


# --- the scenarios: each returns (fun, rebind); rebind(c) makes fun's target c ----------

TARGET = FIRST


def _reads_global(x):
  return _half_square(x, TARGET)


def global_case():
  def rebind(c):
    global TARGET  # pylint: disable=global-statement
    TARGET = c

  rebind(FIRST)
  return _reads_global, rebind


def cell_case():
  c = FIRST

  def fun(x):
    return _half_square(x, c)

  def rebind(new):
    nonlocal c
    c = new

  return fun, rebind


class Holder:
  def __init__(self, c):
    self.c = c

  def loss(self, x):
    return _half_square(x, self.c)


def bound_method_case():
  holder = Holder(FIRST)
  return holder.loss, lambda c: setattr(holder, "c", c)


class Model(eqx.Module):
  c: jax.Array

  def __call__(self, x):
    return _half_square(x, self.c)


def equinox_closure_case():
  model = Model(FIRST)

  def rebind(c):
    nonlocal model
    model = eqx.tree_at(lambda m: m.c, model, c)

  return (lambda x: model(x)), rebind


def pytree_case():
  """A dict of a float target and an integer permutation (not only float constants)."""
  tree = {"c": FIRST[::-1], "perm": jnp.array([2, 1, 0])}

  def rebind(c):
    tree["c"], tree["perm"] = c[jnp.array([1, 2, 0])], jnp.array([2, 0, 1])

  return (lambda x: _half_square(x, tree["c"][tree["perm"]])), rebind


def numpy_in_place_case():
  c = np.array(FIRST)
  fun = functools.partial(lambda x, c: _half_square(x, c), c=c)

  def rebind(new):
    c[:] = np.asarray(new)

  return fun, rebind


CASES = [
  global_case,
  cell_case,
  bound_method_case,
  equinox_closure_case,
  pytree_case,
  numpy_in_place_case,
]
IDS = [case.__name__.removesuffix("_case") for case in CASES]


def _sgd(learning_rate):
  return optax.sgd(learning_rate)


DRIVERS = {
  "solve": (
    lambda fun: hdm_optax.solve(SGD, fun, X0, max_steps=5).params,
    None,
  ),
  "minimize": (
    lambda fun: hdm_optax.minimize(fun, X0, max_steps=50).params,
    None,
  ),
  "sweep": (
    lambda fun: hdm_optax.sweep(
      _sgd, {"learning_rate": [1.0]}, fun, X0, max_steps=5
    ).results.params[0],
    None,
  ),
}


@pytest.mark.parametrize("driver", list(DRIVERS))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rebound_data_is_solved_without_a_new_compile(case, driver):
  run, _ = DRIVERS[driver]
  fun, rebind = case()
  np.testing.assert_allclose(settled(lambda: run(fun)), FIRST, atol=1e-5)
  before = programs.compiled_count()
  rebind(SECOND)
  np.testing.assert_allclose(run(fun), SECOND, atol=1e-5)  # main: FIRST again
  assert programs.compiled_count() == before


@jax.custom_vjp
def _shifted(x, c):
  """x - c, with a hand-written derivative (as the sparse kernels of the LIBSVM problems)."""
  return x - c


_shifted.defvjp(lambda x, c: (x - c, None), lambda _, g: (g, -g))


def test_an_objective_with_a_custom_derivative_compiles_once():
  """A custom_vjp inside f: each trace wraps its rules anew, and the program must still be
  found again (main compiled solve and sweep at every call)."""
  fun = lambda x, c: 0.5 * jnp.sum(_shifted(x, c) ** 2)
  run = lambda c: hdm_optax.solve(SGD, fun, X0, fun_args=(c,), max_steps=5).params
  np.testing.assert_allclose(settled(lambda: run(FIRST)), FIRST)
  before = programs.compiled_count()
  np.testing.assert_allclose(run(SECOND), SECOND)
  assert programs.compiled_count() == before
  grid = lambda c: hdm_optax.sweep(_sgd, {"learning_rate": [1.0]}, fun, X0, fun_args=(c,))
  np.testing.assert_allclose(grid(FIRST).results.params[0], FIRST)
  before = programs.compiled_count()
  np.testing.assert_allclose(grid(SECOND).results.params[0], SECOND)
  assert programs.compiled_count() == before


def test_an_equinox_module_is_the_objective():
  """A Module as ``fun`` (main could not hash it); a new Module of one structure reuses the
  program."""
  first = hdm_optax.solve(SGD, Model(FIRST), X0, max_steps=5)
  before = programs.compiled_count()
  second = hdm_optax.solve(SGD, Model(SECOND), X0, max_steps=5)
  np.testing.assert_allclose(first.params, FIRST)
  np.testing.assert_allclose(second.params, SECOND)
  assert programs.compiled_count() == before


SCALE = 1.0


def _scaled(x):
  return SCALE * _half_square(x, FIRST)


def test_a_changed_python_number_compiles_anew_rather_than_answering_stale():
  global SCALE  # pylint: disable=global-statement
  sgd = optax.sgd(0.5)
  run = lambda: hdm_optax.solve(sgd, _scaled, X0, max_steps=1, tol=0.0).params
  np.testing.assert_allclose(run(), 0.5 * FIRST)  # x1 = x0 - 0.5 * SCALE * (x0 - c)
  before = programs.compiled_count()
  SCALE = 2.0
  try:
    np.testing.assert_allclose(run(), FIRST)
  finally:
    SCALE = 1.0
  assert programs.compiled_count() == before + 1


def test_functions_in_fun_args_with_aux_and_pytree_params():
  """A function in ``fun_args`` (main: not a valid JAX type) whose own closure is read at
  each call; ``has_aux`` and pytree params."""
  target = {"a": FIRST, "b": SECOND[:2]}

  def loss(p):
    return _half_square(p["a"], target["a"]) + _half_square(p["b"], target["b"])

  fun = lambda p, inner: (inner(p), {"sum": jnp.sum(p["a"])})
  x0 = {"a": X0, "b": jnp.zeros(2)}
  run = lambda: hdm_optax.solve(SGD, fun, x0, max_steps=5, fun_args=(loss,), has_aux=True)
  first = run()
  target["a"] = SECOND
  second = run()
  np.testing.assert_allclose(first.params["a"], FIRST)
  np.testing.assert_allclose(second.params["a"], SECOND)
  np.testing.assert_allclose(second.aux["sum"], jnp.sum(SECOND))


def test_hoist_signature_ignores_new_constants_and_sees_literals():
  from hdm_optax.driver import programs  # pylint: disable=import-outside-toplevel

  a = jnp.ones(2)
  fun = lambda x: jnp.sum(a * x) + 1.5
  first, _ = programs.hoist(fun, jnp.ones(2), ())
  a = jnp.zeros(2)
  again, (consts,) = programs.hoist(fun, jnp.ones(2), ())
  assert again == first and hash(again) == hash(first) and consts[0] is a
  other, _ = programs.hoist(lambda x: jnp.sum(a * x) + 2.5, jnp.ones(2), ())
  assert other != first
  nan = lambda x: jnp.sum(x) * jnp.nan  # a NaN literal equals itself
  assert programs.hoist(nan, jnp.ones(2), ())[0] == programs.hoist(nan, jnp.ones(2), ())[0]


@pytest.mark.parametrize("case", [global_case, bound_method_case], ids=["global", "bound_method"])
def test_value_and_grad_from_state_reads_rebound_data(case):
  fun, rebind = case()
  opt = optax.chain(hdm_optax.hdm_best(lipschitz=1.0), optax.scale(0.5))  # cache not used
  value_and_grad = hdm_optax.value_and_grad_from_state(fun)
  state = opt.init(X0)
  np.testing.assert_allclose(value_and_grad(X0, state=state)[1], -FIRST)
  rebind(SECOND)
  with Compilations() as compiled:
    np.testing.assert_allclose(value_and_grad(X0, state=state)[1], -SECOND)  # main: -FIRST
  assert compiled.count == 0


@pytest.mark.parametrize("case", [global_case, bound_method_case], ids=["global", "bound_method"])
def test_value_and_grad_from_state_takes_no_cache_of_other_data(case):
  """Where the method's cache is at the params (HDM last) but of f on other data (rebound
  arrays, or other ``args``: another batch), f is evaluated on this call's data; the same
  data take the cache, with no call (main returned f on the previous data)."""
  fun, rebind = case()
  opt = hdm_optax.trial_lbfgs()
  value_and_grad = hdm_optax.value_and_grad_from_state(fun)
  x, state = X0, opt.init(X0)
  for _ in range(3):
    value, grad = value_and_grad(x, state=state)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    x = optax.apply_updates(x, updates)
  cached = protocol.cache_at_params(state)
  assert cached is not None and bool(jnp.isfinite(cached.value))
  value, grad = value_and_grad(x, state=state)
  assert value is cached.value or float(value) == float(cached.value)  # the same data
  rebind(SECOND)
  value, grad = value_and_grad(x, state=state)
  want_value, want_grad = jax.value_and_grad(fun)(x)
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-12)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-12)

  with_args = lambda p, target: 0.5 * jnp.sum((p - target) ** 2)
  value_and_grad = hdm_optax.value_and_grad_from_state(with_args)
  x, state = X0, opt.init(X0)
  for _ in range(3):
    value, grad = value_and_grad(x, FIRST, state=state)
    step = lambda p: with_args(p, FIRST)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=step)
    x = optax.apply_updates(x, updates)
  value, _ = value_and_grad(x, SECOND, state=state)
  np.testing.assert_allclose(float(value), float(with_args(x, SECOND)), rtol=1e-12)


def test_a_bound_method_accessed_at_each_call_reuses_the_program():
  """``holder.loss`` is a new object at each access; equal ones share the program, as
  ``jax.jit``'s static arguments do."""
  holder = Holder(FIRST)
  hdm_optax.solve(SGD, holder.loss, X0, max_steps=5)
  before = programs.compiled_count()
  holder.c = SECOND
  np.testing.assert_allclose(hdm_optax.solve(SGD, holder.loss, X0, max_steps=5).params, SECOND)
  assert programs.compiled_count() == before


RULE_SCALE = jnp.asarray(2.0)


@jax.custom_jvp
def _scaled_sin(x):
  return jnp.sin(x)


_scaled_sin.defjvps(lambda g, ans, x: RULE_SCALE * jnp.cos(x) * g)  # reads a global


@pytest.mark.parametrize(
  "fun, user",
  [
    (lambda x: jnp.sum(jnp.logaddexp(0.0, x)), False),
    (lambda x: jnp.sum(jax.nn.relu(x)) + jax.scipy.special.logsumexp(x), False),
    (lambda x: jnp.sum(optax.sigmoid_binary_cross_entropy(x, jnp.ones(2))), False),
    (lambda x: jnp.sum(_scaled_sin(x)), True),
    (lambda x: jnp.sum(_shifted(x, jnp.ones(2))), True),
  ],
  ids=["logaddexp", "relu_logsumexp", "optax_loss", "user_defjvps", "user_custom_vjp"],
)
def test_only_a_users_derivative_rule_is_traced_for_what_it_reads(fun, user):
  """JAX's and optax's own rules read nothing of the user's: the objective is traced once per
  call; a rule of the user's is traced too, for the arrays it reads."""
  jaxpr = jax.make_jaxpr(fun)(jnp.ones(2)).jaxpr
  assert programs._user_rules(jaxpr) is user  # pylint: disable=protected-access


def test_a_rule_that_reads_a_rebound_global_is_solved_anew():
  """The user's rule reads ``RULE_SCALE``: rebinding it changes the gradient, and the run."""
  global RULE_SCALE  # pylint: disable=global-statement
  fun = lambda x: jnp.sum(_scaled_sin(x))
  run = lambda: hdm_optax.solve(SGD, fun, X0, max_steps=1, tol=0.0).params
  first = run()
  RULE_SCALE = jnp.asarray(3.0)
  try:
    second = run()
  finally:
    RULE_SCALE = jnp.asarray(2.0)
  # One step of size 1 (SGD's): x - scale * cos(x).
  np.testing.assert_allclose(first, X0 - 2.0 * np.cos(X0), rtol=1e-12)
  np.testing.assert_allclose(second, X0 - 3.0 * np.cos(X0), rtol=1e-12)


def test_a_warm_minimize_traces_the_objective_once():
  """After its first calls, ``minimize`` of the same objective traces it once per call (the
  program's key); neither the traceability check nor a library rule's derivative traces it
  again."""
  traces = []
  a = jnp.linspace(-1.0, 1.0, 4)

  def fun(x):
    traces.append(1)
    return jnp.sum(jnp.logaddexp(0.0, a * x)) + 0.5 * jnp.sum(x**2)

  for _ in range(4):
    hdm_optax.minimize(fun, jnp.zeros(4), bounds=(-0.5, 0.5))
  traces.clear()
  hdm_optax.minimize(fun, jnp.zeros(4), bounds=(-0.5, 0.5))
  assert len(traces) == 1


def test_a_box_is_checked_at_every_call():
  """A box is checked against the params at every call, whatever the front door remembers of
  the optimizer's ``init`` (its shapes, for the same arguments and params' shapes)."""
  fun = lambda x: 0.5 * jnp.sum(x**2)
  solve = lambda lower: hdm_optax.solve(hdm_optax.trial_lbfgs(lower=lower), fun, jnp.ones(2))
  solve(jnp.zeros(2))
  with pytest.raises(ValueError, match="NaN"):
    solve(jnp.array([0.0, jnp.nan]))
  with pytest.raises(ValueError, match="shape"):
    solve(jnp.zeros(3))
