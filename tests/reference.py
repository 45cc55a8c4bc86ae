"""Plain-NumPy reference implementations of the hypergradient descent methods.

These are deliberately naive loops over flat float64 vectors that follow the
paper (Algorithms 1-4, Appendix A and D) line by line.  They are written
independently of the ``hdm_optax`` package and serve as the ground truth in
``tests/test_reference.py``.

Every function takes an objective ``f`` (x -> float), its gradient ``grad``
(x -> array), a starting point ``x0`` and a number of steps, and returns a dict
of per-step records (the state *after* each step).

Conventions shared by all algorithms
------------------------------------
* Candidate preconditioners:
    scalar   P = alpha (0-d),  applied as alpha * g,   reduced hypergradient
             of an outer product u w^T is <u, w>;
    diagonal P = p (n,),       applied as p * g,       reduced u * w;
    full     P (n, n),         applied as P @ g,       reduced outer(u, w).
* Projection onto the candidate set = entrywise clip to [lo, hi] (None means
  unbounded on that side).
* Online learners (G = reduced hypergradient, k = 1, 2, ... the index of the
  learner round; a rejected non-finite trial is not a round):
    ogd:      P' = P - eta G
    ogd_sqrt: P' = P - eta / sqrt(k) G
    adagrad:  U' = U + G*G,  P' = P - eta G / (sqrt(U') + eps)
  followed by the projection.
* A trial point with a non-finite value or gradient is rejected and leaves the
  preconditioner, momentum and every accumulator unchanged; the next trial
  step is damped by s (s <- s/2 after a non-finite trial, s <- 1 after a
  finite one; the trial is x - P (s g) + B (s (x - x^-))). A finite trial
  made with damping s is the trial of (sP, sB): its hypergradient is taken
  there (with g and x - x^-) and the learners continue from sP, sB (HDM-Best:
  also eta_p0's decay factor is multiplied by s). HDM-AGD restarts instead
  (z <- x, A <- 1) when f or its gradient at y is not finite, and halves P
  (then projects) when only the trial y - P g is not finite.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

CANDIDATES = ("scalar", "diagonal", "full")
LEARNERS = ("ogd", "ogd_sqrt", "adagrad")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def init_precond(candidate: str, n: int, value) -> np.ndarray:
  """Initial P for a candidate from a scalar (scalar -> a, diag -> a*1, full -> a*I)
  or from an explicit array of the right shape."""
  value = np.asarray(value, dtype=np.float64)
  if value.ndim > 0:
    return value.copy()
  a = float(value)
  if candidate == "scalar":
    return np.asarray(a, dtype=np.float64)
  if candidate == "diagonal":
    return np.full(n, a, dtype=np.float64)
  if candidate == "full":
    return a * np.eye(n, dtype=np.float64)
  raise ValueError(candidate)


def apply_precond(candidate: str, P: np.ndarray, v: np.ndarray) -> np.ndarray:
  """P v for the candidate representation of P."""
  if candidate == "scalar":
    return float(P) * v
  if candidate == "diagonal":
    return P * v
  if candidate == "full":
    return P @ v
  raise ValueError(candidate)


def reduce_outer(candidate: str, u: np.ndarray, w: np.ndarray) -> np.ndarray:
  """Projection of the matrix gradient u w^T onto the candidate subspace
  (in the candidate's own parametrisation)."""
  if candidate == "scalar":
    return np.asarray(float(np.dot(u, w)))
  if candidate == "diagonal":
    return u * w
  if candidate == "full":
    return np.outer(u, w)
  raise ValueError(candidate)


def clip(P: np.ndarray, lo, hi) -> np.ndarray:
  """Orthogonal projection onto the box [lo, hi] (entrywise); None = unbounded."""
  P = np.asarray(P, dtype=np.float64)
  if lo is not None:
    P = np.maximum(P, lo)
  if hi is not None:
    P = np.minimum(P, hi)
  return P


class Learner:
  """Online learner for one hyper-parameter block (P or B)."""

  def __init__(self, kind: str, lr: float, shape, eps: float = 1e-12):
    if kind not in LEARNERS:
      raise ValueError(kind)
    self.kind = kind
    self.lr = float(lr)
    self.eps = float(eps)
    self.U = np.zeros(shape, dtype=np.float64)  # AdaGrad accumulator U_1 = 0
    self.rounds = 0

  def step(self, P: np.ndarray, G: np.ndarray, k=None) -> np.ndarray:
    """Unprojected update of P with hypergradient G (round k = 1, 2, ...)."""
    del k
    self.rounds += 1
    k = self.rounds
    if self.kind == "ogd":
      return P - self.lr * G
    if self.kind == "ogd_sqrt":
      return P - self.lr / math.sqrt(k) * G
    # adagrad
    self.U = self.U + G * G
    return P - self.lr * G / (np.sqrt(self.U) + self.eps)


def _oracle(f, grad, x):
  with np.errstate(all="ignore"):
    fx = float(f(x))
    gx = np.asarray(grad(x), dtype=np.float64)
  finite = bool(np.isfinite(fx) and np.all(np.isfinite(gx)))
  return fx, gx, finite


def decreases(f_t, fx, g_t, g, step, ulps: float = 64.0) -> bool:
  """The variants' default acceptance (``acceptance.resolved_decrease``), float64.

  f decides where ``|f_t - fx|`` exceeds ``ulps`` eps max(|f|); below that, the
  gradients' decrease ``0.5 <g + g_t, step>`` does.
  """
  if abs(f_t - fx) > ulps * np.finfo(np.float64).eps * max(abs(fx), abs(f_t)):
    return f_t < fx
  return float(0.5 * np.dot(g + g_t, step)) < 0


def _fval(v: float) -> float:
  """Non-finite values count as +inf when comparing."""
  return v if math.isfinite(v) else math.inf


# ---------------------------------------------------------------------------
# Algorithm 1: HDM (+ optional null step)
# ---------------------------------------------------------------------------


def hdm_reference(
  f,
  grad,
  x0,
  steps: int,
  *,
  candidate: str = "diagonal",
  learner: str = "adagrad",
  lr: float,
  null_step: bool = True,
  P1=0.0,
  precond_min=None,
  precond_max=None,
  eps: float = 1e-12,
) -> dict:
  x = np.array(x0, dtype=np.float64)
  n = x.size
  fx, g, _ = _oracle(f, grad, x)
  P = init_precond(candidate, n, P1)  # Algorithm 1, input: P_1 in cal P
  opt = Learner(learner, lr, P.shape, eps)
  out = dict(xs=[], Ps=[], values=[], accepted=[], finite=[])
  s = 1.0  # trial damping (safeguard after non-finite trials)
  for k in range(1, steps + 1):
    # Algorithm 1, line 3 / eq. (null-step): trial point x^k - P_k grad f(x^k)
    sg = s * g
    x_t = x - apply_precond(candidate, P, sg)
    f_t, g_t, finite = _oracle(f, grad, x_t)
    s_trial, s = s, (1.0 if finite else 0.5 * s)
    if finite:
      # eq. (hypergrad-feedback): grad h_{x^k}(P_k) = -grad f(x^{k+1/2}) grad f(x^k)^T / ||grad f(x^k)||^2
      den = float(np.dot(g, g))
      if den > 0:
        G = reduce_outer(candidate, -g_t, g) / den
      else:
        G = np.zeros_like(P)
      # Algorithm 1, line 4: P_{k+1} = Pi_P[P_k - eta_k grad h_{x^k}(P_k)], from s P_k
      P = clip(opt.step(s_trial * P, G, k), precond_min, precond_max)
    # Algorithm 1, line 3: x^{k+1} = argmin_{x in {x^k, x^k - P_k g}} f(x)
    # (vanilla HDM, null_step=False, always moves unless the trial is non-finite)
    accepted = finite and (decreases(f_t, fx, g_t, g, x_t - x) if null_step else True)
    if accepted:
      x, fx, g = x_t, f_t, g_t
    out["xs"].append(x.copy())
    out["Ps"].append(np.array(P, copy=True))
    out["values"].append(fx)
    out["accepted"].append(accepted)
    out["finite"].append(finite)
  return out


# ---------------------------------------------------------------------------
# Algorithm 2: HDM-HB (heavy-ball momentum; gradients from Appendix D.1)
# ---------------------------------------------------------------------------


def heavyball_feedback(f, x, x_prev, g, P, B, *, candidate, momentum_candidate, omega, tau):
  """h_{x,x^-}(P, B) of eq. (heavyball-feedback) (used by the finite-difference tests)."""
  d = x - x_prev
  x_plus = x - apply_precond(candidate, P, g) + apply_precond(momentum_candidate, B, d)
  num = (f(x_plus) + 0.5 * omega * np.dot(x_plus - x, x_plus - x)) - (
    f(x) + 0.5 * omega * np.dot(d, d)
  )
  return num / (np.dot(g, g) + 0.5 * tau * np.dot(d, d))


def hdm_hb_reference(
  f,
  grad,
  x0,
  steps: int,
  *,
  candidate: str = "diagonal",
  momentum_candidate: str = "scalar",
  learner: str = "adagrad",
  lr: float,
  momentum_lr: float,
  omega: float = 0.0,
  tau: float = 0.0,
  P1=0.0,
  B1=0.0,
  precond_min=None,
  precond_max=None,
  momentum_min=0.0,
  momentum_max=0.9995,
  eps: float = 1e-12,
) -> dict:
  if momentum_candidate == "full":
    raise ValueError("full momentum is not part of the reference")
  x = np.array(x0, dtype=np.float64)
  n = x.size
  x_prev = x.copy()  # Algorithm 2, input: x^0 = x^1
  fx, g, _ = _oracle(f, grad, x)
  P = init_precond(candidate, n, P1)
  B = init_precond(momentum_candidate, n, B1)
  opt_p = Learner(learner, lr, P.shape, eps)
  opt_b = Learner(learner, momentum_lr, B.shape, eps)
  out = dict(xs=[], Ps=[], Bs=[], x_prevs=[], values=[], accepted=[], finite=[])
  s = 1.0  # trial damping (safeguard after non-finite trials)
  for k in range(1, steps + 1):
    d = x - x_prev
    sg, sd = s * g, s * d
    # Algorithm 2, line 3: x^{k+1/2} = x^k - P_k g + B_k (x^k - x^{k-1})
    x_t = x - apply_precond(candidate, P, sg) + apply_precond(momentum_candidate, B, sd)
    f_t, g_t, finite = _oracle(f, grad, x_t)
    s_trial, s = s, (1.0 if finite else 0.5 * s)
    if finite:
      # Appendix D.1: grad_P h = [-grad f(x+) + w P g - w B d] g^T / den
      #               grad_B h = [ grad f(x+) - w P g + w B d] d^T / den
      # with -P g + B d = x+ - x, i.e. r = grad f(x+) + w (x+ - x).
      den = float(np.dot(g, g)) + 0.5 * tau * float(np.dot(d, d))
      r = g_t + omega * (x_t - x)
      if den > 0:
        G_P = reduce_outer(candidate, -r, g) / den
        G_B = reduce_outer(momentum_candidate, r, d) / den
      else:
        G_P = np.zeros_like(P)
        G_B = np.zeros_like(B)
      # Algorithm 2, line 4: P_{k+1} = Pi_P[P_k - eta_p grad_P h], from s P_k
      P = clip(opt_p.step(s_trial * P, G_P, k), precond_min, precond_max)
      # Algorithm 2, line 5: B_{k+1} = Pi_B[B_k - eta_b grad_B h], from s B_k
      B = clip(opt_b.step(s_trial * B, G_B, k), momentum_min, momentum_max)
    # Algorithm 2, line 6: null step w.r.t. the potential psi(x, x^-) = f(x) + w/2 ||x - x^-||^2
    psi_new = f_t + 0.5 * omega * float(np.dot(x_t - x, x_t - x))
    psi_old = fx + 0.5 * omega * float(np.dot(d, d))
    accepted = finite and psi_new < psi_old
    if accepted:
      x_prev, x = x, x_t
      fx, g = f_t, g_t
    out["xs"].append(x.copy())
    out["x_prevs"].append(x_prev.copy())
    out["Ps"].append(np.array(P, copy=True))
    out["Bs"].append(np.array(B, copy=True))
    out["values"].append(fx)
    out["accepted"].append(accepted)
    out["finite"].append(finite)
  return out


# ---------------------------------------------------------------------------
# Algorithm 3: HDM-AGD (Nesterov momentum; z-update with the descent sign of App. D.2)
# ---------------------------------------------------------------------------


def hdm_agd_reference(
  f,
  grad,
  x0,
  steps: int,
  *,
  lipschitz: float,
  theta: float = 1.0,
  candidate: str = "diagonal",
  learner: str = "adagrad",
  lr: float,
  P1=0.0,
  precond_min=None,
  precond_max=None,
  eps: float = 1e-12,
) -> dict:
  L = float(lipschitz)
  x = np.array(x0, dtype=np.float64)
  n = x.size
  z = x.copy()  # z^1 = x^1
  A = 1.0  # A_1 = (A_1 - A_0)^2 with A_0 = 0  =>  A_1 = 1
  fx, _, _ = _oracle(f, grad, x)
  P = init_precond(candidate, n, P1)
  opt = Learner(learner, lr, P.shape, eps)
  out = dict(xs=[], zs=[], As=[], Ps=[], values=[], finite_y=[], finite_P=[])

  def record(x, z, A, P, fx, finite_y, finite_P):
    for key, val in (
      ("xs", x.copy()),
      ("zs", z.copy()),
      ("As", A),
      ("Ps", np.array(P, copy=True)),
      ("values", fx),
      ("finite_y", finite_y),
      ("finite_P", finite_P),
    ):
      out[key].append(val)

  for k in range(1, steps + 1):
    # Algorithm 3: A_{k+1} = (A_{k+1} - A_k)^2  =>  a = A_{k+1} - A_k = (1 + sqrt(1 + 4 A_k)) / 2
    a = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * A))
    A_next = A + a
    # y^k = x^k + (1 - A_k / A_{k+1}) (z^k - x^k)
    y = x + (1.0 - A / A_next) * (z - x)
    f_y, g_y, finite_y = _oracle(f, grad, y)
    if not finite_y:  # rejected: restart the momentum (z <- x, A <- 1)
      z, A = x.copy(), 1.0
      record(x, z, A, P, fx, False, False)
      continue
    # candidates y - g/L and y - P g
    x_L = y - g_y / L
    f_L, _, _ = _oracle(f, grad, x_L)
    x_P = y - apply_precond(candidate, P, g_y)
    f_P, g_P, finite_P = _oracle(f, grad, x_P)
    den = float(np.dot(g_y, g_y))
    if finite_P:
      h = (f_P - f_y) / den  # h_{y^k}(P_k)
      G = reduce_outer(candidate, -g_P, g_y) / den if den > 0 else np.zeros_like(P)
      # P_{k+1} = Pi_P[P_k - eta grad h_{y^k}(P_k)]
      P = clip(opt.step(P, G, k), precond_min, precond_max)
    else:
      h = math.inf
      P = clip(0.5 * P, precond_min, precond_max)  # shorten the next trial y - P g
    # x^{k+1} = argmin_{x in {y - g/L, y - P g, x^k}} f(x)  (first minimum wins)
    cands = [(x_L, _fval(f_L)), (x_P, _fval(f_P)), (x, _fval(fx))]
    best_x, best_f = cands[0]
    for cx, cf in cands[1:]:
      if cf < best_f:
        best_x, best_f = cx, cf
    # v_k = max{ 1 / (2 max{-h, 1/(2L)}), L / (2 theta) }
    v = max(1.0 / (2.0 * max(-h, 1.0 / (2.0 * L))), L / (2.0 * theta))
    # z^{k+1} = z^k - (A_{k+1} - A_k) / v_k grad f(y^k)   (descent sign, Appendix D.2)
    z = z - (a / v) * g_y
    x, fx = best_x.copy(), best_f
    A = A_next
    record(x, z, A, P, fx, finite_y, finite_P)
  return out


