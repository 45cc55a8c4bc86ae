"""What a user is told, or refused, at six seams: a chain of two methods, a STOPPED run's
cause, an empty box, a NumPy fun's own exception, a resumed ftol-converged run, and params
that are not floating point.

Each test reproduces a user's example and checks the answer, or, where the right answer
is an error, its type and that its message names what went wrong and the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from hdm_optax.driver import separate


def _fun(x):
  return jnp.sum((x - 1.0) ** 2) + 0.1 * jnp.sum(x**4)


def _status(res) -> hdm_optax.Status:
  return hdm_optax.Status(int(np.ravel(res.status)[0]))


# --- 1. a chain of two methods that each choose their own step is refused ---------------------


def _hand_loop(opt, jitted: bool):
  x = jnp.zeros(3)
  state = opt.init(x)

  def step(x, state):
    value, grad = jax.value_and_grad(_fun)(x)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=_fun)
    return optax.apply_updates(x, updates), state

  step = jax.jit(step) if jitted else step
  for _ in range(3):
    x, state = step(x, state)
  return x


@pytest.mark.parametrize("door", ["solve", "loop", "jitted_loop", "sweep"])
@pytest.mark.parametrize("order", ["lbfgs_first", "auto_first"])
def test_a_chain_of_two_methods_is_refused_naming_both(door, order):
  """optax.chain(trial_lbfgs(), hdm_auto()) hands the second method the first one's step as
  its gradient: every trial went uphill and the run made only null steps (status
  MAX_STEPS, the iterate at x0) with no refusal. It is refused, naming both methods."""
  first, second = (
    ("trial_lbfgs", "hdm_auto") if order == "lbfgs_first" else ("hdm_auto", "trial_lbfgs")
  )
  make = lambda: optax.chain(getattr(hdm_optax, first)(), getattr(hdm_optax, second)())
  with pytest.raises(ValueError) as info:
    if door == "solve":
      hdm_optax.solve(make(), _fun, jnp.zeros(3), max_steps=20)
    elif door == "sweep":
      hdm_optax.sweep(lambda: make(), {}, _fun, jnp.zeros(3), max_steps=20)
    else:
      _hand_loop(make(), door == "jitted_loop")
  text = str(info.value)
  assert f"{second}.update received" in text and f"the step {first}.update returned" in text
  assert f"optax.chain({first}(...), {second}(...))" in text and "Use one of them alone" in text


def test_a_method_after_a_gradient_transformation_still_runs():
  """The refusal is for a method's step only: a transformation before the method (a clip)
  is honoured as before."""
  opt = optax.chain(optax.clip_by_global_norm(10.0), hdm_optax.trial_lbfgs())
  res = hdm_optax.solve(opt, _fun, jnp.zeros(3), max_steps=200)
  assert bool(res.converged)


# --- 2. a STOPPED run's message names what stopped it -----------------------------------------


def _raise_stop(snapshot):
  raise StopIteration


def _raise_interrupt(snapshot):
  raise KeyboardInterrupt


@pytest.mark.parametrize(
  "callback, cause",
  [
    (lambda s: True, "by the callback, which returned True"),
    (_raise_stop, "by the callback, which raised StopIteration"),
  ],
)
def test_a_stopped_solve_says_what_stopped_it(callback, cause):
  """The message said "by the callback, by Ctrl-C (KeyboardInterrupt) or by
  sweep(stop_at_first_converged=True)" whatever the cause."""
  res = hdm_optax.solve(hdm_optax.trial_lbfgs(), _fun, jnp.zeros(3), callback=callback)
  assert _status(res) == hdm_optax.Status.STOPPED
  assert res.message == f"stopped before the end: {cause}"


def test_a_callbacks_keyboard_interrupt_result_says_so():
  with pytest.raises(KeyboardInterrupt) as info:
    hdm_optax.solve(hdm_optax.trial_lbfgs(), _fun, jnp.zeros(3), callback=_raise_interrupt)
  assert info.value.result.message == (
    "stopped before the end: by the callback, which raised KeyboardInterrupt"
  )


