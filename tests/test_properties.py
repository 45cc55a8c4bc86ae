"""Property tests (hypothesis): random convex quadratics and logistic problems,
random hyper-parameters inside their valid ranges. With null steps f(x_k)
never increases, every state leaf stays finite, and P and beta stay inside
their bounds.

Hyper-parameters and data are arguments of one jitted program per optimizer
configuration (traced hyper-parameters skip the construction checks), so the
examples do not recompile.
"""

import functools

import jax


import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import hdm_optax  # noqa: E402

N, M, STEPS = 6, 24, 40
SETTINGS = settings(max_examples=15, deadline=None)


def objective(x, hess, b, a, y, w_quad, w_log):
  """w_quad * (x^T H x / 2 - b^T x) + w_log * sum softplus(-y a x)."""
  quad = 0.5 * x @ (hess @ x) - b @ x
  logi = jnp.sum(jax.nn.softplus(-y * (a @ x)))
  return w_quad * quad + w_log * logi


@st.composite
def problems(draw):
  """A random convex problem: a quadratic, a logistic regression or a mix."""
  seed = draw(st.integers(0, 2**31 - 1))
  kind = draw(st.sampled_from(["quad", "logistic", "mix"]))
  log_cond = draw(st.floats(0.0, 4.0, allow_subnormal=False))
  logit_scale = draw(st.floats(-1.0, 2.0, allow_subnormal=False))  # rows of a scaled by up to 100
  rng = np.random.default_rng(seed)
  q, _ = np.linalg.qr(rng.normal(size=(N, N)))
  eig = np.logspace(0.0, log_cond, N) * rng.uniform(0.1, 10.0)
  hess = (q * eig) @ q.T
  hess = 0.5 * (hess + hess.T)
  b = rng.normal(size=N) * eig.max()
  a = rng.normal(size=(M, N)) * 10.0**logit_scale
  y = np.where(rng.normal(size=M) > 0, 1.0, -1.0)
  w_quad = 0.0 if kind == "logistic" else 1.0
  w_log = 0.0 if kind == "quad" else 1.0
  lip = w_quad * eig.max() + w_log * np.linalg.norm(a, 2) ** 2 / 4
  x0 = rng.normal(size=N)
  data = tuple(jnp.asarray(v, jnp.float64) for v in (hess, b, a, y, w_quad, w_log))
  return data, jnp.asarray(x0), float(lip)


def log_uniform(lo, hi):
  return st.floats(np.log10(lo), np.log10(hi)).map(lambda e: 10.0**e)


@functools.lru_cache(maxsize=None)
def compiled_solve(make):
  """One compiled program per optimizer factory: hp and data are arguments."""

  @jax.jit
  def run(hp, x0, data):
    return hdm_optax.solve(make(**hp), objective, x0, max_steps=STEPS, tol=0.0, fun_args=data)

  return run


def check_run(res, *, monotone):
  for path, leaf in jax.tree_util.tree_leaves_with_path(res):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      assert bool(jnp.all(jnp.isfinite(leaf))), jax.tree_util.keystr(path)
  vals = np.asarray(res.trace.value)
  if monotone:  # up to f's rounding (acceptance.resolved_decrease's 64 ulps)
    tie = 64 * np.finfo(vals.dtype).eps * np.maximum(np.abs(vals[:-1]), np.abs(vals[1:]))
    assert np.all(np.diff(vals) <= tie), vals
  return vals


def assert_within(p, lo, hi):
  for leaf in jax.tree.leaves(p):
    if lo is not None:
      assert float(jnp.min(leaf)) >= lo
    if hi is not None:
      assert float(jnp.max(leaf)) <= hi


def _hdm_diag(**hp):
  return hdm_optax.hdm(candidate="diagonal", learner="adagrad", **hp)


def _hdm_scalar(**hp):
  return hdm_optax.hdm(candidate="scalar", learner="ogd_sqrt", **hp)