# ---------------------------------------------------------------------------
# Algorithm 4: HDM-Best (+ the practical refinements of the spec)
# ---------------------------------------------------------------------------


def hdm_best_reference(
  f,
  grad,
  x0,
  steps: int,
  *,
  lipschitz: float,
  precond_lr: float,
  momentum_lr: float,
  horizon: int = 1000,
) -> dict:
  L = float(lipschitz)
  x = np.array(x0, dtype=np.float64)
  n = x.size
  x_prev = x.copy()  # x^0 = x^1
  fx, g, _ = _oracle(f, grad, x)
  P = np.zeros(n)  # P_1 = 0 (diagonal)
  beta = 0.95  # beta_1 = 0.95
  U = np.zeros(n)  # AdaGrad diagonal U_1 = 0
  v = 0.0  # AdaGrad momentum scalar v_1 = 0
  eta_p0 = float(precond_lr)
  decay = 1.0  # eta_p = eta_p0 * decay until L_hat exists, then 1/L_hat
  eta_b = float(momentum_lr)
  s = 1.0  # trial damping (safeguard after non-finite trials)
  L_hat = None
  ratios: list[float] = []
  counter = 0
  k = 0
  estimating = True
  threshold = max(min(horizon / 4, 200), 20)
  out = dict(
    xs=[],
    x_prevs=[],
    Ps=[],
    betas=[],
    values=[],
    accepted=[],
    finite=[],
    L_hats=[],
    eta_ps=[],
    Us=[],
    vs=[],
  )
  for _ in range(steps):
    d = x - x_prev
    sg, sd = s * g, s * d
    # x^{k+1/2} = x^k - P_k g + beta_k (x^k - x^{k-1})
    x_t = x - P * sg + beta * sd
    f_t, g_t, finite = _oracle(f, grad, x_t)
    s_trial, s = s, (1.0 if finite else 0.5 * s)
    k += 1
    # until L_hat exists, eta_p decays at k = 50, 100, ... before the P update
    if estimating and k % 50 == 0:
      decay = max(0.8 * decay, 1e-3)
    if finite:
      decay *= s_trial  # the damping carries into eta_p0's factor
    eta_p = eta_p0 * decay if L_hat is None else 1.0 / L_hat
    # denominator ||g||^2 + tau/2 ||d||^2 with tau = L_hat^2 / 2 once L is estimated
    if L_hat is None:
      den = float(np.dot(g, g)) + 1e-12
    else:
      den = float(np.dot(g, g)) + (L_hat**2 / 4.0) * float(np.dot(d, d))
    # hypergradients (omega-term dropped, Appendix A)
    G_P = -(g_t * g) / den
    G_b = float(np.dot(g_t, d)) / den
    if finite:
      # U_{k+1} = U_k + G_P o G_P ; v_{k+1} = v_k + G_b^2
      U = U + G_P * G_P
      v = v + G_b * G_b
      L_cur = L if L_hat is None else L_hat
      # P_{k+1} = Pi_{R^n_+}[P_k - eta_p U^{-1/2} G_P]  (upper bound 1e10 / L)
      P = np.clip(s_trial * P - eta_p * G_P / (np.sqrt(U) + 1e-12), 0.0, 1e10 / L_cur)
      # beta_{k+1} = Pi_[0, 0.9995][beta_k - eta_b v^{-1/2} G_b]
      beta = float(np.clip(s_trial * beta - eta_b * G_b / (math.sqrt(v) + 1e-12), 0.0, 0.9995))
    # x^{k+1} = argmin_{x in {x^k, x^{k+1/2}}} f(x)
    accepted = finite and decreases(f_t, fx, g_t, g, x_t - x)
    x_prev = x.copy()  # always, before x moves
    if accepted:
      step_len = float(np.linalg.norm(x_t - x))
      if estimating and step_len > 1e-3:
        ratios.append(float(np.linalg.norm(g_t - g)) / step_len)
      x, fx, g = x_t, f_t, g_t
      counter += 1
    else:
      counter = max(counter - 2, 0)
    if estimating and counter > threshold and ratios:
      L_hat = float(np.mean(ratios))  # from now on eta_p = 1 / L_hat
      U = np.zeros(n)
      estimating = False
    out["xs"].append(x.copy())
    out["x_prevs"].append(x_prev.copy())
    out["Ps"].append(P.copy())
    out["betas"].append(beta)
    out["values"].append(fx)
    out["accepted"].append(accepted)
    out["finite"].append(finite)
    out["L_hats"].append(L_hat)
    out["eta_ps"].append(eta_p)
    out["Us"].append(U.copy())
    out["vs"].append(v)
  return out


