r"""Secant pieces: the last m pairs (s, y) of a run and the L-BFGS operator they define.

Every trial of an HDM-style iteration evaluates the gradient at a trial point;
:math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla f(x))` is a secant pair,
exact curvature information along s, free whether the trial is accepted or
not. :class:`SecantMemory` keeps the last m of them, :func:`inverse_hessian_product`
applies the L-BFGS inverse-Hessian operator :math:`H_m` they define (O(mn), no n x n
matrix; a preconditioner operator ``P v = inverse_hessian_product(memory, gamma, v)``),
in the compact form or by :func:`two_loop_recursion`.

The pairs are stored packed (:mod:`hdm_optax._blocks`): the params' small leaves of one
dtype raveled into one vector, each large leaf a block of its own in its own shape, so
that the memory's work is a few operations per block, not per leaf of the params. The
functions take vectors shaped like the params or already packed (a tuple of blocks like
:attr:`SecantMemory.s` without its leading axis) and return them as they came.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial point whose
  gradient gives the pair); Liu and Nocedal, *On the limited memory BFGS method for large scale
  optimization*, Math. Programming 45, 1989; Nocedal and Wright, *Numerical
  Optimization*, 2nd ed., Algorithm 7.4.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _blocks
from hdm_optax import _checks
from hdm_optax import _numerics
from hdm_optax import _gating

__all__ = (
  "PairProducts",
  "PairsDiagonal",
  "SecantMemory",
  "pair_products",
  "pairs_diagonal",
  "inverse_hessian_product",
  "preconditioner",
  "reset",
  "restricted_memory",
  "secant_memory",
  "secant_record",
  "two_loop_recursion",
)


class SecantMemory(NamedTuple):
  """The last m secant pairs, a circular buffer (the L-BFGS memory), and their inner products.

  Attributes:
    s: the steps :math:`s_i = x_i^+ - x_i`, packed (``hdm_optax._blocks.pack`` of the
      params: a tuple of blocks), each block with a leading axis of size m.
    y: the gradient changes :math:`y_i = \\nabla f(x_i^+) - \\nabla f(x_i)`, like ``s``.
    rho: (m,) :math:`1 / \\langle s_i, y_i \\rangle`; 0 marks an empty slot.
    head: the slot the next pair is written to (the newest pair is in ``head - 1``).
    sy: (m, m) :math:`\\langle s_i, y_j \\rangle` by slot, column j stored when pair j
      arrives (the compact form reads the pairs i no newer than j); the entries of newer
      s and of empty slots are stale and unused.
  """

  s: Any
  y: Any
  rho: jax.Array
  head: jax.Array
  sy: jax.Array


class PairProducts(NamedTuple):
  r"""The inner products of a pair (s, y) that the pair test and :math:`H_0` use.

  ``sy_abs`` is :math:`\sum_i |s_i y_i|`, the size of :math:`\langle s, y\rangle`'s terms
  (the pair test's scale: unchanged by a rescaling of the coordinates, as
  :math:`\langle s, y\rangle` is).
  """

  ss: jax.Array
  yy: jax.Array
  sy: jax.Array
  sy_abs: jax.Array


def _stacked_zeros(block, size: int) -> jax.Array:
  """Zeros of shape ``(size,) + block.shape``, sharded as ``block`` where it is concrete."""
  return jnp.array(jnp.broadcast_to(jnp.zeros_like(block), (size,) + jnp.shape(block)))


def secant_memory(params, size: int) -> SecantMemory:
  """An empty memory of ``size`` pairs for ``params`` (2 ``size`` vectors of n, packed).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(3), 10)
    >>> [b.shape for b in mem.s], mem.sy.shape, int(mem.head)
    ([(10, 3)], (10, 10), 0)
    >>> [b.shape for b in memory.secant_memory({"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}, 10).s]
    [(10, 9)]
  """
  dtype = _numerics.params_dtype(params)
  zeros = tuple(_stacked_zeros(block, size) for block in _blocks.pack(params))
  return SecantMemory(
    s=zeros,
    y=jax.tree.map(jnp.copy, zeros),
    rho=jnp.zeros([size], dtype),
    head=jnp.zeros([], jnp.int32),
    sy=jnp.zeros([size, size], dtype),
  )


def _batched_as(batched: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorates ``fun``: under ``jax.vmap`` it runs as ``jax.vmap(batched)``, and its
  derivatives are ``batched``'s.

  ``batched`` computes the same values as ``fun``, bit for bit, in a form that costs less
  batched (a select over the rows where ``fun`` updates one row in place, which under
  ``vmap`` is a scatter into a copy of the rows).
  """

  def decorate(fun):
    fast = jax.custom_batching.custom_vmap(fun)

    @fast.def_vmap
    def rule(axis_size, in_batched, *args):
      del axis_size
      axes = jax.tree.map(lambda b: 0 if b else None, tuple(in_batched))
      out = jax.vmap(batched, in_axes=axes)(*args)
      return out, jax.tree.map(lambda _: True, out)

    # custom_vmap has no reverse mode: its derivatives are batched's, which has.
    wrapped = jax.custom_jvp(fast)
    wrapped.defjvp(lambda primals, tangents: jax.jvp(batched, primals, tangents))
    return functools.wraps(fun)(wrapped)

  return decorate


def _put_selected(stacked, new, slot):
  """:func:`_put` as a select over the slots (the same values)."""
  hit = lambda a: (jnp.arange(a.shape[0], dtype=jnp.int32) == slot).reshape(
    (-1,) + (1,) * (a.ndim - 1)
  )
  return tuple(jnp.where(hit(a), b[None], a) for a, b in zip(stacked, new))


def _put_in_place(stacked, new, slot):
  """The stacked blocks with row ``slot`` set to ``new`` (nothing past the last row)."""
  return tuple(a.at[slot].set(b, mode="drop") for a, b in zip(stacked, new))


# Under vmap, a select over the rows (the batched while loop selects the whole rows anyway).
_put = _batched_as(_put_selected)(_put_in_place)


def _write(stacked, new, slot):
  """The stacked blocks with row ``slot`` set to ``new``; in a batched loop's step
  (:mod:`hdm_optax._gating`), only where the member runs, in place."""
  gate = _gating.current()
  if gate is None or not gate.holds(stacked):
    return _put(stacked, new, slot)
  slot = jnp.where(gate.running, slot, stacked[0].shape[0])  # past the end: dropped
  out = _put_in_place(stacked, new, slot)  # under vmap: a scatter into the rows, in place
  gate.wrote(stacked, out)
  return out


def _in_blocks(memory: SecantMemory, tree):
  """``(blocks, back)``: ``tree`` packed like the memory, and ``back`` that returns a result
  packed so to ``tree``'s form (a tree already packed is left as it is)."""
  if jax.tree.structure(tree) == jax.tree.structure(memory.s):
    return tree, lambda blocks: blocks
  return _blocks.pack(tree), lambda blocks: _blocks.unpack(blocks, tree)


# Matrix products of the pairs in the arrays' own precision (an NVIDIA GPU would compute
# float32 products in TF32 by default).
_EXACT = jax.lax.Precision.HIGHEST


def _row_dots(stacked, vector, dtype) -> jax.Array:
  r"""(len(stacked), m): :math:`\langle a_i, v\rangle` for the m rows a_i of each stacked tree.

  Per leaf one matrix-vector product per stacked tree, in the leaf's precision (float32
  products in float32 on every backend, not TF32); the m-vectors are summed over leaves.
  """

  def leaf(v, *rows):
    return jnp.stack([jnp.tensordot(a, v, axes=v.ndim, precision=_EXACT) for a in rows])

  sums = jax.tree.leaves(jax.tree.map(leaf, vector, *stacked))
  return sum(sums[1:], sums[0]).astype(dtype)


def pair_products(step, change) -> PairProducts:
  r""":math:`\|s\|^2`, :math:`\|y\|^2`, :math:`\langle s, y\rangle` and :math:`\sum_i |s_i y_i|`.

  Three dot products in the leaves' precision (a single variadic reduction over s and y
  is summed in order, not pairwise, by XLA on the CPU, and loses accuracy at large n).

  Args:
    step: s, a pytree.
    change: y, shaped like ``step``.

  Returns:
    :class:`PairProducts` ``(ss, yy, sy, sy_abs)``, each summed over the leaves.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> p = memory.pair_products(jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0]))
    >>> float(p.ss), float(p.yy), float(p.sy), float(p.sy_abs)
    (5.0, 10.0, 1.0, 5.0)
  """
  dot = lambda a, b: jnp.vdot(a, b, precision=_EXACT)
  size = lambda a, b: jnp.sum(jnp.abs(a * b))
  total = lambda f, a, b: functools.reduce(jnp.add, jax.tree.leaves(jax.tree.map(f, a, b)))
  return PairProducts(
    ss=total(dot, step, step),
    yy=total(dot, change, change),
    sy=total(dot, step, change),
    sy_abs=total(size, step, change),
  )


def _with_column(memory: SecantMemory, slot, column) -> jax.Array:
  """``sy`` of ``memory`` with column ``slot`` set to ``column``."""
  slots = jnp.arange(memory.rho.shape[0], dtype=jnp.int32)
  return jnp.where(slots[None, :] == slot, column[:, None], memory.sy)


def secant_record(memory: SecantMemory, s, y, keep, sy=None) -> SecantMemory:
  """The memory with the pair (s, y) written over its oldest one where ``keep``.

  The caller decides ``keep`` (:func:`hdm_optax.trial_lbfgs`: a finite pair with
  :math:`\\langle s, y\\rangle > \\epsilon_p \\|s\\|\\|y\\|`); s and y must be finite
  where ``keep`` (elsewhere nothing is written, and what is computed from them is
  dropped). The new pair's products :math:`S^T y` with the kept steps are stored (``sy``).

  Args:
    memory: the memory.
    s: the step, shaped like the params (or packed).
    y: the gradient change, like ``s``.
    keep: a boolean scalar.
    sy: :math:`\\langle s, y\\rangle` where the caller has it (:func:`pair_products`);
      computed otherwise.

  Returns:
    The new memory.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(2), 2)
    >>> mem = memory.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([2.0, 0.0]), True)
    >>> float(mem.rho[0]), int(mem.head)
    (0.5, 1)
  """
  size = memory.rho.shape[0]
  s, y = _in_blocks(memory, s)[0], _in_blocks(memory, y)[0]
  sy = optax.tree.vdot(s, y) if sy is None else sy
  rho = jnp.where(keep, 1 / jnp.where(keep, sy, 1), 0).astype(memory.rho.dtype)
  # Written to the head slot, or past the end (dropped) where not kept: no read of the
  # slot's old pair to write back.
  slot = jnp.where(keep, memory.head, size)
  s_new, y_new = _write(memory.s, s, slot), _write(memory.y, y, slot)
  # S^T y of the new pair (its column of R), while y is at hand: no read of it back.
  column = _row_dots((s_new,), y, memory.rho.dtype)[0]
  return SecantMemory(
    s=s_new,
    y=y_new,
    rho=memory.rho.at[slot].set(rho, mode="drop"),
    head=jnp.where(keep, (memory.head + 1) % size, memory.head).astype(jnp.int32),
    sy=jnp.where(keep, _with_column(memory, memory.head, column), memory.sy),
  )


def reset(memory: SecantMemory, where) -> SecantMemory:
  """The memory emptied where ``where`` (every slot marked empty, the next pair in slot 0).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(2), 2)
    >>> mem = memory.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([2.0, 0.0]), True)
    >>> float(memory.reset(mem, True).rho[0])
    0.0
  """
  return memory._replace(
    rho=jnp.where(where, 0, memory.rho).astype(memory.rho.dtype),
    head=jnp.where(where, 0, memory.head).astype(jnp.int32),
  )


def _triangle(memory: SecantMemory) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  r"""``(order, R, D, full)`` of the compact form (Byrd et al., eq. 3.13), pairs oldest first.

  ``order``: the slots oldest first; :math:`R`: the upper triangle of :math:`S^T Y`;
  :math:`D`: its diagonal; ``full``: the filled slots. An empty slot gets a unit row and
  column in R and 0 in D, so a right-hand side that is 0 there gives 0 there.
  """
  size = memory.rho.shape[0]
  order = (memory.head + jnp.arange(size, dtype=jnp.int32)) % size  # oldest first
  rho = memory.rho[order]
  full = rho != 0
  both = full[:, None] & full[None, :]
  d = jnp.where(full, 1 / jnp.where(full, rho, 1), 0).astype(memory.rho.dtype)  # <s_i, y_i>
  upper = both & jnp.triu(jnp.ones([size, size], bool), 1)
  r = jnp.where(upper, memory.sy[order][:, order], jnp.diag(jnp.where(full, d, 1)))
  return order, r, d, full


# Up to this many pairs the compact form's triangular solves are substitutions of
# m(m + 1) / 2 multiply-adds each; above, one ``triangular_solve`` each.
_UNROLLED_SOLVE = 16


def _solve_upper(r, b, transpose: bool = False) -> jax.Array:
  r"""x with :math:`R x = b`, or :math:`R^T x = b` where ``transpose``; R upper triangular.

  Back (forward) substitution for m <= 16, each :math:`x_i` its right-hand side minus the
  known terms in increasing j, divided by :math:`r_{ii}`; above 16, ``solve_triangular``.
  On a GPU or TPU it is written out as scalar operations (:func:`_substitution_unrolled`),
  which XLA:GPU fuses into the small kernels around them (a triangular solve is a cuBLAS
  call of its own, and a loop would test its condition on the host at every row). On a CPU
  it is a ``fori_loop`` over the rows (:func:`_substitution_loop`), the same operations in
  the same order: XLA:CPU compiles the written-out form into about one kernel per row, each
  compiled on its own.
  """
  m = b.shape[0]
  if m > _UNROLLED_SOLVE:
    return jax.scipy.linalg.solve_triangular(r, b, lower=False, trans="T" if transpose else 0)
  return jax.lax.platform_dependent(
    r,
    b,
    cpu=functools.partial(_substitution_loop, transpose=transpose),
    default=functools.partial(_substitution_unrolled, transpose=transpose),
  )


def _substitution_unrolled(r, b, transpose: bool) -> jax.Array:
  """:func:`_solve_upper`'s substitution written out as m(m + 1) / 2 scalar operations."""
  m = b.shape[0]
  entry = (lambda i, j: r[j, i]) if transpose else (lambda i, j: r[i, j])
  rows = range(m) if transpose else reversed(range(m))
  x = [None] * m
  for i in rows:
    known = range(i) if transpose else range(i + 1, m)  # the x_j already solved for
    x[i] = functools.reduce(lambda acc, j: acc - entry(i, j) * x[j], known, b[i]) / r[i, i]
  return jnp.stack(x)


def _substitution_loop(r, b, transpose: bool) -> jax.Array:
  """:func:`_solve_upper`'s substitution as a loop over the rows, operation for operation.

  Row i subtracts the known terms in increasing j, as :func:`_substitution_unrolled`
  does; the terms not yet known are masked out (``where``), not added as zeros, so every
  result is bit for bit the written-out one.
  """
  m = b.shape[0]
  a = r.T if transpose else r
  columns = jnp.asarray(np.arange(m))  # a constant of the program, not a kernel

  def row(k, x):
    i = k if transpose else m - 1 - k
    known = columns < i if transpose else columns > i
    acc = b[i]
    for j in range(m):
      acc = jnp.where(known[j], acc - a[i, j] * x[j], acc)
    # A select, not an in-place update: XLA fuses the reads of x into it then.
    return jnp.where(columns == i, acc / a[i, i], x)

  return jax.lax.fori_loop(0, m, row, jnp.zeros_like(b))


def _combination(coef, rows) -> jax.Array:
  """:math:`\\sum_k c_k a_k` over the m rows of ``rows``, written out as an elementwise sum.

  XLA fuses it with the elementwise work around it (``H_0 (v - Y c)``) into one pass over
  the rows, which it does not do with a matrix-vector product. Only where its result has
  one consumer: XLA repeats it in each.
  """
  coef = coef.astype(rows.dtype)
  return functools.reduce(jnp.add, [coef[k] * rows[k] for k in range(rows.shape[0])])


def _compact(memory: SecantMemory, initial, vector):
  r""":math:`H_m v` in the compact form: four matrix-vector products with the pairs, no m^2 n work.

  Byrd, Nocedal and Schnabel's eq. 3.13 with :math:`H_0` a scalar or a diagonal:
  with :math:`c = R^{-1} S^T v` and :math:`u = v - Y c`,

  .. math::
    H_m v = H_0 u + S p, \qquad p = R^{-T}(D c - Y^T H_0 u),

  the same as :math:`R^{-T}(D c + Y^T H_0 Y c - Y^T H_0 v)` without forming
  :math:`Y^T H_0 Y` (m^2 n work, and for a diagonal :math:`H_0` it changes at every
  call): :math:`S^T v`, :math:`Y^T H_0 u` and :math:`S p` are one matrix-vector product
  each, and :math:`Y c` one pass over Y together with :math:`H_0 u`
  (:func:`_combination`).
  """
  dtype = memory.rho.dtype
  size = memory.rho.shape[0]
  order, r, d, full = _triangle(memory)
  by_slot = (jnp.arange(size, dtype=jnp.int32) - memory.head) % size
  s_v = _row_dots((memory.s,), vector, dtype)[0]
  c = _solve_upper(r, jnp.where(full, s_v[order], 0))
  # H_m v feeds several passes (the step, the trial point, the pair): a matrix-vector
  # product stores S p once, where XLA would repeat the elementwise sum in each of them.
  back = lambda coef, rows: jnp.tensordot(coef.astype(rows.dtype), rows, axes=1, precision=_EXACT)
  # Y c likewise where H_0 is a scalar; with a diagonal, XLA stores u = v - Y c by itself.
  combine = _combination if _is_diagonal(initial, vector) else back
  u = jax.tree.map(lambda v, y: v - combine(c[by_slot], y), vector, memory.y)
  h_u = _apply_initial(initial, u, dtype)
  y_hu = _row_dots((memory.y,), h_u, dtype)[0]
  rhs = d * c - jnp.where(full, y_hu[order], 0)
  p = _solve_upper(r, rhs, transpose=True)
  return jax.tree.map(lambda hu, s: hu + back(p[by_slot], s), h_u, memory.s)


def two_loop_recursion(memory: SecantMemory, gamma, vector):
  r""":math:`H_m v` by the two-loop recursion (Nocedal and Wright, Algorithm 7.4).

  Newest to oldest, then oldest to newest, skipping empty slots (:math:`\rho_i = 0`);
  2m dependent passes over v. It reads only ``s``, ``y`` and ``rho``, so it serves pairs
  changed for one update (the pairs restricted to a box's free variables,
  :func:`hdm_optax.pieces.lbfgs.bounded.restricted_memory`), whose stored products
  ``sy`` would be stale for the compact form of :func:`inverse_hessian_product`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(2), 3)
    >>> mem = memory.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([4.0, 0.0]), True)
    >>> [float(v) for v in memory.two_loop_recursion(mem, 0.5, jnp.array([4.0, 2.0]))]
    [1.0, 1.0]
  """
  vector, back = _in_blocks(memory, vector)
  return back(_two_loop(memory, _initial_in_blocks(memory, gamma, vector), vector))


def _two_loop(memory: SecantMemory, gamma, vector):
  """:func:`two_loop_recursion` on packed vectors."""
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
  r = _apply_initial(gamma, q, dtype)

  def second(k, r):
    i = (memory.head + k.astype(jnp.int32)) % size  # oldest to newest
    beta = memory.rho[i] * optax.tree.vdot(at(memory.y, i), r)
    return optax.tree.add_scale(r, alphas[i] - beta, at(memory.s, i))

  return jax.lax.fori_loop(0, size, second, r)


def _is_diagonal(gamma, vector) -> bool:
  """Whether ``gamma`` is a diagonal shaped like ``vector`` rather than a scalar."""
  return jax.tree.structure(gamma) == jax.tree.structure(vector) and any(
    jnp.ndim(g) > 0 for g in jax.tree.leaves(gamma)
  )


def _initial_in_blocks(memory: SecantMemory, gamma, vector):
  """:math:`H_0`'s gamma as it is where a scalar, packed where a diagonal like the params."""
  structure = jax.tree.structure(gamma)
  scalar = jax.tree_util.treedef_is_leaf(structure) and jnp.ndim(gamma) == 0
  if scalar or structure == jax.tree.structure(vector):
    return gamma
  return _in_blocks(memory, gamma)[0]


def _apply_initial(gamma, vector, dtype):
  """:math:`H_0 v`: ``gamma v`` for a scalar gamma, ``gamma * v`` for a diagonal."""
  if _is_diagonal(gamma, vector):
    return jax.tree.map(lambda h, v: h.astype(v.dtype) * v, gamma, vector)
  return optax.tree.scale(jnp.asarray(gamma, dtype), vector)


def inverse_hessian_product(memory: SecantMemory, gamma, vector):
  r"""The L-BFGS inverse-Hessian operator applied to ``vector``: :math:`H_m v`.

  The operator of the two-loop recursion (Nocedal and Wright, Algorithm 7.4)
  over the pairs of ``memory`` with :math:`H_0 = \gamma I` or a diagonal
  :math:`H_0 = \operatorname{diag}(h)`; empty slots (:math:`\rho_i = 0`)
  contribute nothing. O(mn) work, no n x n matrix. With no pair it is
  :math:`H_0 v`; with pairs, :math:`H_m y_i = s_i` for the newest pair
  :math:`(s_i, y_i)`.

  Where v has more entries than the memory has slots (n > m), it is computed
  in the compact form of Byrd, Nocedal and Schnabel (1994, eq. 3.13) rather
  than by the recursion's 2m dependent passes over v: four matrix-vector
  products with the stacked pairs (:math:`S^T v`, :math:`Y c`,
  :math:`Y^T H_0 u`, :math:`S p`; :math:`S^T y` is stored with each pair), and two
  m x m triangular solves; the same operator up to rounding. Where n <= m the
  pairs are linearly dependent, the triangular matrix :math:`R` of the compact
  form is singular up to rounding, and the two-loop recursion is used
  (:func:`two_loop_recursion`).

  Args:
    memory: the pairs (:class:`SecantMemory`).
    gamma: :math:`H_0`: a scalar gamma, or a diagonal h shaped like ``vector`` (or like
      the params, or packed).
    vector: v, shaped like the params (or packed).

  Returns:
    :math:`H_m v`, shaped like ``vector``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(2), 3)
    >>> mem = memory.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([4.0, 0.0]), True)
    >>> [float(v) for v in memory.inverse_hessian_product(mem, 0.5, jnp.array([4.0, 2.0]))]
    [1.0, 1.0]

  References:
    Byrd, Nocedal, Schnabel, *Representations of quasi-Newton matrices and
    their use in limited memory methods*, Math. Programming 63, 1994.
  """
  vector, back = _in_blocks(memory, vector)
  gamma = _initial_in_blocks(memory, gamma, vector)
  n = sum(jnp.size(leaf) for leaf in jax.tree.leaves(vector))
  if n <= memory.rho.shape[0]:
    return back(_two_loop(memory, gamma, vector))
  return back(_compact(memory, gamma, vector))


def _ratio(a, b):
  """sqrt(a / b) where both are positive; 0 where the pairs have not seen the coordinate."""
  ok = (a > 0) & (b > 0)
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, a, 1) / jnp.where(ok, b, 1)), 0)