class _Mine(ValueError):
  pass


def _raise_mine(snapshot):
  raise _Mine("here")


def test_a_callbacks_own_exception_result_names_its_builtin_type():
  """The cause is an int32 code in the result: a builtin exception type is named, one of
  the user's by the builtin type it derives from."""
  with pytest.raises(_Mine) as info:
    hdm_optax.solve(hdm_optax.trial_lbfgs(), _fun, jnp.zeros(3), callback=_raise_mine)
  assert info.value.result.message == (
    "stopped before the end: by the callback, which raised an exception derived from ValueError"
  )


def test_a_stopped_minimize_says_what_stopped_it():
  def callback(intermediate_result):
    raise StopIteration

  res = hdm_optax.minimize(_fun, np.zeros(3), callback=callback)
  assert res.status == hdm_optax.Status.STOPPED
  assert res.message == "stopped before the end: by the callback, which raised StopIteration"


def test_a_sweeps_stopped_points_say_what_stopped_them():
  make = lambda lipschitz: hdm_optax.hdm_best(lipschitz=lipschitz)
  grid = {"lipschitz": [2.0, 3.0, 50.0]}
  out = hdm_optax.sweep(make, grid, _fun, jnp.zeros(30), stop_at_first_converged=True)
  codes = np.asarray(out.results.status)
  stopped = [m for m, c in zip(out.results.message, codes) if c == hdm_optax.Status.STOPPED]
  assert stopped and all("another point converged first" in m for m in stopped)
  out = hdm_optax.sweep(make, grid, _fun, jnp.zeros(3), callback=lambda s: True)
  assert all(m.endswith("by the callback, which returned True") for m in out.results.message)


def test_a_copied_stopped_result_still_says_what_stopped_it():
  """The cause was kept on the host by the id of the status array: a copy of the result
  (``jax.tree.map``, to NumPy or on the device) said only the statuses' common line."""
  res = hdm_optax.solve(hdm_optax.trial_lbfgs(), _fun, jnp.zeros(3), callback=lambda s: True)
  for copy in (np.asarray, jnp.copy):
    copied = jax.tree.map(copy, res)
    assert copied.message == "stopped before the end: by the callback, which returned True"


@pytest.mark.parametrize("transform", ["jit", "vmap"])
def test_a_result_made_under_jit_or_vmap_says_what_stopped_it(transform):
  """Under the user's ``jax.jit`` or ``jax.vmap`` the host saw the run's result only as
  another array, and the message said the statuses' common line."""
  solve = lambda x0: hdm_optax.solve(hdm_optax.trial_lbfgs(), _fun, x0, callback=lambda s: True)
  res = jax.jit(solve)(jnp.zeros(3)) if transform == "jit" else jax.vmap(solve)(jnp.zeros((2, 3)))
  assert np.all(np.asarray(res.status) == hdm_optax.Status.STOPPED)
  messages = res.message if transform == "vmap" else [res.message]
  assert messages == ["stopped before the end: by the callback, which returned True"] * (
    2 if transform == "vmap" else 1
  )


def test_a_sweep_of_states_of_other_shapes_says_what_stopped_its_points():
  """Points whose states have other shapes run as programs of their own, and their results
  are joined (``results.state`` a list): the stopped points said the common line."""
  make = lambda memory_size, learning_rate: optax.chain(
    optax.scale_by_lbfgs(memory_size=memory_size), optax.scale(-learning_rate)
  )
  grid = [{"memory_size": m, "learning_rate": lr} for m in (3, 5) for lr in (0.5, 0.001)]
  out = hdm_optax.sweep(make, grid, _fun, jnp.zeros(3), stop_at_first_converged=True)
  assert isinstance(out.results.state, list)
  codes = np.asarray(out.results.status)
  stopped = [m for m, c in zip(out.results.message, codes) if c == hdm_optax.Status.STOPPED]
  assert len(stopped) == 2, out.results.message
  assert all(m.endswith("another point converged first") for m in stopped), stopped