# ---------------------------------------------------------------------------
# OSGM-Best (Part II, arXiv:2509.11007), as the authors' implementation runs
# ---------------------------------------------------------------------------


def osgm_best_reference(
  f, grad, x0, steps: int, *, directions, horizon: int = 1000, probe_size: float = 1e-4
) -> dict:
  """``steps`` updates of OSGM-Best; the first ``len(directions)`` are the probes.

  A probe (one per direction, unit vectors) evaluates the oracle at
  x + probe_size d_i and leaves x in place; L holds the largest ratio so far,
  and the last probe sets L_0. Every later update is one iteration: one call
  at the trial point, plus one per point tried by the lookahead.
  """
  x = np.array(x0, dtype=np.float64)
  n = x.size
  fx, g, _ = _oracle(f, grad, x)
  L, calls = 0.0, 0
  x_prev = x.copy()
  P = np.zeros(n)  # P_1 = 0 (diagonal)
  beta = 0.95
  U = np.zeros(n)
  v = 0.0
  decay = 1.0  # lr_P = decay / L while L is being estimated, then 1 / L_hat
  s = 1.0  # trial damping (safeguard after non-finite trials)
  ratios: list[float] = []
  counter, k = 0, 0
  estimating = True
  threshold = max(min(horizon / 4, 200), 20)
  out = dict(xs=[], Ps=[], betas=[], values=[], accepted=[], calls=[], Ls=[], looked=[], finite=[])

  def record(accepted, looked, finite=True):
    out["finite"].append(finite)
    for key, val in (
      ("xs", x.copy()),
      ("Ps", P.copy()),
      ("betas", beta),
      ("values", fx),
      ("accepted", accepted),
      ("calls", calls),
      ("Ls", L),
      ("looked", looked),
    ):
      out[key].append(val)

  for i, d in enumerate(directions):
    _, g_d, _ = _oracle(f, grad, x + probe_size * np.asarray(d, dtype=np.float64))
    calls += 1
    L = float(np.maximum(L, np.linalg.norm(g_d - g) / probe_size))  # NaN stays NaN
    if i == len(directions) - 1 and not (math.isfinite(L) and L > 0):
      L = 1e-5
    record(False, False)
  for _ in range(steps - len(directions)):
    d = x - x_prev
    x_t = x - P * (s * g) + beta * (s * d)
    f_t, g_t, finite = _oracle(f, grad, x_t)
    calls += 1
    k += 1
    if estimating and k % 50 == 0:
      decay = max(0.8 * decay, 1e-3)  # lr_P <- max(0.8 lr_P, 1e-3 / L)
    if finite:  # the trial was the one of sP, s beta: the learners continue from there
      P, beta, decay = s * P, s * beta, s * decay
    s = 1.0 if finite else 0.5 * s
    lr_p = decay / L if estimating else 1.0 / L
    lr_b = min(1.0, L)
    gg = float(np.dot(g, g))
    den = gg + 1e-12 if estimating else gg + (L**2 / 4.0) * float(np.dot(d, d))
    looked = False
    if finite:
      G_P = -(g_t * g) / den
      G_b = float(np.dot(g_t, d)) / den
      U = U + G_P * G_P
      v = v + G_b * G_b
      P = np.clip(P - lr_p * G_P / (np.sqrt(U) + 1e-12), 0.0, 1e5 / L)
      beta = float(np.clip(beta - lr_b * G_b / (math.sqrt(v) + 1e-12), 0.0, 0.9995))
      if not estimating and np.linalg.norm(g_t) > 2 * math.sqrt(gg):
        # lookahead: Armijo backtracking from x_t along -P g_t
        p = P * g_t
        slope = float(np.dot(g_t, p))
        eta = 1.0
        while eta >= 1e-6:
          f_e, g_e, _ = _oracle(f, grad, x_t - eta * p)
          calls += 1
          if f_e <= f_t - 0.5 * eta * slope:
            x_t, f_t, g_t, looked = x_t - eta * p, f_e, g_e, True
            break
          eta *= 0.8
    accepted = finite and decreases(f_t, fx, g_t, g, x_t - x)
    x_prev = x.copy()
    if accepted:
      step_len = float(np.linalg.norm(x_t - x))
      if estimating and step_len > 1e-3:
        ratios.append(float(np.linalg.norm(g_t - g)) / step_len)
      x, fx, g = x_t, f_t, g_t
      counter += 1
    else:
      counter = max(counter - 2, 0)
    if estimating and counter > threshold and ratios:
      L = float(np.mean(ratios))
      U = np.zeros(n)
      estimating = False
    record(accepted, looked, finite)
  return out


