"""Adversarial: every driver x every way a function holds data x every kind of bounds.

The pattern (issue 45, "Done when"): call, change the data (rebind a name, edit an array in
place, reassign an attribute, build a new partial or module), call again, and check the
second answer against the right one: a closed form (the target of ``0.5 ||x - c||^2``, the
box solution ``clip(c, lower, upper)`` of a separable quadratic), SciPy's L-BFGS-B, or a
fresh Python process that runs the same problem once. The drivers: ``solve``,
``minimize``, ``sweep``, ``solve_batch`` and a user's own optax loop with
``hdm_optax.value_and_grad_from_state``.

The unbounded cases run ``optax.sgd(1.0)``, which takes x0 = 0 to the target c of
``0.5 ||x - c||^2`` in one step, so that the answer is exact and each program is cheap to
compile; ``minimize`` and the bounded cases run ``trial_lbfgs``.
"""

import functools
import gc
import hashlib
import itertools
import json
import lzma
import os
import shutil
import stat
import subprocess
import sys
import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import hdm_optax
from hdm_optax._private_dir import private_dir
from hdm_optax.driver import hooks
from helpers import ROOT
from helpers import Compilations

SGD = optax.sgd(1.0)
STEPS = 8  # max_steps of the SGD runs (one step reaches the target)
FIRST, SECOND = np.array([1.0, -2.0, 3.0]), np.array([-4.0, 5.0, 0.5])
X0 = np.zeros(3)


def _half_square(x, c):
  return 0.5 * jnp.sum((x - c) ** 2)


# --- the ways a function holds its data: each holder's fun() and args() read c -------------

TARGET = jnp.asarray(FIRST)


def _reads_global(x):
  return _half_square(x, TARGET)


class _Global:
  def set(self, c):
    global TARGET  # pylint: disable=global-statement
    TARGET = jnp.asarray(c)

  def fun(self):
    return _reads_global

  def args(self):
    return ()


class _ClosureCell:
  def __init__(self):
    c = jnp.asarray(FIRST)

    def fun(x):
      return _half_square(x, c)

    def set_(new):
      nonlocal c
      c = jnp.asarray(new)

    self._fun, self.set = fun, set_

  def fun(self):
    return self._fun

  def args(self):
    return ()


class _Problem:
  """A SciPy-style class: the objective is a bound method reading ``self.c``."""

  def __init__(self, c):
    self.c = jnp.asarray(c)

  def loss(self, x):
    return _half_square(x, self.c)


class _BoundMethod:
  def __init__(self):
    self.problem = _Problem(FIRST)

  def set(self, c):
    self.problem.c = jnp.asarray(c)  # the attribute reassigned, the object kept

  def fun(self):
    return self.problem.loss  # a new bound-method object at each access, as users write it

  def args(self):
    return ()


class _Partial:
  def __init__(self):
    self.set(FIRST)

  def set(self, c):
    self.partial = functools.partial(_half_square, c=jnp.asarray(c))

  def fun(self):
    return self.partial

  def args(self):
    return ()


class _Model(eqx.Module):
  c: jax.Array

  def __call__(self, x):
    return _half_square(x, self.c)


class _Equinox:
  def __init__(self):
    self.set(FIRST)

  def set(self, c):
    self.model = _Model(jnp.asarray(c))

  def fun(self):
    return self.model

  def args(self):
    return ()


JVP_TARGET = jnp.asarray(FIRST)


@jax.custom_jvp
def _jvp_distance(x):
  return _half_square(x, JVP_TARGET)


@_jvp_distance.defjvp
def _jvp_distance_rule(primals, tangents):
  (x,), (dx,) = primals, tangents
  return _jvp_distance(x), jnp.sum((x - JVP_TARGET) * dx)


class _CustomJvpGlobal:
  def set(self, c):
    global JVP_TARGET  # pylint: disable=global-statement
    JVP_TARGET = jnp.asarray(c)

  def fun(self):
    return _jvp_distance

  def args(self):
    return ()


def _own_rule(target):
  @jax.custom_vjp
  def distance(x):
    return _half_square(x, target)

  distance.defvjp(lambda x: (distance(x), x), lambda x, ct: (ct * (x - target),))
  return distance


RULE = _own_rule(jnp.asarray(FIRST))


def _calls_rule(x):
  return RULE(x)


class _ReboundRule:
  def set(self, c):
    global RULE  # pylint: disable=global-statement
    RULE = _own_rule(jnp.asarray(c))  # the same name bound to a new rule

  def fun(self):
    return _calls_rule

  def args(self):
    return ()


class _NumpyInPlace:
  def __init__(self):
    self.c = np.array(FIRST)
    self._fun = lambda x: _half_square(x, self.c)

  def set(self, c):
    self.c[:] = c  # the same array, edited

  def fun(self):
    return self._fun

  def args(self):
    return ()


class _FunArgs:
  def __init__(self):
    self.set(FIRST)

  def set(self, c):
    self.c = jnp.asarray(c)

  def fun(self):
    return _half_square

  def args(self):
    return (self.c,)


HOLDERS = {
  "global": _Global,
  "closure_cell": _ClosureCell,
  "bound_method": _BoundMethod,
  "partial": _Partial,
  "equinox": _Equinox,
  "custom_jvp_global": _CustomJvpGlobal,
  "rebound_custom_vjp": _ReboundRule,
  "numpy_in_place": _NumpyInPlace,
  "fun_args": _FunArgs,
}


# --- the drivers: each returns the params it reached (one problem) --------------------------


def _solve(fun, args):
  return hdm_optax.solve(SGD, fun, jnp.zeros(3), fun_args=args, max_steps=STEPS).params


def _minimize(fun, args):
  return hdm_optax.minimize(fun, X0, args=args, tol=1e-10).x


def _sweep(fun, args):
  out = hdm_optax.sweep(
    optax.sgd, {"learning_rate": [1.0]}, fun, jnp.zeros(3), fun_args=args, max_steps=STEPS
  )
  return out.results.params[0]


def _solve_batch(fun, args):
  out = hdm_optax.solve_batch(
    SGD, fun, jnp.zeros((2, 3)), fun_args=args, in_axes=(0, None), compact=False, max_steps=STEPS
  )
  np.testing.assert_array_equal(out.params[0], out.params[1])
  return out.params[0]


def _own_loop(fun, args, value_and_grad=None):
  """The user's optax loop: f and grad f from ``value_and_grad_from_state``, two updates."""
  value_and_grad = value_and_grad or hdm_optax.value_and_grad_from_state(fun)
  x, state = jnp.zeros(3), SGD.init(jnp.zeros(3))
  for _ in range(2):
    _, grad = value_and_grad(x, *args, state=state)
    updates, state = SGD.update(grad, state, x)
    x = optax.apply_updates(x, updates)
  return x


DRIVERS = {
  "solve": _solve,
  "minimize": _minimize,
  "sweep": _sweep,
  "solve_batch": _solve_batch,
  "own_loop": _own_loop,
}


@pytest.mark.parametrize("driver", list(DRIVERS))
@pytest.mark.parametrize("holder", list(HOLDERS))
def test_a_second_call_answers_for_the_changed_data(holder, driver):
  """Call, change the data the way the holder holds it, call again: the target each time."""
  data, run = HOLDERS[holder](), DRIVERS[driver]
  data.set(FIRST)
  if driver == "own_loop" and holder not in ("partial", "equinox"):
    # the loop's value_and_grad is built once, outside the loop, as its docstring says
    made = hdm_optax.value_and_grad_from_state(data.fun())
    run = functools.partial(_own_loop, value_and_grad=made)
  np.testing.assert_allclose(run(data.fun(), data.args()), FIRST, atol=1e-6)
  data.set(SECOND)
  np.testing.assert_allclose(run(data.fun(), data.args()), SECOND, atol=1e-6)


# --- bounds: a separable quadratic, whose box solution is clip(c, lower, upper) -------------

CURVATURE = np.array([1.0, 10.0, 100.0])
CENTER = jnp.asarray(FIRST)


def _separable(x):
  return 0.5 * jnp.sum(CURVATURE * (x - CENTER) ** 2)


def _set_center(c):
  global CENTER  # pylint: disable=global-statement
  CENTER = jnp.asarray(c)


TRIAL_STEPS = 200
PRECISE = {"gtol": 1e-9, "ftol": 0.0}  # minimize's options: stop on the projected gradient


def _bounded_solve(lower, upper):
  opt = hdm_optax.trial_lbfgs(lower=lower, upper=upper)
  return hdm_optax.solve(opt, _separable, jnp.zeros(3), max_steps=TRIAL_STEPS, tol=1e-9).params


BOUND_KINDS = {
  # name: (lower, upper, (numpy lower, numpy upper) of the same box)
  "none": (None, None, (-np.inf, np.inf)),
  "scalar": (-1.0, 2.0, (-1.0, 2.0)),
  "jnp_array": (jnp.array([-1.0, 0.0, 0.0]), jnp.array([2.0, 1.0, jnp.inf]), None),
  "numpy_array": (np.array([-1.0, 0.0, 0.0]), np.array([2.0, 1.0, np.inf]), None),
  "open_side": (None, np.array([0.5, np.inf, 1.0]), None),
}


def _box(kind):
  lower, upper, numbers = BOUND_KINDS[kind]
  if numbers is not None:
    return lower, upper, np.broadcast_to(numbers[0], 3), np.broadcast_to(numbers[1], 3)
  lo = np.full(3, -np.inf) if lower is None else np.asarray(lower)
  return lower, upper, lo, np.asarray(upper)


@pytest.mark.parametrize("kind", list(BOUND_KINDS))
def test_bounded_solve_and_minimize_read_the_data_at_each_call(kind):
  """solve(trial_lbfgs(lower, upper)) and minimize(bounds=...) with the center rebound
  between calls: clip(c, lower, upper) each time."""
  lower, upper, lo, hi = _box(kind)
  for c in (FIRST, SECOND):
    _set_center(c)
    np.testing.assert_allclose(_bounded_solve(lower, upper), np.clip(c, lo, hi), atol=1e-6)
    res = hdm_optax.minimize(_separable, X0, bounds=(lower, upper), options=PRECISE)
    np.testing.assert_allclose(res.x, np.clip(c, lo, hi), atol=1e-6)


def _pytree_fun(params):
  w, b = params["w"], params["b"]
  return 0.5 * jnp.sum(CURVATURE[:2] * (w - CENTER[:2]) ** 2) + 0.5 * (b - CENTER[2]) ** 2