# --- 3. an empty box's message prints plain numbers and names the leaf ------------------------


@pytest.mark.parametrize(
  "make, expected",
  [
    (
      lambda: hdm_optax.minimize(_fun, np.zeros(3), bounds=[(0, 1), (2.0, 1.0), (0, 1)]),
      "bounds' lower > bounds' upper at index (1,): 2.0 > 1.0;",
    ),
    (
      lambda: hdm_optax.trial_lbfgs(lower=np.array([0, 2.0, 0]), upper=np.ones(3)),
      "lower > upper at index (1,): 2.0 > 1.0;",
    ),
    (
      lambda: hdm_optax.trial_lbfgs(lower={"a": np.array([0, 2.0])}, upper={"a": np.ones(2)}),
      "lower > upper at leaf ['a'], index (1,): 2.0 > 1.0;",
    ),
    (
      lambda: hdm_optax.trial_lbfgs(lower={"a": np.float32(2.5)}, upper={"a": np.float32(0.1)}),
      "lower > upper at leaf ['a']: 2.5 > 0.1;",
    ),
  ],
)
def test_an_empty_box_is_named_with_plain_numbers(make, expected):
  """The message printed np.float64(2.0) > np.float64(1.0), "at index ()" for a scalar, and
  no leaf for a pytree bound."""
  with pytest.raises(ValueError) as info:
    make()
  text = str(info.value)
  assert expected in text and "np.float" not in text


# --- 4. a NumPy objective's exception reaches the user as itself ------------------------------


def _numpy_fun(x):
  x = np.asarray(x)
  if x[0] > 0.5:
    raise ValueError("bad x")
  return float(np.sum((x - 1.0) ** 2))


def test_a_numpy_objectives_exception_surfaces_under_vmap():
  """Under jax.vmap the host function runs in a jax.pure_callback, and the user got JAX's
  INTERNAL JaxRuntimeError instead of their ValueError."""
  run = jax.vmap(lambda x0: hdm_optax.minimize(_numpy_fun, x0, jac="2-point").x)
  with pytest.raises(ValueError, match="bad x") as info:
    run(jnp.zeros((2, 3)))
  assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)


def test_a_numpy_objectives_exception_surfaces_on_the_fused_path(monkeypatch):
  """Where the separate path is closed (a GPU's default backend, sharded inputs) the host
  function runs in a jax.pure_callback of the fused program."""
  monkeypatch.setattr(separate, "open_to", lambda *args: False)
  with pytest.raises(ValueError, match="bad x"):
    hdm_optax.minimize(_numpy_fun, np.zeros(3), jac="2-point")


# --- 5. a run converged on ftol, resumed, does not move ----------------------------------------


def test_a_resumed_ftol_converged_solve_stays():
  """Resumed from its result, an ftol-converged run made one more step (and then reported
  CONVERGED) where a tol-converged one made none."""
  opt = hdm_optax.trial_lbfgs()
  res = hdm_optax.solve(opt, _fun, jnp.zeros(3), ftol=1e-3)
  assert _status(res) == hdm_optax.Status.CONVERGED_FTOL
  again = hdm_optax.solve(opt, _fun, res.params, init_state=res, ftol=1e-3)
  assert _status(again) == hdm_optax.Status.CONVERGED_FTOL
  assert int(again.num_steps) == int(res.num_steps)
  np.testing.assert_array_equal(again.params, res.params)
  # Asked for more (a smaller ftol), it goes on.
  further = hdm_optax.solve(opt, _fun, res.params, init_state=res, ftol=1e-12)
  assert int(further.num_steps) > int(res.num_steps)