# ---------------------------------------------------------------------------
# hdm_auto: Algorithm 4 with P in log space, null-step shrink, random probes
# ---------------------------------------------------------------------------


def hdm_auto_reference(
  f,
  grad,
  x0,
  steps: int,
  *,
  directions,
  horizon: int = 1000,
  probe_size: float = 1e-4,
  precond_lr: float = 0.5,
  precond_decay: float = 0.9,
  momentum_lr: float = 1.0,
  null_shrink: float = 0.5,
) -> dict:
  """``steps`` updates of hdm_auto; the first ``len(directions)`` are the probes.

  A probe evaluates the oracle at x + probe_size d_i and leaves x in place; L
  holds the largest ratio so far, and the last probe sets L_0 and P_1 = 1/L_0.
  """
  x = np.array(x0, dtype=np.float64)
  n = x.size
  fx, g, _ = _oracle(f, grad, x)
  tiny = 1e-30
  calls = 0
  L = 0.0
  x_prev = x.copy()
  P = np.zeros(n)
  beta = 0.95
  U = np.zeros(n)  # accumulator of (P o G_P)^2, forgetting factor precond_decay
  v = 0.0
  s = 1.0
  ratios: list[float] = []
  counter = 0
  estimating = True
  threshold = max(min(horizon / 4, 200), 20)
  out = dict(xs=[], Ps=[], betas=[], values=[], accepted=[], calls=[], Ls=[], finite=[], Us=[])

  def record(accepted, finite=True):
    for key, val in (
      ("xs", x.copy()),
      ("Ps", P.copy()),
      ("betas", beta),
      ("values", fx),
      ("accepted", accepted),
      ("calls", calls),
      ("Ls", L),
      ("finite", finite),
      ("Us", U.copy()),
    ):
      out[key].append(val)

  for i, d in enumerate(directions):
    _, g_d, _ = _oracle(f, grad, x + probe_size * np.asarray(d, dtype=np.float64))
    calls += 1
    L = float(np.maximum(L, np.linalg.norm(g_d - g) / probe_size))  # NaN stays NaN
    if i == len(directions) - 1:
      if not (math.isfinite(L) and L > 0):
        L = 1e-5
      P = np.full(n, 1.0 / L)  # P_1 = 1 / L_0
    record(False)
  for _ in range(steps - len(directions)):
    d = x - x_prev
    x_t = x - P * (s * g) + beta * (s * d)
    f_t, g_t, finite = _oracle(f, grad, x_t)
    calls += 1
    if finite:  # the trial was the one of sP, s beta: the learners continue from there
      P, beta = s * P, s * beta
    s = 1.0 if finite else 0.5 * s
    gg = float(np.dot(g, g))
    den = gg + 1e-12 if estimating else gg + (L**2 / 4.0) * float(np.dot(d, d))
    if finite:
      G_P = -(g_t * g) / den
      G_b = float(np.dot(g_t, d)) / den
      H = P * G_P  # gradient with respect to log P
      U = precond_decay * U + H * H
      P = np.clip(P * np.exp(-precond_lr * H / (np.sqrt(U) + tiny)), tiny, 1e10 / L)
      v = v + G_b * G_b
      beta = float(np.clip(beta - momentum_lr * G_b / (math.sqrt(v) + 1e-12), 0.0, 0.9995))
    accepted = finite and decreases(f_t, fx, g_t, g, x_t - x)
    if not accepted:
      P = np.maximum(null_shrink * P, tiny)  # a null step says P is too long
    x_prev = x.copy()
    if accepted:
      step_len = float(np.linalg.norm(x_t - x))
      if estimating and step_len > 1e-3:
        ratios.append(float(np.linalg.norm(g_t - g)) / step_len)
      x, fx, g = x_t, f_t, g_t
      counter += 1
    else:
      counter = max(counter - 2, 0)
    if estimating and counter > threshold and ratios:
      L = float(np.mean(ratios))
      U = np.zeros(n)
      estimating = False
    record(accepted, finite)
  return out


