r"""Box constraints :math:`l \le x \le u`: the box, its projection, free variables, stationarity.

The pieces a one-call method needs to stay in a box (:func:`hdm_optax.trial_lbfgs`'s
``lower=`` / ``upper=``):

- :func:`make_box` builds a :class:`Box` from what a user passes (scalars, pytrees shaped like
  the params, ``None`` or :math:`\pm\infty` for an open side) and checks it;
- :func:`project` is :math:`P(x) = \min(\max(x, l), u)`, leaf by leaf;
- :func:`free_mask` marks the variables the quasi-Newton operator acts on: all but those at a
  bound whose gradient pushes outward (Bertsekas' binding set);
- :func:`projected_step` is the step actually taken, :math:`P(x + d) - x`;
- :func:`projected_gradient_norm` is :math:`\|P(x - \nabla f(x)) - x\|_\infty`, the
  stationarity measure of L-BFGS-B's ``pgtol`` (0 exactly at a KKT point of the box);
- :func:`free_at_solution` marks the variables free at a returned point (the implicit
  adjoint's), by L-BFGS-B's projected gradient.

A state declares its box to a driver by its ``driver_box()``
(:class:`hdm_optax.driver.protocol.OptimizerState`); the driver calls the :class:`Box`'s
methods.

The L-BFGS step in a box is :mod:`hdm_optax.pieces.lbfgs.bounded`. Every function is pure and
traceable, so per-problem boxes run under ``jax.vmap``.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation with
  Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial point and null step the box
  keeps); Bertsekas, *Projected Newton methods for optimization problems with simple constraints*,
  SIAM J. Control Optim. 20(2), 1982 (the binding set, the two-metric projection); Byrd, Lu,
  Nocedal, Zhu, *A limited memory algorithm for bound constrained optimization*, SIAM J. Sci.
  Comput. 16(5), 1995 (L-BFGS-B: the projected gradient test).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = (
  "Box",
  "free_mask",
  "free_at_solution",
  "make_box",
  "project",
  "projected_gradient_norm",
  "projected_step",
)


class Box(NamedTuple):
  """The box :math:`l \\le x \\le u`, leaves in the params' dtype.

  Attributes:
    lower: l, a pytree with the params' structure; each leaf is 0-d (one bound for the
      whole leaf) or of the leaf's shape; -inf where a side is open.
    upper: u, like ``lower``; +inf where a side is open.
  """

  lower: Any
  upper: Any

  def project(self, x):
    """:func:`project`."""
    return project(self, x)

  def projected_gradient(self, x, grad):
    """:math:`P(x - \nabla f(x)) - x`, the step of the projected gradient."""
    return optax.tree.sub(project(self, optax.tree.sub(x, grad)), x)

  def projected_gradient_norm(self, x, grad) -> jax.Array:
    """:func:`projected_gradient_norm`."""
    return projected_gradient_norm(self, x, grad)

  def free_at_solution(self, x, grad, tol):
    """:func:`free_at_solution`."""
    return free_at_solution(self, x, grad, tol)


def _concrete(value) -> Optional[np.ndarray]:
  try:
    return np.asarray(value, dtype=np.float64)
  except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def _plain(value, leaf) -> str:
  """``value`` (an entry of the bound ``leaf``) as a number reads, in the leaf's own floating
  dtype: ``2.0``, ``0.1`` for a float32 0.1 (not ``np.float64(2.0)``, nor its float64
  digits)."""
  dtype = np.asarray(leaf).dtype  # concrete: check_order compared its values
  return str(np.asarray(value, dtype if np.issubdtype(dtype, np.floating) else np.float64)[()])


def _side(name: str, bound, params, open_value: float):
  """One side of the box as a pytree of arrays of the params' dtype (0-d where a scalar)."""
  leaves, treedef = jax.tree.flatten(params)
  dtype = jnp.result_type(leaves[0])
  fix = f"pass a number, None, or a pytree shaped like the params with leaves of dtype {dtype}"
  if bound is None:
    return jax.tree.unflatten(treedef, [jnp.asarray(open_value, dtype) for _ in leaves])
  if isinstance(bound, (str, bytes, bool, np.bool_)):
    raise TypeError(f"{name} must be a number or a pytree of arrays, got {bound!r}; {fix}.")
  if isinstance(bound, (int, float)) or (hasattr(bound, "shape") and np.ndim(bound) == 0):
    bound_leaves = [bound] * len(leaves)
  else:
    try:  # a leaf per params leaf (None: open); None where the params have None
      bound_leaves = treedef.flatten_up_to(bound)
      leafy = lambda b: b is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(b))
      if not all(map(leafy, bound_leaves)):
        raise ValueError(name)
    except (ValueError, TypeError):
      bound_def = jax.tree.structure(bound, is_leaf=lambda b: b is None)
      raise ValueError(
        f"{name} must be a scalar or have the pytree structure of the params; params: "
        f"{treedef}, {name}: {bound_def}; {fix}."
      ) from None
  out = []
  for leaf, b in zip(leaves, bound_leaves):
    if b is None:
      b = open_value
    weak = isinstance(b, (int, float)) or getattr(b, "weak_type", False)
    b_dtype = jnp.result_type(b)
    if not weak and b_dtype != dtype:
      raise TypeError(
        f"{name} has dtype {b_dtype} for params of dtype {dtype} (no silent promotion); "
        f"cast it, e.g. jax.tree.map(lambda b: jnp.asarray(b, jnp.{dtype}), {name})."
      )
    if np.ndim(b) not in (0, np.ndim(leaf)) or (np.ndim(b) and np.shape(b) != np.shape(leaf)):
      raise ValueError(
        f"{name} has a leaf of shape {np.shape(b)} for a params leaf of shape "
        f"{np.shape(leaf)}; {fix} (a leaf may also be a scalar)."
      )
    value = _concrete(b)
    if value is not None and np.any(np.isnan(value)):
      raise ValueError(f"{name} contains NaN; use -inf / +inf (or None) for an open side.")
    if value is not None and np.any(value == -open_value):
      at = tuple(int(i) for i in np.argwhere(value == -open_value)[0]) if value.ndim else ()
      raise ValueError(
        f"{name} is {-open_value:+} at index {at}: no finite x satisfies "
        f"x {'>=' if open_value < 0 else '<='} {-open_value:+}; use {open_value:+} or None "
        "for an open side."
      )
    out.append(jnp.asarray(b, dtype))
  return jax.tree.unflatten(treedef, out)