def test_pytree_bounds_with_a_numpy_leaf_edited_in_place():
  """Bounds as a pytree shaped like dict params (a NumPy leaf, a number, None): editing the
  NumPy leaf in place moves the box at the next call of the same transformation."""
  _set_center(SECOND)  # w's target (-4, 5), b's 0.5
  upper_w = np.array([0.0, 1.0])
  opt = hdm_optax.trial_lbfgs(lower={"w": -1.0, "b": 0.0}, upper={"w": upper_w, "b": None})
  x0 = {"w": jnp.zeros(2), "b": jnp.zeros(())}
  for top in (1.0, 3.0):
    upper_w[1] = top
    res = hdm_optax.solve(opt, _pytree_fun, x0, max_steps=TRIAL_STEPS, tol=1e-9)
    np.testing.assert_allclose(res.params["w"], [-1.0, top], atol=1e-6)
    np.testing.assert_allclose(res.params["b"], 0.5, atol=1e-6)


@pytest.mark.parametrize("form", ["scipy_bounds", "pairs", "tuple_with_none"])
def test_minimize_takes_scipys_bound_forms_and_reads_them_at_each_call(form):
  """SciPy's bound forms, each edited (or rebuilt) between calls, against L-BFGS-B."""
  lo, hi = np.array([-1.0, 0.0, -np.inf]), np.array([2.0, 1.0, 0.0])
  for c in (FIRST, SECOND):
    _set_center(c)
    if form == "scipy_bounds":
      bounds = scipy.optimize.Bounds(lo, hi)
    elif form == "pairs":
      bounds = [(None if np.isinf(a) else a, None if np.isinf(b) else b) for a, b in zip(lo, hi)]
    else:
      bounds = (None, hi)
    res = hdm_optax.minimize(_separable, X0, bounds=bounds, options=PRECISE)
    fun_np = lambda x: (float(_separable(x)), np.asarray(jax.grad(_separable)(x)))
    box = scipy.optimize.Bounds(-np.inf, hi) if form == "tuple_with_none" else bounds
    ref = scipy.optimize.minimize(
      fun_np, X0, jac=True, method="L-BFGS-B", bounds=box, options={"gtol": 1e-10}
    )
    np.testing.assert_allclose(res.x, ref.x, atol=1e-5)
    lo[0] -= 1.0  # edited in place (the SciPy Bounds object holds the arrays as given)


def _bounded_sweep(opt, make):
  del opt
  out = hdm_optax.sweep(make, [{}], _separable, jnp.zeros(3), max_steps=TRIAL_STEPS, tol=1e-9)
  return out.results.params[0]


def _bounded_batch(opt, make):
  del make
  out = hdm_optax.solve_batch(
    opt, _separable, jnp.zeros((2, 3)), in_axes=(0, None), max_steps=TRIAL_STEPS, tol=1e-9
  )
  return out.params[1]


def _bounded_own_loop(opt, make):
  """The user's loop: init (which reads the box), then jitted updates (the box in the state)."""
  del make
  value_and_grad = hdm_optax.value_and_grad_from_state(_separable)
  update = jax.jit(opt.update, static_argnames="value_fn")
  x = jnp.zeros(3)
  state = opt.init(x)
  for _ in range(30):
    value, grad = value_and_grad(x, state=state)
    updates, state = update(grad, state, x, value=value, grad=grad, value_fn=_separable)
    x = optax.apply_updates(x, updates)
  return x


BOUNDED_DRIVERS = {
  "solve": lambda opt, make: (
    hdm_optax.solve(opt, _separable, jnp.zeros(3), max_steps=TRIAL_STEPS, tol=1e-9).params
  ),
  "sweep": _bounded_sweep,
  "solve_batch": _bounded_batch,
  "own_loop": _bounded_own_loop,
}


@pytest.mark.parametrize("driver", list(BOUNDED_DRIVERS))
def test_a_numpy_bound_edited_in_place_moves_the_box_in_every_driver(driver):
  """The optimizer's NumPy upper bound edited in place between two calls (the same
  transformation object): the second call's box is the edited one."""
  _set_center(np.array([5.0, 5.0, 5.0]))
  upper = np.array([1.0, 2.0, 3.0])
  opt = hdm_optax.trial_lbfgs(lower=0.0, upper=upper)
  make = lambda: opt  # sweep's make_optimizer: one object for both calls
  run = BOUNDED_DRIVERS[driver]
  np.testing.assert_allclose(run(opt, make), [1.0, 2.0, 3.0], atol=1e-6)
  upper[:] = [4.0, 0.5, 6.0]
  np.testing.assert_allclose(run(opt, make), [4.0, 0.5, 5.0], atol=1e-6)


# --- random data and boxes (hypothesis): one program each, every example the closed form ----

_ENTRY = st.floats(-5.0, 5.0, allow_nan=False, width=64)
_BOX_ROW = st.tuples(_ENTRY, _ENTRY, _ENTRY)  # two ends of the box (either order), a center
SOLVE_LOWER, SOLVE_UPPER = np.full(3, -1.0), np.full(3, 1.0)
SOLVE_BOXED = hdm_optax.trial_lbfgs(lower=SOLVE_LOWER, upper=SOLVE_UPPER)


@settings(max_examples=6, deadline=None)
@given(rows=st.lists(_BOX_ROW, min_size=3, max_size=3))
def test_random_center_and_box_edited_in_place_give_the_clipped_center(rows):
  """Each example edits the box's NumPy arrays in place and rebinds the center: solve and
  minimize (bounds from the same arrays) answer clip(c, lower, upper)."""
  a, b, c = (np.array(column) for column in zip(*rows))
  lo, hi = np.minimum(a, b), np.maximum(a, b) + 1e-3
  SOLVE_LOWER[:], SOLVE_UPPER[:] = lo, hi
  _set_center(c)
  expected = np.clip(c, lo, hi)
  got = hdm_optax.solve(SOLVE_BOXED, _separable, jnp.zeros(3), max_steps=TRIAL_STEPS, tol=1e-9)
  np.testing.assert_allclose(got.params, expected, atol=1e-6)
  res = hdm_optax.minimize(_separable, X0, bounds=(SOLVE_LOWER, SOLVE_UPPER), options=PRECISE)
  np.testing.assert_allclose(res.x, expected, atol=1e-6)


# --- a fresh process: the second answer equals the one a new Python process gives ----------

DATA = None  # (A, y): the logistic regression the drivers below read as a global


def _logistic_global(w):
  A, y = DATA
  return jnp.sum(jnp.logaddexp(0.0, -y * (A @ w))) + 0.05 * jnp.sum(w**2)


def set_data(seed):
  """Rebinds the global DATA to the problem of ``seed``."""
  global DATA  # pylint: disable=global-statement
  rng = np.random.default_rng(seed)
  A = jnp.asarray(rng.standard_normal((30, 4)))
  DATA = (A, jnp.asarray(np.sign(rng.standard_normal(30))))


def answers() -> dict:
  """Each driver's answer on DATA after 12 steps (a trajectory, not only a minimiser):
  optax.sgd(0.05) where the driver takes any optimizer, minimize's trial_lbfgs."""
  opt, steps = optax.sgd(0.05), 12
  x0 = jnp.zeros(4)
  out = {
    "solve": hdm_optax.solve(opt, _logistic_global, x0, max_steps=steps, tol=0.0).params,
    "minimize": hdm_optax.minimize(_logistic_global, x0, options={"maxiter": steps, "gtol": 0}).x,
    "sweep": hdm_optax.sweep(
      optax.sgd, {"learning_rate": [0.05]}, _logistic_global, x0, max_steps=steps, tol=0.0
    ).results.params[0],
    "solve_batch": hdm_optax.solve_batch(
      opt,
      _logistic_global,
      jnp.stack([x0, x0]),
      in_axes=(0, None),
      max_steps=steps,
      tol=0.0,
      compact=False,
    ).params[0],
  }
  value_and_grad = hdm_optax.value_and_grad_from_state(_logistic_global)
  x, state = x0, opt.init(x0)
  for _ in range(steps):
    _, grad = value_and_grad(x, state=state)
    updates, state = opt.update(grad, state, x)
    x = optax.apply_updates(x, updates)
  out["own_loop"] = x
  return {k: np.asarray(v).tolist() for k, v in out.items()}


