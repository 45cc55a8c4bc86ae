"""Candidate sets for the learned stepsize P (and the momentum B).

A candidate set fixes the shape of P, how P acts on a vector, how the matrix
hypergradient ``u w^T`` of the paper is reduced to that shape, and the
projection Pi_P onto the bounded set (Section 2: the sets S, D and R^{n x n}).

- ``scalar``:   P = alpha I, stored as a 0-d array; ``u w^T`` reduces to <u, w>.
- ``diagonal``: P = diag(d), stored as a pytree shaped like the params;
  ``u w^T`` reduces to u * w (its diagonal).
- ``full``:     P is an n x n matrix acting on the flattened params
  (``jax.flatten_util.ravel_pytree``); ``u w^T`` is the outer product. For small n.

The projection clips every stored entry to ``[lower, upper]`` (``None`` means
unbounded). For ``full`` this clips all n^2 entries, which is the exact
Frobenius projection onto the box {P : lower <= P_ij <= upper}.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import optax


class CandidateSet(NamedTuple):
  """A candidate set P of stepsizes.

  Attributes:
    name: ``"scalar"``, ``"diagonal"`` or ``"full"``.
    init: ``init(params, value) -> P``, the element ``value * I``.
    apply: ``apply(P, v) -> P v`` for a pytree ``v`` shaped like the params.
    outer: ``outer(u, w) -> G``, the matrix ``u w^T`` reduced to P's shape
      (the gradient of <u, P w> with respect to P inside the set).
    project: ``project(P, lower, upper) -> Pi_P[P]``.
  """

  name: str
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
  """P = alpha I, a 0-d array."""
  return CandidateSet(
    name="scalar",
    init=lambda params, value: jnp.asarray(value).astype(_dtype(params)),
    apply=lambda p, v: jax.tree.map(lambda x: p * x, v),
    outer=lambda u, w: optax.tree.vdot(u, w),
    project=_clip,
  )


def diagonal() -> CandidateSet:
  """P = diag(d), d stored like the params."""
  return CandidateSet(
    name="diagonal",
    init=lambda params, value: optax.tree.full_like(params, value),
    apply=lambda p, v: jax.tree.map(jnp.multiply, p, v),
    outer=lambda u, w: jax.tree.map(jnp.multiply, u, w),
    project=_clip,
  )


def full() -> CandidateSet:
  """P an n x n matrix over the flattened params (for small n)."""

  def init(params, value):
    flat, _ = ravel_pytree(params)
    return jnp.asarray(value).astype(flat.dtype) * jnp.eye(flat.size, dtype=flat.dtype)

  def apply(p, v):
    flat, unravel = ravel_pytree(v)
    return unravel(p @ flat)

  def outer(u, w):
    return jnp.outer(ravel_pytree(u)[0], ravel_pytree(w)[0])

  return CandidateSet(name="full", init=init, apply=apply, outer=outer, project=_clip)


CANDIDATE_SETS = {"scalar": scalar, "diagonal": diagonal, "full": full}


def get(candidate, *, allowed=tuple(CANDIDATE_SETS)) -> CandidateSet:
  """Resolves a name (or passes a ``CandidateSet`` through)."""
  if isinstance(candidate, CandidateSet):
    return candidate
  if candidate not in allowed:
    raise ValueError(
      f"unknown candidate set {candidate!r}; valid: " + ", ".join(repr(c) for c in allowed)
    )
  return CANDIDATE_SETS[candidate]()
