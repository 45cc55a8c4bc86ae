"""The paper's claims, checked numerically in float64.

- Null steps make f(x^k) (HDM-HB: the potential psi) non-increasing (Sections 3.2, 4, App. A).
- Theorem 3.5 / Lemma 3.4: with [grad^2 f]^{-1} in the candidate set, P_k -> A^{-1}.
- Theorem 3.3: local superlinear convergence (and GD with 1/L is only linear).
- Figure 1a: vanilla HDM (no null step) blows up, then converges; the null step
  keeps f below f(x^1).
"""

import jax


import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import hdm_optax  # noqa: E402
from fast_jit import run_jit  # noqa: E402
from experiments import toy  # noqa: E402

N = 5
M = 30


# ---------------------------------------------------------------------------
# Problems: one objective for all (so each optimizer compiles once), batched.
#   f(x) = 1/2 x^T A x + b^T x + sum_i log(1 + exp(-y_i <X_i, x>))
# Quadratics use X = 0 (the log-sum is the constant M log 2); the logistic
# regression uses A = 0.1 I (a ridge, for strong convexity) and b = 0.
# ---------------------------------------------------------------------------


def objective(x, A, b, X, y):
  return 0.5 * x @ (A @ x) + b @ x + jnp.sum(jax.nn.softplus(-y * (X @ x)))


def _problems():
  rng = np.random.default_rng(0)
  As, bs, Xs, ys, Ls = [], [], [], [], []
  for cond in (10.0, 1e3):  # two random strongly convex quadratics
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    eig = np.logspace(0, np.log10(cond), N)
    As.append(Q @ np.diag(eig) @ Q.T)
    bs.append(rng.standard_normal(N))
    Xs.append(np.zeros((M, N)))
    ys.append(np.ones(M))
    Ls.append(eig.max())
  for _ in range(2):  # two small random logistic regressions
    X = rng.standard_normal((M, N))
    y = np.where(rng.standard_normal(M) + X @ rng.standard_normal(N) > 0, 1.0, -1.0)
    As.append(0.1 * np.eye(N))
    bs.append(np.zeros(N))
    Xs.append(X)
    ys.append(y)
    Ls.append(0.1 + 0.25 * np.linalg.norm(X, 2) ** 2)
  data = tuple(jnp.asarray(np.stack(v)) for v in (As, bs, Xs, ys))
  x0 = jnp.asarray(rng.standard_normal((len(As), N)))
  return data, jnp.asarray(Ls), x0


DATA, LIPS, X0S = _problems()


def _assert_nonincreasing(values, what):
  values = np.asarray(values)
  assert np.all(np.isfinite(values)), what
  inc = np.diff(values, axis=-1)
  tol = 1e-12 * np.abs(values[..., :-1]) + 1e-300
  worst = np.max(inc - tol)
  assert worst <= 0, f"{what}: f increased by {worst:.3e}"


# name -> make(L) -> optimizer.
MONOTONE = {
  "hdm_scalar": lambda L: hdm_optax.hdm(candidate="scalar", precond_lr=1.0),
  "hdm_diagonal": lambda L: hdm_optax.hdm(candidate="diagonal", precond_lr=1.0),
  "hdm_full_ogd": lambda L: hdm_optax.hdm(candidate="full", learner="ogd", precond_lr=1.0 / L),
  "hdm_hb_omega0": lambda L: hdm_optax.hdm_hb(precond_lr=1.0, momentum_lr=1.0),
  "hdm_agd": lambda L: hdm_optax.hdm_agd(lipschitz=L, precond_lr=1.0),
  "hdm_best": lambda L: hdm_optax.hdm_best(lipschitz=L),
}


@pytest.mark.parametrize("name", list(MONOTONE))
def test_null_step_makes_f_nonincreasing(name):
  make = MONOTONE[name]
  steps = 150

  def run(data, lips, x0s):
    return jax.vmap(
      lambda d, L, x0: hdm_optax.solve(
        make(L), objective, x0, max_steps=steps, tol=0.0, fun_args=d, trace=steps + 1
      )
    )(data, lips, x0s)

  res = run_jit(run, DATA, LIPS, X0S)
  values = np.asarray(res.trace.value)
  _assert_nonincreasing(values, name)
  # The runs make progress and take null steps (so the null step is exercised).
  assert np.all(values[:, -1] < values[:, 0] - 1e-3 * np.abs(values[:, 0]))
  nulls = np.asarray(optax.tree.get(res.state, "num_null_steps"))
  assert nulls.sum() > 0


