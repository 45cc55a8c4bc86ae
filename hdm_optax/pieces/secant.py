r"""Secant pieces: the last m pairs (s, y) of a run and the L-BFGS operator they define.

Every trial of an HDM-style iteration evaluates the gradient at a trial point;
:math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla f(x))` is a secant pair,
exact curvature information along s, free whether the trial is accepted or
not. :class:`SecantMemory` keeps the last m of them, :func:`two_loop` applies
the L-BFGS inverse-Hessian operator :math:`H_m` they define (O(mn), no n x n
matrix; a preconditioner operator ``P v = two_loop(memory, gamma, v)``).

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial point whose
  gradient gives the pair); Liu and Nocedal, *On the limited memory BFGS method for large scale
  optimization*, Math. Programming 45, 1989; Nocedal and Wright, *Numerical
  Optimization*, 2nd ed., Algorithm 7.4.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common

__all__ = (
  "SecantMemory",
  "reset",
  "secant_memory",
  "secant_record",
  "two_loop",
)


class SecantMemory(NamedTuple):
  """The last m secant pairs, a circular buffer (the L-BFGS memory).

  Attributes:
    s: the steps :math:`s_i = x_i^+ - x_i`, each leaf with a leading axis of size m.
    y: the gradient changes :math:`y_i = \\nabla f(x_i^+) - \\nabla f(x_i)`, like ``s``.
    rho: (m,) :math:`1 / \\langle s_i, y_i \\rangle`; 0 marks an empty slot.
    head: the slot the next pair is written to (the newest pair is in ``head - 1``).
  """

  s: Any
  y: Any
  rho: jax.Array
  head: jax.Array


def secant_memory(params, size: int) -> SecantMemory:
  """An empty memory of ``size`` pairs shaped like ``params`` (2 ``size`` vectors of n).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import secant
    >>> mem = secant.secant_memory(jnp.zeros(3), 10)
    >>> mem.s.shape, int(mem.head)
    ((10, 3), 0)
  """
  zeros = jax.tree.map(lambda p: jnp.zeros((size,) + jnp.shape(p), jnp.result_type(p)), params)
  dtype = _common.params_dtype(params)
  return SecantMemory(
    s=zeros,
    y=jax.tree.map(jnp.copy, zeros),
    rho=jnp.zeros([size], dtype),
    head=jnp.zeros([], jnp.int32),
  )


def secant_record(memory: SecantMemory, s, y, keep) -> SecantMemory:
  """The memory with the pair (s, y) written over its oldest one where ``keep``.

  The caller decides ``keep`` (:func:`hdm_optax.trial_lbfgs`: a finite pair with
  :math:`\\langle s, y\\rangle > \\epsilon_p \\|s\\|\\|y\\|`); s and y must be finite.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import secant
    >>> mem = secant.secant_memory(jnp.zeros(2), 2)
    >>> mem = secant.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([2.0, 0.0]), True)
    >>> float(mem.rho[0]), int(mem.head)
    (0.5, 1)
  """
  size = memory.rho.shape[0]
  sy = optax.tree.vdot(s, y)
  rho = jnp.where(keep, 1 / jnp.where(keep, sy, 1), 0).astype(memory.rho.dtype)
  put = lambda stacked, new: jax.tree.map(
    lambda a, b: a.at[memory.head].set(jnp.where(keep, b, a[memory.head])), stacked, new
  )
  return SecantMemory(
    s=put(memory.s, s),
    y=put(memory.y, y),
    rho=memory.rho.at[memory.head].set(jnp.where(keep, rho, memory.rho[memory.head])),
    head=jnp.where(keep, (memory.head + 1) % size, memory.head).astype(jnp.int32),
  )


def reset(memory: SecantMemory, where) -> SecantMemory:
  """The memory emptied where ``where`` (every slot marked empty, the next pair in slot 0).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import secant
    >>> mem = secant.secant_memory(jnp.zeros(2), 2)
    >>> mem = secant.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([2.0, 0.0]), True)
    >>> float(secant.reset(mem, True).rho[0])
    0.0
  """
  return memory._replace(
    rho=jnp.where(where, 0, memory.rho).astype(memory.rho.dtype),
    head=jnp.where(where, 0, memory.head).astype(jnp.int32),
  )


def two_loop(memory: SecantMemory, gamma, vector):
  r"""The L-BFGS inverse-Hessian operator applied to ``vector``: :math:`H_m v`.

  The two-loop recursion (Nocedal and Wright, Algorithm 7.4) over the pairs
  of ``memory``, newest first, with :math:`H_0 = \gamma I`; empty slots
  (:math:`\rho_i = 0`) contribute nothing. O(mn) work, no n x n matrix. With
  no pair it is :math:`\gamma v`; with pairs, :math:`H_m y_i = s_i` for the
  newest pair :math:`(s_i, y_i)`.

  Args:
    memory: the pairs (:class:`SecantMemory`).
    gamma: the scalar of :math:`H_0`.
    vector: v, shaped like the params.

  Returns:
    :math:`H_m v`, shaped like ``vector``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import secant
    >>> mem = secant.secant_memory(jnp.zeros(2), 3)
    >>> mem = secant.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([4.0, 0.0]), True)
    >>> [float(v) for v in secant.two_loop(mem, 0.5, jnp.array([4.0, 2.0]))]
    [1.0, 1.0]
  """
  size = memory.rho.shape[0]
  dtype = memory.rho.dtype
  at = lambda stacked, i: jax.tree.map(lambda a: a[i], stacked)

  def first(k, carry):
    q, alphas = carry
    i = (memory.head - 1 - k.astype(jnp.int32)) % size  # newest to oldest
    alpha = memory.rho[i] * optax.tree.vdot(at(memory.s, i), q)
    q = optax.tree.add_scale(q, -alpha, at(memory.y, i))
    return q, alphas.at[i].set(alpha)

  q, alphas = jax.lax.fori_loop(0, size, first, (vector, jnp.zeros([size], dtype)))
  r = optax.tree.scale(jnp.asarray(gamma, dtype), q)

  def second(k, r):
    i = (memory.head + k.astype(jnp.int32)) % size  # oldest to newest
    beta = memory.rho[i] * optax.tree.vdot(at(memory.y, i), r)
    return optax.tree.add_scale(r, alphas[i] - beta, at(memory.s, i))

  return jax.lax.fori_loop(0, size, second, r)
