"""The members of a batch: the problems (``in_axes`` over ``init_params`` and ``fun_args``)
and the grid of settings (``sweep``'s columns, the settings held static, the optimizer each
member builds inside the program)."""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax import _numerics
from hdm_optax.driver import programs
from hdm_optax.driver import protocol

__all__ = (
  "Maker",
  "Problems",
  "column",
  "grid_points",
  "plain",
  "problems",
  "static_names",
)


class Problems(NamedTuple):
  """The problems of a batch: ``(init_params, fun_args)``, mapped leaves on axis 0."""

  tree: Any
  mapped: tuple  # per leaf of tree: on the batch axis
  count: int  # 1 when nothing is mapped


def problems(init_params, fun_args: tuple, in_axes) -> Problems:
  if not (isinstance(in_axes, (tuple, list)) and len(in_axes) == 2):
    raise ValueError(
      "in_axes must be a pair (axes of init_params, axes of fun_args), each an int, None "
      f"or a pytree prefix as in jax.vmap, got {in_axes!r}; e.g. in_axes=(None, (None, 0))"
    )
  tree, none = (init_params, fun_args), lambda x: x is None
  try:
    axes = jax.tree.flatten(jax.tree.broadcast(tuple(in_axes), tree, is_leaf=none), is_leaf=none)[0]
  except ValueError:
    raise ValueError(
      f"in_axes must be a pytree prefix of (init_params, fun_args) with ints or None at its "
      f"leaves (as jax.vmap's), got {in_axes!r} for {jax.tree.structure(tree)}"
    ) from None
  for leaf in jax.tree.leaves(init_params):
    try:
      _numerics.dtype_of(leaf)
    except TypeError as err:
      raise TypeError(f"init_params: {err}") from None
  leaves, treedef = jax.tree.flatten(tree)
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  out, sizes = [], {}
  for leaf, axis, path in zip(leaves, axes, paths):
    if axis is not None:
      leaf = jnp.asarray(leaf)
      where = ("init_params", "fun_args")[path[0].idx] + jax.tree_util.keystr(path[1:])
      if not isinstance(axis, int) or not -leaf.ndim <= axis < leaf.ndim:
        raise ValueError(
          f"in_axes maps axis {axis!r} of {where}, of shape {leaf.shape}, which has no such "
          "axis; give it None in in_axes (e.g. in_axes=(0, (0, None)) for fun_args=(data, "
          "number): data mapped, the number shared)."
        )
      sizes.setdefault(leaf.shape[axis], f"axis {axis} of {where}, of shape {leaf.shape}")
      leaf = jnp.moveaxis(leaf, axis, 0) if axis % leaf.ndim else leaf
    out.append(leaf)
  if set(sizes) == {0}:
    raise ValueError(
      "in_axes maps axes of size 0 (init_params and fun_args hold no problem): there is "
      "nothing to solve; pass at least one problem on the mapped axes."
    )
  _check_one_count(sizes)
  mapped = tuple(a is not None for a in axes)
  return Problems(jax.tree.unflatten(treedef, out), mapped, sizes.popitem()[0] if sizes else 1)


def _check_one_count(sizes: dict) -> None:
  """The mapped axes' sizes (each with the first axis found of that size) are one count."""
  if len(sizes) > 1:
    found = "; ".join(f"{size} on {where}" for size, where in sorted(sizes.items()))
    raise ValueError(
      f"in_axes: the mapped axes of init_params and fun_args must have one size (the number "
      f"of problems), got sizes {sorted(sizes)} ({found}). Give them one size, or None in "
      "in_axes for what every problem shares: in_axes=(None, 0) for one start (init_params "
      "unbatched), in_axes=(0, None) for one set of fun_args."
    )


# --- the grid of settings ----------------------------------------------------------------


def grid_points(grid):
  """``(names, points)``: the grid's keys and its points (dicts), in the grid's order."""
  if isinstance(grid, Mapping):
    names = list(grid)
    values = [_values(name, grid[name]) for name in names]
    points = [dict(zip(names, vals)) for vals in itertools.product(*values)]
  else:
    points = [dict(p) for p in grid]
    names = list(points[0]) if points else []
    if any(set(p) != set(names) for p in points):
      raise ValueError("every grid point must have the same keys")
  if not points:
    raise ValueError("grid is empty")
  return names, points


