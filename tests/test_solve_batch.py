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

import hdm_optax
from hdm_optax.driver import solving
from hdm_optax.driver import runs


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
  out = hdm_optax.solve_batch(make(), quadratic, x0, fun_args=(d, c), **KW)
  steps = np.asarray(ref.num_steps)
  assert steps.max() >= 2 * steps.min()  # members stop at different times: stages run
  np.testing.assert_array_equal(np.asarray(out.num_steps), steps)
  np.testing.assert_array_equal(np.asarray(out.num_grad_evals), np.asarray(ref.num_grad_evals))
  np.testing.assert_array_equal(np.asarray(out.status), np.asarray(ref.status))
  np.testing.assert_allclose(out.params, ref.params, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(out.value, ref.value, rtol=1e-9, atol=1e-15)
  for i, k in enumerate(steps):
    np.testing.assert_allclose(out.trace.value[i, : k + 1], ref.trace.value[i, : k + 1], rtol=1e-9)


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
  out = hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, fun_args=(d, c), **kw)
  assert out.params.dtype == jnp.float32 and out.value.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out.num_grad_evals), np.asarray(ref.num_grad_evals))
  np.testing.assert_allclose(out.params, ref.params, rtol=1e-5, atol=1e-6)
  assert bool(jnp.all(out.converged))


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
  before = solving.compiled_count()  # pylint: disable=protected-access
  d2, c2 = spread_batch(8, 3, jnp.float64, seed=5)
  out = hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, x0, fun_args=(d2, c2))
  assert solving.compiled_count() == before  # pylint: disable=protected-access
  ref = lockstep(hdm_optax.trial_lbfgs(), x0, d2, c2, max_steps=1000, tol=1e-4)
  np.testing.assert_allclose(out.params, ref.params, rtol=1e-9, atol=1e-12)


def test_in_axes_that_map_nothing_is_refused_with_the_fix():
  d, c = spread_batch(3, 2, jnp.float64)
  with pytest.raises(ValueError, match=r"in_axes=\(None, None\) maps no axis.*hdm_optax.solve"):
    hdm_optax.solve_batch(
      hdm_optax.trial_lbfgs(), quadratic, jnp.zeros(2), fun_args=(d[0], c[0]), in_axes=(None, None)
    )
  with pytest.raises(ValueError, match="one size"):
    hdm_optax.solve_batch(hdm_optax.trial_lbfgs(), quadratic, jnp.zeros((2, 2)), fun_args=(d, c))