def _bfgs_matrix(pairs, gamma0, n: int) -> np.ndarray:
  """The L-BFGS inverse Hessian, explicit: BFGS updates of gamma0 I (gamma0 a number) or of
  diag(gamma0) (an array of n) by ``pairs``, oldest first."""
  H = np.diag(np.broadcast_to(np.asarray(gamma0, np.float64), (n,)))
  for s, y in pairs:
    r = 1.0 / float(s @ y)
    V = np.eye(n) - r * np.outer(y, s)
    H = V.T @ H @ V + r * np.outer(s, s)
  return H


def _judge_trial(f_t, g_t, fx, g, step, band, curvature, pair_tol):
  """trial_lbfgs on a finite trial: (accepted, y, <s, y>, whether the pair is kept)."""
  y = g_t - g
  sy = float(step @ y)
  near = f_t <= fx + max(band, 1024 * np.finfo(np.float64).eps) * abs(fx)
  flat = abs(float(g_t @ step)) <= curvature * abs(float(g @ step))
  kept = sy > pair_tol * float(np.sum(np.abs(step * y)))  # not ||s|| ||y||: scale-free
  return f_t <= fx or (near and flat), y, sy, kept


def _remember(pairs, gamma, step, y, sy, scales, kept, memory_size):
  """The last ``memory_size`` pairs with (step, y) where ``kept``; gamma from it where ``scales``."""
  if kept:
    pairs = (pairs + [(step.copy(), y.copy())])[-memory_size:]
  return pairs, (sy / float(y @ y) if scales else gamma)


