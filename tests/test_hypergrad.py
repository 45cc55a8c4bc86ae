"""Hypergradients used by hdm_optax against central finite differences.

The package does not expose the hypergradient it used, so it is recovered from
the state: starting from a known state (random P, B, x^-), one update with
``learner="ogd"``, learning rate eta and no bounds gives
``G = (P_before - P_after) / eta``.  This is compared with a central finite
difference of the feedback function at P_before:

* HDM / HDM-AGD:  h_x(P) = (f(x - P g) - f(x)) / ||g||^2          eq. (hypergrad-feedback)
* HDM-HB:        h_{x,x^-}(P, B) of eq. (heavyball-feedback), omega, tau > 0

f is a random strongly convex quadratic, so h is quadratic in (P, B) and the
central difference is exact up to rounding.
"""

import jax


import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import hdm_optax  # noqa: E402

try:
  import reference as ref  # noqa: E402
  from helpers import replace_fields  # noqa: E402
except ImportError:  # pragma: no cover
  from tests import reference as ref  # noqa: E402
  from tests.helpers import replace_fields  # noqa: E402

N = 5
N_PROBLEMS = 4  # random problems per configuration
ETA = 1.0
FD_STEP = 1e-3
RTOL = 1e-6
ATOL = 1e-9


def random_problem(seed: int):
  rng = np.random.default_rng(seed)
  Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
  A = (Q * rng.uniform(0.5, 5.0, N)) @ Q.T
  A = 0.5 * (A + A.T)
  b = rng.standard_normal(N)
  x = rng.standard_normal(N)
  return rng, A, b, x


def np_quadratic(A, b):
  return (lambda x: float(0.5 * x @ A @ x - b @ x)), (lambda x: A @ x - b)


def random_param(rng, candidate, scale):
  if candidate == "scalar":
    return np.asarray(scale * rng.uniform(0.2, 1.0))
  if candidate == "diagonal":
    return scale * rng.uniform(-0.5, 1.0, N)
  return scale * (0.5 * np.eye(N) + 0.3 * rng.standard_normal((N, N)))  # non-symmetric


def central_fd(h, P):
  """Central finite-difference gradient of the scalar function h at array P."""
  P = np.asarray(P, dtype=np.float64)
  flat = np.zeros(P.size)
  for i in range(P.size):
    E = np.zeros(P.size)
    E[i] = FD_STEP
    E = E.reshape(P.shape)
    flat[i] = (h(P + E) - h(P - E)) / (2 * FD_STEP)
  return flat.reshape(P.shape)


def package_hypergrad(opt, A, b, x, replace):
  """One package update from a known state; returns (G_P, G_B) recovered from the state.

  Run eagerly (not jitted): a single update per problem, and JAX's per-op
  caches are shared between configurations, which is much cheaper than one
  XLA compilation per configuration.
  """
  A, b, x = jnp.asarray(A), jnp.asarray(b), jnp.asarray(x)

  def f(z):
    return 0.5 * z @ A @ z - b @ z

  state = opt.init(x)
  state = replace_fields(state, **{k: jnp.asarray(v) for k, v in replace.items()})
  v, g = jax.value_and_grad(f)(x)
  _, new = opt.update(g, state, x, value=v, grad=g, value_fn=f)
  old, new = getattr(state, "direction", state), getattr(new, "direction", new)  # AGD: its own
  G_P = (np.asarray(old.precond) - np.asarray(new.precond)) / ETA
  G_B = None
  if hasattr(old, "momentum"):
    G_B = (np.asarray(old.momentum) - np.asarray(new.momentum)) / ETA
  return G_P, G_B


def _assert_nontrivial(Gs):
  assert max(np.max(np.abs(G)) for G in Gs) > 1e-2, "hypergradients are ~0: test is vacuous"


