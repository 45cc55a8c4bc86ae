"""hdm_optax.solve_batch: a batch of problems in one program, stopped members retired.

Each member must get what ``jax.vmap(solve)`` gives it (the same steps and calls, the same
point up to rounding), with the batch's members finishing at very different times so that
the stages run, for hdm_optax's methods and for optax's own L-BFGS.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import backends
import hdm_optax
from hdm_optax import _gating
from hdm_optax.driver import batching
from hdm_optax.driver import members as members_lib
from hdm_optax.driver import programs
from hdm_optax.driver import runs
from hdm_optax.pieces.lbfgs import memory as memory_lib


def quadratic(w, d, c):
  """``1/2 sum d_i (w_i - c_i)^2``: one member, its own scales d and centre c."""
  return 0.5 * jnp.sum(d * (w - c) ** 2)


def spread_batch(batch, n, dtype, seed=0):
  """Diagonal quadratics whose condition numbers spread over 1e0..1e4 (steps differ)."""
  rng = np.random.default_rng(seed)
  kappa = 10.0 ** rng.uniform(0, 4, batch)
  d = kappa[:, None] ** -np.linspace(0.0, 1.0, n)[None, :]
  c = rng.standard_normal((batch, n))
  return jnp.asarray(d, dtype), jnp.asarray(c, dtype)


def batch_rtol(d, steps):
  """rtol between the staged batch and ``jax.vmap(solve)`` (two programs: other batch
  sizes, other vector loops): :func:`backends.rounding_tol` of f's n terms over ``steps``,
  with the batch's largest condition number max d / min d."""
  d = np.asarray(d, np.float64)
  return backends.rounding_tol(d.shape[1], steps, condition=float(np.max(d.max(1) / d.min(1))))


def lockstep(optimizer, x0, d, c, **kw):
  one = lambda x, d, c: hdm_optax.solve(optimizer, quadratic, x, fun_args=(d, c), **kw)
  return jax.jit(jax.vmap(one))(x0, d, c)


KW = dict(max_steps=300, tol=1e-6)


@pytest.mark.parametrize(
  "make", [hdm_optax.trial_lbfgs, lambda: hdm_optax.hdm_best(lipschitz=1.0), optax.lbfgs]
)
def test_each_member_gets_what_a_vmapped_solve_gives_it(make):
  d, c = spread_batch(80, 6, jnp.float64)
  x0 = jnp.zeros_like(c)
  assert runs.stage_sizes(80, True) == (80, 20, 5)
  ref = lockstep(make(), x0, d, c, **KW)
  out = hdm_optax.solve_batch(make(), quadratic, x0, fun_args=(d, c), compact=True, **KW)
  steps = np.asarray(ref.num_steps)
  assert steps.max() >= 2 * steps.min()  # members stop at different times: stages run
  np.testing.assert_array_equal(np.asarray(out.num_steps), steps)
  np.testing.assert_array_equal(np.asarray(out.num_grad_evals), np.asarray(ref.num_grad_evals))
  np.testing.assert_array_equal(np.asarray(out.status), np.asarray(ref.status))
  rtol = batch_rtol(d, KW["max_steps"])  # 1.6e-12
  np.testing.assert_allclose(out.params, ref.params, rtol=rtol, atol=rtol * np.max(np.abs(c)))
  # f moves by grad f times the iterate's difference: at most rtol 2 f(x0) (x0 = 0)
  atol = rtol * np.max(np.sum(d * c**2, axis=1))
  np.testing.assert_allclose(out.value, ref.value, rtol=rtol, atol=atol)
  for i, k in enumerate(steps):
    got, want = out.trace.value[i, : k + 1], ref.trace.value[i, : k + 1]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_the_stages_shrink_to_sixteen_above_sixty_four_members():
  assert runs.stage_sizes(4096, True) == (4096, 1024, 256, 64, 16)
  assert runs.stage_sizes(64, True) == (64, 16, 4, 1)
  assert runs.stage_sizes(65, True) == (65, 17, 5)
  assert runs.stage_sizes(4096, False) == (4096,)