def _square_sums(stacked, mask):
  """Per coordinate, the sum over the slots where ``mask`` of the squares of ``stacked``.

  A sum over the m slots written out: XLA on CPU reduces a leading axis 50x slower.
  """
  return jax.tree.map(
    lambda a: sum(jnp.where(mask[k], a[k] * a[k], 0) for k in range(a.shape[0])), stacked
  )


def _add_leaves(tree) -> jax.Array:
  return functools.reduce(jnp.add, jax.tree.leaves(tree))


def _false(*_) -> jax.Array:
  return jnp.asarray(False)


def _predicts_recent(memory: SecantMemory, full, settled) -> jax.Array:
  """Whether h of the other pairs predicts the newest pair (:func:`_predicts_newest`) or,
  in a full memory (``settled``), the one before it: one miss can be rounding near a
  minimiser, an h whose steps are rejected misses pair after pair. The second test, two
  more passes over the pairs, runs only where the first misses."""
  newest = _predicts_newest(memory, full)
  second = functools.partial(_predicts_newest, back=2)
  before = jax.lax.cond(settled & ~newest, second, _false, memory, full)
  return newest | before


def _predicts_newest(memory: SecantMemory, full, back: int = 1) -> jax.Array:
  r"""Whether h of the other pairs predicts the newest pair's (``back`` = 2: the one before
  it) s from its y better than their scalar
  :math:`c = \sqrt{\sum_k \|s_k\|^2 / \sum_k \|y_k\|^2}`:
  :math:`\|h \circ y - s\| < \|c\,y - s\|`, h taking c where the other pairs have not
  seen a coordinate."""
  size = memory.rho.shape[0]
  newest = (memory.head - back) % size
  old = full & (jnp.arange(size, dtype=jnp.int32) != newest)
  ss, yy = _square_sums(memory.s, old), _square_sums(memory.y, old)
  total = lambda tree: _add_leaves(jax.tree.map(jnp.sum, tree))
  tiny = jnp.finfo(memory.rho.dtype).tiny
  c = jnp.sqrt(total(ss) / jnp.maximum(total(yy), tiny)).astype(memory.rho.dtype)

  def misses(a, b, s, y):  # the two squared residuals on this leaf
    h = _ratio(a, b)
    h = jnp.where(h > 0, h, c.astype(h.dtype))
    return jnp.stack(
      [jnp.sum((h * y[newest] - s[newest]) ** 2), jnp.sum((c * y[newest] - s[newest]) ** 2)]
    )

  diagonal, scalar = _add_leaves(jax.tree.map(misses, ss, yy, memory.s, memory.y))
  return diagonal < scalar