def test_a_resumed_ftol_converged_minimize_stays():
  res = hdm_optax.minimize(_fun, np.zeros(3), options={"ftol": 1e-3})
  assert res.status == hdm_optax.Status.CONVERGED_FTOL
  again = hdm_optax.minimize(_fun, res.x, options={"ftol": 1e-3}, init_state=res)
  assert again.status == hdm_optax.Status.CONVERGED_FTOL and again.nit == res.nit
  np.testing.assert_array_equal(again.x, res.x)


def test_a_resumed_ftol_converged_batch_stays():
  """A batch keeps no trace by default: its result's ftol test holds at any ftol > 0."""
  run = lambda x, state: hdm_optax.solve_batch(
    hdm_optax.trial_lbfgs(), _fun, x, in_axes=(0, None), init_state=state, ftol=1e-3
  )
  res = run(jnp.zeros((2, 3)), None)
  assert np.all(np.asarray(res.status) == hdm_optax.Status.CONVERGED_FTOL)
  again = run(res.params, res)
  np.testing.assert_array_equal(again.num_steps, res.num_steps)
  np.testing.assert_array_equal(again.params, res.params)


def test_a_result_resumes_inside_jit():
  """Resuming a result inside jax.jit raised TracerArrayConversionError (the counts were
  made NumPy ints)."""
  opt = hdm_optax.trial_lbfgs()
  res = hdm_optax.solve(opt, _fun, jnp.zeros(3), ftol=1e-3)
  again = jax.jit(lambda r: hdm_optax.solve(opt, _fun, r.params, init_state=r, ftol=1e-3))(res)
  assert _status(again) == hdm_optax.Status.CONVERGED_FTOL
  assert int(again.num_steps) == int(res.num_steps)


# --- a new user's tasks ------------------------------------------------------------------------


def test_scipys_return_all_is_refused_with_the_fix():
  """A SciPy user's options={"return_all": True} was refused without a fix ("unknown
  options ['return_all']; L-BFGS-B's are ..."): it says how to get the iterates, and to
  drop the option."""
  with pytest.raises(ValueError) as info:
    hdm_optax.minimize(_fun, np.zeros(3), options={"return_all": True})
  text = str(info.value)
  assert "['return_all']" in text and "callback=" in text and "Drop the others" in text


# --- 6. params that are not floating point: the argument, its dtype and the cast -----------


@pytest.mark.parametrize(
  "call, expected",
  [
    (
      lambda: hdm_optax.solve(hdm_optax.trial_lbfgs(), _fun, np.arange(3)),
      "init_params: params must be real floating-point arrays, got dtype int64: cast it, "
      "e.g. jnp.asarray(init_params, jnp.float64)",
    ),
    (
      lambda: hdm_optax.solve(hdm_optax.trial_lbfgs(), lambda p: _fun(p["a"]), {"a": np.arange(3)}),
      "got dtype int64 at init_params['a']: cast it, e.g. "
      "jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), init_params)",
    ),
    (
      lambda: hdm_optax.minimize(_fun, jnp.arange(3)),
      "x0: params must be real floating-point arrays, got dtype int64: cast it, e.g. "
      "jnp.asarray(x0, jnp.float64)",
    ),
  ],
  ids=["solve", "solve_pytree", "minimize"],
)
def test_integer_params_are_refused_naming_the_argument_its_dtype_and_the_cast(call, expected):
  """An int64 x0 was refused as "init_params: params must be real floating-point arrays, got
  dtype int64; cast them, e.g. jnp.asarray(x, jnp.float32)": a cast of an ``x`` the user
  never named, to float32 where float64 is on (the suite's), and no leaf named."""
  with pytest.raises(TypeError) as info:
    call()
  assert expected in str(info.value), str(info.value)


def test_python_numbers_and_lists_are_still_made_float():
  res = hdm_optax.solve(hdm_optax.trial_lbfgs(), _fun, [0, 0, 0])
  assert bool(res.converged) and jnp.issubdtype(res.params.dtype, jnp.floating)