_FRESH = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
sys.path.insert(0, "tests")
import test_seams_adversarial as t
t.set_data(2)
print(json.dumps(t.answers()))
"""


@pytest.fixture(scope="module")
def fresh_answers():
  """The drivers' answers on the seed-2 data, computed once in a new Python process."""
  out = subprocess.run(
    [sys.executable, "-c", _FRESH], cwd=ROOT, capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_call_on_rebound_data_equals_a_fresh_process(fresh_answers):
  """Every driver, called on seed-1 data, then on seed-2 data (the global rebound), answers
  as a fresh process that only ever saw seed 2."""
  set_data(1)
  first = answers()
  set_data(2)
  second = answers()
  for driver, fresh in fresh_answers.items():
    np.testing.assert_allclose(second[driver], fresh, rtol=1e-9, atol=1e-12, err_msg=driver)
    assert not np.allclose(first[driver], fresh, rtol=1e-3), driver  # the data matter


# --- the cache policy's costs: a program is reused wherever a fresh one gives the same answer --


def _first_k_at(x, k, s):
  """0.5 ||x - t||^2 with t = (s, ..., s, 0, ...): k entries of s (k a size: static)."""
  return _half_square(x, jnp.concatenate([jnp.full(k, s), jnp.zeros(3 - k)]))


def test_python_ints_in_fun_args_are_static_and_python_floats_traced():
  """A new Python float reuses the program; a new Python int compiles its own (as
  jax.jit's static_argnums): each call answers for its own values."""
  run = lambda k, s: _solve(_first_k_at, (k, s))
  np.testing.assert_allclose(run(2, 1.0), [1.0, 1.0, 0.0])
  with Compilations() as compiled:
    np.testing.assert_allclose(run(2, 3.0), [3.0, 3.0, 0.0])
  assert compiled.count == 0
  with Compilations() as compiled:
    np.testing.assert_allclose(run(1, 3.0), [3.0, 0.0, 0.0])
  assert compiled.count >= 1


@pytest.mark.parametrize("driver", ["solve", "minimize"])
def test_a_new_callback_object_does_not_compile_again(driver):
  """SciPy users write ``hist = []; cb = lambda r: hist.append(...)`` inside a function, so
  each call brings a new callback object: the program is reused, and the new one called."""

  def call():
    seen = []
    callback = lambda snapshot: seen.append(1)
    if driver == "solve":
      _ = hdm_optax.solve(SGD, _reads_global, jnp.zeros(3), max_steps=STEPS, callback=callback)
    else:
      _ = hdm_optax.minimize(_reads_global, X0, callback=callback)
    return seen

  _Global().set(FIRST)
  assert call()
  with Compilations() as compiled:
    assert call()
  assert compiled.count == 0


def test_grad_through_solve_without_jit_reuses_its_program():
  """jax.grad through solve (no jax.jit around it), called again with new data: no compile,
  and the gradient of the new data (x* = a, d(sum x*)/da = 1)."""
  total = lambda a: jnp.sum(_solve(_half_square, (a,)))
  np.testing.assert_allclose(jax.grad(total)(jnp.asarray(FIRST)), 1.0)
  with Compilations() as compiled:
    np.testing.assert_allclose(jax.grad(total)(jnp.asarray(SECOND)), 1.0)
  assert compiled.count == 0


# --- derivatives without jax.jit: every front door under every transformation (issue 55) --
#
# x*(c) = c for 0.5 ||x - c||^2 (clip(c, lo, hi) in a box), so dx*/dc is the identity (on the
# free variables): the closed form each derivative is checked against. ``c`` reaches the
# objective the ways a user writes it: closed over, or in fun_args.


def _closed(c):
  return lambda x: _half_square(x, c)


GRAD_DOORS = {
  "solve": lambda c: hdm_optax.solve(SGD, _closed(c), jnp.zeros(3), max_steps=STEPS).params,
  "solve_fun_args": lambda c: (
    hdm_optax.solve(SGD, _half_square, jnp.zeros(3), fun_args=(c,), max_steps=STEPS).params
  ),
  "minimize": lambda c: hdm_optax.minimize(_closed(c), X0, tol=1e-12).x,
  "minimize_box": lambda c: hdm_optax.minimize(_closed(c), X0, bounds=(-10.0, 10.0), tol=1e-12).x,
  "sweep": lambda c: hdm_optax.sweep(
    optax.sgd, {"learning_rate": [1.0]}, _closed(c), jnp.zeros(3), max_steps=STEPS
  ).results.params[0],
  "solve_batch": lambda c: hdm_optax.solve_batch(
    SGD, _closed(c), jnp.zeros((2, 3)), in_axes=(0, None), max_steps=STEPS
  ).params[1],
}

_W = jnp.asarray([0.5, -1.0, 2.0])
TRANSFORMS = {
  "grad": (lambda door, c: jax.grad(lambda c: _W @ door(c))(c), lambda c: _W),
  "jacrev": (lambda door, c: jax.jacrev(door)(c), lambda c: jnp.eye(3)),
  "jacfwd": (lambda door, c: jax.jacfwd(door)(c), lambda c: jnp.eye(3)),
  "linearize": (lambda door, c: jax.linearize(door, c)[1](_W), lambda c: _W),
  "hessian": (
    lambda door, c: jax.hessian(lambda c: jnp.sum(door(c) ** 2))(c),
    lambda c: 2 * jnp.eye(3),
  ),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("door", list(GRAD_DOORS))
def test_derivatives_without_jit_through_every_front_door(door, transform):
  """No outer jax.jit: a derivative with respect to an array the objective closes over (or
  takes in fun_args) is the closed form's, for problems small enough that the front door
  would pick XLA's compile options for a small program (JAX takes them at the top only)."""
  derivative, expected = TRANSFORMS[transform]
  c = jnp.asarray(FIRST)
  np.testing.assert_allclose(derivative(GRAD_DOORS[door], c), expected(c), atol=1e-6)


@pytest.mark.parametrize("door", ["solve", "minimize", "minimize_box"])
def test_vmap_without_jit_of_a_front_door(door):
  """jax.vmap (no jit) of a front door over the array its objective closes over: each row
  its own answer, and the derivative of each row."""
  cs = jnp.asarray([FIRST, SECOND, 0.5 * FIRST])
  np.testing.assert_allclose(jax.vmap(GRAD_DOORS[door])(cs), cs, atol=1e-6)
  grads = jax.vmap(jax.grad(lambda c: _W @ GRAD_DOORS[door](c)))(cs)
  np.testing.assert_allclose(grads, jnp.broadcast_to(_W, (3, 3)), atol=1e-6)


def test_grad_with_respect_to_the_center_of_a_box_at_its_bound():
  """In a box, dx*/dc is 1 on the free variables and 0 on those a bound holds; the box is
  closed over with the center, at a size the small-program options would apply to."""
  lo, hi = jnp.asarray([-1.0, -1.0, -1.0]), jnp.asarray([2.0, 2.0, 2.0])
  c = jnp.asarray([1.0, -2.0, 3.0])  # the second and third on a bound
  door = lambda c: hdm_optax.minimize(_closed(c), X0, bounds=(lo, hi), tol=1e-12).x
  np.testing.assert_allclose(door(c), jnp.clip(c, lo, hi), atol=1e-9)
  np.testing.assert_allclose(jax.jacrev(door)(c), jnp.diag(jnp.asarray([1.0, 0.0, 0.0])), atol=1e-9)


# --- a callback is released when its call returns, under un-jitted transformations too ----


class _HeavyCallback:
  """A callback that holds 16 MB, as one holding a model or a dataset does."""

  def __init__(self):
    self.payload = np.zeros(2_000_000)
    self.calls = 0

  def __call__(self, *args):
    self.calls += 1


def _watched(door):
  """``door(c, callback)``: a front door whose objective takes c in fun_args."""
  sgd = optax.sgd(0.5)  # halves the distance each step: every step is watched
  doors = {
    "solve": lambda c, cb: (
      hdm_optax.solve(
        sgd, _half_square, jnp.zeros(3), fun_args=(c,), max_steps=4, callback=cb
      ).params
    ),
    "solve_closed": lambda c, cb: (
      hdm_optax.solve(sgd, _closed(c), jnp.zeros(3), max_steps=4, callback=cb).params
    ),
    "solve_progress": lambda c, cb: (
      hdm_optax.solve(
        sgd, _half_square, jnp.zeros(3), fun_args=(c,), max_steps=4, callback=cb, progress=True
      ).params
    ),
    "minimize": lambda c, cb: hdm_optax.minimize(_half_square, X0, args=(c,), callback=cb).x,
    "sweep": lambda c, cb: hdm_optax.sweep(
      optax.sgd, {"learning_rate": [0.5]}, _half_square, X0, fun_args=(c,), max_steps=4, callback=cb
    ).results.params[0],
    "solve_batch": lambda c, cb: hdm_optax.solve_batch(
      sgd,
      _half_square,
      jnp.zeros((2, 3)),
      fun_args=(c,),
      in_axes=(0, None),
      max_steps=4,
      callback=cb,
    ).params[0],
  }
  return doors[door]


LEAK_TRANSFORMS = {
  "plain": lambda run, c: run(c),
  "grad": lambda run, c: jax.grad(lambda c: jnp.sum(run(c)))(c),
  "jvp": lambda run, c: jax.jvp(run, (c,), (jnp.ones(3),))[1],
  "vjp": lambda run, c: jax.vjp(run, c)[1](jnp.ones(3)),
  "vmap": lambda run, c: jax.vmap(run)(jnp.stack([c, 2 * c])),
}


def _run_watched(door, transform, callback):
  run = _watched(door)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", hdm_optax.ImplicitGradientWarning)  # 4 steps: unconverged
    out = LEAK_TRANSFORMS[transform](lambda c: run(c, callback), jnp.asarray(FIRST))
  jax.block_until_ready(out)


# Each front door's own path (solve's fused program, minimize's separate path, the batched
# program of sweep and solve_batch) under each transformation that reaches it (sweep and
# solve_batch refuse jax.vmap: they batch already); jax.vjp only through solve, since
# jax.grad is jax.vjp and its pullback. solve_closed: the objective closes over the traced
# data, which only a transformation traces; solve_progress: the progress line's host call,
# unbatched and batched.
LEAK_CASES = [
  *[("solve", t) for t in LEAK_TRANSFORMS],
  *[("solve_closed", t) for t in ("grad", "jvp", "vmap")],
  *[("solve_progress", t) for t in ("plain", "vmap")],
  *[("minimize", t) for t in ("plain", "grad", "jvp", "vmap")],
  *[(door, t) for door in ("sweep", "solve_batch") for t in ("plain", "grad", "jvp")],
]


@pytest.mark.parametrize("door, transform", LEAK_CASES, ids=[f"{d}-{t}" for d, t in LEAK_CASES])
def test_a_callback_is_released_when_its_call_returns(door, transform, capsys):
  """After the call (un-jitted jax.grad, jax.jvp, jax.vjp, jax.vmap around it included) no
  session holds the callback: a weak reference to it dies once the caller drops it."""
  before = len(hooks._SESSIONS)  # pylint: disable=protected-access
  callback = _HeavyCallback()
  alive = weakref.ref(callback)
  _run_watched(door, transform, callback)
  assert callback.calls >= 1
  del callback
  gc.collect()
  assert alive() is None
  assert len(hooks._SESSIONS) == before  # pylint: disable=protected-access
  capsys.readouterr()


def test_a_callback_under_jit_stays_with_its_one_trace():
  """Under jax.jit the program runs after the trace, as often as it is called: the session
  stays open, one per trace, however many calls."""
  callback = _HeavyCallback()
  run = jax.jit(lambda c: _watched("solve")(c, callback))
  before = len(hooks._SESSIONS)  # pylint: disable=protected-access
  for k in range(20):
    run(jnp.asarray(FIRST) + k)
  assert len(hooks._SESSIONS) == before + 1  # pylint: disable=protected-access
  assert callback.calls == 20 * 4


class _Refuses:
  """Raises ``error`` at the ``at``-th step it sees."""

  def __init__(self, error, at=2):
    self.error, self.at, self.calls = error, at, 0

  def __call__(self, *args):
    self.calls += 1
    if self.calls == self.at:
      raise self.error


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap"])
def test_a_callback_error_under_an_unjitted_transformation_comes_back_as_itself(transform):
  """An exception the callback raises under an un-jitted jax.grad/jax.jvp/jax.vmap comes back
  as itself (not as XLA's runtime error), with the partial result as values."""
  callback = _Refuses(LookupError("enough"))
  run = lambda c: _watched("solve")(c, callback)
  with pytest.raises(LookupError, match="enough") as caught, warnings.catch_warnings():
    warnings.simplefilter("ignore", hdm_optax.ImplicitGradientWarning)
    LEAK_TRANSFORMS[transform](run, jnp.asarray(FIRST))
  result = caught.value.result
  assert int(np.ravel(result.num_steps)[0]) == 2
  assert int(np.ravel(result.status)[0]) == hdm_optax.Status.STOPPED
  params = np.asarray(result.params)
  expected = np.asarray(FIRST) * 0.75  # two steps of sgd(0.5) from 0 towards c
  np.testing.assert_allclose(params if transform != "vmap" else params[0], expected)


# --- files: a private cache directory, the kernel it loads, the LIBSVM files it reads ------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o777])
def test_a_new_cache_directory_is_private_whatever_the_umask(tmp_path, umask):
  """Created with mode 0700 (its missing parents too, none wider than 0700)."""
  old = os.umask(umask)
  try:
    path = private_dir(tmp_path / "a" / "b" / "cache")
  finally:
    os.umask(old)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
  for parent in (tmp_path / "a", tmp_path / "a" / "b"):
    assert stat.S_IMODE(os.stat(parent).st_mode) & 0o077 == 0


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o500])
def test_an_existing_directory_nobody_else_writes_to_is_taken_as_it_is(tmp_path, mode):
  path = tmp_path / "cache"
  path.mkdir()
  path.chmod(mode)
  assert private_dir(path) == str(path)
  assert stat.S_IMODE(path.stat().st_mode) == mode  # not changed behind the user's back


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722, 0o702, 0o1777])
def test_a_directory_others_can_write_to_is_refused(tmp_path, mode):
  path = tmp_path / "cache"
  path.mkdir()
  path.chmod(mode)
  with pytest.raises(ValueError, match=r"writable by other users .*chmod 700"):
    private_dir(path)