def test_hdm_hb_potential_nonincreasing():
  """HDM-HB's null step is on psi(x, x^-) = f(x) + omega/2 ||x - x^-||^2."""
  omega = 1.0
  steps = 150

  def run(data, x0s):
    def one(d, x0):
      vf = lambda x: objective(x, *d)
      opt = hdm_optax.hdm_hb(precond_lr=1.0, momentum_lr=1.0, omega=omega, tau=1.0)
      vg = optax.value_and_grad_from_state(vf)
      state = opt.init(x0)

      def body(carry, _):
        x, state = carry
        value, grad = vg(x, state=state)
        upd, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=vf)
        x = optax.apply_updates(x, upd)
        psi = state.value + 0.5 * omega * jnp.sum((x - state.direction.prev_params) ** 2)
        return (x, state), (psi, state.value, state.info.accepted)

      psi0 = vf(x0)  # x^0 = x^1
      _, (psi, f, acc) = jax.lax.scan(body, (x0, state), None, length=steps)
      return jnp.concatenate([psi0[None], psi]), f, acc

    return jax.vmap(one)(data, x0s)

  psi, f, acc = run_jit(run, DATA, X0S)
  _assert_nonincreasing(psi, "psi")
  assert np.all(psi[:, -1] < psi[:, 0] - 1e-3 * np.abs(psi[:, 0]))
  assert np.all(acc.sum(axis=1) > 10) and np.any(~np.asarray(acc))


# ---------------------------------------------------------------------------
# Theorem 3.5 (and Lemma 3.4): P_k -> A^{-1} when A^{-1} is in the candidate set.
# ---------------------------------------------------------------------------


def quadratic(x, A):
  return 0.5 * x @ (A @ x)


def test_diagonal_precond_converges_to_inverse_hessian():
  """Diagonal A, diagonal P, OGD with a constant step: one plain run.

  On a quadratic h_x(P) is invariant to the scale of x, so x^1 is scaled by
  1e100 only to give float64 more range before the superlinearly converging
  iterates underflow to 0 (after which grad f = 0 and P stops learning).
  """
  rng = np.random.default_rng(1)
  a = rng.uniform(1.0, 10.0, N)
  A = np.diag(a)
  x0 = rng.standard_normal(N) * 1e100
  opt = hdm_optax.hdm(candidate="diagonal", learner="ogd", precond_lr=0.1)
  res = run_jit(
    lambda x0, A: hdm_optax.solve(opt, quadratic, x0, max_steps=400, tol=0.0, fun_args=(A,)),
    jnp.asarray(x0),
    jnp.asarray(A),
  )
  err = np.linalg.norm(np.asarray(res.state.direction.precond) - 1 / a) / np.linalg.norm(1 / a)
  assert err < 1e-3, err  # starts at 1 (P_1 = 0)


def test_full_precond_converges_to_inverse_hessian():
  """Full P on a dense A, OGD with eta = 0.2 < 1/L (Lemma 3.4 needs eta - L eta^2 > 0).

  Theorem 3.5 assumes the normalized gradients are uniformly independent. A
  single run does not provide that: the gradients quickly align with the few
  directions P has already learned and x converges superlinearly, leaving P
  accurate only on those directions (relative error stalls at ~1e-2). So the
  run is restarted from fresh random points, keeping the optimizer state,
  40 times for 10 steps each. Lemma 3.4 with H = 0 also says the error
  ||P_k - A^{-1}||_F never increases.
  """
  rng = np.random.default_rng(2)
  n = 3
  Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
  A = Q @ np.diag(rng.uniform(1.0, 4.0, n)) @ Q.T
  Ainv = np.linalg.inv(A)
  starts = jnp.asarray(rng.standard_normal((40, n)))
  opt = hdm_optax.hdm(candidate="full", learner="ogd", precond_lr=0.2)

  def run(A, starts):
    state0 = opt.init(starts[0])

    def restart(state, x0):
      res = hdm_optax.solve(
        opt, quadratic, x0, max_steps=10, tol=0.0, init_state=state, fun_args=(A,)
      )
      return res.state, res.state.direction.precond

    _, precs = jax.lax.scan(restart, state0, starts)
    return precs

  precs = np.asarray(run_jit(run, jnp.asarray(A), starts))
  err = np.linalg.norm(precs - Ainv, axis=(1, 2)) / np.linalg.norm(Ainv)
  assert np.all(np.diff(err) <= 1e-12), err
  assert err[-1] < 1e-3 and err[-1] < 1e-2 * err[0], err