# trial_lbfgs's resolution of x: 1024 eps of float64, coordinate by coordinate.
RESOLUTION = 1024 * float(np.finfo(np.float64).eps)


def below_resolution(step, x) -> bool:
  """The step moves no coordinate by more than ``RESOLUTION`` of it."""
  return bool(np.all(np.abs(step) <= RESOLUTION * np.abs(x)))


def noise_seen(fx, f_t, d0, d1, curvature=0.9) -> float:
  """|f+ - f - (d0 + d1)/2| where d0 < 0 and |d1 - d0| <= (1 - curvature) |d0|, else 0."""
  linear = d0 < 0 and abs(d1 - d0) <= (1 - curvature) * abs(d0)
  return abs(f_t - fx - (d0 + d1) / 2) if linear else 0.0


def _within_noise(run, fx, f_t, d0, d1, curvature) -> bool:
  """After two null steps in a row (``run`` = (nulls, their largest noise_seen)), an increase
  within that noise along which the slope shrank."""
  nulls, noise = run
  flat = d0 < 0 and abs(d1) <= curvature * abs(d0)
  return nulls >= 2 and noise > 0 and flat and f_t - fx <= noise


def _next_run(run, accepted, finite, fx, f_t, d0, d1, curvature):
  """The null run's (count, noise) after a trial: (0, 0) after an accepted one."""
  if accepted:
    return 0, 0.0
  seen = noise_seen(fx, f_t, d0, d1, curvature) if finite else 0.0
  return run[0] + 1, max(run[1], seen)


def _learn_trial(
  f_t,
  g_t,
  fx,
  g,
  step,
  pairs,
  gamma,
  band,
  curvature,
  pair_tol,
  agree,
  memory_size,
  lost=False,
  run=(0, 0.0),
):
  """trial_lbfgs on a finite trial: (accepted, d0, d1, y, <s, y>, kept, pairs, gamma) after it.

  The pair is kept where its curvature passes and the trial was accepted or, rejected, the
  cubic's and the secant's minimisers along s agree, and the step is not ``lost`` (below x's
  resolution); gamma scales from a kept accepted pair. ``run``: the null run before it
  (:func:`_within_noise`)."""
  accepted, y, sy, curved = _judge_trial(f_t, g_t, fx, g, step, band, curvature, pair_tol)
  d0, d1 = float(g @ step), float(g_t @ step)
  accepted = accepted or _within_noise(run, fx, f_t, d0, d1, curvature)
  kept = curved and not lost and (accepted or _agree(fx, f_t, d0, d1, agree))
  pairs, gamma = _remember(pairs, gamma, step, y, sy, kept and accepted, kept, memory_size)
  return accepted, d0, d1, y, sy, kept, pairs, gamma


def _square_sums(pairs):
  return sum(s * s for s, _ in pairs), sum(y * y for _, y in pairs)


def _predicts_newest(pairs, back: int = 1) -> bool:
  """h of the other pairs predicts the newest pair's (``back`` = 2: the one before it) s from
  its y better than their scalar c = sqrt(sum ss / sum yy) does."""
  s_new, y_new = pairs[-back]
  ss, yy = _square_sums(pairs[: len(pairs) - back] + pairs[len(pairs) - back + 1 :])
  c = math.sqrt(ss.sum() / max(yy.sum(), np.finfo(np.float64).tiny))
  seen = (ss > 0) & (yy > 0)
  h = np.where(seen, np.sqrt(np.where(seen, ss, 1.0) / np.where(seen, yy, 1.0)), c)
  return np.sum((h * y_new - s_new) ** 2) < np.sum((c * y_new - s_new) ** 2)


def pairs_diagonal_reference(pairs, gamma: float, gate: float, bound: float, memory_size: int):
  """H_0 from the pairs: h_i = sqrt(sum_k s_ki^2 / sum_k y_ki^2) clipped to [gamma / bound,
  gamma bound] (gamma where a coordinate's sums are 0), where at least two pairs are kept,
  max h / min h over the coordinates with nonzero sums exceeds ``gate`` and, until the memory
  is full, the older pairs' h predicts the newest pair better than their scalar (with a full
  memory: the other pairs' h predicts the newest pair or the one before it); gamma
  otherwise."""
  if len(pairs) < 2:
    return gamma
  ss, yy = _square_sums(pairs)
  seen = (ss > 0) & (yy > 0)
  h = np.sqrt(np.where(seen, ss, 1.0) / np.where(seen, yy, 1.0))
  if len(pairs) == memory_size:
    predicted = _predicts_newest(pairs) or _predicts_newest(pairs, 2)
  else:
    predicted = _predicts_newest(pairs)
  if not seen.any() or h[seen].max() <= gate * h[seen].min() or not predicted:
    return gamma
  return np.where(seen, np.clip(h, gamma / bound, gamma * bound), gamma)


def _first_gamma(gamma: float, g: np.ndarray) -> float:
  gn = float(np.linalg.norm(g))
  return gamma if gamma > 0 else (min(1.0, 1.0 / gn) if gn > 0 else 1.0)