def check_order(lower, upper, lower_name: str = "lower", upper_name: str = "upper") -> None:
  """Raises a ``ValueError`` where concrete bounds have ``lower > upper``."""
  lower_paths = jax.tree_util.tree_flatten_with_path(lower)[0]
  for (path, lo), hi in zip(lower_paths, jax.tree.leaves(upper)):
    lo_arr, hi_arr = _concrete(lo), _concrete(hi)
    if lo_arr is None or hi_arr is None:
      continue
    bad = np.broadcast_to(lo_arr > hi_arr, np.broadcast_shapes(lo_arr.shape, hi_arr.shape))
    if np.any(bad):
      at = tuple(int(i) for i in np.argwhere(bad)[0])
      lo_at = np.broadcast_to(lo_arr, bad.shape)[at]
      hi_at = np.broadcast_to(hi_arr, bad.shape)[at]
      where = [f"leaf {jax.tree_util.keystr(path)}"] if path else []
      where += [f"index {at}"] if at else []
      place = f" at {', '.join(where)}" if where else ""
      raise ValueError(
        f"{lower_name} > {upper_name}{place}: {_plain(lo_at, lo)} > {_plain(hi_at, hi)}; the "
        "box is empty. "
        f"Pass {lower_name} <= {upper_name} everywhere (equal bounds fix a variable)."
      )


def make_box(params, lower=None, upper=None) -> Optional[Box]:
  """The :class:`Box` of ``lower`` and ``upper`` for ``params``, checked; ``None`` if both are None.

  Args:
    params: the params (any pytree of float arrays of one dtype).
    lower: l: ``None`` (no lower bound), a number (the same for every variable; -inf allowed),
      or a pytree with the params' structure whose leaves are numbers, ``None`` or arrays of
      the leaf's shape and the params' dtype.
    upper: u, like ``lower`` (+inf or ``None`` for no upper bound).

  Returns:
    A :class:`Box` in the params' dtype, or ``None`` when both sides are ``None``.

  Raises:
    ValueError: ``lower > upper`` somewhere (concrete values), NaN, another structure or
      leaf shape; the message names the argument and the fix.
    TypeError: a leaf of another dtype than the params' (no silent promotion).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(3), 0.0, jnp.array([1.0, 2.0, jnp.inf]))
    >>> [float(v) for v in box.project(b, jnp.array([-1.0, 3.0, 5.0]))]
    [0.0, 2.0, 5.0]
  """
  if lower is None and upper is None:
    return None
  lower = _side("lower", lower, params, -np.inf)
  upper = _side("upper", upper, params, np.inf)
  check_order(lower, upper)
  return Box(lower=lower, upper=upper)


def project(box: Box, x):
  """:math:`P(x) = \\min(\\max(x, l), u)`, leaf by leaf.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> [float(v) for v in box.project(b, jnp.array([-0.5, 2.0]))]
    [0.0, 1.0]
  """
  return jax.tree.map(jnp.clip, x, box.lower, box.upper)