# ---------------------------------------------------------------------------
# Theorem 3.3: superlinear convergence on a quadratic with A^{-1} in the set.
# ---------------------------------------------------------------------------


def _gap_ratios(values, floor):
  """(f_{k+1} - f*)/(f_k - f*) over accepted steps while f_k - f* > floor (f* = 0)."""
  v = np.asarray(values)
  v = v[np.concatenate([[True], np.diff(v) < 0])]  # accepted steps only
  v = v[v > floor]
  return v[1:] / v[:-1]


def _is_superlinear(ratios):
  """The ratios go to 0: the last five average < 0.1 and are 4x below the first ten."""
  tail = np.mean(ratios[-5:])
  return len(ratios) >= 15 and tail < 0.1 and tail < 0.25 * np.mean(ratios[:10])


def test_superlinear_convergence_and_gd_is_only_linear():
  rng = np.random.default_rng(3)
  a = np.logspace(0, 1, N)
  A = jnp.asarray(np.diag(a))
  x0 = jnp.asarray(rng.standard_normal(N))
  f1 = float(quadratic(x0, A))
  floor = 1e-20 * f1
  steps = 600

  def run(x0, A):
    hdm = hdm_optax.solve(
      hdm_optax.hdm(candidate="diagonal", learner="ogd", precond_lr=0.1),
      quadratic,
      x0,
      max_steps=steps,
      tol=0.0,
      fun_args=(A,),
    )
    gd = hdm_optax.solve(
      optax.sgd(1.0 / a.max()), quadratic, x0, max_steps=steps, tol=0.0, fun_args=(A,)
    )
    return hdm, gd

  hdm, gd = run_jit(run, x0, A)
  r_hdm = _gap_ratios(hdm.trace.value, floor)
  r_gd = _gap_ratios(gd.trace.value, floor)
  # Both reach the 1e-20 floor within the budget.
  assert np.asarray(hdm.trace.value)[-1] <= floor
  assert np.asarray(gd.trace.value)[-1] <= floor
  assert _is_superlinear(r_hdm), r_hdm
  assert np.min(r_hdm[-5:]) < 0.05
  # Gradient descent converges linearly: its ratios settle near (1 - mu/L)^2.
  assert not _is_superlinear(r_gd), r_gd[-5:]
  np.testing.assert_allclose(r_gd[-5:], (1 - 1 / a.max()) ** 2, rtol=0.05)


# ---------------------------------------------------------------------------
# Figure 1a/1b on experiments.toy.toy_quadratic().
# ---------------------------------------------------------------------------


def test_vanilla_hdm_blows_up_then_converges_and_null_step_prevents_it():
  A, x0 = toy.toy_quadratic()
  A, x0 = jnp.asarray(A), jnp.asarray(x0)
  f1 = toy.toy_value(x0, A)

  def run(x0, A):
    return [
      hdm_optax.solve(
        hdm_optax.hdm(null_step=null_step, **toy.VANILLA_HDM),
        toy.toy_objective,
        x0,
        max_steps=toy.TOY_MAX_STEPS,
        tol=0.0,
        fun_args=(A,),
        trace=toy.TOY_MAX_STEPS + 1,
      )
      for null_step in (False, True)
    ]

  vanilla, guarded = run_jit(run, x0, A)
  v = np.asarray(vanilla.trace.value)
  assert np.all(np.isfinite(v))
  assert v.max() >= 1e6 * f1, v.max() / f1  # warm-up phase: blow-up ...
  assert v[-1] < 1e-8 * f1, v[-1] / f1  # ... then convergence
  peak = int(np.argmax(v))
  assert np.all(v[peak:][-10:] < 1e-8 * f1)

  g = np.asarray(guarded.trace.value)
  assert g.max() <= f1
  _assert_nonincreasing(g, "null step")
  assert g[-1] < 1e-8 * f1