class PairsDiagonal(NamedTuple):
  """:func:`pairs_diagonal`'s rule: ``rule.apply(memory, gamma) -> (h, on)``; equal for equal
  ``gate`` and ``bound`` (so ``trial_lbfgs(diagonal=pairs_diagonal())`` built twice is one
  configuration, one compiled program). It is not callable: ``optax.inject_hyperparams``
  takes a callable argument for a schedule, and passes this one through as it is."""

  gate: Any
  bound: Any

  def apply(self, memory: SecantMemory, gamma) -> tuple[Any, jax.Array]:
    """H_0's diagonal from the pairs of ``memory`` around ``gamma``, and whether it is used."""
    gate, bound = self.gate, self.bound
    full = memory.rho != 0
    ss, yy = _square_sums(memory.s, full), _square_sums(memory.y, full)

    # One array out of the pass over the pairs: what follows reads it, not the pairs again.
    raw = jax.tree.leaves(jax.tree.map(_ratio, ss, yy))
    hi = functools.reduce(jnp.maximum, [jnp.max(h) for h in raw])
    lo = functools.reduce(jnp.minimum, [jnp.min(jnp.where(h > 0, h, jnp.inf)) for h in raw])
    held = jnp.sum(full)
    settled = held == full.shape[0]  # a full memory: the spread of m pairs is evidence enough
    spread = (held >= 2) & (hi > gate * lo)
    # The tests on the newest pairs are passes over the pairs: run only where they decide.
    on = spread & jax.lax.cond(spread, _predicts_recent, _false, memory, full, settled)
    gamma = jnp.asarray(gamma, memory.rho.dtype)
    clip = lambda h: jnp.where(h > 0, jnp.clip(h, gamma / bound, gamma * bound), gamma)
    treedef = jax.tree.structure(memory.s)
    return jax.tree.unflatten(treedef, [clip(h).astype(h.dtype) for h in raw]), on