@pytest.mark.parametrize("target", ["private", "public", "dangling", "file"])
def test_a_symbolic_link_is_never_followed(tmp_path, target):
  """A link is refused, whatever it points to: a private directory, a public one, nothing
  (a clear error, not FileExistsError), a file."""
  pointee = tmp_path / target
  if target in ("private", "public"):
    pointee.mkdir(mode=0o700)
    pointee.chmod(0o700 if target == "private" else 0o777)
  elif target == "file":
    pointee.write_text("x")
  link = tmp_path / "cache"
  link.symlink_to(pointee)
  with pytest.raises(ValueError, match="symbolic link") as caught:
    private_dir(link)
  assert ("does not exist" in str(caught.value)) == (target == "dangling")
  assert not pointee.exists() or target != "dangling"


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
  (tmp_path / "cache").write_text("x")
  with pytest.raises(ValueError, match="not a directory"):
    private_dir(tmp_path / "cache")


def test_another_users_directory_is_refused(tmp_path):
  """A directory of another uid (root's / for a user; a directory handed to uid 65534 when
  the tests run as root)."""
  if os.getuid() != 0:
    path = "/"
  else:
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
  with pytest.raises(ValueError, match="belongs to another user"):
    private_dir(path)


@pytest.mark.parametrize("case", ["public", "dangling", "link"])
def test_enable_compilation_cache_refuses_an_unsafe_directory(tmp_path, case):
  """The checks run before JAX's configuration is touched: the process keeps its cache."""
  before = jax.config.jax_compilation_cache_dir
  path = tmp_path / "cache"
  if case == "public":
    path.mkdir()
    path.chmod(0o777)
  else:
    (tmp_path / "real").mkdir(mode=0o700)
    path.symlink_to(tmp_path / ("gone" if case == "dangling" else "real"))
  with pytest.raises(ValueError, match="path .*(writable by other|symbolic link)"):
    hdm_optax.enable_compilation_cache(str(path))
  assert jax.config.jax_compilation_cache_dir == before


def _libsvm_dir(tmp_path, text: bytes, stated=None, compress=False):
  """A data directory holding dataset "toy" (with a MANIFEST row stating ``stated``
  features where given)."""
  directory = tmp_path / "data"
  directory.mkdir()
  name = "toy.xz" if compress else "toy"
  (directory / name).write_bytes(lzma.compress(text) if compress else text)
  if stated is not None:
    (directory / "MANIFEST.tsv").write_text(
      "name\trows\tfeatures_in_file\tstated_features\tlabels\tsha256_of_uncompressed\t"
      f"source_repo\tnotes\ntoy\t\t\t{stated}\t\t\tlocal\tsynthetic\n"
    )
  return directory, directory / name


_GOOD = [
  b"# a comment line",
  b"+1 1:0.5 3:-1",
  b"",
  b"-1 2:1.5 # trailing comment",
  b"+1 1:1 2:2 3:3",
]
_BAD_LINES = {
  "nan_label": (b"nan 1:1", "label is nan"),
  "inf_label": (b"-inf 2:1", "label is -inf"),
  "word_label": (b"yes 1:1", "label 'yes' is not a number"),
  "nan_value": (b"+1 1:NaN", "feature 1 is NaN"),
  "inf_value": (b"-1 3:inf", "feature 3 is inf"),
  "overflowing_value": (b"-1 2:1e999", "feature 2 is 1e999"),
  "word_value": (b"+1 2:x", "'2:x' is not index:value"),
  "no_colon": (b"+1 2", "'2' is not index:value"),
  "zero_index": (b"-1 0:1", "indices start at 1"),
  "negative_index": (b"-1 -4:1", "indices start at 1"),
  "huge_index": (b"+1 1000000000:1", "feature index 1000000000 exceeds MAX_FEATURES"),
  "overflowing_index": (b"+1 1000000000000:1", "feature index 1000000000000 exceeds"),
  "int64_overflow": (b"+1 99999999999999999999999:1", "exceeds"),
}


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("at", [0, 2, 5])
@pytest.mark.parametrize("case", list(_BAD_LINES))
def test_a_bad_libsvm_line_is_named_by_file_and_line(tmp_path, case, at, compress):
  """One bad line among good ones (comments and blank lines counted as lines): the error
  names the file and that line, and says what is wrong; nothing of the size of a feature
  index is allocated first."""
  from experiments import data as data_lib

  bad, what = _BAD_LINES[case]
  lines = _GOOD[:at] + [bad] + _GOOD[at:]
  directory, path = _libsvm_dir(tmp_path, b"\n".join(lines) + b"\n", compress=compress)
  with pytest.raises(ValueError) as caught:
    data_lib.load_dataset("toy", data_dir=directory, cache_dir=tmp_path / "c")
  message = str(caught.value)
  assert message.startswith(f"{path}, line {at + 1}: "), message
  assert what in message, message


@pytest.mark.parametrize("index, ok", [(7, True), (8, False)])
def test_a_libsvm_index_is_checked_against_the_manifest_count(tmp_path, index, ok):
  """With a MANIFEST row stating 7 features, index 7 is read and index 8 refused."""
  from experiments import data as data_lib

  text = b"+1 1:1\n-1 %d:2\n" % index
  directory, path = _libsvm_dir(tmp_path, text, stated=7)
  if ok:
    X, y = data_lib.load_dataset("toy", data_dir=directory, cache_dir=tmp_path / "c")
    assert X.shape == (2, 7) and X[1, index - 1] == 2.0
    np.testing.assert_array_equal(y, [1.0, -1.0])
  else:
    with pytest.raises(ValueError, match=rf"^{path}, line 2: feature index 8 exceeds the 7"):
      data_lib.load_dataset("toy", data_dir=directory, cache_dir=tmp_path / "c")


def test_good_libsvm_lines_read_as_written(tmp_path):
  """Comments, blank lines, trailing comments: the matrix and labels as written."""
  from experiments import data as data_lib

  directory, _ = _libsvm_dir(tmp_path, b"\n".join(_GOOD) + b"\n")
  X, y = data_lib.load_dataset("toy", data_dir=directory, cache_dir=tmp_path / "c")
  np.testing.assert_array_equal(X.toarray(), [[0.5, 0, -1], [0, 1.5, 0], [1, 2, 3]])
  np.testing.assert_array_equal(y, [1.0, -1.0, 1.0])


@pytest.fixture(scope="module")
def built_kernel(tmp_path_factory):
  """The CSR kernel built once into a private cache: ``(library, its .sha256)``."""
  from experiments.sparse import host_csr

  if shutil.which(os.environ.get("CXX", "g++")) is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here")
  cache = tmp_path_factory.mktemp("kernel")
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("HDM_KERNEL_CACHE", str(cache))
    library = host_csr._build_kernel()  # pylint: disable=protected-access
  return library, library.with_suffix(".sha256")


def _kernel_cache(tmp_path, built, change):
  """A copy of the built kernel's cache, changed by ``change``; returns the library's path."""
  from experiments.sparse import host_csr

  cache = tmp_path / "cache"
  cache.mkdir(mode=0o700)
  library, digest = (cache / built[0].name, cache / built[1].name)
  shutil.copy2(built[0], library)
  shutil.copy2(built[1], digest)
  change(cache, library, digest)
  assert host_csr.KERNEL_SOURCE.exists()
  return library


def _append_a_byte(cache, library, digest):
  library.write_bytes(library.read_bytes() + b"\0")


def _other_library(cache, library, digest):
  library.write_bytes(b"\x7fELF not the kernel")
  digest.write_text(hashlib.sha256(b"something else").hexdigest())


def _link_to_a_copy(cache, library, digest):
  elsewhere = cache.parent / "elsewhere.so"
  library.rename(elsewhere)
  library.symlink_to(elsewhere)


def _group_writable(cache, library, digest):
  library.chmod(0o775)


UNCHECKED = {
  "appended_byte": _append_a_byte,
  "another_library": _other_library,
  "a_link": _link_to_a_copy,
  "group_writable": _group_writable,
}


@pytest.mark.parametrize("change", list(UNCHECKED))
def test_the_kernel_cache_loads_only_what_it_built(tmp_path, built_kernel, change):
  """A library in the cache that is not the one built there (another digest, a link, a file
  others can write) is refused before it is loaded."""
  from experiments.sparse import host_csr

  library = _kernel_cache(tmp_path, built_kernel, UNCHECKED[change])
  with pytest.raises(host_csr.UncheckedLibrary):
    host_csr._checked_library(library)  # pylint: disable=protected-access


def test_the_kernel_cache_checks_a_library_it_built(tmp_path, built_kernel):
  from experiments.sparse import host_csr

  library = _kernel_cache(tmp_path, built_kernel, lambda *a: None)
  assert host_csr._checked_library(library) == library  # pylint: disable=protected-access


_LOAD = """
import warnings, sys
from experiments.sparse import host_csr
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  print(host_csr.lowering(), "|", " ".join(str(w.message) for w in caught))
"""


