"""A pytree packed into a few flat blocks, so that work on it does not grow with its leaves.

Work written leaf by leaf compiles into a program with a copy of that work per leaf, and
XLA's compile time grows faster than the program (a model of 200 small leaves took
minutes). :func:`pack` turns a pytree into a tuple of blocks, :func:`unpack` turns blocks
back into a pytree shaped like another; a method keeps its per-coordinate state and does
its per-coordinate work on blocks, with pytrees only at its edges.

The layout is a function of the leaves' shapes, dtypes and explicit shardings alone, so
``init`` and every ``update`` (traced or not) agree on it:

- a leaf of at least :data:`OWN_BLOCK` entries, and a leaf whose type carries an explicit
  sharding (``jax.typeof(leaf).sharding``), is a block of its own, in its own shape (it
  keeps its sharding, and no copy of it is made);
- the other leaves of one dtype are raveled and concatenated, in order, into one 1-D block.

A tree of one leaf is its single block, unchanged. The blocks come in the order of their
first leaf.

A reduction over a pytree (:func:`vdot`, :func:`all_finite`, ``_numerics.norm``) is one
reduction per block here: summed leaf by leaf, the scalar would be a sum of L terms, and XLA
copies such a scalar's computation into every kernel that reads it, so that a per-leaf
update reading it (a step size, a null step's select) compiles into a program of L^2
operands.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = (
  "OWN_BLOCK",
  "Packing",
  "all_finite",
  "groups",
  "layout",
  "pack",
  "unpack",
  "vdot",
)

# A leaf this large is its own block: a copy of it would cost a pass over it, and a leaf a
# user shards over devices is one of this size (a concatenation with others would
# gather it).
OWN_BLOCK = 1 << 16


def _explicitly_sharded(leaf) -> bool:
  try:
    spec = jax.typeof(leaf).sharding.spec
  except (AttributeError, TypeError):
    return False
  return any(axis is not None for axis in spec)


def _alone(leaf) -> bool:
  return math.prod(jnp.shape(leaf)) >= OWN_BLOCK or _explicitly_sharded(leaf)


def groups(leaves) -> tuple[tuple[int, ...], ...]:
  """The indices of the leaves of each block, blocks in the order of their first leaf."""
  out, shared = [], {}
  for i, leaf in enumerate(leaves):
    if _alone(leaf):
      out.append([i])
      continue
    dtype = jnp.result_type(leaf)
    if dtype not in shared:
      shared[dtype] = []
      out.append(shared[dtype])
    shared[dtype].append(i)
  return tuple(tuple(g) for g in out)


def pack(tree) -> tuple[jax.Array, ...]:
  """``tree`` as a tuple of blocks (see the module's docstring).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import _blocks
    >>> [b.shape for b in _blocks.pack({"a": jnp.zeros((2, 3)), "b": jnp.zeros(4)})]
    [(10,)]
    >>> [b.shape for b in _blocks.pack(jnp.zeros((2, 3)))]
    [(2, 3)]
  """
  leaves = jax.tree.leaves(tree)
  blocks = []
  for group in groups(leaves):
    if len(group) == 1:
      blocks.append(jnp.asarray(leaves[group[0]]))
    else:
      blocks.append(jnp.concatenate([jnp.ravel(leaves[i]) for i in group]))
  return tuple(blocks)


def unpack(blocks, like) -> Any:
  """The blocks of ``pack(x)`` as ``x``'s pytree, ``like`` a pytree shaped like ``x``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import _blocks
    >>> like = {"a": jnp.zeros((2, 1)), "b": jnp.zeros(1)}
    >>> out = _blocks.unpack((jnp.arange(3.0),), like)
    >>> out["a"].tolist(), out["b"].tolist()
    ([[0.0], [1.0]], [2.0])
  """
  leaves, treedef = jax.tree.flatten(like)
  out = [None] * len(leaves)
  for block, group in zip(blocks, groups(leaves)):
    if len(group) == 1:
      out[group[0]] = block
      continue
    start = 0
    for i in group:
      shape = jnp.shape(leaves[i])
      size = math.prod(shape)
      out[i] = block[start : start + size].reshape(shape)
      start += size
  return jax.tree.unflatten(treedef, out)


def vdot(a, b) -> jax.Array:
  """:math:`\\langle a, b\\rangle` over the packed trees (``optax.tree.vdot``'s value)."""
  return optax.tree.vdot(pack(a), pack(b))


def all_finite(*trees) -> jax.Array:
  """Whether every entry of the trees is finite (one reduction per block)."""
  blocks = [b for tree in trees for b in pack(tree)]
  if not blocks:
    return jnp.asarray(True)
  return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(b)) for b in blocks])


def layout(tree) -> tuple:
  """``tree``'s structure and its leaves' shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def shaped_like(node, like: tuple) -> bool:
  """Whether ``node`` has the :func:`layout` ``like`` (its structure compared first: a node
  of another structure may hold leaves that are not arrays)."""
  return jax.tree.structure(node) == like[0] and layout(node) == like


class Packing:
  """A method's view of the params packed, and back: its per-coordinate work then compiles
  once per block rather than once per leaf of the params.

  A method whose state is shaped like the params packs the params, the gradient and the
  state's params-shaped subtrees on the way into an update and unpacks them on the way out,
  so its state keeps the params' layout (docs/speed.md, "Many leaves"). ``Packing(None)``,
  or params of a single leaf, leaves everything as it is.
  """

  def __init__(self, params):
    self.like = params
    self.treedef = jax.tree.structure(params)
    self.on = params is not None and self.treedef.num_leaves > 1

  @functools.cached_property
  def _layout(self) -> tuple:
    return layout(self.like)

  def like_params(self, node) -> bool:
    """Whether ``node`` is shaped like the params: their structure, shapes and dtypes (a
    tuple of scalars in a state is not packed because the params are a tuple too)."""
    return shaped_like(node, self._layout)

  def pack(self, tree):
    """``tree`` with every subtree shaped like the params packed (the params themselves too)."""
    if not self.on:
      return tree
    packed = lambda node: pack(node) if self.like_params(node) else node
    return jax.tree.map(packed, tree, is_leaf=self.like_params)

  def unpack(self, blocks):
    """Packed blocks as the params' pytree."""
    return unpack(blocks, self.like) if self.on else blocks

  def unpack_as(self, packed, template):
    """``packed`` (:meth:`pack` of a tree like ``template``) in ``template``'s layout."""
    if not self.on:
      return packed
    nodes, outer = jax.tree.flatten(template, is_leaf=self.like_params)
    got = outer.flatten_up_to(packed)
    back = [self.unpack(g) if self.like_params(n) else g for n, g in zip(nodes, got)]
    return outer.unflatten(back)

  def oracle(self, value_and_grad):
    """``value_and_grad(point) -> (value, grad)`` on the params as one on packed blocks."""
    if not self.on:
      return value_and_grad

    def packed(point):
      value, grad = value_and_grad(self.unpack(point))
      return value, pack(grad)

    return packed