@SETTINGS
@given(
  prob=problems(),
  make=st.sampled_from([_hdm_diag, _hdm_scalar]),
  lr=log_uniform(1e-3, 10.0),
  precond_min=st.floats(0.0, 0.1, allow_subnormal=False),
  p_span=log_uniform(1e-3, 10.0),
  init=st.floats(0.0, 1.0, allow_subnormal=False),
)
def test_hdm_properties(prob, make, lr, precond_min, p_span, init):
  data, x0, lip = prob
  precond_max = (precond_min + p_span) / lip
  precond_min = precond_min / lip
  hp = dict(
    precond_lr=lr / lip, precond_min=precond_min, precond_max=precond_max, init_precond=init / lip
  )
  res = compiled_solve(make)(hp, x0, data)
  check_run(res, monotone=True)
  assert_within(res.state.direction.precond, precond_min * (1 - 1e-12), precond_max * (1 + 1e-12))


def _hdm_hb(**hp):
  return hdm_optax.hdm_hb(**hp)


@SETTINGS
@given(
  prob=problems(),
  lr=log_uniform(1e-3, 10.0),
  mlr=log_uniform(1e-3, 10.0),
  omega=st.floats(0.0, 10.0, allow_subnormal=False),
  tau=st.floats(0.0, 100.0, allow_subnormal=False),
  b_lo=st.floats(-0.99, 0.5, allow_subnormal=False),
  b_span=st.floats(0.0, 0.49, allow_subnormal=False),
  b_init=st.floats(0.0, 1.0, allow_subnormal=False),
)
def test_hdm_hb_properties(prob, lr, mlr, omega, tau, b_lo, b_span, b_init):
  data, x0, lip = prob
  b_hi = b_lo + b_span
  hp = dict(
    precond_lr=lr / lip,
    momentum_lr=mlr,
    omega=omega * lip,
    tau=tau * lip**2,
    momentum_min=b_lo,
    momentum_max=b_hi,
    init_momentum=b_lo + b_init * b_span,
    precond_min=0.0,
    precond_max=10.0 / lip,
  )
  res = compiled_solve(_hdm_hb)(hp, x0, data)
  check_run(res, monotone=False)  # monotone in the potential psi, not in f
  assert_within(res.state.direction.precond, 0.0, 10.0 / lip * (1 + 1e-12))
  assert_within(res.state.direction.momentum, b_lo, b_hi)


def _hdm_agd(**hp):
  return hdm_optax.hdm_agd(**hp)


@SETTINGS
@given(
  prob=problems(),
  l_factor=log_uniform(0.5, 10.0),
  theta=st.floats(0.5, 5.0, allow_subnormal=False),
  lr=log_uniform(1e-3, 10.0),
)
def test_hdm_agd_properties(prob, l_factor, theta, lr):
  data, x0, lip = prob
  hp = dict(
    lipschitz=l_factor * lip,
    theta=theta,
    precond_lr=lr / lip,
    precond_min=0.0,
    precond_max=10.0 / lip,
  )
  res = compiled_solve(_hdm_agd)(hp, x0, data)
  check_run(res, monotone=True)
  assert_within(res.state.precond, 0.0, 10.0 / lip * (1 + 1e-12))


def _hdm_best(**hp):
  estimate = hdm_optax.pieces.curvature.running_mean(horizon=STEPS)
  return hdm_optax.hdm_best(curvature_estimate=estimate, **hp)


@SETTINGS
@given(
  prob=problems(),
  l_factor=log_uniform(0.1, 10.0),
  lr=log_uniform(0.1, 100.0),
  mlr=log_uniform(0.01, 30.0),
  b_lo=st.floats(0.0, 0.5, allow_subnormal=False),
  b_hi=st.floats(0.6, 0.9995, allow_subnormal=False),
  b_init=st.floats(0.0, 1.0, allow_subnormal=False),
)
def test_hdm_best_properties(prob, l_factor, lr, mlr, b_lo, b_hi, b_init):
  data, x0, lip = prob
  hp = dict(
    lipschitz=l_factor * lip,
    precond_lr=lr / lip,
    momentum_lr=mlr,
    momentum_bounds=(b_lo, b_hi),
    init_momentum=b_init,
  )
  res = compiled_solve(_hdm_best)(hp, x0, data)
  check_run(res, monotone=True)
  st_ = res.state.direction
  l_now = jnp.where(st_.curvature.l_hat > 0, st_.curvature.l_hat, st_.lipschitz)
  assert_within(st_.precond, 0.0, None)
  assert float(jnp.max(st_.precond)) <= float(1e10 / l_now) * (1 + 1e-12)
  assert_within(st_.momentum, b_lo, b_hi)
