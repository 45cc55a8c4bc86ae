"""The library under ``jax_numpy_dtype_promotion="strict"`` (as optimistix runs its tests).

Every variant runs a few steps of :func:`hdm_optax.solve` in float32 and
float64 with strict promotion on, through the paths a run can take: a
pytree of two leaves, non-finite trials (f = sum(x - log x) from x = 5 steps
into x < 0), the curvature estimate forming L_hat (a short ``horizon``) and
OSGM-Best's lookahead. The setting is restored after each test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from hdm_optax import pieces


@pytest.fixture(autouse=True)
def strict_promotion():
  with jax.numpy_dtype_promotion("strict"):
    yield


def fun(params):
  """sum(x - log x) over both leaves: minimum at x = 1, +inf/NaN for x <= 0."""
  return sum(jnp.sum(x - jnp.log(x)) for x in jax.tree.leaves(params))


def start(dtype):
  return {"w": jnp.full(3, 5.0, dtype), "b": jnp.asarray(0.5, dtype)}


VARIANTS = {
  "hdm": lambda: hdm_optax.hdm(precond_lr=1.0),
  "hdm_scalar_ogd_sqrt": lambda: hdm_optax.hdm(candidate="scalar", learner="ogd_sqrt"),
  "hdm_full_ogd": lambda: hdm_optax.hdm(candidate="full", learner="ogd", precond_max=10.0),
  "hdm_hb": lambda: hdm_optax.hdm_hb(precond_lr=1.0, tau=1.0, omega=0.1),
  "hdm_agd": lambda: hdm_optax.hdm_agd(lipschitz=30.0, precond_lr=1.0),
  "hdm_best": lambda: hdm_optax.hdm_best(curvature_estimate=pieces.curvature.running_mean(40)),
  "hdm_best_fixed": lambda: hdm_optax.hdm_best(
    lipschitz=30.0,
    denominator=pieces.hypergradient.fixed_tau(1.0),
    schedule=pieces.decay.constant(),
  ),
  "hdm_auto": lambda: hdm_optax.hdm_auto(horizon=40),
  "osgm_best": lambda: hdm_optax.osgm_best(horizon=40),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", VARIANTS)
def test_solve_under_strict_promotion(name, dtype):
  result = hdm_optax.solve(VARIANTS[name](), fun, start(dtype), max_steps=60, tol=1e-30)
  assert result.value.dtype == dtype
  assert all(leaf.dtype == dtype for leaf in jax.tree.leaves(result.params))
  assert np.isfinite(float(result.value))
  assert float(result.value) < float(fun(start(dtype)))


def test_sweep_and_minibatch_under_strict_promotion():
  x0 = start(jnp.float32)
  swept = hdm_optax.sweep(
    lambda precond_lr: hdm_optax.hdm_best(precond_lr=precond_lr),
    {"precond_lr": [0.1, 1.0]},
    fun,
    x0,
    max_steps=20,
  )
  assert np.all(np.isfinite(np.asarray(swept.results.value)))
  opt = hdm_optax.hdm_auto()
  step = hdm_optax.minibatch_step(opt, lambda p, batch: fun(p) * batch)
  params, state = x0, opt.init(x0)
  for _ in range(5):
    params, state, _ = step(params, state, jnp.asarray(1.0, jnp.float32))
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


def test_chain_under_strict_promotion():
  opt = optax.chain(optax.scale(1.0), hdm_optax.hdm_best())
  result = hdm_optax.solve(opt, fun, start(jnp.float32), max_steps=20)
  assert np.isfinite(float(result.value))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_derivative_through_a_box_under_strict_promotion(dtype):
  # The implicit rule counts the degenerate bound variables (booleans summed: int64 under
  # x64), which must not meet an int32 without promotion.
  a = jnp.array([[3.0, 0.5, 0.0], [0.5, 2.0, 0.3], [0.0, 0.3, 1.5]], dtype)
  quadratic = lambda x, th: 0.5 * x @ a @ x - th @ x
  th = jnp.array([1.0, -0.5, 2.0], dtype)
  x0 = jnp.zeros(3, dtype)
  solved = lambda t: (
    hdm_optax.solve(
      hdm_optax.trial_lbfgs(lower=0.0), quadratic, x0, fun_args=(t,), max_steps=200
    ).params
  )
  minimized = lambda t: hdm_optax.minimize(quadratic, x0, args=(t,), bounds=(0.0, None)).x
  for run in (solved, minimized):
    jacobian = jax.jacrev(run)(th)
    assert jacobian.dtype == dtype
    assert np.all(np.isfinite(np.asarray(jacobian)))
    np.testing.assert_array_equal(np.asarray(jacobian)[1], 0.0)  # x[1] is on its bound


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_vmapped_solve_under_strict_promotion(dtype):
  # Under vmap trial_lbfgs writes its secant pairs by a select over the slots, whose
  # indices (int64 under x64) must not meet the int32 slot without promotion.
  scale = jnp.array([[1.0, 2.0, 3.0], [0.5, 1.0, 4.0]], dtype)
  quartic = lambda x, a: jnp.sum(a * x**2) + jnp.sum(x**4)
  solved = jax.vmap(
    lambda a: hdm_optax.solve(
      hdm_optax.trial_lbfgs(), quartic, jnp.ones(3, dtype), fun_args=(a,), max_steps=20
    )
  )(scale)
  assert solved.params.dtype == dtype
  assert np.all(np.asarray(solved.num_steps) > 2)  # pairs were written
  assert np.all(
    np.asarray(solved.value) < np.asarray(jax.vmap(quartic)(jnp.ones((2, 3), dtype), scale))
  )