def _append(out: dict, **values) -> None:
  for key, val in values.items():
    out[key].append(val)


def _cubic_t(f0, f1, d0, d1):
  """The minimiser in t of the cubic through (0, f0, d0), (1, f1, d1) (Nocedal-Wright 3.59)."""
  e1 = d0 + d1 - 3.0 * (f1 - f0)
  disc = e1 * e1 - d0 * d1
  if disc < 0:
    return math.nan
  e2 = math.sqrt(disc)
  den = d1 - d0 + 2.0 * e2
  return 1.0 - (d1 + e2 - e1) / den if den != 0 else math.nan


def _secant_t(d0, d1):
  return d0 / (d0 - d1) if d1 > d0 else math.nan


def _agree(f0, f1, d0, d1, factor):
  ratio = _cubic_t(f0, f1, d0, d1) / _secant_t(d0, d1)
  return math.isfinite(ratio) and 1.0 / factor <= ratio <= factor


def unseen_decrease(f0, f1, d0, d1, curvature=0.9) -> bool:
  """d0 < 0, |d1 - d0| <= (1 - curvature) |d0| and f1 <= f0 + max(1e-10, 1024 eps) |f0|: the
  slopes show a decrease along s that f's values cannot (step_rule.unseen_decrease)."""
  width = max(1e-10, 1024 * np.finfo(np.float64).eps) * abs(f0)
  return d0 < 0 and abs(d1 - d0) <= (1 - curvature) * abs(d0) and f1 <= f0 + width


def evidence_alpha(
  alpha,
  f0,
  f1,
  d0,
  d1,
  finite,
  accepted,
  *,
  shrink=0.5,
  steep=0.9,
  extrapolate=4.0,
  max_step=1e6,
  lo=0.1,
  hi=0.5,
  agree=3.0,
  restarted=False,
):
  """hdm_optax.pieces.lbfgs.step_rule.evidence_step's alpha after one trial, case by case.

  ``restarted``: the memory restarted at this x since the last accepted trial."""
  if not finite:
    return alpha * shrink
  if accepted:
    if d1 < steep * d0:  # still steep along s: extrapolate
      return min(max_step, alpha * extrapolate)
    if alpha <= 1:
      return 1.0
    back = alpha * min(max(_secant_t(d0, d1), lo), 1.0)
    return max(1.0, back) if d1 > 0 and math.isfinite(back) else alpha
  if restarted and unseen_decrease(f0, f1, d0, d1):  # too short for f's rounding: lengthened
    return min(max_step, alpha * extrapolate)
  t = _cubic_t(f0, f1, d0, d1)
  if _agree(f0, f1, d0, d1, agree):
    t = t / _secant_t(d0, d1)
  return alpha * (min(max(t, lo), hi) if math.isfinite(t) else shrink)


def trial_lbfgs_reference(
  f,
  grad,
  x0,
  steps: int,
  *,
  memory_size: Optional[int] = None,
  pair_tol: float = 1e-10,
  band: float = 1e-10,
  curvature: float = 0.9,
  agree: float = 3.0,
  alpha_rule=evidence_alpha,
  diagonal=(1e3, 1e12),
) -> dict:
  """``steps`` updates of trial_lbfgs: x+ = x - alpha H g, H from the last pairs of every trial.

  H is the L-BFGS inverse-Hessian matrix built explicitly (BFGS updates of
  H_0 = gamma I by the kept pairs, oldest first), not by the two-loop
  recursion. gamma = <s, y>/<y, y> of the newest accepted kept pair, before
  one min(1, 1/||g||). A pair is kept when <s, y> > pair_tol sum_i |s_i y_i| and the
  trial was accepted or its cubic and secant minimisers along s agree within
  ``agree``. Accepted: f+ <= f, or f+ <= f + band |f| and
  |<g+, s>| <= curvature |<g, s>|, or, after two null steps in a row, f+ - f at most the
  largest :func:`noise_seen` of those null steps and |<g+, s>| <= curvature |<g, s>|. alpha:
  ``alpha_rule`` (told whether the memory restarted at this x since the last accepted
  trial). A step that moves no coordinate
  by more than 1024 eps of it (:func:`below_resolution`), or a rejected one that leaves the
  gradient as it was, restarts: no pair kept, the memory emptied, gamma from the gradient
  again, alpha = 1. An accepted step that leaves the gradient as it was keeps no pair and
  goes on (f is linear along it: alpha_rule lengthens the next trial).
  ``diagonal``: ``(gate, bound)`` of H_0 = :func:`pairs_diagonal_reference` (trial_lbfgs()'s
  default; not where x has fewer entries than pairs), or None for H_0 = gamma I.
  ``memory_size`` None: trial_lbfgs()'s, x's size clipped to [10, 30] where it is at most
  1000, 10 above.
  """
  x = np.array(x0, dtype=np.float64)
  if memory_size is None:
    memory_size = min(max(x.size, 10), 30) if x.size <= 1000 else 10
  if x.size < memory_size:
    diagonal = None
  fx, g, _ = _oracle(f, grad, x)
  pairs: list[tuple[np.ndarray, np.ndarray]] = []
  gamma, alpha, calls, run, restarted = 0.0, 1.0, 0, (0, 0.0), False
  out = dict(xs=[], values=[], accepted=[], calls=[], alphas=[], gammas=[], pairs=[], restarts=[])
  for _ in range(steps):
    h0 = _first_gamma(gamma, g)
    if diagonal is not None:
      h0 = pairs_diagonal_reference(pairs, h0, *diagonal, memory_size)
    step = -alpha * (_bfgs_matrix(pairs, h0, x.size) @ g)
    f_t, g_t, finite = _oracle(f, grad, x + step)
    calls += 1
    accepted = False
    d0 = d1 = math.nan
    short = below_resolution(step, x)
    flat = finite and (short or not np.any(g_t != g))  # no curvature along s
    if finite:
      accepted, d0, d1, y, sy, kept, pairs, gamma = _learn_trial(
        f_t,
        g_t,
        fx,
        g,
        step,
        pairs,
        gamma,
        band,
        curvature,
        pair_tol,
        agree,
        memory_size,
        lost=flat,
        run=run,
      )
    run = _next_run(run, accepted, finite, fx, f_t, d0, d1, curvature)
    alpha = alpha_rule(alpha, fx, f_t, d0, d1, finite, accepted, restarted=restarted)
    lost = flat and (short or not accepted)  # accepted, g unchanged: f linear along s
    restarted = lost or (restarted and not accepted)
    if lost:
      pairs, gamma, alpha = [], 0.0, 1.0
    if accepted:
      x, fx, g = x + step, f_t, g_t
    _append(
      out,
      restarts=lost,
      xs=x.copy(),
      values=fx,
      accepted=accepted,
      calls=calls,
      alphas=alpha,
      gammas=gamma,
      pairs=len(pairs),
    )
  return out


