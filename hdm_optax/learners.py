"""Online learners that update P (and B, beta) from the hypergradient feedback.

Every HDM variant treats its stepsize as the decision of an online learner
fed with the gradient G of the hypergradient feedback h (Section 2.2):

- ``ogd``:      online gradient descent with a constant step,
  P <- P - eta G (eq. (2), Lemma 2.2);
- ``ogd_sqrt``: online gradient descent with step eta / sqrt(k), k = 1, 2, ...
  (the K-free form of the step of Lemma 2.2);
- ``adagrad``:  diagonal AdaGrad (Section 3.2, Algorithm 4),
  U <- U + G * G,  P <- P - eta G / (sqrt(U) + eps).

A learner only proposes the step; the caller adds it to P and projects.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common


class OnlineLearner(NamedTuple):
  """An online learner.

  Attributes:
    name: the learner's name.
    init: ``init(P) -> state``.
    step: ``step(G, state, lr) -> (delta, state)``; the new decision is
      ``project(P + delta)``.
  """

  name: str
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
  """Online gradient descent with a constant step: delta = -lr G."""
  return OnlineLearner(
    name="ogd",
    init=lambda p: optax.EmptyState(),
    step=lambda g, state, lr: (_scaled(g, lr), state),
  )


def ogd_sqrt() -> OnlineLearner:
  """Online gradient descent with step lr / sqrt(k), k = 1, 2, ..."""

  def step(g, state, lr):
    count = state.count + 1
    lr_k = jnp.asarray(lr) / jnp.sqrt(count.astype(jnp.asarray(lr).dtype))
    return _scaled(g, lr_k), OGDSqrtState(count=count)

  return OnlineLearner(
    name="ogd_sqrt",
    init=lambda p: OGDSqrtState(count=jnp.zeros([], jnp.int32)),
    step=step,
  )


def adagrad(eps: float = 1e-12) -> OnlineLearner:
  """Diagonal AdaGrad: U += G*G; delta = -lr G / (sqrt(U) + eps)."""

  def step(g, state, lr):
    sum_sq = jax.tree.map(lambda u, x: u + x * x, state.sum_sq, g)
    delta = jax.tree.map(
      lambda x, u: (
        -jnp.asarray(lr).astype(x.dtype) * x / (jnp.sqrt(u) + jnp.asarray(eps).astype(x.dtype))
      ),
      g,
      sum_sq,
    )
    return delta, AdagradState(sum_sq=sum_sq)

  return OnlineLearner(
    name="adagrad",
    init=lambda p: AdagradState(sum_sq=optax.tree.zeros_like(p)),
    step=step,
  )


LEARNERS = ("ogd", "ogd_sqrt", "adagrad")


def get(learner, *, eps: float = 1e-12) -> OnlineLearner:
  """Resolves a learner name (or passes an ``OnlineLearner`` through)."""
  if isinstance(learner, OnlineLearner):
    return learner
  if learner == "ogd":
    return ogd()
  if learner == "ogd_sqrt":
    return ogd_sqrt()
  if learner == "adagrad":
    return adagrad(eps)
  raise ValueError(f"unknown learner {learner!r}; valid: " + ", ".join(repr(n) for n in LEARNERS))


def learn(
  candidate, learner: OnlineLearner, p, g, state, lr, lower, upper, *, check_finite: bool = True
):
  """One online-learning round: P <- Pi_P[P + learner step(G)].

  If the round produces a non-finite P or learner state (the feedback G
  overflowed), P and the learner state are left unchanged. Callers that
  guarantee a finite round pass ``check_finite=False`` to save two passes
  over P.
  """
  delta, new_state = learner.step(g, state, lr)
  new_p = candidate.project(optax.tree.add(p, delta), lower, upper)
  if not check_finite:
    return new_p, new_state
  ok = _common.all_finite(new_p, new_state)
  return _common.keep_if(ok, (new_p, new_state), (p, state))
