"""One set of limits for every front door, one stop rule that writes every status, one
meaning of "converged" (hdm_optax/driver/limits.py, engine.judge, results.converged)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from hdm_optax.driver import limits as limits_lib
from hdm_optax.driver.limits import Limits

A = jnp.asarray([1.0, 10.0, 100.0])


def fun(x, a):
  return jnp.sum(a * (x - 1.0) ** 2)


DOORS = {
  "solve": lambda **kw: hdm_optax.solve(
    hdm_optax.trial_lbfgs(), fun, jnp.zeros(3), fun_args=(A,), **kw
  ),
  "solve_batch": lambda **kw: hdm_optax.solve_batch(
    hdm_optax.trial_lbfgs(), fun, jnp.zeros(3), fun_args=(A[None],), in_axes=(None, 0), **kw
  ),
  "sweep": lambda **kw: (
    hdm_optax.sweep(
      lambda memory_size: hdm_optax.trial_lbfgs(memory_size=memory_size),
      {"memory_size": [10]},
      fun,
      jnp.zeros(3),
      fun_args=(A,),
      **kw,
    ).results
  ),
}


def _own_loop(**kw):
  run = hdm_optax.loop(hdm_optax.trial_lbfgs(), fun, fun_args=(A,), **kw)
  s = run.start(jnp.zeros(3))
  while not run.done(s):
    s = run.step(s)
  return s, int(run.status(s))


@pytest.mark.parametrize("name", ["solve", "solve_batch", "sweep", "loop"])
def test_every_front_door_lists_the_limits_with_one_set_of_defaults(name):
  door = getattr(hdm_optax, name)
  parameters = inspect.signature(door).parameters
  for field in Limits._fields[:-1]:
    assert parameters[field].default == Limits._field_defaults[field], (name, field)
  assert parameters["limits"].default is None


def test_a_limits_value_and_keywords_are_one_run():
  given = DOORS["solve"](limits=Limits(tol=1e-9, max_steps=4))
  keywords = DOORS["solve"](tol=1e-9, max_steps=4)
  mixed = DOORS["solve"](limits=Limits(tol=1e-9, max_steps=50), max_steps=4)
  for res in (given, keywords, mixed):
    assert int(res.num_steps) == 4 and int(res.status) == hdm_optax.Status.MAX_STEPS
  np.testing.assert_array_equal(given.params, keywords.params)
  np.testing.assert_array_equal(given.params, mixed.params)


@pytest.mark.parametrize("name", sorted(DOORS))
def test_a_bad_limit_is_named_by_every_front_door(name):
  with pytest.raises(ValueError, match="max_null_steps"):
    DOORS[name](max_null_steps=0)
  with pytest.raises(TypeError, match="ftol"):
    DOORS[name](ftol="small")
  with pytest.raises(TypeError, match="unexpected keyword argument 'tols'"):
    DOORS[name](tols=1e-6)


def test_own_loop_has_the_front_doors_budget():
  """loop's default budget is solve's: 1000 updates (the paper's)."""
  slow = hdm_optax.loop(optax.sgd(1e-6), fun, fun_args=(A,), tol=0.0)
  s = slow.start(jnp.zeros(3))
  s = jax.jit(lambda s: jax.lax.while_loop(lambda s: ~slow.done(s), slow.step, s))(s)
  assert int(s.num_steps) == 1000 and int(slow.status(s)) == hdm_optax.Status.MAX_STEPS


def test_ftol_switch_is_derived_and_static():
  assert not Limits().uses_ftol and Limits(ftol=1e-9).uses_ftol
  assert Limits(ftol=jnp.float32(0.0)).uses_ftol  # an array may be traced: on
  # static: part of the tree's structure, not a leaf
  on, off = Limits(ftol=1e-9).checked(), Limits().checked()
  assert jax.tree.structure(on) != jax.tree.structure(off)
  assert len(jax.tree.leaves(on)) == len(jax.tree.leaves(off)) == 7
  assert jax.tree.map(lambda x: x, on).ftol_on is True


def test_converged_is_one_property():
  codes = np.arange(len(hdm_optax.Status))
  expected = [s.name.startswith("CONVERGED") for s in map(hdm_optax.Status, codes)]
  assert [hdm_optax.Status(c).converged for c in codes] == expected
  assert hdm_optax.driver.results.converged(codes).tolist() == expected
  assert hdm_optax.driver.results.converged(jnp.asarray(codes)).tolist() == expected


def test_ftol_convergence_is_convergence_for_every_reader():
  """A run that ends CONVERGED_FTOL is converged in the result, and ends a sweep that stops
  at its first converged point."""
  grid = {"memory_size": [2, 3, 4]}
  make = lambda memory_size: hdm_optax.trial_lbfgs(memory_size=memory_size)
  out = hdm_optax.sweep(
    make,
    grid,
    fun,
    jnp.zeros(3),
    fun_args=(A,),
    tol=0.0,
    ftol=1e-3,
    stop_at_first_converged=True,
  )
  status = np.asarray(out.results.status)
  assert hdm_optax.Status.CONVERGED_FTOL in status, status
  assert np.all(np.asarray(out.results.converged) == (status == hdm_optax.Status.CONVERGED_FTOL))
  others = status[status != hdm_optax.Status.CONVERGED_FTOL]
  assert np.all(others == hdm_optax.Status.STOPPED), status


def test_a_halt_at_the_last_step_reports_the_budget():
  """judge's precedence: a callback's stop ends a run that goes on; one that met a limit at
  that step reports the limit."""
  res = DOORS["solve"](tol=0.0, max_steps=3, callback=lambda snap: int(snap.num_steps) >= 3)
  assert int(res.status) == hdm_optax.Status.MAX_STEPS
  res = DOORS["solve"](tol=0.0, max_steps=5, callback=lambda snap: int(snap.num_steps) >= 3)
  assert int(res.status) == hdm_optax.Status.STOPPED and int(res.num_steps) == 3


def test_a_snapshot_counts_null_steps_as_the_loop_does():
  seen = []
  res = hdm_optax.solve(
    hdm_optax.hdm(precond_lr=5.0),
    fun,
    jnp.zeros(3),
    fun_args=(A,),
    max_steps=40,
    callback=lambda snap: seen.append(int(snap.num_null_steps)),
  )
  run = hdm_optax.loop(hdm_optax.hdm(precond_lr=5.0), fun, fun_args=(A,), max_steps=40)
  step = jax.jit(run.step)
  s, counted = run.start(jnp.zeros(3)), []
  while not run.done(s):
    s = step(s)
    counted.append(int(s.num_null_steps))
  assert seen == counted and counted[-1] > 0
  assert counted[-1] == int(np.sum(~np.asarray(res.trace.accepted)[1 : int(res.num_steps) + 1]))


def test_takes_limits_checks_once_and_names_the_keywords():
  @limits_lib.takes_limits
  def door(x, *, limits, extra=0):
    return limits, extra

  text = str(inspect.signature(door))
  assert "tol: Any = 0.0001" in text and "limits: Optional" in text and "extra=0" in text
  limits, extra = door(1, max_steps=None, min_value=None, extra=2)
  assert limits.max_steps == np.iinfo(np.int32).max and limits.min_value == -np.inf
  assert extra == 2 and limits.ftol_on is False


def test_plain_limits_are_checked_once_per_typed_value():
  """Limits of plain numbers are checked once per value and type (1 and 1.0 are different
  arguments of a program); a bad one is refused every time; arrays are checked each call."""
  assert Limits(tol=1e-5).checked() is Limits(tol=1e-5).checked()
  assert type(Limits(tol=1).checked().tol) is int
  assert type(Limits(tol=1.0).checked().tol) is float
  for _ in range(2):
    with pytest.raises(ValueError, match="tol must be a scalar >= 0"):
      Limits(tol=-1.0).checked()
  with pytest.raises(ValueError, match="tol must be a scalar >= 0"):
    Limits(tol=np.asarray([1.0, 2.0])).checked()
  assert Limits(tol=np.float64(1e-3)).checked().tol == 1e-3