@pytest.mark.parametrize("case", ["appended_byte", "public_cache", "no_digest"])
def test_a_fresh_process_falls_back_or_rebuilds_rather_than_load_an_unchecked_kernel(
  tmp_path, built_kernel, case
):
  """In a new process: a tampered library or a cache others can write to gives the callback
  path with a warning that says why; a library with no recorded digest is built again."""
  change = {
    "appended_byte": _append_a_byte,
    "public_cache": lambda cache, library, digest: cache.chmod(0o777),
    "no_digest": lambda cache, library, digest: digest.unlink(),
  }[case]
  library = _kernel_cache(tmp_path, built_kernel, change)
  env = dict(os.environ, HDM_KERNEL_CACHE=str(library.parent), PYTHONPATH=str(ROOT))
  env.pop("HDM_HOST_CSR", None)
  out = subprocess.run(
    [sys.executable, "-c", _LOAD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-2000:]
  lowering, _, warned = (part.strip() for part in out.stdout.splitlines()[-1].partition("|"))
  if case == "no_digest":
    assert lowering == "ffi" and not warned
    assert library.with_suffix(".sha256").read_text() == built_kernel[1].read_text()
  else:
    assert lowering == "callback"
    assert ("SHA-256" if case == "appended_byte" else "writable by other users") in warned


# --- a bad argument gets a message naming it, its value and the fix ----------------------

_ONES = jnp.ones(3)


def _no_batch(in_axes, params, data):
  return lambda: hdm_optax.solve_batch(SGD, _half_square, params, fun_args=(data,), in_axes=in_axes)


def _sweep_of(make, grid, **kw):
  return lambda: hdm_optax.sweep(make, grid, _half_square, jnp.zeros(3), fun_args=(_ONES,), **kw)


def _aux(out):
  return lambda: hdm_optax.solve(
    SGD, lambda x: out(_half_square(x, _ONES)), jnp.zeros(3), has_aux=True, max_steps=2
  )


def _resumed(state):
  return lambda: hdm_optax.solve(
    hdm_optax.trial_lbfgs(), _half_square, jnp.zeros(3), fun_args=(_ONES,), init_state=state
  )


_STATE_5 = hdm_optax.trial_lbfgs().init(jnp.zeros(5))
_STATE_F32 = hdm_optax.trial_lbfgs().init(jnp.zeros(3, jnp.float32))
_CPU = jax.devices("cpu")[0]


def _str_aux(x):
  return _half_square(x, _ONES), "note"


_STR_AUX = (
  r"fun's aux is a str \('note'\), which a compiled program cannot return: .* must hold "
  r"arrays or numbers only; keep strings .* outside fun"
)
_MLP = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
_MODEL_LEAF = (
  r"a params leaf of type custom_jvp is not an array: pass only the arrays, .*"
  r"eqx.partition\(model, eqx.is_array\)"
)


def _model_loss(model):
  return jnp.sum(model(jnp.ones(2)) ** 2)


def _batch_loss(model, scale):
  return _model_loss(model) * scale


BAD_ARGUMENTS = {
  "batch_of_none": (_no_batch((0, 0), jnp.zeros((0, 3)), jnp.zeros((0, 3))), ValueError, "size 0"),
  "batch_of_none_in_data": (
    _no_batch((None, 0), jnp.zeros(3), jnp.zeros((0, 3))),
    ValueError,
    "size 0",
  ),
  "sweep_of_no_problem": (
    lambda: hdm_optax.sweep(
      optax.sgd,
      {"learning_rate": [1.0]},
      _half_square,
      jnp.zeros(3),
      fun_args=(jnp.zeros((0, 3)),),
      in_axes=(None, 0),
    ),
    ValueError,
    "size 0",
  ),
  "devices_twice": (
    lambda: hdm_optax.solve_batch(
      SGD, _half_square, jnp.zeros((4, 3)), fun_args=(jnp.zeros((4, 3)),), devices=[_CPU, _CPU]
    ),
    ValueError,
    r"devices names cpu:0 more than once",
  ),
  "memory_size_0": (
    _sweep_of(lambda memory_size: hdm_optax.trial_lbfgs(memory_size), {"memory_size": [0, 3]}),
    ValueError,
    r"grid point \{'memory_size': 0\}.*memory_size must be an int >= 1, got 0",
  ),
  "memory_size_0_second": (
    _sweep_of(lambda memory_size: hdm_optax.trial_lbfgs(memory_size), {"memory_size": [3, 0]}),
    ValueError,
    r"grid point \{'memory_size': 0\}.*got 0",
  ),
  "negative_learning_rate_point": (
    _sweep_of(lambda m: hdm_optax.trial_lbfgs(m), [{"m": 4}, {"m": -1}]),
    ValueError,
    r"grid point \{'m': -1\}",
  ),
  "instance_with_a_grid": (
    _sweep_of(hdm_optax.trial_lbfgs(), {"memory_size": [3]}),
    ValueError,
    "has no settings for the grid",
  ),
  "not_a_factory": (_sweep_of(3.0, {}), TypeError, "make_optimizer must be a factory"),
  "init_state_of_other_shape": (_resumed(_STATE_5), ValueError, r"init_state .*shape \(10, 5\)"),
  "init_state_of_other_dtype": (_resumed(_STATE_F32), ValueError, r"init_state .*dtype float32"),
  "lower_plus_inf": (
    lambda: hdm_optax.minimize(_closed(_ONES), X0, bounds=(np.inf, None)),
    ValueError,
    r"lower is \+inf .*use -inf or None",
  ),
  "upper_minus_inf_entry": (
    lambda: hdm_optax.minimize(_closed(_ONES), X0, bounds=(None, np.array([1.0, -np.inf, 2.0]))),
    ValueError,
    r"upper is -inf at index \(1,\)",
  ),
  "scipy_pair_plus_inf": (
    lambda: hdm_optax.minimize(_closed(_ONES), X0, bounds=[(0, 1), (np.inf, None), (None, None)]),
    ValueError,
    r"lower is \+inf at index \(1,\)",
  ),
  "optimizer_lower_plus_inf": (
    lambda: hdm_optax.trial_lbfgs(lower=np.inf).init(jnp.zeros(3)),
    ValueError,
    r"lower is \+inf",
  ),
  "aux_missing": (
    _aux(lambda v: v),
    TypeError,
    r"pair \(value, aux\), got a single array of shape \(\)",
  ),
  "aux_triple": (_aux(lambda v: (v, v, v)), TypeError, "got a tuple of length 3"),
  "aux_in_a_dict": (_aux(lambda v: {"value": v}), TypeError, r"got a dict with 1 array"),
  "aux_a_str": (_aux(lambda v: (v, "note")), TypeError, _STR_AUX),
  "aux_a_str_in_a_dict": (
    _aux(lambda v: (v, {"ok": v, "why": "note"})),
    TypeError,
    r"fun's aux\['why'\] is a str \('note'\).*arrays or numbers",
  ),
  "aux_a_str_solve_batch": (
    lambda: hdm_optax.solve_batch(
      SGD, _str_aux, jnp.zeros((2, 3)), has_aux=True, in_axes=(0, None), max_steps=2
    ),
    TypeError,
    _STR_AUX,
  ),
  "aux_a_str_sweep": (
    lambda: hdm_optax.sweep(
      lambda m: hdm_optax.trial_lbfgs(m), {"m": [3, 4]}, _str_aux, X0, has_aux=True
    ),
    TypeError,
    _STR_AUX,
  ),
  "aux_a_str_minimize": (
    lambda: hdm_optax.minimize(_str_aux, X0, has_aux=True),
    TypeError,
    _STR_AUX,
  ),
  "value_an_int": (
    lambda: hdm_optax.solve(SGD, lambda x: jnp.sum(x).astype(jnp.int32), jnp.zeros(3)),
    TypeError,
    r"fun's value has dtype int32, which has no gradient; return a real floating value",
  ),
  "value_none": (
    lambda: hdm_optax.solve(SGD, lambda x: None, jnp.zeros(3)),
    TypeError,
    r"fun's value is None, not a scalar.*without a return statement",
  ),
  "callback_returns_an_array": (
    lambda: hdm_optax.solve(
      SGD, _closed(_ONES), jnp.zeros(3), callback=lambda s: np.array([False, True])
    ),
    TypeError,
    r"callback's return value, of type ndarray .* is neither true nor false: return None or "
    r"False to go on, True",
  ),
  "model_leaves_init": (lambda: hdm_optax.hdm_auto().init(_MLP), TypeError, _MODEL_LEAF),
  "model_leaves_loop": (
    lambda: hdm_optax.loop(hdm_optax.hdm_auto(), _model_loss).start(_MLP),
    TypeError,
    _MODEL_LEAF,
  ),
  "model_leaves_solve_batch": (
    lambda: hdm_optax.solve_batch(
      hdm_optax.hdm_auto(),
      lambda m, d: _model_loss(m) * d,
      _MLP,
      fun_args=(jnp.ones(2),),
      in_axes=(None, 0),
    ),
    TypeError,
    "init_params: " + _MODEL_LEAF,
  ),
  "model_leaves_minibatch_step": (
    lambda: hdm_optax.minibatch_step(hdm_optax.hdm_auto(), _batch_loss, jit=False)(_MLP, None, 1.0),
    TypeError,
    _MODEL_LEAF,
  ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_bad_argument_is_named_with_its_value_and_fix(case):
  call, kind, message = BAD_ARGUMENTS[case]
  with pytest.raises(kind, match=message) as caught:
    call()
  assert "Tracer" not in str(caught.value)  # a value the user wrote, not a traced one


def test_sweep_takes_an_optimizer_with_an_empty_grid_for_problem_data_alone():
  """An optimizer and grid={}: one point per problem, each the closed form x* = c."""
  cs = jnp.asarray([FIRST, SECOND])
  out = hdm_optax.sweep(SGD, {}, _half_square, jnp.zeros(3), fun_args=(cs,), in_axes=(None, 0))
  np.testing.assert_allclose(out.results.params, cs)
  assert out.points == [{"problem": 0}, {"problem": 1}]


FRONT_DOOR_OPTIONS = ("callback", "progress", "ftol", "init_state", "has_aux", "adjoint")


@pytest.mark.parametrize(
  "door", ["solve", "solve_batch", "sweep", "minimize", "loop", "minibatch_step"]
)
def test_the_readme_says_which_front_door_takes_which_option(door):
  """README: solve, solve_batch, sweep and minimize take every option; loop takes ftol and
  has_aux; minibatch_step none. What a door does not take is a TypeError naming it."""
  import inspect

  readme = (ROOT / "README.md").read_text()
  assert (
    "The first\n  four take `callback=`, `progress=True`, `ftol=`, `init_state=`, `has_aux=`"
    in readme
  )
  taken = set(inspect.signature(getattr(hdm_optax, door)).parameters)
  expected = {
    "loop": {"ftol", "has_aux"},
    "minibatch_step": set(),
    "minimize": set(FRONT_DOOR_OPTIONS) - {"ftol"},  # SciPy's options={"ftol": ...}
  }.get(door, set(FRONT_DOOR_OPTIONS))
  assert taken & set(FRONT_DOOR_OPTIONS) == expected


# --- ftol at the edge of the region where f is finite (docs/scipy.md states the rule) -----

_WEIGHTS = jnp.asarray([1.0, 10.0, 100.0])


def _edge_objective(bad, region="halfspace"):
  """0.5 sum w (x - 1)^2, and ``bad`` (NaN or inf) where ``region`` says: its minimiser
  (1, 1, 1) lies beyond the edge, so a run from 0 ends at the edge."""
  inside = {
    "halfspace": lambda x: jnp.any(x > 0.5),
    "ball": lambda x: jnp.sum(x**2) > 0.8,
    "slab": lambda x: jnp.abs(x[0] - x[2]) > 0.3,
  }[region]
  return lambda x: jnp.where(inside(x), bad, 0.5 * jnp.sum(_WEIGHTS * (x - 1.0) ** 2))


def _edge_run(door, fun, ftol):
  x0 = jnp.zeros(3)
  if door == "minimize":
    r = hdm_optax.minimize(fun, x0, options={"ftol": ftol})
    return r.x, r.status, r.success, r.grad_norm, r.fun
  if door == "loop":
    run = hdm_optax.loop(hdm_optax.trial_lbfgs(), fun, ftol=ftol, tol=1e-5, max_steps=1000)
    s = jax.lax.while_loop(lambda s: ~run.done(s), run.step, run.start(x0))
    status = run.status(s)
    return s.params, status, status == hdm_optax.Status.CONVERGED_FTOL, s.grad_norm, s.value
  opt = {"solve": hdm_optax.trial_lbfgs(), "hdm_auto": hdm_optax.hdm_auto()}.get(door)
  opt = opt or hdm_optax.hdm_best(lipschitz=100.0)
  r = hdm_optax.solve(opt, fun, x0, ftol=ftol, tol=1e-5)
  return r.params, r.status, r.converged, r.grad_norm, r.value


_EDGE_DOORS = ("minimize", "solve", "hdm_auto", "hdm_best", "loop")
_EDGE_REGIONS = ("halfspace", "ball", "slab")
_EDGE_FTOLS = (2.2e-9, 1e-6, 1e-12)
_EDGE_BADS = (np.nan, np.inf)
# Every pair of (door, region, ftol, bad) in 15 cases, not the 90 of the whole grid (each
# compiles its own program): each door in each region, with ftol and bad following
# i = door + region, whose residues mod 3 and mod 2 meet every door, region and each other.
_EDGE_CASES = [
  (door, _EDGE_BADS[(d + r) % 2], region, _EDGE_FTOLS[(d + r) % 3])
  for d, door in enumerate(_EDGE_DOORS)
  for r, region in enumerate(_EDGE_REGIONS)
]
_EDGE_LEVELS = (_EDGE_DOORS, _EDGE_BADS, _EDGE_REGIONS, _EDGE_FTOLS)
for _i, _j in itertools.combinations(range(4), 2):  # the pairs are all there
  _pairs = set(itertools.product(_EDGE_LEVELS[_i], _EDGE_LEVELS[_j]))
  assert {(case[_i], case[_j]) for case in _EDGE_CASES} == _pairs, (_i, _j)


@pytest.mark.parametrize(
  "door, bad, region, ftol",
  [
    pytest.param(*case, id=f"{case[0]}-{'nan' if np.isnan(case[1]) else 'inf'}-{case[2]}-{case[3]}")
    for case in _EDGE_CASES
  ],
)
def test_an_ftol_stop_at_the_edge_of_the_finite_region_is_no_success(door, bad, region, ftol):
  """Rule 3: a small decrease right after non-finite trials stops with FTOL_AT_NON_FINITE,
  not a success; f, grad_norm are those at the returned point (a fresh evaluation), and the
  point is no stationary point (grad_norm far above tol)."""
  fun = _edge_objective(bad, region)
  x, status, success, grad_norm, value = _edge_run(door, fun, ftol)
  assert int(status) == hdm_optax.Status.FTOL_AT_NON_FINITE
  assert not bool(success)
  np.testing.assert_allclose(float(value), float(fun(jnp.asarray(x))), rtol=1e-12)
  g = jax.grad(fun)(jnp.asarray(x))
  np.testing.assert_allclose(float(grad_norm), float(jnp.max(jnp.abs(g))), rtol=1e-12)
  assert float(grad_norm) > 1.0


def test_the_edge_message_says_why_and_how():
  res = hdm_optax.minimize(_edge_objective(np.nan), jnp.zeros(3))
  assert "edge of the region where f is finite" in res.message and "bounds" in res.message
  assert res.fun > 13.875  # the best finite value, at (0.5, 0.5, 0.5): no minimum was found


@pytest.mark.parametrize("lipschitz", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("wall", [3.0, 6.0])
def test_non_finite_trials_before_an_interior_minimum_do_not_count(lipschitz, wall):
  """Rule 4: a step size far too large sends the first trials into the NaN region; the run
  then converges inside it, and its ftol stop is a success at the closed-form minimiser."""
  evaluations = []

  def fun(x):
    v = jnp.where(jnp.any(jnp.abs(x) > wall), jnp.nan, 0.5 * jnp.sum(_WEIGHTS * (x - 0.9) ** 2))
    jax.debug.callback(lambda v: evaluations.append(float(v)), v)
    return v

  res = hdm_optax.solve(
    hdm_optax.hdm_best(lipschitz=lipschitz),
    fun,
    jnp.zeros(3),
    ftol=1e-10,
    tol=1e-12,
    max_steps=2000,
  )
  jax.effects_barrier()
  assert not np.all(np.isfinite(evaluations))  # the early trials did cross the edge
  assert int(res.status) == hdm_optax.Status.CONVERGED_FTOL and bool(res.converged)
  np.testing.assert_allclose(res.params, 0.9, atol=1e-3)


def test_an_optimizer_without_trials_keeps_scipys_ftol():
  """Rule 5: optax.lbfgs reports no trials; its ftol stop is judged by the decrease alone."""
  fun = lambda x: 0.5 * jnp.sum(_WEIGHTS * (x - 0.3) ** 2)
  res = hdm_optax.solve(optax.lbfgs(), fun, jnp.zeros(3), ftol=1e-6, tol=1e-14)
  assert int(res.status) == hdm_optax.Status.CONVERGED_FTOL and bool(res.converged)


def test_the_nonfinite_run_counts_trials_since_the_last_accepted_update():
  """HDMInfo.nonfinite_run, update by update, against the trial values each update
  evaluated (logged from inside the objective): +1 on a null step whose trial was not
  finite, 0 after an accepted update (trial_lbfgs accepts finite trials only)."""
  trials = []
  edge = _edge_objective(np.nan)

  def fun(x):
    v = edge(x)
    jax.debug.callback(lambda v: trials.append(float(v)), v)
    return v

  opt = hdm_optax.trial_lbfgs()
  x = jnp.zeros(3)
  value, grad = jax.value_and_grad(edge)(x)
  state = opt.init(x)._replace(value=value, grad=grad)
  update = jax.jit(lambda x, s: opt.update(s.grad, s, x, value=s.value, grad=s.grad, value_fn=fun))
  expected, seen = 0, []
  for _ in range(40):
    trials.clear()
    updates, state = update(x, state)
    jax.effects_barrier()
    x = x + updates
    assert len(trials) == 1  # one trial per update
    if bool(state.info.accepted):
      assert np.isfinite(trials[0])
      expected = 0
    else:
      expected += int(not np.isfinite(trials[0]))
    assert int(state.info.nonfinite_run) == expected
    seen.append(expected)
  assert max(seen) >= 2  # runs of non-finite trials happened, and were counted


# --- interrupts: KeyboardInterrupt, SystemExit and Ctrl-C keep the partial result --------


def _interrupting_door(door, callback, progress=False):
  x0, c = jnp.zeros(3), jnp.asarray(FIRST)
  sgd = optax.sgd(0.1)  # x_k = (1 - 0.9^k) c: the closed form of the partial result
  kw = dict(callback=callback, progress=progress, max_steps=50, tol=0.0)
  if door == "solve":
    return lambda: hdm_optax.solve(sgd, _half_square, x0, fun_args=(c,), **kw)
  if door == "minimize":
    del kw["max_steps"], kw["tol"]
    return lambda: hdm_optax.minimize(_half_square, x0, args=(c,), **kw)
  if door == "sweep":
    return lambda: hdm_optax.sweep(
      optax.sgd, {"learning_rate": [0.1]}, _half_square, x0, fun_args=(c,), **kw
    )
  return lambda: hdm_optax.solve_batch(
    sgd, _half_square, jnp.zeros((2, 3)), fun_args=(c,), in_axes=(0, None), **kw
  )


@pytest.mark.parametrize("progress", [False, True])
@pytest.mark.parametrize(
  "error", [KeyboardInterrupt, SystemExit], ids=["KeyboardInterrupt", "SystemExit"]
)
@pytest.mark.parametrize("door", ["solve", "minimize", "sweep", "solve_batch"])
def test_keyboard_interrupt_and_system_exit_in_a_callback_come_back_as_themselves(
  door, error, progress, capfd
):
  """Raised by the callback at its k-th call: the same exception, the partial result of k
  steps as the door returns it (the closed form for sgd; minimize's x against a fresh run
  of k iterations), status STOPPED, and the progress line ended."""
  at = 1 if door == "minimize" else 4  # trial_lbfgs solves the quadratic in two steps
  callback = _Refuses(error("stop here"), at=at)
  with pytest.raises(error) as caught:
    _interrupting_door(door, callback, progress)()
  result = caught.value.result
  if door == "sweep":
    assert isinstance(result, hdm_optax.SweepResult) and result.points == [{"learning_rate": 0.1}]
    result = result.results
  assert np.all(np.ravel(result.num_steps) == at)
  assert np.all(np.ravel(result.status) == hdm_optax.Status.STOPPED)
  messages = result.message if isinstance(result.message, list) else [result.message]
  cause = f"stopped before the end: by the callback, which raised {error.__name__}"
  assert all(m == cause for m in messages), messages
  params = np.asarray(result.params).reshape(-1, 3)[0]
  if door == "minimize":
    assert isinstance(result, hdm_optax.MinimizeResult) and not result.success
    fresh = hdm_optax.minimize(_half_square, jnp.zeros(3), args=(jnp.asarray(FIRST),), max_steps=at)
    np.testing.assert_allclose(result.x, fresh.x, rtol=1e-12)
  else:
    np.testing.assert_allclose(params, (1 - 0.9**at) * np.asarray(FIRST), rtol=1e-12)
  assert callback.calls == at  # no call after the error
  err = capfd.readouterr().err
  if progress:
    assert err.endswith("\n") and err.splitlines()[-1].startswith("hdm_optax: ")
    assert err.splitlines()[-1].endswith("batch" if door == "solve_batch" else "STOPPED")


def test_ctrl_c_stops_a_compiled_run_and_keeps_its_result():
  """SIGINT one second into a run of 10^8 steps (a fresh process, every front door): a
  KeyboardInterrupt within a few seconds (the figure: the check comes every 0.2 s),
  carrying a partial result equal to a fresh run of that many steps (status STOPPED, its
  message naming Ctrl-C), and the SIGINT handler of before restored; a handler of the user's is left alone."""
  doors = ["solve", "solve_watched", "minimize", "solve_batch", "sweep", "user_handler"]
  out = subprocess.run(
    [sys.executable, str(ROOT / "tests" / "interrupt_worker.py"), *doors],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
  )
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
  assert [r["door"] for r in rows] == doors
  for row in rows[:-1]:
    assert row["interrupted"], row
    assert row["latency"] < 30.0, row  # stopped, not run to its end (minutes)
    assert all(0 < s < 100_000_000 for s in row["steps"]) and set(row["status"]) == {3}, row
    assert row["replay_error"] <= 1e-9, row
    assert row["handler_restored"] and row["wakeup_fd_restored"], row
    assert row["message"] == "stopped before the end: by Ctrl-C (KeyboardInterrupt)", row
  mine = rows[-1]
  assert mine["steps"] == [20_000] and mine["user_handler_ran"] and mine["handler_restored"]


# A Ctrl-C that lands while a call sets up its SIGINT handler (simulated: the first
# reading of the wakeup socket raises KeyboardInterrupt, as Python's default handler
# would there), then a NumPy fun (Rosenbrock's) that sends SIGINT to the process at its 5th call.
_CTRL_C_DURING_SETUP = """
import json, os, signal
import numpy as np, hdm_optax
from hdm_optax.driver import interrupts
from scipy.optimize import rosen_der

drain, landed = interrupts._Signal.drain, []


def drain_once_interrupted(state):
  if not landed:
    landed.append(1)
    raise KeyboardInterrupt
  return drain(state)


interrupts._Signal.drain = drain_once_interrupted
calls = []


def fun(x, kill_at):
  calls.append(1)
  if len(calls) == kill_at:
    os.kill(os.getpid(), signal.SIGINT)
  return float(np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2))


def run(kill_at=0):
  calls.clear()
  return hdm_optax.minimize(fun, np.zeros(4), args=(kill_at,), jac=lambda x, k: rosen_der(x))


row = {}
try:
  run()
except KeyboardInterrupt:
  row["first"] = "KeyboardInterrupt"
row["handler_after"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
try:
  run(kill_at=5)
except KeyboardInterrupt as error:
  row["second"] = "with its result" if hasattr(error, "result") else "bare"
third = run()
row["third"] = [bool(third.success), third.x.tolist()]
print(json.dumps(row))
"""


def test_a_ctrl_c_during_the_handlers_setup_leaves_the_next_calls_ctrl_c_working():
  """The interrupted call raises KeyboardInterrupt and restores Python's handler; the next
  call still records a SIGINT (its KeyboardInterrupt carries the run's result, not a bare
  one raised from inside ``fun``) and the one after runs normally."""
  out = subprocess.run(
    [sys.executable, "-c", _CTRL_C_DURING_SETUP],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, PYTHONPATH=str(ROOT), HDM_OPTAX_PROGRAM_CACHE="0"),
  )
  assert out.returncode == 0, out.stderr[-3000:]
  row = json.loads(out.stdout.splitlines()[-1])
  assert row["first"] == "KeyboardInterrupt" and row["handler_after"], row
  assert row.get("second") == "with its result", row
  assert row["third"][0], row
  np.testing.assert_allclose(row["third"][1], np.ones(4), atol=1e-2)


# --- resuming a run (docs/guide.md, "Resuming a run", rule by rule) ----------------------

_RNG = np.random.default_rng(7)
_A = jnp.asarray(_RNG.standard_normal((60, 8)))
_Y = jnp.sign(_A @ jnp.ones(8) + 0.1)


def _ridge_logistic(w, a, y):
  return jnp.sum(jnp.logaddexp(0.0, -y * (a @ w))) + 0.05 * w @ w


RESUMED_OPTIMIZERS = {
  "trial_lbfgs": hdm_optax.trial_lbfgs,
  "hdm_auto": hdm_optax.hdm_auto,
  "hdm_best": lambda: hdm_optax.hdm_best(lipschitz=20.0),
  "optax_lbfgs": optax.lbfgs,
}


_CALLS = []


def _counted(w, a, y):
  """The objective, its calls counted in ``_CALLS`` (one function for every test: a debug
  callback is part of the program its first solve compiled)."""
  jax.debug.callback(lambda: _CALLS.append(1))
  return _ridge_logistic(w, a, y)


@pytest.mark.parametrize("k", [1, 7, 19])
@pytest.mark.parametrize("name", list(RESUMED_OPTIMIZERS))
def test_a_resumed_run_is_the_uninterrupted_run(name, k):
  """Rules 1-3: stopped at k steps and resumed from its result, the run makes the steps,
  the calls (the objective's own count, by a debug callback: one objective throughout)
  and the point of the run that never stopped, and the resumed call compiles nothing."""
  opt = RESUMED_OPTIMIZERS[name]()

  def run(x0, steps, state=None):
    jax.effects_barrier()
    _CALLS.clear()
    out = hdm_optax.solve(
      opt, _counted, x0, fun_args=(_A, _Y), max_steps=steps, tol=1e-9, init_state=state
    )
    jax.effects_barrier()
    return out, len(_CALLS)

  whole, whole_calls = run(jnp.zeros(8), 400)
  first, first_calls = run(jnp.zeros(8), k)
  run(first.params, 400, first)  # compiles the eager helpers once
  with Compilations() as compiled:
    rest, rest_calls = run(first.params, 400, first)
  assert compiled.count == 0
  assert int(whole.num_steps) > k  # the split happened inside the run
  assert int(rest.num_steps) == int(whole.num_steps)
  assert int(rest.num_grad_evals) == int(whole.num_grad_evals)
  assert first_calls + rest_calls == whole_calls  # no extra call at the resume
  assert int(rest.status) == int(whole.status)
  np.testing.assert_allclose(rest.params, whole.params, rtol=1e-12, atol=1e-15)


def test_a_fresh_a_warm_and_a_resumed_run_share_one_program():
  """Rule 5: init_state None, a state, a result: one compiled program."""
  opt = hdm_optax.trial_lbfgs(memory_size=4)
  run = lambda x0, state=None: hdm_optax.solve(
    opt, _ridge_logistic, x0, fun_args=(_A, _Y), max_steps=1500, tol=1e-9, init_state=state
  )
  first = run(jnp.zeros(8))
  run(first.params, first), run(jnp.ones(8), first.state)  # eager helpers
  with Compilations() as compiled:
    fresh = run(jnp.ones(8))
    warm = run(jnp.ones(8), first.state)
    resumed = run(first.params, first)
  assert compiled.count == 0
  assert int(warm.num_steps) < int(fresh.num_steps) or int(warm.num_grad_evals) >= 1
  assert int(resumed.num_steps) == int(first.num_steps)  # already converged: no step


def test_the_progress_line_the_callback_and_the_trace_go_on(capfd):
  """Rule 2: the resumed run's snapshots, line and trace count from where it stopped."""
  seen = []
  run = lambda x0, steps, state=None, **kw: hdm_optax.solve(
    optax.sgd(1e-3),
    _ridge_logistic,
    x0,
    fun_args=(_A, _Y),
    max_steps=steps,
    tol=0.0,
    init_state=state,
    **kw,
  )
  first = run(jnp.zeros(8), 10)
  capfd.readouterr()
  rest = run(
    first.params, 16, first, callback=lambda s: seen.append(int(s.num_steps)), progress=True
  )
  assert seen == list(range(11, 17))
  assert "steps 16" in capfd.readouterr().err.splitlines()[-1]
  np.testing.assert_array_equal(rest.trace.step[:7], np.arange(10, 17))
  np.testing.assert_allclose(rest.trace.value[0], first.value, rtol=0)


def test_an_optimizer_without_a_cache_evaluates_once_at_the_resume():
  """Rule 3: optax.sgd keeps no f and grad f: the resumed run evaluates them, counted."""
  run = lambda x0, steps, state=None: hdm_optax.solve(
    optax.sgd(1e-3),
    _ridge_logistic,
    x0,
    fun_args=(_A, _Y),
    max_steps=steps,
    tol=0.0,
    init_state=state,
  )
  whole, first = run(jnp.zeros(8), 30), run(jnp.zeros(8), 12)
  rest = run(first.params, 30, first)
  assert int(rest.num_steps) == 30 and int(rest.num_grad_evals) == int(whole.num_grad_evals) + 1
  np.testing.assert_allclose(rest.params, whole.params, rtol=1e-12)


@pytest.mark.parametrize("how", ["callback_stop", "callback_error", "minimize", "solve_batch"])
def test_every_way_a_run_stops_resumes(how):
  """Rules 1-2 across the doors: a callback's StopIteration, a callback's exception's
  .result, minimize's own result, a batch's result member by member."""
  if how == "minimize":
    whole = hdm_optax.minimize(_ridge_logistic, jnp.zeros(8), args=(_A, _Y), tol=1e-10)
    first = hdm_optax.minimize(_ridge_logistic, jnp.zeros(8), args=(_A, _Y), tol=1e-10, max_steps=5)
    rest = hdm_optax.minimize(_ridge_logistic, first.x, args=(_A, _Y), tol=1e-10, init_state=first)
    assert (rest.nit, rest.njev) == (whole.nit, whole.njev)
    np.testing.assert_allclose(rest.x, whole.x, rtol=1e-12)
    return
  opt = hdm_optax.trial_lbfgs()
  if how == "solve_batch":
    a, y = jnp.stack([_A, 2 * _A]), jnp.stack([_Y, _Y])
    run = lambda x0, steps, state=None: hdm_optax.solve_batch(
      opt, _ridge_logistic, x0, fun_args=(a, y), max_steps=steps, tol=1e-9, init_state=state
    )
    whole, first = run(jnp.zeros((2, 8)), 400), run(jnp.zeros((2, 8)), 6)
    rest = run(first.params, 400, first)
    np.testing.assert_array_equal(rest.num_grad_evals, whole.num_grad_evals)
    np.testing.assert_allclose(rest.params, whole.params, rtol=1e-12, atol=1e-15)
    return
  whole = hdm_optax.solve(opt, _ridge_logistic, jnp.zeros(8), fun_args=(_A, _Y), tol=1e-9)
  if how == "callback_stop":
    stop = lambda s: int(s.num_steps) == 6
    first = hdm_optax.solve(
      opt, _ridge_logistic, jnp.zeros(8), fun_args=(_A, _Y), tol=1e-9, callback=stop
    )
  else:
    with pytest.raises(LookupError) as caught:
      hdm_optax.solve(
        opt,
        _ridge_logistic,
        jnp.zeros(8),
        fun_args=(_A, _Y),
        tol=1e-9,
        callback=_Refuses(LookupError("out"), at=6),
      )
    first = caught.value.result
  assert int(first.num_steps) == 6 and int(first.status) == hdm_optax.Status.STOPPED
  rest = hdm_optax.solve(
    opt, _ridge_logistic, first.params, fun_args=(_A, _Y), tol=1e-9, init_state=first
  )
  assert (int(rest.num_steps), int(rest.num_grad_evals)) == (
    int(whole.num_steps),
    int(whole.num_grad_evals),
  )
  np.testing.assert_allclose(rest.params, whole.params, rtol=1e-12, atol=1e-15)


def test_a_result_resumes_only_from_its_own_params():
  """Rule 1: other init_params with a result are refused by name (the warm start is the
  state's); a warm start counts from 0 and evaluates f."""
  opt = hdm_optax.trial_lbfgs()
  first = hdm_optax.solve(opt, _ridge_logistic, jnp.zeros(8), fun_args=(_A, _Y), max_steps=5)
  with pytest.raises(
    ValueError, match=r"init_params differ from result.params.*init_state=result.state"
  ):
    hdm_optax.solve(opt, _ridge_logistic, first.params + 1e-3, fun_args=(_A, _Y), init_state=first)
  warm = hdm_optax.solve(
    opt, _ridge_logistic, first.params + 1e-3, fun_args=(_A, _Y), init_state=first.state
  )
  assert int(warm.num_grad_evals) == int(warm.num_steps) + 1  # counted from 0, f evaluated


# --- objectives whose gradient has no forward mode (docs/gradients.md) --------------------


@jax.custom_vjp
def _identity_reverse_only(x):
  return x


_identity_reverse_only.defvjp(lambda x: (x, None), lambda _, g: (g,))


@jax.custom_vjp
def _square_plain_rule(x):
  return x**2


_square_plain_rule.defvjp(lambda x: (x**2, x), lambda x, g: (2 * x * g,))


@jax.custom_vjp
def _square_reverse_only(x):  # its gradient holds a custom_vjp: no jax.jvp of grad f
  return x**2


_square_reverse_only.defvjp(lambda x: (x**2, x), lambda x, g: (2 * _identity_reverse_only(x) * g,))


def _fit(square):
  """f(x; a) = sum square(x - a) + 0.1 ||x||^2: x*(a) = a / 1.1, d sum x* / da_i = 1 / 1.1."""
  return lambda x, a: jnp.sum(square(x - a)) + 0.1 * jnp.sum(x**2)


_REVERSE_DOORS = {
  "solve": lambda fun, a, adjoint: (
    hdm_optax.solve(
      hdm_optax.trial_lbfgs(), fun, jnp.zeros(3), fun_args=(a,), tol=1e-10, adjoint=adjoint
    ).params
  ),
  "minimize": lambda fun, a, adjoint: (
    hdm_optax.minimize(fun, jnp.zeros(3), args=(a,), tol=1e-12, adjoint=adjoint, max_steps=60).x
  ),
  "solve_batch": lambda fun, a, adjoint: (
    hdm_optax.solve_batch(
      hdm_optax.trial_lbfgs(),
      fun,
      jnp.zeros((2, 3)),
      fun_args=(jnp.stack([a, 2 * a]),),
      tol=1e-10,
      adjoint=adjoint,
      max_steps=60,
    ).params
  ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("door", list(_REVERSE_DOORS))
def test_a_gradient_without_forward_mode_is_refused_by_name(door, jit):
  """The implicit rule needs jax.jvp of grad f; where f's gradient holds a custom_vjp (as
  diffrax's RecursiveCheckpointAdjoint's does) JAX fails only when lowering the backward
  pass, with no hint. The refusal names the cause and the two fixes."""
  solve = _REVERSE_DOORS[door]
  outer = lambda a: jnp.sum(solve(_fit(_square_reverse_only), a, None))
  grad = jax.jit(jax.grad(outer)) if jit else jax.grad(outer)
  with pytest.raises(TypeError, match=r"custom_vjp.*UnrolledAdjoint\(\).*DirectAdjoint"):
    grad(jnp.ones(3))


@pytest.mark.parametrize("door", ["solve", "minimize"])
def test_the_fixes_the_refusal_names_give_the_derivative(door):
  """UnrolledAdjoint differentiates the same reverse-only objective (reverse over reverse),
  and a custom_vjp whose rule is plain JAX keeps the implicit rule: both give the closed
  form d sum x*(a) / da = 1 / 1.1 per entry."""
  solve = _REVERSE_DOORS[door]
  unrolled = hdm_optax.UnrolledAdjoint()
  via_scan = jax.grad(lambda a: jnp.sum(solve(_fit(_square_reverse_only), a, unrolled)))
  implicit = jax.grad(lambda a: jnp.sum(solve(_fit(_square_plain_rule), a, None)))
  a = jnp.asarray([1.0, -2.0, 0.5])
  # Both runs converge to ||grad f|| <= 1e-10 on a problem of condition 1: the derivatives
  # carry that residual, far above float64 rounding.
  np.testing.assert_allclose(via_scan(a), np.full(3, 1 / 1.1), rtol=1e-8)
  np.testing.assert_allclose(implicit(a), np.full(3, 1 / 1.1), rtol=1e-8)


@pytest.mark.parametrize("door", ["solve", "solve_batch", "minimize"])
def test_a_result_resumed_on_other_data_evaluates_f_there(door):
  """A resumed run takes f and grad f at the params from the optimizer's cache, which
  belongs to the data its run read. On other data (here 3 A) they are evaluated anew, one
  counted call: the run reports f of the new data at its params (it reported the old f,
  and CONVERGED on the old gradient). On the same arrays the cache is taken (no call)."""
  opt, steps = hdm_optax.trial_lbfgs(), 12
  new = (3.0 * _A, _Y)
  f_new = jax.jit(_ridge_logistic)

  def run(fun_args, init_state=None, max_steps=steps):
    if door == "solve":
      return hdm_optax.solve(
        opt,
        _ridge_logistic,
        jnp.zeros(8) if init_state is None else init_state.params,
        fun_args=fun_args,
        max_steps=max_steps,
        tol=1e-12,
        init_state=init_state,
      )
    if door == "solve_batch":
      x0 = jnp.zeros((1, 8)) if init_state is None else init_state.params
      return hdm_optax.solve_batch(
        opt,
        _ridge_logistic,
        x0,
        fun_args=fun_args,
        in_axes=(0, None),
        max_steps=max_steps,
        tol=1e-12,
        init_state=init_state,
      )
    x0 = np.zeros(8) if init_state is None else init_state.x
    options = {"maxiter": max_steps, "gtol": 1e-12, "ftol": 0.0}
    return hdm_optax.minimize(
      _ridge_logistic, x0, args=fun_args, options=options, init_state=init_state
    )

  first = run((_A, _Y))
  same = run((_A, _Y), first, max_steps=steps + 1)
  assert int(np.ravel(same.num_value_evals)[0]) == int(np.ravel(first.num_value_evals)[0]) + 1
  other = run(new, first, max_steps=steps + 1)
  assert int(np.ravel(other.num_value_evals)[0]) == int(np.ravel(first.num_value_evals)[0]) + 2
  params = jnp.asarray(other.params if door != "minimize" else other.x).reshape(8)
  np.testing.assert_allclose(
    float(np.ravel(other.value)[0]), float(f_new(params, *new)), rtol=1e-14
  )


def _run_door(door, fun, x0, init_state=None, max_steps=200):
  """``fun`` minimized from ``x0`` through ``door`` (two problems of ``x0`` for the batch
  doors), to ||grad f||_inf <= 1e-10; ``init_state`` as the door takes it."""
  opt, limits = hdm_optax.trial_lbfgs(), dict(max_steps=max_steps, tol=1e-10)
  if door == "solve":
    return hdm_optax.solve(opt, fun, x0, init_state=init_state, **limits)
  if door == "solve_batch":
    return hdm_optax.solve_batch(opt, fun, x0, in_axes=(0, None), init_state=init_state, **limits)
  if door == "sweep":
    return hdm_optax.sweep(opt, {}, fun, x0, in_axes=(0, None), init_state=init_state, **limits)
  options = {"maxiter": max_steps, "gtol": 1e-10, "ftol": 0.0}
  return hdm_optax.minimize(fun, x0, options=options, init_state=init_state)


_RESUMING_DOORS = ("solve", "minimize", "solve_batch", "sweep")


def _x0(door):
  return jnp.zeros(3) if door in ("solve", "minimize") else jnp.zeros((2, 3))


@pytest.mark.parametrize("change", ["closed_array", "closed_number", "another_function"])
@pytest.mark.parametrize("door", _RESUMING_DOORS)
def test_a_result_resumed_with_another_objective_evaluates_f_there(door, change):
  """The optimizer's cache of f and grad f belongs to the objective its run ran: resumed
  after the array or the number ``fun`` closes over was rebound, or with another ``fun``,
  the run evaluates f and grad f at the params (one counted call, as a warm start from
  ``result.state`` does) and goes on to the new optimum. It reported f = 0 and CONVERGED at
  the old optimum, where the new f is 48."""
  c, k = jnp.full(3, 1.0), 1.0
  fun = {
    "closed_array": lambda x: jnp.sum((x - c) ** 2),
    "closed_number": lambda x: jnp.sum((x - k) ** 2),
    "another_function": lambda x: jnp.sum((x - 1.0) ** 2),
  }[change]
  out = _run_door(door, fun, _x0(door))
  first = getattr(out, "results", out)
  assert bool(np.all(first.converged))
  c, k = jnp.full(3, 5.0), 5.0
  if change == "another_function":
    fun = lambda x: 0.5 * jnp.sum((x - 5.0) ** 2) + 1.0
  rest = _run_door(door, fun, first.params, init_state=out)
  rest = getattr(rest, "results", rest)
  warm = _run_door(door, fun, first.params, init_state=first.state)
  warm = getattr(warm, "results", warm)
  params = np.reshape(rest.params, (-1, 3))
  # f at its minimum 0 or 1, evaluated in float64 by the program and here: rounding alone.
  fresh = [float(fun(jnp.asarray(x))) for x in params]
  np.testing.assert_allclose(np.ravel(rest.value), fresh, rtol=1e-14, atol=1e-14)
  np.testing.assert_allclose(params, np.full_like(params, 5.0), rtol=0, atol=1e-9)
  assert bool(np.all(rest.converged))
  for count in ("num_value_evals", "num_grad_evals", "num_steps"):
    resumed, parts = getattr(rest, count), (getattr(first, count), getattr(warm, count))
    np.testing.assert_array_equal(np.ravel(resumed), np.ravel(parts[0]) + np.ravel(parts[1]))


@pytest.mark.parametrize("door", _RESUMING_DOORS)
def test_a_result_resumed_with_the_same_objective_makes_no_extra_call(door):
  """The same objective (a new function object of the same code, reading the same array and
  number, and a NumPy constant that ``fun`` makes anew at each trace): the resumed run
  takes f and grad f from the cache and is the run that never stopped, call for call."""
  c, k = jnp.asarray([1.0, -2.0, 3.0]), 0.5
  make = lambda: lambda x: jnp.sum(np.linspace(1.0, 3.0, 3) * (x - c) ** 2) + k * jnp.sum(x**4)
  whole = _run_door(door, make(), _x0(door))
  out = _run_door(door, make(), _x0(door), max_steps=3)
  first = getattr(out, "results", out)
  rest = _run_door(door, make(), first.params, init_state=out)
  whole, rest = getattr(whole, "results", whole), getattr(rest, "results", rest)
  assert int(np.ravel(whole.num_steps)[0]) > 3  # the split happened inside the run
  for count in ("num_value_evals", "num_grad_evals", "num_steps"):
    np.testing.assert_array_equal(getattr(rest, count), getattr(whole, count))
  np.testing.assert_allclose(rest.params, whole.params, rtol=1e-12, atol=1e-15)
