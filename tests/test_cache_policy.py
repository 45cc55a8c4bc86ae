"""docs/guide.md's cache rule, statement by statement: a compiled program is reused only where
a fresh one would give the same answer (hdm_optax/driver/programs.py).

Statements tested elsewhere: rebound globals, closure cells, bound methods, equinox modules,
functools.partial, custom rules reading a global, NumPy bounds edited in place, a new
callback object and jax.grad without jit (tests/test_seams_adversarial.py); Python ints
static (tests/test_seams.py); the limits are values of the program
(tests/test_driver_usage.py::test_budgets_and_tolerances_are_traced).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from hdm_optax.driver import compiled as compiled_lib
from hdm_optax.driver import programs

# The separate path, the fused program and the switch between them (tests/conftest.py).
pytestmark = pytest.mark.fused_program

X0 = jnp.zeros(3)


def _solve(fun, **kw):
  return hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, X0, tol=1e-9, **kw)


def _settled(run):
  """``run()`` until its programs are all built: the separate path's two runs, the second
  of which builds the fused program (docs/guide.md, "Which program runs")."""
  for _ in range(2):
    run()
  compiled_lib.wait()


def test_a_new_lambda_of_the_same_code_reuses_the_program():
  """fun is compared by its trace, not its identity (a lambda built at every call)."""
  target = jnp.array([1.0, 2.0, 3.0])
  _settled(lambda: _solve(lambda x: jnp.sum((x - target) ** 2)))
  before = programs.compiled_count()
  res = _solve(lambda x: jnp.sum((x - target) ** 2))
  assert programs.compiled_count() == before
  np.testing.assert_allclose(res.params, target, atol=1e-6)


def test_a_changed_python_number_compiles_a_new_program():
  for shift in (1.0, 2.0):
    res = _solve(lambda x, shift=shift: jnp.sum((x - shift) ** 2))
    np.testing.assert_allclose(res.params, shift, atol=1e-6)


def test_a_python_float_in_fun_args_is_a_value_of_the_program():
  fun = lambda x, c: jnp.sum((x - c) ** 2)
  _settled(lambda: _solve(fun, fun_args=(1.0,)))
  before = programs.compiled_count()
  res = _solve(fun, fun_args=(2.5,))
  assert programs.compiled_count() == before
  np.testing.assert_allclose(res.params, 2.5, atol=1e-6)


_INNER = {"data": jnp.ones(3)}


@jax.jit
def _inner(x):
  return jnp.sum((x - _INNER["data"]) ** 2)


def test_arrays_a_jitted_inner_function_reads_are_compared_by_content():
  """A jax.jit-ed function inside fun bakes what it reads (JAX's own rule): the program
  answers as a fresh call of that function would, and is reused while those arrays are
  the same."""
  fun = lambda x: _inner(x)
  first = _solve(fun)
  _settled(lambda: _solve(fun))
  before = programs.compiled_count()
  again = _solve(fun)
  assert programs.compiled_count() == before
  np.testing.assert_allclose(again.params, first.params)
  fresh = jax.jit(lambda x: jax.grad(_inner)(x))  # what JAX itself answers now
  np.testing.assert_allclose(jax.grad(_inner)(again.params), fresh(again.params), atol=1e-9)


def test_an_equal_optax_chain_built_again_reuses_the_program():
  """Other optax transformations are compared by their functions and what those hold."""
  fun = lambda x: jnp.sum((x - 1.0) ** 2)
  make = lambda: optax.chain(optax.clip(10.0), hdm_optax.trial_lbfgs())
  _settled(lambda: hdm_optax.solve(make(), fun, X0))
  before = programs.compiled_count()
  hdm_optax.solve(make(), fun, X0)
  assert programs.compiled_count() == before
  hdm_optax.solve(optax.chain(optax.clip(5.0), hdm_optax.trial_lbfgs()), fun, X0)
  assert programs.compiled_count() == before + 1  # another clip: another method's program


def test_a_numpy_array_an_optax_transformation_holds_is_compared_by_content():
  fun = lambda x: jnp.sum((x - 3.0) ** 2)
  keep = np.array([1.0, 0.0, 1.0])  # entry 1 frozen
  opt = optax.chain(optax.stateless(lambda u, params=None: u * keep), hdm_optax.hdm_best())
  first = hdm_optax.solve(opt, fun, X0, max_steps=50)
  keep[:] = 1.0  # edited in place: nothing is frozen any more
  second = hdm_optax.solve(opt, fun, X0, max_steps=50)
  assert float(first.params[1]) == 0.0 and float(second.params[1]) != 0.0


# --- sweep's make_optimizer: compared by the optimizer it builds ----------------------------

SCALE = 1.0  # a module global that _scaled_sgd reads
_RATES = (0.01, 0.02)
_WEIGHTED = lambda x: jnp.sum(jnp.array([1.0, 10.0, 3.0]) * (x - 1.0) ** 2)  # noqa: E731


def _scaled_sgd(learning_rate):
  return optax.sgd(learning_rate * SCALE)


class _Config:
  """A bound method's object: ``make`` reads ``momentum`` when it builds."""

  momentum = None

  def make(self, learning_rate):
    return optax.sgd(learning_rate, momentum=self.momentum)


def _swept(make_optimizer):
  grid = {"learning_rate": list(_RATES)}
  return hdm_optax.sweep(make_optimizer, grid, _WEIGHTED, X0, max_steps=5, tol=0.0).results.params


def _solved(make_optimizer):
  """Each grid point's own solve, with the optimizer ``make_optimizer`` builds now."""
  run = lambda rate: hdm_optax.solve(make_optimizer(rate), _WEIGHTED, X0, max_steps=5, tol=0.0)
  return np.stack([run(rate).params for rate in _RATES])


def test_a_global_make_optimizer_reads_is_read_at_each_sweep(monkeypatch):
  """A module global read by make_optimizer, changed between two sweeps: each sweep runs the
  optimizer built now."""
  for scale in (1.0, 0.0, 1.0):
    monkeypatch.setitem(globals(), "SCALE", scale)
    np.testing.assert_allclose(_swept(_scaled_sgd), _solved(_scaled_sgd), rtol=1e-12)


def test_a_bound_make_optimizer_reads_its_objects_attributes_at_each_sweep():
  config = _Config()
  for momentum in (None, 0.9, None):
    config.momentum = momentum
    np.testing.assert_allclose(_swept(config.make), _solved(config.make), rtol=1e-12)


def test_an_unchanged_make_optimizer_reuses_the_sweeps_program():
  """The same factory again, a bound method of the same unchanged object and an hdm_optax
  factory built anew compile nothing new."""
  config = _Config()
  hdm_best = lambda: lambda learning_rate: hdm_optax.hdm_best(precond_lr=learning_rate)  # noqa: E731
  for make in (_scaled_sgd, config.make, hdm_best()):
    _swept(make)
  before = programs.compiled_count()
  for make in (_scaled_sgd, config.make, hdm_best()):
    _swept(make)
  assert programs.compiled_count() == before


def test_a_make_optimizer_that_reads_a_traced_value_runs_inline():
  """make_optimizer closing over a caller's jit's tracer: no key, so the sweep is traced
  inline, as solve is."""
  inside = jax.jit(lambda scale: _swept(lambda learning_rate: optax.sgd(learning_rate * scale)))
  np.testing.assert_allclose(inside(0.5), _solved(lambda rate: optax.sgd(rate * 0.5)), rtol=1e-12)


# --- an optax optimizer: traced at the call where a function of the user's lies inside ----

RATE = 0.1  # a module global the user's schedule and transformation below read
_HALF_SQUARE = lambda x: 0.5 * jnp.sum(x**2)  # noqa: E731
_OPTAX_MADE = {
  "lbfgs": optax.lbfgs,
  "adam": lambda: optax.adam(1e-2),
  "chain": lambda: optax.chain(optax.clip(1.0), optax.sgd(0.1)),
}


def _users_update(updates, state, params=None):
  del params
  return jax.tree.map(lambda u: -RATE * u, updates), state


_READS_RATE = {
  "schedule": lambda: optax.sgd(lambda count: RATE),
  "injected schedule": lambda: optax.inject_hyperparams(optax.sgd)(lambda count: RATE),
  "transformation in a chain": lambda: optax.chain(
    optax.clip(10.0), optax.GradientTransformation(lambda p: optax.EmptyState(), _users_update)
  ),
}


@pytest.mark.parametrize("where", list(_READS_RATE))
def test_a_global_a_users_function_inside_an_optax_optimizer_reads_is_read_at_each_call(
  where, monkeypatch
):
  """x <- (1 - RATE) x three times, RATE read by the user's function at each call: the same
  optimizer solves again after RATE changes with the new rate."""
  optimizer = _READS_RATE[where]()
  for rate in (0.1, 0.5, 0.1):
    monkeypatch.setitem(globals(), "RATE", rate)
    for _ in range(3):  # the separate path twice, then the fused program
      res = hdm_optax.solve(optimizer, _HALF_SQUARE, jnp.ones(2), max_steps=3, tol=0.0)
      np.testing.assert_allclose(res.params, (1 - rate) ** 3, rtol=1e-6)


def test_a_global_a_users_function_inside_a_swept_optax_optimizer_reads_is_read_at_each_sweep(
  monkeypatch,
):
  make = lambda learning_rate: optax.sgd(lambda count: learning_rate * RATE)  # noqa: E731
  for rate in (1.0, 0.0, 1.0):
    monkeypatch.setitem(globals(), "RATE", rate)
    np.testing.assert_allclose(_swept(make), _solved(make), rtol=1e-12)


def test_an_optax_optimizer_made_of_library_code_is_keyed_without_tracing_its_update(monkeypatch):
  """Its functions are optax's and JAX's and what they hold is in its fingerprint: its key
  needs no trace of init and update (which costs 30 ms for optax.lbfgs's line search), and
  its repeated call compiles nothing. A function of the user's inside is still traced."""
  traced = []
  trace = programs._update_trace  # pylint: disable=protected-access
  counted = lambda *args: traced.append(args) or trace(*args)  # noqa: E731
  monkeypatch.setattr(programs, "_update_trace", counted)
  for make in _OPTAX_MADE.values():
    _settled(lambda: hdm_optax.solve(make(), _HALF_SQUARE, X0, max_steps=5))
    before = programs.compiled_count()
    hdm_optax.solve(make(), _HALF_SQUARE, X0, max_steps=5)
    assert programs.compiled_count() == before
  lbfgs = lambda learning_rate: optax.lbfgs(learning_rate)  # noqa: E731
  _settled(lambda: _swept(lbfgs))
  before = programs.compiled_count()
  _swept(lbfgs)
  assert programs.compiled_count() == before
  assert not traced
  for make in _READS_RATE.values():
    hdm_optax.solve(make(), _HALF_SQUARE, X0, max_steps=5)
  assert len(traced) == len(_READS_RATE)


def test_small_programs_compile_with_the_elemental_emitters_on_the_cpu():
  """docs/speed.md: inputs of at most SMALL_PROGRAM entries compile for a short first call,
  and the separate path's small method program (a host call per iteration) is scheduled
  depth first; larger ones, and programs staged inside a caller's jit, keep XLA's
  defaults."""
  if jax.default_backend() != "cpu":
    pytest.skip("the elemental emitters are an XLA:CPU option; other backends keep defaults")
  elemental = {"xla_cpu_use_fusion_emitters": False}
  depth_first = {**elemental, "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
  small = (jnp.zeros(10), (jnp.ones((100, 10)),))
  large = (jnp.zeros(10), (jnp.ones((programs.SMALL_PROGRAM, 2)),))
  assert programs.compiler_options(small) == elemental
  assert programs.compiler_options(small, host_loop=True) == depth_first
  assert programs.compiler_options(large) == {}
  assert programs.compiler_options(large, host_loop=True) == {}
  # The front door compiles a small problem's method program (the separate path) with them.
  hdm_optax.clear_caches()
  _solve(lambda x: jnp.sum((x - 4.0) ** 2))
  keys = list(compiled_lib._CACHE.entries)  # pylint: disable=protected-access
  assert any(key[0] == "method" and key[-1] == tuple(sorted(depth_first.items())) for key in keys)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
def test_an_xla_that_spells_the_scheduler_otherwise_compiles_with_its_spelling(monkeypatch):
  """The scheduler's option keeps its key; the compile tries the next spelling where XLA
  refuses one (older XLAs spell it otherwise), and the next compile starts there."""
  spellings = ({"xla_cpu_no_such_scheduler": "X"}, *programs._DEPTH_FIRST)  # pylint: disable=protected-access
  monkeypatch.setattr(programs, "_DEPTH_FIRST", spellings)
  monkeypatch.setattr(programs, "_SPELLING", [0])
  options = programs.compiler_options((jnp.zeros(3),), host_loop=True)
  assert "xla_cpu_no_such_scheduler" in options
  lowered = jax.jit(lambda x: x * 2.0).lower(jnp.ones(3))
  compiled = programs.compile_lowered(lowered, options)
  np.testing.assert_array_equal(compiled(jnp.ones(3)), 2.0)
  assert programs._SPELLING == [1]  # pylint: disable=protected-access
  programs.compile_lowered(lowered, options)
  assert programs._SPELLING == [1]  # pylint: disable=protected-access
  with pytest.raises(jax.errors.JaxRuntimeError, match="no_such_option"):
    programs.compile_lowered(lowered, {**options, "xla_cpu_no_such_option": 1})


def test_a_solve_staged_in_a_callers_jit_takes_the_callers_options():
  """JAX refuses compiler options on a nested jit: the front door must not pass them there."""
  fun = lambda x, c: jnp.sum((x - c) ** 2)  # noqa: E731
  inside = jax.jit(
    lambda c: hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, X0, fun_args=(c,)).params
  )
  inside_np = jax.jit(
    lambda: (
      hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, np.zeros(3), fun_args=(np.ones(3),)).params
    )
  )
  outside = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, X0, fun_args=(jnp.ones(3),)).params
  np.testing.assert_allclose(inside(jnp.ones(3)), outside, atol=1e-6)
  np.testing.assert_allclose(inside_np(), outside, atol=1e-6)