def _values(name, values) -> list:
  """A grid key's values as a list; a single value (a number, a string) is refused."""
  try:
    if isinstance(values, (str, bytes, Mapping)):
      raise TypeError
    return list(values)
  except TypeError:
    raise TypeError(
      f"grid[{name!r}] must be a list of values, got {values!r} ({type(values).__name__}); "
      f"pass a list, e.g. grid={{{name!r}: [{values!r}]}}."
    ) from None


def column(name, values, float_dtype) -> jax.Array:
  """A grid column: floats in the params' dtype, ints and bools in their own, arrays as given."""
  if all(isinstance(v, (bool, np.bool_)) for v in values):
    return jnp.asarray(values, bool)
  if all(isinstance(v, (numbers.Integral, np.integer)) for v in values):
    return jnp.asarray(values)
  if all(isinstance(v, numbers.Real) and not hasattr(v, "dtype") for v in values):
    return jnp.asarray(values, float_dtype)
  column = jnp.asarray(values)
  if column.ndim != 1:
    raise ValueError(f"grid values of {name!r} must be scalars, got shape {column.shape[1:]}")
  return column


def static_names(make_optimizer, names, points, params, float_dtype) -> tuple:
  """The settings held static: non-numbers, and numbers a trace cannot build (a memory size,
  a rate an optax schedule compares in Python); integers are tried first."""

  def builds(traced):
    try:
      jax.eval_shape(lambda v: make_optimizer(**{**points[0], **v}).init(params), traced)
    except Exception:  # pylint: disable=broad-except  # any failure: held static
      return False
    return True

  number = (numbers.Number, np.generic, np.ndarray, jax.Array)
  held = [n for n in names if not all(isinstance(p[n], number) for p in points)]
  traced = {n: column(n, [p[n] for p in points], float_dtype)[0] for n in names if n not in held}
  integral = lambda n: all(isinstance(p[n], numbers.Integral) for p in points)
  for name in sorted(traced, key=lambda n: not integral(n)):
    if builds(traced):
      break
    rest = {n: v for n, v in traced.items() if n != name}
    if builds(rest):
      traced, held = rest, held + [name]
  return tuple(held)


def plain(value):
  return value.item() if isinstance(value, np.generic) else value


class Maker:
  """How a member's optimizer is built inside the program (static).

  ``make_optimizer(**settings, **columns)`` for a sweep, keyed on what it computes: the
  optimizer it builds from a member's values of ``columns``, traced
  (:func:`~hdm_optax.driver.programs.built_signature`), so that a module global or an
  object's attribute it reads is in the key; or a given optimizer's
  :class:`~hdm_optax.driver.programs.OptimizerKey`. A maker that reads a traced value from
  outside its arguments has no key (it is not hashable): its program is traced inline.

  Args:
    make_optimizer: the sweep's factory, or ``None`` with ``key``.
    settings: the settings held static, ``(name, value)`` pairs.
    key: the given optimizer's key, or ``None``.
    columns: the settings traced, name -> column (one value per member).
    params: the params of a member (the first problem's).
  """

  def __init__(self, make_optimizer, settings, key, columns, params):
    self.make_optimizer, self.settings, self.optimizer_key = make_optimizer, settings, key
    try:
      self._key = (key, programs.fingerprint((make_optimizer, settings)))
      if key is None:
        member = {n: jax.ShapeDtypeStruct(c.shape[1:], c.dtype) for n, c in columns.items()}
        built = programs.built_signature(lambda s: self.build([], s), member, params)
        self._key += (built,)
    except programs.Uncacheable:
      self._key = None

  def build(self, arrays, columns):
    if self.optimizer_key is not None:
      return self.optimizer_key.build(arrays)
    return protocol.check_optimizer("sweep", self.make_optimizer(**dict(self.settings), **columns))

  def __hash__(self):
    if self._key is None:
      raise TypeError("a Maker that reads traced values is not hashable")
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, Maker) and self._key is not None and other._key == self._key
