"""The points of a sweep: settings of the optimizer, problems of batched data, their programs.

:func:`hdm_optax.sweep` runs every point of a grid of optimizer settings on
every problem of a batch (axes of ``init_params`` and ``fun_args``, named as
``jax.vmap``'s ``in_axes``), all points of a program in one vmapped loop. A
setting passes into the program as a traced array, unless the optimizer cannot
be built from a traced value (``trial_lbfgs``'s ``memory_size`` sets the shape of
its state, a string picks a piece): then each of its values gets a program of
its own, and the results are put back in the grid's order.
"""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax.driver.results import SolveResult

__all__ = (
  "Bound",
  "Layout",
  "Problems",
  "column",
  "combine",
  "expand",
  "grid_points",
  "problems",
  "programs",
  "static_names",
)


def grid_points(grid: Union[Mapping[str, Sequence[Any]], Sequence[Mapping[str, Any]]]):
  """``(names, points)``: the Cartesian product of a mapping, or an explicit list of dicts."""
  if isinstance(grid, Mapping):
    names = list(grid)
    points = [dict(zip(names, vals)) for vals in itertools.product(*grid.values())]
  else:
    points = [dict(p) for p in grid]
    names = list(points[0]) if points else []
    if any(set(p) != set(names) for p in points):
      raise ValueError("every grid point must have the same keys")
  if not points:
    raise ValueError("grid is empty")
  return names, points


def column(name: str, values: Sequence[Any], float_dtype) -> jax.Array:
  """One grid column as an array: numbers of a float grid in the params' dtype.

  Booleans and integers keep their dtype (so they can be swept, e.g. a number
  of steps or an on/off switch); Python floats take the params' dtype (no
  silent promotion of float32 runs); arrays with a dtype keep it.
  """
  if all(isinstance(v, (bool, np.bool_)) for v in values):
    return jnp.asarray(values, bool)
  if all(isinstance(v, (numbers.Integral, np.integer)) for v in values):
    return jnp.asarray(values)
  if all(isinstance(v, numbers.Real) and not hasattr(v, "dtype") for v in values):
    return jnp.asarray(values, float_dtype)
  column_ = jnp.asarray(values)
  if column_.ndim != 1:
    raise ValueError(f"grid values of {name!r} must be scalars, got shape {column_.shape[1:]}")
  return column_


def _is_number(value) -> bool:
  return isinstance(value, (numbers.Number, np.generic, np.ndarray, jax.Array))


def _builds(make_optimizer, point: dict, traced: dict, params) -> bool:
  """Whether the optimizer is built, and initialised, with the settings ``traced`` traced."""

  def build(values):
    return make_optimizer(**{**point, **values}).init(params)

  try:
    jax.eval_shape(build, traced)
  except Exception:  # pylint: disable=broad-except  # any failure: held static, built concretely
    return False
  return True


def static_names(make_optimizer, names, points, params, float_dtype) -> tuple[str, ...]:
  """The settings held static: values that are not numbers, or integers a trace cannot build.

  Every numeric setting is tried traced (a step size, a number of steps, a switch),
  as the sweep passes it; while that fails, an integer setting whose concrete value
  makes it build is held static (``trial_lbfgs(memory_size=<traced>)`` cannot
  size its state). A failure no integer explains surfaces when the sweep runs.
  """
  held = [n for n in names if not all(_is_number(p[n]) for p in points)]
  traced = {n: column(n, [p[n] for p in points], float_dtype)[0] for n in names if n not in held}
  integers = [
    n for n in traced if all(isinstance(p[n], (numbers.Integral, np.integer)) for p in points)
  ]
  for name in integers:
    if _builds(make_optimizer, points[0], traced, params):
      break
    rest = {n: v for n, v in traced.items() if n != name}
    if _builds(make_optimizer, points[0], rest, params):
      traced, held = rest, held + [name]
  return tuple(held)


def _plain(value):
  return value.item() if isinstance(value, np.generic) else value


class Bound:
  """``make_optimizer`` with the static settings of one program bound (hashable, as a key)."""

  def __init__(self, make_optimizer: Callable[..., Any], settings: Mapping[str, Any]):
    self.make_optimizer = make_optimizer
    self.settings = tuple((k, _plain(v)) for k, v in settings.items())

  def __call__(self, **traced):
    return self.make_optimizer(**dict(self.settings), **traced)

  def __eq__(self, other):
    return (
      isinstance(other, Bound)
      and other.make_optimizer == self.make_optimizer
      and other.settings == self.settings
    )

  def __hash__(self):
    return hash((self.make_optimizer, self.settings))


class Layout(NamedTuple):
  """How one point's problem data rebuild ``init_params`` and ``fun_args`` (static)."""

  params_def: Any
  params_mapped: tuple
  args_def: Any
  args_mapped: tuple

  def params(self, mapped, fixed):
    return _merge(self.params_def, self.params_mapped, mapped, fixed)

  def args(self, mapped, fixed):
    return _merge(self.args_def, self.args_mapped, mapped, fixed)


class Problems(NamedTuple):
  """The batch of problems of a sweep.

  Attributes:
    layout: the static :class:`Layout`.
    mapped: ``(params_leaves, args_leaves)`` with a leading problem axis.
    fixed: ``(params_leaves, args_leaves)`` common to every problem.
    count: the number of problems (1 without a mapped axis).
  """

  layout: Layout
  mapped: tuple
  fixed: tuple
  count: int


def _merge(treedef, is_mapped, mapped, fixed):
  mapped, fixed = iter(mapped), iter(fixed)
  return jax.tree.unflatten(treedef, [next(mapped) if m else next(fixed) for m in is_mapped])


class _Axis(NamedTuple):
  axis: Any