def pairs_diagonal(gate: Any = 1e3, bound: Any = 1e12) -> PairsDiagonal:
  r"""A diagonal :math:`H_0` from the kept pairs, used on evidence of badly scaled coordinates.

  Per coordinate :math:`h_i = \sqrt{\sum_k s_{ki}^2 / \sum_k y_{ki}^2}` over the kept
  pairs: on a quadratic with a diagonal Hessian A, :math:`1/A_{ii}`; under
  :math:`x \to f(D x)` it moves as :math:`D^{-2} h`, as the inverse Hessian does. It replaces
  :math:`\gamma I` only where at least two pairs are kept, its spread
  :math:`\max h / \min h` over the coordinates the pairs have seen exceeds ``gate``, and,
  while the memory is not full, it has predicted the newest pair: h of the older pairs maps
  the newest y closer to its s than the older pairs' scalar
  :math:`c = \sqrt{\sum_k \|s_k\|^2 / \sum_k \|y_k\|^2}` does,
  :math:`\|h \circ y - s\| < \|c\, y - s\|` (elsewhere the L-BFGS scaling of Liu and
  Nocedal is kept as it is). Where the Hessian is not diagonal, y mixes coordinates and a
  few pairs spread h by chance; the out-of-sample test keeps such an h out, and where
  coordinates are badly scaled h predicts the next pair and c does not. With m pairs the
  spread is evidence enough until h fails the test on both of the two newest pairs (each
  against h and c of the other m - 1 pairs): the test on one pair would switch h by
  rounding near a float32 minimiser, and an h that makes the steps too long, the trials
  rejected and their pairs kept, fails on pair after pair. h is clipped to
  :math:`[\gamma / \text{bound}, \gamma\,\text{bound}]`; a coordinate the pairs have
  not seen keeps :math:`\gamma`. The sums are one pass over the pairs; the test on the newest
  pair, two more (four for the two newest, with a full memory), runs only where the spread
  is above the gate.

  Args:
    gate: the spread of h above which it is used, >= 1.
    bound: the clip of h around gamma, >= 1.

  Returns:
    A :class:`PairsDiagonal`, ``rule.apply(memory, gamma) -> (h, on)``: h packed as the pairs
    are (a tuple of blocks like ``memory.s`` without its leading axis) and whether it is used, for :func:`hdm_optax.pieces.lbfgs.direction.lbfgs_direction`'s ``diagonal=``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(2), 3)
    >>> for s in ([1.0, 1.0], [1.0, -1.0]):
    ...   mem = memory.secant_record(mem, jnp.array(s), jnp.array([1e4, 1.0]) * jnp.array(s), True)
    >>> h, on = memory.pairs_diagonal(gate=1e3).apply(mem, 1.0)
    >>> [round(float(v), 6) for v in h[0]], bool(on)
    ([0.0001, 1.0], True)
  """
  _checks.check_at_least("gate", gate, 1)
  _checks.check_at_least("bound", bound, 1)

  return PairsDiagonal(gate=gate, bound=bound)