def _inside(x, target, lo, hi):
  """``target - x``, corrected so that ``x + step`` (rounded) stays in [lo, hi].

  ``x + (t - x)`` rounds to a neighbour of t about as often as not (outside the box in about
  one case in eight for random values, float32 and float64 alike); one step of
  ``nextafter`` towards the inside corrects it (every such case of 2e6 random ones), and a
  variable whose corrected step still ends outside does not move.
  """
  step = target - x
  end = x + step
  inward = jnp.where(end > hi, -jnp.inf, jnp.inf).astype(step.dtype)
  # The one-ulp correction has derivative 1 (a run differentiated through its iterations).
  fixed = jax.lax.stop_gradient(step)
  nudge = jnp.nextafter(fixed, inward) - fixed
  step = jnp.where((end > hi) | (end < lo), step + nudge, step)
  end = x + step
  return jnp.where((end > hi) | (end < lo), jnp.zeros((), step.dtype), step)


def projected_step(box: Box, x, step):
  """The step actually taken from ``x`` in the box: :math:`P(x + d) - x`.

  Computed so that ``x + step`` lies in the box after rounding (``optax.apply_updates``
  adds it to x; :math:`x + (P(x + d) - x)` itself rounds outside the box in about one case
  in eight), for x in the box.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> [float(v) for v in box.projected_step(b, jnp.array([0.0, 0.5]), jnp.array([-1.0, 1.0]))]
    [0.0, 0.5]
  """
  target = project(box, optax.tree.add(x, step))
  return jax.tree.map(_inside, x, target, box.lower, box.upper)


def free_mask(box: Box, x, grad):
  r"""True for the free variables: not at a bound with ``grad`` pushing outward.

  A variable is *binding* where :math:`x_i \le l_i` and :math:`g_i > 0`, or
  :math:`x_i \ge u_i` and :math:`g_i < 0`: a descent step along :math:`-g` would leave
  the box there (Bertsekas' binding set at distance 0, not his :math:`\epsilon`-active set).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> [bool(v) for v in box.free_mask(b, jnp.array([0.0, 0.5]), jnp.array([3.0, -0.25]))]
    [False, True]
  """
  return jax.tree.map(
    lambda x, g, lo, hi: ~(((x <= lo) & (g > 0)) | ((x >= hi) & (g < 0))),
    x,
    grad,
    box.lower,
    box.upper,
  )


def projected_gradient_norm(box: Box, x, grad) -> jax.Array:
  """:math:`\\|P(x - \\nabla f(x)) - x\\|_\\infty`: 0 exactly at a KKT point of the box.

  The measure L-BFGS-B stops on (``pgtol``); without bounds it is :math:`\\|\\nabla f\\|_\\infty`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> float(box.projected_gradient_norm(b, jnp.array([0.0, 0.5]), jnp.array([3.0, -0.25])))
    0.25
  """
  return optax.tree.norm(box.projected_gradient(x, grad), ord=jnp.inf)


def free_at_solution(box: Box, x, grad, tol):
  """``(free, degenerate)`` at a returned point: L-BFGS-B's projected gradient decides which
  variables are bound.

  A variable is bound where the projected gradient step ends on a bound, ``x - g <= l``
  with ``g > 0`` (or ``x - g >= u`` with ``g < 0``); it is degenerate where it lies within
  ``tol`` of a bound with ``|g| <= tol`` (the side is then a matter of rounding).

  Why not :func:`free_mask`: that is the binding set at distance 0, of the iterate a method
  steps from, where a variable on its bound with the gradient pushing outward must stay. A
  returned point is a stationary point only to ``tol``: a variable may sit within ``|g|`` of
  its bound, not on it, and the projected gradient (the measure the run stopped on) puts it
  there. The implicit derivative (:mod:`hdm_optax.driver.adjoint`) holds those fixed.

  Returns:
    ``free``, a boolean tree shaped like ``x``, and ``degenerate``, the number of degenerate
    variables (int32).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(3), 0.0, 1.0)
    >>> free, odd = box.free_at_solution(
    ...     b, jnp.array([1e-6, 0.5, 0.0]), jnp.array([0.1, 0.0, 0.0]), 1e-4)
    >>> [bool(v) for v in free], int(odd)
    ([False, True, True], 1)
  """

  def leaf(lo, hi, xi, gi):
    bound = ((xi - gi <= lo) & (gi > 0)) | ((xi - gi >= hi) & (gi < 0))
    near = (jnp.abs(xi - lo) <= tol) | (jnp.abs(hi - xi) <= tol)
    return ~bound, near & (jnp.abs(gi) <= tol)

  pairs = jax.tree.map(leaf, box.lower, box.upper, x, grad)
  free = jax.tree.map(lambda p: p[0], pairs, is_leaf=lambda p: isinstance(p, tuple))
  odd = jax.tree.leaves(
    jax.tree.map(
      lambda p: jnp.sum(p[1], dtype=jnp.int32), pairs, is_leaf=lambda p: isinstance(p, tuple)
    )
  )
  return free, sum(odd, jnp.int32(0))
