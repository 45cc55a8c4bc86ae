r"""Box constraints :math:`l \le x \le u`: the box, its projection, free variables, stationarity.

The pieces a one-call method needs to stay in a box (:func:`hdm_optax.trial_lbfgs`'s
``lower=`` / ``upper=``):

- :func:`make_box` builds a :class:`Box` from what a user passes (scalars, pytrees shaped like
  the params, ``None`` or :math:`\pm\infty` for an open side) and checks it;
- :func:`project` is :math:`P(x) = \min(\max(x, l), u)`, leaf by leaf;
- :func:`free_mask` marks the variables the quasi-Newton operator acts on: all but those at a
  bound whose gradient pushes outward (Bertsekas' binding set);
- :func:`free_part` is a vector restricted to them;
- :func:`free_scaling` is the :math:`\gamma` of :math:`H_0 = \gamma I` from a pair restricted
  to them;
- :func:`projected_step` is the step actually taken, :math:`P(x + d) - x`;
- :func:`projected_gradient_norm` is :math:`\|P(x - \nabla f(x)) - x\|_\infty`, the
  stationarity measure of L-BFGS-B's ``pgtol`` (0 exactly at a KKT point of the box);
- :func:`two_metric_step` puts them together: the trial step of a projected quasi-Newton
  iteration with one oracle call.

Every function is pure and traceable, so per-problem boxes run under ``jax.vmap``.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation with
  Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial point and null step the box
  keeps); Bertsekas, *Projected Newton methods for optimization problems with simple constraints*,
  SIAM J. Control Optim. 20(2), 1982 (the binding set, the two-metric projection); Byrd, Lu,
  Nocedal, Zhu, *A limited memory algorithm for bound constrained optimization*, SIAM J. Sci.
  Comput. 16(5), 1995 (L-BFGS-B: the projected gradient test); Kim, Sra, Dhillon, *Tackling
  box-constrained optimization via a new projected quasi-Newton approach*, SIAM J. Sci.
  Comput. 32(6), 2010 (the quasi-Newton operator on the free variables).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax.pieces import secant as secant_lib

__all__ = (
  "Box",
  "find_box",
  "free_mask",
  "free_part",
  "free_scaling",
  "make_box",
  "project",
  "projected_gradient_norm",
  "projected_step",
  "restricted_memory",
  "step_cap",
  "two_metric_step",
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


def _concrete(value) -> Optional[np.ndarray]:
  try:
    return np.asarray(value, dtype=np.float64)
  except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


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
    bound_leaves, bound_def = jax.tree.flatten(bound, is_leaf=lambda b: b is None)
    if bound_def != treedef:
      raise ValueError(
        f"{name} must be a scalar or have the pytree structure of the params; params: "
        f"{treedef}, {name}: {bound_def}; {fix}."
      )
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
    out.append(jnp.asarray(b, dtype))
  return jax.tree.unflatten(treedef, out)


def check_order(lower, upper, lower_name: str = "lower", upper_name: str = "upper") -> None:
  """Raises a ``ValueError`` where concrete bounds have ``lower > upper``."""
  for lo, hi in zip(jax.tree.leaves(lower), jax.tree.leaves(upper)):
    lo_arr, hi_arr = _concrete(lo), _concrete(hi)
    if lo_arr is None or hi_arr is None:
      continue
    bad = np.broadcast_to(lo_arr > hi_arr, np.broadcast_shapes(lo_arr.shape, hi_arr.shape))
    if np.any(bad):
      at = tuple(int(i) for i in np.argwhere(bad)[0])
      lo_at = np.broadcast_to(lo_arr, bad.shape)[at]
      hi_at = np.broadcast_to(hi_arr, bad.shape)[at]
      raise ValueError(
        f"{lower_name} > {upper_name} at index {at}: {lo_at!r} > {hi_at!r}; the box is empty. "
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


def _where(mask, x, y):
  """``x`` where the boolean tree ``mask``, else ``y``, leaf by leaf."""
  return jax.tree.map(jnp.where, mask, x, y)


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
  the box there (Bertsekas' binding set at distance 0; his :math:`\epsilon`-active set,
  which also holds variables near a bound, took more calls on the bounded dev problems,
  ``docs/bounds.md``).

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


def free_part(box: Optional[Box], x, vector, grad=None):
  """``vector`` on the free variables (:func:`free_mask` of ``grad``, default ``vector``), else 0.

  With ``box=None`` it is ``vector`` itself (nothing is traced).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> [float(v) for v in box.free_part(b, jnp.array([0.0, 0.5]), jnp.array([3.0, -0.25]))]
    [0.0, -0.25]
  """
  if box is None:
    return vector
  free = free_mask(box, x, vector if grad is None else grad)
  return _where(free, vector, optax.tree.zeros_like(vector))


def free_scaling(box: Box, x, direction, step, change, full_scaling):
  r"""The :math:`\gamma` of :math:`H_0 = \gamma I` from a pair restricted to its free variables.

  .. math::
    \gamma = \frac{\langle s_F, y_F\rangle}{\langle y_F, y_F\rangle},

  F the variables free when the step s was proposed (:func:`free_mask` at x of the
  ``direction`` u that proposed it), :math:`y = \nabla f(x + s) - \nabla f(x)`. H acts on the
  free variables (:func:`two_metric_step`), so its scale is the reduced Hessian's: a binding
  variable does not move (:math:`s_B = 0`) but its gradient change :math:`y_B` enters
  :math:`\langle y, y\rangle`, and where many variables sit at a bound with a large
  gradient (logistic regression with :math:`w \ge 0`) the full pair's
  :math:`\langle s, y\rangle / \langle y, y\rangle` makes every step on the free
  variables too short. Where :math:`\langle s_F, y_F\rangle \le 0` it is
  ``full_scaling`` (the full pair's).

  Args:
    box: the :class:`Box`.
    x: the iterate the step was taken from.
    direction: u, the incoming updates at x (the gradient when the method is alone).
    step: s, the step taken.
    change: y, the gradient's change along it.
    full_scaling: :math:`\langle s, y\rangle / \langle y, y\rangle` of the full pair.

  Returns:
    :math:`\gamma`, a scalar of ``full_scaling``'s dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> x, u = jnp.array([0.0, 0.5]), jnp.array([3.0, -0.25])
    >>> s, y = jnp.array([0.0, 0.25]), jnp.array([4.0, 0.5])
    >>> float(box.free_scaling(b, x, u, s, y, jnp.asarray(0.125 / 16.25)))
    0.5
  """
  s_free, y_free = free_part(box, x, step, direction), free_part(box, x, change, direction)
  curvature = optax.tree.vdot(s_free, y_free)
  scaling = curvature / jnp.where(curvature > 0, optax.tree.vdot(y_free, y_free), 1)
  return jnp.where(curvature > 0, scaling, full_scaling).astype(jnp.result_type(full_scaling))


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
  moved = optax.tree.sub(project(box, optax.tree.sub(x, grad)), x)
  return optax.tree.norm(moved, ord=jnp.inf)


def two_metric_step(
  box: Box, x, direction, step_size, gamma, operator: Callable[[Any], Any]
) -> tuple[Any, jax.Array]:
  r"""The projected quasi-Newton trial step of a one-call iteration, and whether it is one.

  With F the free variables of :func:`free_mask` (of ``direction`` u, the gradient when the
  method is alone) and B the binding ones,

  .. math::
    d_F = H\,u_F, \qquad d_B = \gamma\, u_B, \qquad s = P(x - \alpha d) - x,

  H the ``operator`` applied to u restricted to F (zero on B, so that the pairs' coupling
  of a binding variable does not move a free one), B scaled by :math:`\gamma` as a
  gradient step (Bertsekas' two-metric projection; the projection keeps a binding
  variable where it is). The step is the projected step actually taken. Where it is not a
  descent direction (:math:`\langle u, s\rangle \ge 0`: the projection cut the
  quasi-Newton step so that what is left goes uphill), it is the projected scaled gradient
  step :math:`P(x - \alpha\gamma u) - x` instead, a descent direction wherever x is not
  stationary. Neither choice calls the oracle.

  Args:
    box: the :class:`Box`.
    x: the iterate (in the box).
    direction: u, the incoming updates (the gradient when alone in a chain).
    step_size: alpha.
    gamma: the scalar of :math:`H_0`.
    operator: ``(v, free) -> H v`` on the free variables ``free`` (a boolean tree), e.g.
      ``lambda v, free: secant.recursion(restricted_memory(memory, free), gamma, v)``.

  Returns:
    ``(s, quasi_newton)``: the step and whether it is the quasi-Newton one.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> x, g = jnp.array([0.0, 0.5]), jnp.array([3.0, -0.25])
    >>> step, newton = box.two_metric_step(b, x, g, 1.0, 0.5, lambda v, free: v)
    >>> [float(v) for v in step], bool(newton)
    ([0.0, 0.25], True)
  """
  free = free_mask(box, x, direction)
  zeros = optax.tree.zeros_like(direction)
  newton = operator(_where(free, direction, zeros), free)
  scaled = optax.tree.scale(gamma, direction)
  d = _where(free, newton, scaled)
  step = projected_step(box, x, optax.tree.scale(-step_size, d))
  fallback = projected_step(box, x, optax.tree.scale(-step_size, scaled))
  descent = optax.tree.vdot(direction, step) < 0
  return optax.tree.where(descent, step, fallback), descent


def step_cap(box: Optional[Box], curvature, step):
  r"""The largest alpha after an accepted trial: 1, or no cap where the box bounds the step.

  Where the curvature :math:`\langle s, y\rangle` along an accepted step is not positive
  and every variable the step moves has a finite bound in the direction it moves, the
  quadratic model has no minimum along the step and the box is what stops it (the
  minimisers of a concave piece are at the box's vertices): alpha then grows past 1 by the
  method's ``grow`` per accepted step, and the projection keeps each trial in the box.
  L-BFGS-B's generalized Cauchy point reaches the same vertices by following the projected
  gradient path to its last breakpoint. Elsewhere (positive curvature, or a variable moving
  towards an open side) the cap is 1, the unbounded method's; without a box it is the
  number 1 (nothing is traced).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box
    >>> b = box.make_box(jnp.zeros(2), 0.0, 1.0)
    >>> float(box.step_cap(b, jnp.asarray(-1.0), jnp.array([0.0, 0.5]))), box.step_cap(None, 1.0, None)
    (inf, 1)
  """
  if box is None:
    return 1

  def blocked(s, lo, hi):
    return jnp.all((s == 0) | ((s > 0) & (hi < jnp.inf)) | ((s < 0) & (lo > -jnp.inf)))

  leaves = jax.tree.leaves(jax.tree.map(blocked, step, box.lower, box.upper))
  bounded = jnp.all(jnp.stack(leaves))
  return jnp.where((curvature > 0) | ~bounded, 1, jnp.inf).astype(jnp.result_type(curvature))


def restricted_memory(memory: secant_lib.SecantMemory, free, pair_tol=1e-10):
  r"""The secant pairs restricted to the free variables: :math:`(s_F, y_F)`.

  Where the variables outside F did not move along a pair, :math:`y_F = (Z^T B Z) s_F` is
  the secant pair of the reduced Hessian on F, so the two-loop operator of the restricted
  pairs approximates :math:`(Z^T B Z)^{-1}` (the quasi-Newton step on the free subspace,
  as L-BFGS-B's subspace minimisation), not :math:`Z^T H Z`. A restricted pair whose
  curvature :math:`\langle s_F, y_F\rangle` is not above ``pair_tol`` times
  :math:`\|s_F\|\|y_F\|` is left out (:math:`\rho = 0`).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import box, secant
    >>> mem = secant.secant_memory(jnp.zeros(2), 2)
    >>> mem = secant.secant_record(mem, jnp.array([1.0, 1.0]), jnp.array([2.0, 3.0]), True)
    >>> restricted = box.restricted_memory(mem, jnp.array([False, True]))
    >>> [float(v) for v in restricted.s[0]], round(float(restricted.rho[0]), 4)
    ([0.0, 1.0], 0.3333)
  """
  mask = lambda stacked: jax.tree.map(
    lambda a, f: jnp.where(f, a, jnp.zeros((), a.dtype)), stacked, free
  )
  s, y = mask(memory.s), mask(memory.y)
  per_pair = lambda a, b: sum(
    jnp.sum((u * v).reshape(u.shape[0], -1), axis=1)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  sy, ss, yy = per_pair(s, y), per_pair(s, s), per_pair(y, y)
  tol = jnp.asarray(pair_tol, sy.dtype)
  keep = (memory.rho != 0) & (sy > tol * jnp.sqrt(ss * yy))
  rho = jnp.where(keep, 1 / jnp.where(keep, sy, 1), 0).astype(memory.rho.dtype)
  return memory._replace(s=s, y=y, rho=rho)


def find_box(state, last) -> Optional[Box]:
  """The :class:`Box` held in an optimizer state (a ``box`` field), or ``None``.

  ``last`` is the state of the transformation whose update reaches the params unchanged
  (:func:`hdm_optax.driver.cache.cache_at_params`). The box must be held there: a later
  transformation could move the iterate out of the box, and then a ``ValueError`` says so.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> from hdm_optax.pieces import box
    >>> state = hdm_optax.trial_lbfgs(lower=0.0).init(jnp.ones(2))
    >>> float(box.find_box(state, state).lower)
    0.0
  """
  found = [b for _, b in optax.tree.get_all_with_path(state, "box") if isinstance(b, Box)]
  if not found:
    return None
  held = [b for _, b in optax.tree.get_all_with_path(last, "box") if isinstance(b, Box)]
  last_box = held[0] if len(held) == 1 else None
  if len(found) > 1 or last_box is None:
    raise ValueError(
      "a transformation with bounds (lower=/upper=) must be the last one of the chain, and "
      "the only one with bounds: a later transformation changes its step and could move the "
      "iterate out of the box. Put the bounded transformation last (clipping, weight decay "
      "and the like go before it)."
    )
  return last_box
