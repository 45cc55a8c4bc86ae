"""Candidate sets for the learned stepsize P (and the momentum B).

A candidate set fixes the shape of P, how P acts on a vector, how the matrix
hypergradient ``u w^T`` of the paper is reduced to that shape, and the
projection Pi_P onto the bounded set (Section 2: the sets S, D and R^{n x n}).

- :func:`scalar`:   P = alpha I, stored as a 0-d array; ``u w^T`` reduces to <u, w>.
- :func:`diagonal`: P = diag(d), stored as a pytree shaped like the params;
  ``u w^T`` reduces to u * w (its diagonal).
- :func:`full`:     P is an n x n matrix acting on the flattened params
  (``jax.flatten_util.ravel_pytree``); ``u w^T`` is the outer product. For small n.

The projection clips every stored entry to ``[lower, upper]`` (``None`` means
unbounded). For ``full`` this clips all n^2 entries, which is the exact
Frobenius projection onto the box {P : lower <= P_ij <= upper}.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Section 2.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import optax

from hdm_optax import _blocks
from hdm_optax import _checks
from hdm_optax import _oracle

__all__ = ("CANDIDATE_SETS", "CandidateSet", "diagonal", "full", "get", "scalar", "trial_step")


class CandidateSet(NamedTuple):
  """A candidate set P of stepsizes.

  Attributes:
    init: ``init(params, value) -> P``, the element ``value * I``.
    apply: ``apply(P, v) -> P v`` for a pytree ``v`` shaped like the params.
    outer: ``outer(u, w) -> G``, the matrix ``u w^T`` reduced to P's shape
      (the gradient of <u, P w> with respect to P inside the set).
    project: ``project(P, lower, upper) -> Pi_P[P]``.
  """

  init: Callable[[Any, Any], Any]
  apply: Callable[[Any, Any], Any]
  outer: Callable[[Any, Any], Any]
  project: Callable[[Any, Any, Any], Any]


def _clip(tree, lower, upper):
  if lower is None and upper is None:
    return tree
  return jax.tree.map(lambda p: jnp.clip(p, lower, upper).astype(p.dtype), tree)


def _dtype(params):
  return jax.tree.leaves(params)[0].dtype


def scalar() -> CandidateSet:
  r"""P = alpha I, a 0-d array of the params' dtype.

  ``outer(u, w)`` is :math:`\langle u, w\rangle`, the gradient of
  :math:`\langle u, \alpha w\rangle` in alpha.

  Returns:
    A :class:`CandidateSet`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates
    >>> cand = candidates.scalar()
    >>> p = cand.init(jnp.zeros(2), 0.5)
    >>> [float(v) for v in cand.apply(p, jnp.array([2.0, 4.0]))]
    [1.0, 2.0]
    >>> float(cand.outer(jnp.array([1.0, 2.0]), jnp.array([3.0, 1.0])))
    5.0
    >>> float(cand.project(p, 0.0, 0.25))
    0.25
  """
  return CandidateSet(
    init=lambda params, value: jnp.asarray(value).astype(_dtype(params)),
    apply=lambda p, v: jax.tree.map(lambda x: p * x, v),
    outer=lambda u, w: _blocks.vdot(u, w),
    project=_clip,
  )


def diagonal() -> CandidateSet:
  """P = diag(d), d stored as a pytree shaped like the params.

  ``outer(u, w)`` is ``u * w``, the diagonal of ``u w^T``.

  Returns:
    A :class:`CandidateSet`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates
    >>> cand = candidates.diagonal()
    >>> p = cand.init(jnp.zeros(2), 0.5)
    >>> [float(v) for v in cand.apply(p, jnp.array([2.0, 4.0]))]
    [1.0, 2.0]
    >>> [float(v) for v in cand.outer(jnp.array([1.0, 2.0]), jnp.array([3.0, 1.0]))]
    [3.0, 2.0]
  """
  return CandidateSet(
    init=lambda params, value: optax.tree.full_like(params, value),
    apply=lambda p, v: jax.tree.map(jnp.multiply, p, v),
    outer=lambda u, w: jax.tree.map(jnp.multiply, u, w),
    project=_clip,
  )


def full() -> CandidateSet:
  """P an n x n matrix over the flattened params (for small n).

  ``outer(u, w)`` is the outer product of the flattened u and w.

  Returns:
    A :class:`CandidateSet`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates
    >>> cand = candidates.full()
    >>> p = cand.init(jnp.zeros(2), 0.5)
    >>> p.shape
    (2, 2)
    >>> cand.outer(jnp.array([1.0, 2.0]), jnp.array([3.0, 1.0])).tolist()
    [[3.0, 1.0], [6.0, 2.0]]
  """

  def init(params, value):
    flat, _ = ravel_pytree(params)
    return jnp.asarray(value).astype(flat.dtype) * jnp.eye(flat.size, dtype=flat.dtype)

  def apply(p, v):
    flat, unravel = ravel_pytree(v)
    return unravel(p @ flat)

  def outer(u, w):
    return jnp.outer(ravel_pytree(u)[0], ravel_pytree(w)[0])

  return CandidateSet(init=init, apply=apply, outer=outer, project=_clip)


CANDIDATE_SETS: dict[str, Callable[[], CandidateSet]] = {
  "scalar": scalar,
  "diagonal": diagonal,
  "full": full,
}


def trial_step(
  precond_set: CandidateSet,
  precond: Any,
  direction: Any,
  momentum_set: Optional[CandidateSet] = None,
  momentum: Any = None,
  momentum_direction: Any = None,
  held: Any = None,
) -> Any:
  r"""The trial step :math:`x^+ - x = -P d + B m`.

  A ``full`` P mixes the coordinates, so :math:`P d` moves a coordinate with
  :math:`d_i = 0`. Where ``held`` marks a coordinate that a transformation before the
  method held (:math:`u_i = 0` while :math:`\nabla f(x)_i \neq 0`), :math:`(P d)_i` is
  0, as a scalar or diagonal P gives it; :math:`B m` is left as it is (B is scalar or
  diagonal, and m is 0 on a coordinate that has never moved).

  Args:
    precond_set: the candidate set of P (its ``apply``).
    precond: P.
    direction: d, shaped like the params (usually s times the gradient).
    momentum_set: the candidate set of B (``None``: no momentum term).
    momentum: B.
    momentum_direction: m, shaped like the params (usually s (x - x^-)).
    held: a boolean pytree shaped like ``direction``, or ``None`` (no coordinate held:
      the program has no test).

  Returns:
    The step, a pytree shaped like ``direction``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates
    >>> step = candidates.trial_step(
    ...   candidates.diagonal(), jnp.array([0.5, 0.25]), jnp.array([2.0, 4.0]),
    ...   candidates.scalar(), jnp.asarray(0.5), jnp.array([1.0, 0.0]))
    >>> [float(v) for v in step]
    [-0.5, -1.0]
  """
  step = _oracle.hold(optax.tree.scale(-1.0, precond_set.apply(precond, direction)), held)
  if momentum_set is None:
    return step
  return optax.tree.add(step, momentum_set.apply(momentum, momentum_direction))


def get(candidate, *, allowed=tuple(CANDIDATE_SETS)) -> CandidateSet:
  """Resolves a name in :data:`CANDIDATE_SETS` (or passes a ``CandidateSet`` through).

  Args:
    candidate: a name or a :class:`CandidateSet`.
    allowed: the names accepted here.

  Returns:
    A :class:`CandidateSet`.

  Examples:
    >>> from hdm_optax.pieces import candidates
    >>> cand = candidates.get("diagonal")
  """
  if isinstance(candidate, CandidateSet):
    return candidate
  return _checks.lookup("candidate set", candidate, CANDIDATE_SETS, allowed)()
