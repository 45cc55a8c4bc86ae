"""Online learners that update P (and B, beta) from the hypergradient feedback.

Every HDM variant treats its stepsize as the decision of an online learner
fed with the gradient G of the hypergradient feedback h (Section 2.2):

- ``ogd``:      online gradient descent with a constant step,
  P <- P - eta G (eq. (2), Lemma 2.2);
- ``ogd_sqrt``: online gradient descent with step eta / sqrt(k), k = 1, 2, ...
  (the K-free form of the step of Lemma 2.2);
- ``adagrad``:  diagonal AdaGrad (Section 3.2, Algorithm 4),
  U <- U + G * G,  P <- P - eta G / (sqrt(U) + eps).

A learner only proposes the step; :func:`learn` adds it to P and projects.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Section 2.2, Section
  3.2 and Algorithm 4. Duchi, Hazan, Singer, *Adaptive Subgradient Methods for
  Online Learning and Stochastic Optimization*, JMLR 12, 2011 (AdaGrad);
  McMahan, Streeter, arXiv:1002.4908, 2010.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _checks
from hdm_optax import _numerics

__all__ = (
  "LEARNERS",
  "AdagradState",
  "OGDSqrtState",
  "OnlineLearner",
  "adagrad",
  "decayed_adagrad",
  "get",
  "learn",
  "learn_log",
  "ogd",
  "ogd_sqrt",
)


class OnlineLearner(NamedTuple):
  """An online learner.

  Attributes:
    init: ``init(P) -> state``.
    step: ``step(G, state, lr) -> (delta, state)``; the new decision is
      ``project(P + delta)``.
  """

  init: Callable[[Any], Any]
  step: Callable[[Any, Any, Any], tuple[Any, Any]]


class OGDSqrtState(NamedTuple):
  """State of ``ogd_sqrt``: ``count`` is k, the number of steps taken."""

  count: jax.Array


class AdagradState(NamedTuple):
  """State of ``adagrad``: ``sum_sq`` is U_k, the sum of squared feedback
  gradients (Algorithm 4: U for P, v for beta), shaped like P."""

  sum_sq: Any


def _scaled(g, lr):
  return jax.tree.map(lambda x: -jnp.asarray(lr).astype(x.dtype) * x, g)


def ogd() -> OnlineLearner:
  """Online gradient descent with a constant step: delta = -lr G (eq. (2)).

  Returns:
    An :class:`OnlineLearner` with an empty state.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import learners
    >>> learner = learners.ogd()
    >>> delta, state = learner.step(jnp.array([1.0, -2.0]), learner.init(None), 0.5)
    >>> [float(v) for v in delta]
    [-0.5, 1.0]
  """
  return OnlineLearner(
    init=lambda p: optax.EmptyState(),
    step=lambda g, state, lr: (_scaled(g, lr), state),
  )


def ogd_sqrt() -> OnlineLearner:
  """Online gradient descent with step lr / sqrt(k), k = 1, 2, ...

  Returns:
    An :class:`OnlineLearner` whose state counts the steps.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import learners
    >>> learner = learners.ogd_sqrt()
    >>> state = learner.init(None)
    >>> _, state = learner.step(jnp.array([1.0]), state, 1.0)
    >>> delta, state = learner.step(jnp.array([1.0]), state, 1.0)  # k = 2
    >>> round(float(delta[0]), 4), int(state.count)
    (-0.7071, 2)
  """

  def step(g, state, lr):
    count = state.count + 1
    lr_k = jnp.asarray(lr) / jnp.sqrt(count.astype(jnp.asarray(lr).dtype))
    return _scaled(g, lr_k), OGDSqrtState(count=count)

  return OnlineLearner(
    init=lambda p: OGDSqrtState(count=jnp.zeros([], jnp.int32)),
    step=step,
  )


def adagrad(eps: float = 1e-12) -> OnlineLearner:
  """Diagonal AdaGrad: U += G*G; delta = -lr G / (sqrt(U) + eps).

  Args:
    eps: added to sqrt(U).

  Returns:
    An :class:`OnlineLearner` whose state is U (:class:`AdagradState`).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import learners
    >>> learner = learners.adagrad(eps=0.0)
    >>> state = learner.init(jnp.zeros(2))
    >>> delta, state = learner.step(jnp.array([3.0, -4.0]), state, 0.1)
    >>> [round(float(v), 6) for v in delta], [float(u) for u in state.sum_sq]
    ([-0.1, 0.1], [9.0, 16.0])
  """

  def step(g, state, lr):
    sum_sq = jax.tree.map(lambda u, x: u + x * x, state.sum_sq, g)
    delta = jax.tree.map(
      lambda x, u: (
        -jnp.asarray(lr).astype(x.dtype)
        * x
        / (_numerics.sqrt(u) + jnp.asarray(eps).astype(x.dtype))
      ),
      g,
      sum_sq,
    )
    return delta, AdagradState(sum_sq=sum_sq)

  return OnlineLearner(
    init=lambda p: AdagradState(sum_sq=optax.tree.zeros_like(p)),
    step=step,
  )


def decayed_adagrad(decay: Any = 0.9, eps: float = 1e-12) -> OnlineLearner:
  """AdaGrad whose sum forgets: U <- decay U + G*G; delta = -lr G / (sqrt(U) + eps).

  With ``decay`` = 1 this is :func:`adagrad`. With ``decay`` < 1 the step does
  not shrink like 1/sqrt(k) under feedback of constant size; it settles at
  about lr sqrt(1 - decay), so the decision can keep following a feedback
  whose sign changes late in a run (a departure from the paper's AdaGrad).

  Args:
    decay: the factor of U per round, in (0, 1].
    eps: added to sqrt(U).

  Returns:
    An :class:`OnlineLearner` whose state is U (:class:`AdagradState`).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import learners
    >>> learner = learners.decayed_adagrad(decay=0.5, eps=0.0)
    >>> state = learner.init(jnp.zeros(1))
    >>> _, state = learner.step(jnp.array([2.0]), state, 1.0)
    >>> delta, state = learner.step(jnp.array([2.0]), state, 1.0)  # U = 0.5 * 4 + 4
    >>> round(float(delta[0]), 6), float(state.sum_sq[0])
    (-0.816497, 6.0)
  """
  _checks.check_positive("decay", decay)

  def step(g, state, lr):
    sum_sq = jax.tree.map(
      lambda u, x: jnp.asarray(decay).astype(u.dtype) * u + x * x, state.sum_sq, g
    )
    delta = jax.tree.map(
      lambda x, u: (
        -jnp.asarray(lr).astype(x.dtype)
        * x
        / (_numerics.sqrt(u) + jnp.asarray(eps).astype(x.dtype))
      ),
      g,
      sum_sq,
    )
    return delta, AdagradState(sum_sq=sum_sq)

  return OnlineLearner(init=adagrad(eps).init, step=step)


LEARNERS: dict[str, Callable[..., OnlineLearner]] = {
  "ogd": lambda eps: ogd(),
  "ogd_sqrt": lambda eps: ogd_sqrt(),
  "adagrad": adagrad,
}


def get(learner, *, eps: float = 1e-12) -> OnlineLearner:
  """Resolves a name in :data:`LEARNERS` (or passes an ``OnlineLearner`` through).

  Args:
    learner: a name or an :class:`OnlineLearner`.
    eps: AdaGrad's eps (the other learners ignore it).

  Returns:
    An :class:`OnlineLearner`.

  Examples:
    >>> from hdm_optax.pieces import learners
    >>> learner = learners.get("adagrad", eps=1e-8)
  """
  if isinstance(learner, OnlineLearner):
    return learner
  return _checks.lookup("learner", learner, LEARNERS)(eps)


def learn(
  candidate, learner: OnlineLearner, p, g, state, lr, lower, upper, *, check_finite: bool = True
):
  """One online-learning round: P <- Pi_P[P + learner step(G)].

  If the round produces a non-finite P or learner state (the feedback G
  overflowed), P and the learner state are left unchanged. Callers that
  guarantee a finite round pass ``check_finite=False`` to save two passes
  over P.

  Args:
    candidate: the :class:`~hdm_optax.pieces.candidates.CandidateSet` of P (its
      ``project``).
    learner: the :class:`OnlineLearner`.
    p: P.
    g: G, the hypergradient, shaped like P.
    state: the learner's state.
    lr: the learner's step size.
    lower: lower bound of P's entries (``None``: unbounded).
    upper: upper bound of P's entries (``None``: unbounded).
    check_finite: keep P and the state on a non-finite round.

  Returns:
    ``(P, state)`` after the round.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates, learners
    >>> p, state = learners.learn(candidates.scalar(), learners.ogd(), jnp.asarray(0.5),
    ...                           jnp.asarray(-1.0), None, 1.0, 0.0, 1.0)
    >>> float(p)
    1.0
  """
  delta, new_state = learner.step(g, state, lr)
  new_p = candidate.project(optax.tree.add(p, delta), lower, upper)
  if not check_finite:
    return new_p, new_state
  ok = _numerics.all_finite(new_p, new_state)
  return _numerics.keep_if(ok, (new_p, new_state), (p, state))


def learn_log(candidate, learner: OnlineLearner, p, g, state, lr, lower, upper):
  r"""One online-learning round on log P: P <- Pi_P[P exp(learner step(P G))].

  The learner runs on :math:`\theta = \log P` (entrywise), whose feedback
  gradient is :math:`P \circ G` by the chain rule. With :func:`adagrad` each
  entry of P then moves by a factor of at most :math:`e^{lr}` per round,
  whatever its scale: P too long by a factor of 100 comes back in a few
  rounds, where an additive step of :math:`\eta_p` per round takes
  :math:`P / \eta_p` rounds. Entries of P must be positive (a zero entry stays
  zero). A departure from the paper, whose learners act on P itself.

  Args:
    candidate: the :class:`~hdm_optax.pieces.candidates.CandidateSet` of P (its ``project``;
      ``scalar`` or ``diagonal``).
    learner: the :class:`OnlineLearner` of log P.
    p: P, positive.
    g: G, the hypergradient with respect to P, shaped like P.
    state: the learner's state.
    lr: the learner's step size (of log P).
    lower: lower bound of P's entries (``None``: unbounded).
    upper: upper bound of P's entries (``None``: unbounded).

  Returns:
    ``(P, state)`` after the round.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates, learners
    >>> learner = learners.adagrad(eps=0.0)
    >>> p = jnp.array([1.0, 1e-3])
    >>> g = jnp.array([2.0, -500.0])  # dh/dP; dh/dlogP = P G = [2, -0.5]
    >>> p, state = learners.learn_log(candidates.diagonal(), learner, p, g,
    ...                               learner.init(p), 0.5, 0.0, None)
    >>> [round(float(v), 6) for v in p]
    [0.606531, 0.001649]
  """
  log_grad = optax.tree.mul(p, g)
  delta, new_state = learner.step(log_grad, state, lr)
  new_p = jax.tree.map(lambda x, d: x * jnp.exp(d), p, delta)
  return candidate.project(new_p, lower, upper), new_state