def test_a_large_batch_retires_members_and_matches_the_lockstep_loop():
  """200 members (stages 200, 50, 13), float32: the tail runs in the small stages."""
  d, c = spread_batch(200, 5, jnp.float32, seed=1)
  x0 = jnp.zeros_like(c)
  kw = dict(max_steps=200, tol=1e-4)
  ref = lockstep(hdm_optax.trial_lbfgs(), x0, d, c, **kw)
  out = hdm_optax.solve_batch(
    hdm_optax.trial_lbfgs(), quadratic, x0, fun_args=(d, c), compact=True, **kw
  )
  assert out.params.dtype == jnp.float32 and out.value.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out.num_grad_evals), np.asarray(ref.num_grad_evals))
  np.testing.assert_allclose(out.params, ref.params, rtol=1e-5, atol=1e-6)
  assert bool(jnp.all(out.converged))


def test_small_batches_run_in_lockstep_and_large_ones_retire_members():
  """The default ``compact=None``: a batch whose inputs hold at most SMALL_PROGRAM entries runs
  the lockstep program (``compact=False``'s: no new compile), a larger one the stages."""
  d, c = spread_batch(8, 3, jnp.float64, seed=2)
  x0 = jnp.zeros_like(c)
  hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, fun_args=(d, c), max_steps=7)
  before = programs.compiled_count()
  kw = dict(fun_args=(d, c), max_steps=7, compact=False)
  hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, **kw)
  assert programs.compiled_count() == before
  hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, **{**kw, "compact": True})
  assert programs.compiled_count() == before + 1
  small = members_lib.problems(x0, (d, c), (0, 0))
  large = members_lib.problems(jnp.zeros((80, 1024)), (jnp.ones((80, 1024)),), (0, 0))
  implicit, unrolled = hdm_optax.ImplicitAdjoint(), hdm_optax.UnrolledAdjoint()
  assert not batching._compact(None, small, implicit)  # pylint: disable=protected-access
  assert batching._compact(None, large, implicit)  # pylint: disable=protected-access
  assert not batching._compact(None, large, unrolled)  # pylint: disable=protected-access
  assert batching._compact(True, small, implicit)  # pylint: disable=protected-access


def test_a_shared_start_and_pytree_params():
  """``in_axes=(None, 0)``: one start for every member; params a dict."""
  d, c = spread_batch(5, 3, jnp.float64)
  fun = lambda p, d, c: quadratic(p["w"], d, c) + 0.5 * jnp.sum((p["b"] - 1.0) ** 2)
  x0 = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
  out = hdm_optax.solve_batch(
    hdm_optax.trial_lbfgs(), fun, x0, fun_args=(d, c), in_axes=(None, 0), tol=1e-8
  )
  assert out.params["w"].shape == (5, 3) and out.params["b"].shape == (5, 2)
  np.testing.assert_allclose(out.params["w"], c, atol=1e-6)
  np.testing.assert_allclose(out.params["b"], 1.0, atol=1e-6)
  for i in range(5):  # each member as solve gives it alone
    one = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, x0, fun_args=(d[i], c[i]), tol=1e-8)
    assert int(out.num_grad_evals[i]) == int(one.num_grad_evals)


def test_new_data_and_an_equal_optimizer_do_not_compile_again():
  d, c = spread_batch(8, 3, jnp.float64)
  x0 = jnp.zeros_like(c)
  hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, fun_args=(d, c))
  before = programs.compiled_count()  # pylint: disable=protected-access
  d2, c2 = spread_batch(8, 3, jnp.float64, seed=5)
  out = hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, fun_args=(d2, c2))
  assert programs.compiled_count() == before  # pylint: disable=protected-access
  ref = lockstep(hdm_optax.trial_lbfgs(), x0, d2, c2, max_steps=1000, tol=1e-4)
  rtol = batch_rtol(d2, int(np.max(ref.num_steps)))
  np.testing.assert_allclose(out.params, ref.params, rtol=rtol, atol=rtol * np.max(np.abs(c2)))