@pytest.mark.parametrize("candidate", ref.CANDIDATES)
def test_hdm_hypergradient_matches_finite_difference(candidate):
  opt = hdm_optax.hdm(candidate=candidate, learner="ogd", precond_lr=ETA, null_step=True)
  seen = []
  for seed in range(N_PROBLEMS):
    rng, A, b, x = random_problem(seed)
    f, grad = np_quadratic(A, b)
    g = grad(x)
    P = random_param(rng, candidate, 0.3)

    def h(Pv):  # eq. (hypergrad-feedback)
      return (f(x - ref.apply_precond(candidate, Pv, g)) - f(x)) / (g @ g)

    G_fd = central_fd(h, P)
    G_pkg, _ = package_hypergrad(opt, A, b, x, dict(precond=P))
    assert G_pkg.shape == G_fd.shape
    np.testing.assert_allclose(G_pkg, G_fd, rtol=RTOL, atol=ATOL, err_msg=f"seed {seed}")
    seen.append(G_fd)
    # and the closed form of the reference: reduce(-grad f(x - P g) g^T) / ||g||^2
    x_t = x - ref.apply_precond(candidate, P, g)
    np.testing.assert_allclose(
      G_fd, ref.reduce_outer(candidate, -grad(x_t), g) / (g @ g), rtol=RTOL, atol=ATOL
    )
  _assert_nontrivial(seen)


@pytest.mark.parametrize("candidate", ref.CANDIDATES)
def test_hdm_agd_hypergradient_matches_finite_difference(candidate):
  """First HDM-AGD step: z_1 = x_1 so y_1 = x_1, and P moves along -grad h_{y_1}(P_1)."""
  L = 5.0  # upper bound of the spectrum of every random_problem
  opt = hdm_optax.hdm_agd(lipschitz=L, candidate=candidate, learner="ogd", precond_lr=ETA)
  seen = []
  for seed in range(N_PROBLEMS):
    rng, A, b, x = random_problem(seed)
    f, grad = np_quadratic(A, b)
    g = grad(x)
    P = random_param(rng, candidate, 0.3)

    def h(Pv):
      return (f(x - ref.apply_precond(candidate, Pv, g)) - f(x)) / (g @ g)

    G_fd = central_fd(h, P)
    G_pkg, _ = package_hypergrad(opt, A, b, x, dict(precond=P))
    np.testing.assert_allclose(G_pkg, G_fd, rtol=RTOL, atol=ATOL, err_msg=f"seed {seed}")
    seen.append(G_fd)
  _assert_nontrivial(seen)


@pytest.mark.parametrize("momentum_candidate", ["scalar", "diagonal"])
@pytest.mark.parametrize("candidate", ref.CANDIDATES)
def test_hdm_hb_hypergradients_match_finite_difference(candidate, momentum_candidate):
  omega, tau = 0.7, 1.3
  opt = hdm_optax.hdm_hb(
    candidate=candidate,
    momentum_candidate=momentum_candidate,
    learner="ogd",
    precond_lr=ETA,
    momentum_lr=ETA,
    omega=omega,
    tau=tau,
    momentum_min=None,
    momentum_max=None,
  )
  seen, seen_b = [], []
  for seed in range(N_PROBLEMS):
    rng, A, b, x = random_problem(seed)
    f, grad = np_quadratic(A, b)
    g = grad(x)
    x_prev = x + 0.5 * rng.standard_normal(N)
    P = random_param(rng, candidate, 0.3)
    B = random_param(rng, momentum_candidate, 0.6)
    kw = dict(candidate=candidate, momentum_candidate=momentum_candidate, omega=omega, tau=tau)

    G_P_fd = central_fd(lambda Pv: ref.heavyball_feedback(f, x, x_prev, g, Pv, B, **kw), P)
    G_B_fd = central_fd(lambda Bv: ref.heavyball_feedback(f, x, x_prev, g, P, Bv, **kw), B)
    G_P, G_B = package_hypergrad(opt, A, b, x, dict(precond=P, momentum=B, prev_params=x_prev))
    np.testing.assert_allclose(G_P, G_P_fd, rtol=RTOL, atol=ATOL, err_msg=f"P, seed {seed}")
    np.testing.assert_allclose(G_B, G_B_fd, rtol=RTOL, atol=ATOL, err_msg=f"B, seed {seed}")
    seen.append(G_P_fd)
    seen_b.append(G_B_fd)
    # Appendix D.1 closed form (as used by the reference)
    d = x - x_prev
    x_t = x - ref.apply_precond(candidate, P, g) + ref.apply_precond(momentum_candidate, B, d)
    r = grad(x_t) + omega * (x_t - x)
    den = g @ g + 0.5 * tau * d @ d
    np.testing.assert_allclose(
      G_P_fd, ref.reduce_outer(candidate, -r, g) / den, rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
      G_B_fd, ref.reduce_outer(momentum_candidate, r, d) / den, rtol=RTOL, atol=ATOL
    )
  _assert_nontrivial(seen)
  _assert_nontrivial(seen_b)