def test_staged_answers_as_a_bind_of_a_constant_would():
  """programs.staged's shortcut outside every transformation agrees with what a constant's
  bind gives under each transformation (staged only where a trace stages it out)."""
  bind = lambda: isinstance(jax.lax.stop_gradient(0.0), jax.core.Tracer)
  seen = []

  def probe(x):
    seen.append((programs.staged(), bind()))
    return x

  probe(1.0)
  jax.jit(probe)(1.0)
  jax.vmap(probe)(jnp.ones(2))
  jax.grad(probe)(1.0)
  jax.jit(jax.vmap(probe))(jnp.ones(2))
  jax.vmap(jax.jit(probe))(jnp.ones(2))
  assert [s for s, _ in seen] == [b for _, b in seen]
  assert [s for s, _ in seen] == [False, True, False, False, True, True]


def test_a_transformation_of_plain_arguments_is_prepared_once_per_shapes():
  """prepare() keeps its answer for a call of numbers, strings and None (the same for the
  same params' shapes), and works it out again for other shapes and for arrays (which a
  user may edit in place: tests/test_seams_adversarial.py)."""
  x, y = jnp.zeros(3), jnp.zeros(4)
  first = programs.prepare(hdm_optax.trial_lbfgs(), x)
  assert programs.prepare(hdm_optax.trial_lbfgs(), x) is first
  assert programs.prepare(hdm_optax.trial_lbfgs(), y) is not first
  assert programs.prepare(hdm_optax.trial_lbfgs(memory_size=4), x)[2] != first[2]
  lower = np.zeros(3)
  boxed = hdm_optax.trial_lbfgs(lower=lower)
  assert programs.prepare(boxed, x) is not programs.prepare(boxed, x)


def test_a_dict_of_bounds_edited_after_the_build_is_not_seen_on_any_call():
  """The transformation holds its arguments' dicts as they were when it was built: every
  call, on the separate path and on the fused program alike, answers as the transformation
  built with the original dict does (an edit does not reach it)."""
  fun = lambda p: (p["a"] - 3.0) ** 2 + (p["b"] + 3.0) ** 2
  x0 = {"a": jnp.zeros(()), "b": jnp.zeros(())}
  lower, upper = {"a": -1.0, "b": -1.0}, {"a": 1.0, "b": 1.0}
  optimizer = hdm_optax.trial_lbfgs(lower=lower, upper=upper)
  fresh = hdm_optax.trial_lbfgs(lower=dict(lower), upper=dict(upper))
  expected = hdm_optax.solve(fresh, fun, x0, tol=1e-8)
  upper["a"] = 2.0
  answers = []
  for _ in range(5):
    res = hdm_optax.solve(optimizer, fun, x0, tol=1e-8)
    compiled_lib.wait()  # the fused program serves the third call on
    answers.append((float(res.params["a"]), float(res.value)))
  assert optimizer == fresh
  assert answers == [(float(expected.params["a"]), float(expected.value))] * 5