def _leaf_axes(axes, tree, what: str) -> list:
  """The axis of each leaf of ``tree`` from ``axes``, an int, None or a prefix tree of them."""
  count = len(jax.tree.leaves(tree))
  if axes is None or isinstance(axes, int):
    return [axes] * count
  try:
    nested = jax.tree.map(
      lambda ax, sub: [_Axis(ax)] * len(jax.tree.leaves(sub)),
      axes,
      tree,
      is_leaf=lambda x: x is None,
    )
  except ValueError:
    raise ValueError(
      f"in_axes for {what} must be an int, None or a pytree prefix of {what} with ints and "
      f"None at its leaves (as jax.vmap's in_axes), got {axes!r} for {what} of structure "
      f"{jax.tree.structure(tree)}"
    ) from None
  found = [a.axis for a in jax.tree.leaves(nested, is_leaf=lambda x: isinstance(x, _Axis))]
  if any(a is not None and not isinstance(a, int) for a in found):
    raise ValueError(f"in_axes for {what} must hold ints or None, got {axes!r}")
  return found


def _split(tree, axes, what: str):
  leaves, treedef = jax.tree.flatten(tree)
  leaf_axes = _leaf_axes(axes, tree, what)
  mapped, fixed, sizes = [], [], []
  for leaf, axis in zip(leaves, leaf_axes):
    if axis is None:
      fixed.append(leaf)
      continue
    leaf = jnp.asarray(leaf)
    if not -leaf.ndim <= axis < leaf.ndim:
      raise ValueError(f"in_axes for {what}: axis {axis} of a leaf of shape {leaf.shape}")
    mapped.append(leaf if axis % leaf.ndim == 0 else jnp.moveaxis(leaf, axis, 0))
    sizes.append(leaf.shape[axis])
  return treedef, tuple(a is not None for a in leaf_axes), mapped, fixed, sizes


def problems(init_params, fun_args: tuple, in_axes) -> Problems:
  """The problems named by ``in_axes = (params_axes, fun_args_axes)``, as ``jax.vmap``'s."""
  if not (isinstance(in_axes, (tuple, list)) and len(in_axes) == 2):
    raise ValueError(
      "in_axes must be a pair (axes of init_params, axes of fun_args), each an int, None "
      f"or a pytree prefix as in jax.vmap, got {in_axes!r}; e.g. in_axes=(None, (None, 0))"
    )
  p_def, p_mask, p_mapped, p_fixed, p_sizes = _split(init_params, in_axes[0], "init_params")
  a_def, a_mask, a_mapped, a_fixed, a_sizes = _split(fun_args, in_axes[1], "fun_args")
  sizes = set(p_sizes + a_sizes)
  if len(sizes) > 1:
    raise ValueError(
      f"in_axes: the mapped axes of init_params and fun_args must have one size (the number "
      f"of problems), got sizes {sorted(sizes)}"
    )
  return Problems(
    layout=Layout(p_def, p_mask, a_def, a_mask),
    mapped=(p_mapped, a_mapped),
    fixed=(p_fixed, a_fixed),
    count=sizes.pop() if sizes else 1,
  )


def expand(points: list, count: int) -> tuple[list, np.ndarray]:
  """Every point on every problem: the points (with ``"problem"`` when ``count > 1``) and ids."""
  if count == 1:
    return points, np.zeros(len(points), np.int32)
  if "problem" in points[0]:
    raise ValueError(
      'with in_axes every point gets the key "problem" (its problem\'s index): rename the '
      'grid setting "problem"'
    )
  out = [dict(p, problem=b) for p in points for b in range(count)]
  return out, np.tile(np.arange(count, dtype=np.int32), len(points))


def programs(make_optimizer, names, points: list, static, float_dtype) -> list:
  """``(indices, make_optimizer, columns)`` of each program of a sweep over ``points``.

  One program per combination of the static settings' values, with those values
  bound (:class:`Bound`); the other settings are its traced columns.
  """
  groups = {}
  for i, point in enumerate(points):
    groups.setdefault(tuple((n, _plain(point[n])) for n in static), []).append(i)
  out = []
  for settings, indices in groups.items():
    make = Bound(make_optimizer, dict(settings)) if static else make_optimizer
    traced = [n for n in names if n not in static]
    columns = {n: column(n, [points[i][n] for i in indices], float_dtype) for n in traced}
    out.append((np.asarray(indices), make, columns))
  return out


def _stacked(trees: list):
  """The trees' leaves concatenated on axis 0, or None when their structures or shapes differ."""
  shapes = {
    (jax.tree.structure(t), tuple(np.shape(x)[1:] for x in jax.tree.leaves(t))) for t in trees
  }
  if len(shapes) > 1:
    return None
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees)


def combine(parts: list, count: int) -> SolveResult:
  """The results of several programs, put back in point order.

  Args:
    parts: ``(indices, result)`` per program: the points it ran and its batched result.
    count: the number of points.

  Returns:
    A :class:`SolveResult` whose leaves have a leading axis of ``count``; its
    ``state`` is a list with one state per point when the programs' states differ
    in structure or shape (a setting that sizes the state, such as ``memory_size``).
  """
  if len(parts) == 1:
    return parts[0][1]
  order = np.argsort(np.concatenate([np.asarray(i) for i, _ in parts]), kind="stable")
  results = [r for _, r in parts]
  take = lambda tree: jax.tree.map(lambda x: x[order], tree)
  fields = {
    f: take(_stacked([getattr(r, f) for r in results])) for f in SolveResult._fields if f != "state"
  }
  state = _stacked([r.state for r in results])
  if state is None:
    each = [
      jax.tree.map(lambda x, k=k: x[k], r.state) for r in results for k in range(len(r.value))
    ]
    state = [each[i] for i in order]
  else:
    state = take(state)
  return SolveResult(state=state, **fields)