def _pair_sums(a, b) -> jax.Array:
  """(m,): :math:`\\langle a_i, b_i\\rangle` of the stacked blocks ``a`` and ``b``, slot by slot."""
  return sum(
    jnp.sum((u * v).reshape(u.shape[0], -1), axis=1)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def _pair_norms(stacked) -> jax.Array:
  """The Euclidean norm of each pair of stacked blocks (leading axis m), without overflow."""
  rows = jnp.concatenate([leaf.reshape(leaf.shape[0], -1) for leaf in stacked], axis=1)
  return jax.vmap(_numerics.scaled_norm)(rows)


def restricted_memory(memory: SecantMemory, free, pair_tol=1e-10) -> SecantMemory:
  r"""The secant pairs restricted to the free variables: :math:`(s_F, y_F)`.

  Where the variables outside F did not move along a pair, :math:`y_F = (Z^T B Z) s_F` is
  the secant pair of the reduced Hessian on F, so the two-loop operator of the restricted
  pairs approximates :math:`(Z^T B Z)^{-1}` (the quasi-Newton step on the free subspace,
  as L-BFGS-B's subspace minimisation), not :math:`Z^T H Z`. A restricted pair whose
  curvature :math:`\langle s_F, y_F\rangle` is not above ``pair_tol`` times
  :math:`\|s_F\|\|y_F\|` is left out (:math:`\rho = 0`).

  Args:
    memory: the pairs.
    free: F, a boolean tree shaped like the params (or packed).
    pair_tol: the cosine below which a restricted pair is left out.

  Returns:
    The restricted memory, for :func:`two_loop_recursion` (its ``sy`` is stale).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(2), 2)
    >>> mem = memory.secant_record(mem, jnp.array([1.0, 1.0]), jnp.array([2.0, 3.0]), True)
    >>> restricted = memory.restricted_memory(mem, jnp.array([False, True]))
    >>> [float(v) for v in restricted.s[0][0]], round(float(restricted.rho[0]), 4)
    ([0.0, 1.0], 0.3333)
  """
  free = _in_blocks(memory, free)[0]
  mask = lambda stacked: tuple(
    jnp.where(f, a, jnp.zeros((), a.dtype)) for a, f in zip(stacked, free)
  )
  s, y = mask(memory.s), mask(memory.y)
  sy, ss, yy = _pair_sums(s, y), _pair_sums(s, s), _pair_sums(y, y)
  tol = jnp.asarray(pair_tol, sy.dtype)
  size = jnp.sqrt(ss * yy)
  # Where ||s_F||^2 ||y_F||^2 overflows (gradients of 1e19 in float32): the norms apart.
  size = jax.lax.cond(
    jnp.all(jnp.isfinite(size)),
    lambda: size,
    lambda: jnp.where(jnp.isfinite(size), size, _pair_norms(s) * _pair_norms(y)),
  )
  keep = (memory.rho != 0) & (sy > tol * size)
  rho = jnp.where(keep, 1 / jnp.where(keep, sy, 1), 0).astype(memory.rho.dtype)
  return memory._replace(s=s, y=y, rho=rho)


def _single_memory(state) -> Optional[SecantMemory]:
  """The one :class:`SecantMemory` in ``state``; ``None`` where there is none or several."""
  is_memory = lambda a: isinstance(a, SecantMemory)
  found = [leaf for leaf in jax.tree.leaves(state, is_leaf=is_memory) if is_memory(leaf)]
  return found[0] if len(found) == 1 else None


def preconditioner(state, free=None) -> Optional[Callable[[Any], Any]]:
  r""":math:`v \mapsto H_m v` of the pairs a state holds, on the free variables F.

  :math:`H_m` is the two-loop operator (:func:`two_loop_recursion`) of the pairs restricted
  to F (:func:`restricted_memory`; all of them without ``free``), with
  :math:`H_0 = \gamma I`,
  :math:`\gamma = \sum_i \langle s_i, y_i\rangle / \sum_i \langle y_i, y_i\rangle` over
  the kept restricted pairs (1 where there is none). Off F it is the identity: a
  preconditioner for a linear solve with the Hessian on F (the implicit adjoint's).

  Args:
    state: a state that holds one :class:`SecantMemory` (``trial_lbfgs``'s), or the memory.
    free: ``None`` (every variable) or a boolean tree shaped like the params.

  Returns:
    ``apply(v) -> H_m v`` (v and the result shaped like the params), or ``None`` where
    ``state`` holds no single :class:`SecantMemory`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import memory
    >>> mem = memory.secant_memory(jnp.zeros(2), 3)
    >>> mem = memory.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([4.0, 0.0]), True)
    >>> [float(v) for v in memory.preconditioner(mem)(jnp.array([4.0, 2.0]))]
    [1.0, 0.5]
  """
  memory = _single_memory(state)
  if memory is None:
    return None
  if free is not None:
    memory = restricted_memory(memory, free)
  kept = memory.rho != 0
  sy = jnp.sum(jnp.where(kept, _pair_sums(memory.s, memory.y), 0))
  yy = jnp.sum(jnp.where(kept, _pair_sums(memory.y, memory.y), 0))
  gamma = jnp.where(yy > 0, sy / jnp.where(yy > 0, yy, 1), 1)
  where_free = lambda v, other: v if free is None else jax.tree.map(jnp.where, free, v, other)

  def apply(v):
    on_free = two_loop_recursion(memory, gamma, where_free(v, optax.tree.zeros_like(v)))
    return where_free(on_free, v)

  return apply