def trial_lbfgs_box_reference(
  f,
  grad,
  x0,
  lower,
  upper,
  steps: int,
  memory_size: int = 10,
  **rule,
) -> dict:
  """``steps`` updates of trial_lbfgs(lower=, upper=): the two-metric projected step.

  x0 is projected onto the box. Free variables F: all but those with x_i <= l_i and
  g_i > 0 or x_i >= u_i and g_i < 0. H_F is the BFGS matrix (explicit, oldest pair first)
  of the pairs restricted to F, (s_F, y_F), each kept where <s_F, y_F> > pair_tol
  ||s_F|| ||y_F||, from H_0 = gamma I; gamma <s_F, y_F> / <y_F, y_F> of the newest accepted
  kept pair restricted to the F it was proposed on (the full pair's where <s_F, y_F> <= 0),
  its first value min(1, 1/||g_F||). d = H_F g_F on F and gamma g elsewhere; the step is clip(x - alpha d)
  - x, or clip(x - alpha gamma g) - x where <g, step> >= 0. Pairs (step, g+ - g) and the
  acceptance are the unbounded method's, alpha ``alpha_rule``'s (default
  :func:`evidence_alpha`). ``rule``: ``pair_tol``, ``band``, ``curvature``,
  ``agree`` and ``alpha_rule``, as :func:`trial_lbfgs_reference`'s.
  """
  defaults = dict(pair_tol=1e-10, band=1e-10, curvature=0.9, agree=3.0, alpha_rule=evidence_alpha)
  rule = {**defaults, **rule}
  pair_tol, band, curvature = rule["pair_tol"], rule["band"], rule["curvature"]
  agree, alpha_rule = rule["agree"], rule["alpha_rule"]
  lower, upper = np.asarray(lower, np.float64), np.asarray(upper, np.float64)
  x = np.clip(np.array(x0, dtype=np.float64), lower, upper)
  fx, g, _ = _oracle(f, grad, x)
  pairs: list[tuple[np.ndarray, np.ndarray]] = []
  gamma, alpha, calls, run = 0.0, 1.0, 0, (0, 0.0)
  out = dict(xs=[], values=[], accepted=[], calls=[], alphas=[])
  for _ in range(steps):
    free = ~(((x <= lower) & (g > 0)) | ((x >= upper) & (g < 0)))
    g_free = np.where(free, g, 0.0)
    g0 = _first_gamma(gamma, g_free)
    restricted = [(np.where(free, s, 0.0), np.where(free, y, 0.0)) for s, y in pairs]
    restricted = [
      (s, y)
      for s, y in restricted
      if float(s @ y) > pair_tol * np.linalg.norm(s) * np.linalg.norm(y)
    ]
    d = np.where(free, _bfgs_matrix(restricted, g0, x.size) @ g_free, g0 * g)
    step = np.clip(x - alpha * d, lower, upper) - x
    if float(g @ step) >= 0:
      step = np.clip(x - alpha * g0 * g, lower, upper) - x
    f_t, g_t, finite = _oracle(f, grad, x + step)
    calls += 1
    accepted = False
    d0 = d1 = math.nan
    if finite:
      accepted, d0, d1, y, sy, kept, pairs, gamma = _learn_trial(
        f_t, g_t, fx, g, step, pairs, gamma, band, curvature, pair_tol, agree, memory_size, run=run
      )
      sy_free = float(np.where(free, step, 0.0) @ np.where(free, y, 0.0))
      if kept and accepted and sy_free > 0:  # the scale of the pair restricted to F
        gamma = sy_free / float(np.where(free, y, 0.0) @ np.where(free, y, 0.0))
    run = _next_run(run, accepted, finite, fx, f_t, d0, d1, curvature)
    alpha = alpha_rule(alpha, fx, f_t, d0, d1, finite, accepted)
    if accepted:
      x, fx, g = x + step, f_t, g_t
    _append(out, xs=x.copy(), values=fx, accepted=accepted, calls=calls, alphas=alpha)
  return out


def two_loop_reference(s, y, rho, head: int, gamma: float, v) -> np.ndarray:
  """H_m v by the two-loop recursion (Nocedal and Wright, Algorithm 7.4) over a ring buffer.

  ``s``, ``y`` (m, n) by slot, ``rho`` (m,) with 0 marking an empty slot, ``head`` the slot
  after the newest pair: newest to oldest, ``q <- q - alpha_i y_i``; ``r = gamma q``; oldest
  to newest, ``r <- r + (alpha_i - beta_i) s_i``. Empty slots are skipped.
  """
  s, y, rho = (np.asarray(a, dtype=np.float64) for a in (s, y, rho))
  m = rho.size
  q = np.array(v, dtype=np.float64)
  alphas = {}
  for k in range(m):
    i = (head - 1 - k) % m
    if rho[i] != 0:
      alphas[i] = rho[i] * float(s[i] @ q)
      q = q - alphas[i] * y[i]
  r = gamma * q
  for k in range(m):
    i = (head + k) % m
    if rho[i] != 0:
      beta = rho[i] * float(y[i] @ r)
      r = r + (alphas[i] - beta) * s[i]
  return r