def test_in_axes_that_map_nothing_is_refused_with_the_fix():
  d, c = spread_batch(3, 2, jnp.float64)
  with pytest.raises(ValueError, match=r"in_axes=\(None, None\) maps no axis.*hdm_optax.solve"):
    hdm_optax.solve_batch(
      hdm_optax.trial_lbfgs(), quadratic, jnp.zeros(2), fun_args=(d[0], c[0]), in_axes=(None, None)
    )
  with pytest.raises(ValueError, match="one size"):
    hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, jnp.zeros((2, 2)), fun_args=(d, c))


def _memories(state):
  return [
    x
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, memory_lib.SecantMemory))
    if isinstance(x, memory_lib.SecantMemory)
  ]


def test_a_stopped_members_memory_is_what_the_lockstep_loop_keeps():
  """The batched loop writes a pair only for the members still running
  (:mod:`hdm_optax._gating`): the memory a stopped member returns (to resume from) is the
  one it stopped with, as ``jax.vmap(solve)`` keeps it."""
  d, c = spread_batch(80, 6, jnp.float64)
  x0 = jnp.zeros_like(c)
  ref = lockstep(hdm_optax.trial_lbfgs(), x0, d, c, **KW)
  out = hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, fun_args=(d, c), **KW)
  steps = np.asarray(ref.num_steps)
  assert steps.max() >= 2 * steps.min()  # most members stop while others run on
  (got,), (want,) = _memories(out.state), _memories(ref.state)
  np.testing.assert_array_equal(np.asarray(got.head), np.asarray(want.head))
  rtol = batch_rtol(d, KW["max_steps"])  # a pair written or not differs by its own size
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.max(np.abs(b), initial=0.0))


def _gated_step(change=None):
  """One member's memory write inside a gate, kept where the member runs."""

  def step(mem, s, y, running):
    with _gating.gate(running, mem) as gate:
      new = memory_lib.secant_record(mem, s, y, True)
      if change is not None:
        new = change(new)
    return gate.where(new, mem)

  return step


def _selects_of_shape(jaxpr, shape) -> int:
  count = sum(
    e.primitive.name == "select_n" and e.outvars[0].aval.shape == shape for e in jaxpr.eqns
  )
  return count + sum(_selects_of_shape(sub, shape) for sub in jax.extend.core.subjaxprs(jaxpr))


@pytest.mark.parametrize("changed", [False, True])
def test_a_gated_write_keeps_a_stopped_member_and_skips_the_pass_over_the_pairs(changed):
  """Members 0 and 2 run, 1 has stopped. The pairs written under the gate come out as the
  stopped member had them with no select over them; a piece that changes them after the
  write gets the select (a pass, never a wrong state)."""
  batch, m, n = 3, 4, 5
  mem = jax.vmap(lambda p: memory_lib.secant_memory(p, m))(jnp.zeros((batch, n)))
  mem = jax.vmap(memory_lib.secant_record, in_axes=(0, 0, 0, None))(
    mem, jnp.ones((batch, n)), 2 * jnp.ones((batch, n)), True
  )
  s = jnp.arange(batch * n, dtype=jnp.float32).reshape(batch, n) + 1
  y, running = 3 * s, jnp.array([True, False, True])
  change = (lambda new: new._replace(s=tuple(a * 1.0 for a in new.s))) if changed else None
  step = jax.vmap(_gated_step(change))
  selects = _selects_of_shape(jax.make_jaxpr(step)(mem, s, y, running).jaxpr, (batch, m, n))
  assert selects == (1 if changed else 0)
  out = step(mem, s, y, running)
  want = jax.vmap(lambda *a: memory_lib.secant_record(*a, True))(mem, s, y)
  want = jax.tree.map(
    lambda w, o: jnp.where(running.reshape((-1,) + (1,) * (w.ndim - 1)), w, o), want, mem
  )
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
