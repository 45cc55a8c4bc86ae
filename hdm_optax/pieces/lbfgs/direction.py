r"""trial_lbfgs's direction: :math:`-\alpha H_m u`, the L-BFGS operator of the trials' pairs.

A :class:`hdm_optax.pieces.shell.Direction`: it proposes the trial step from the secant
pairs of earlier trials (:mod:`hdm_optax.pieces.lbfgs.memory`; in a box,
:mod:`hdm_optax.pieces.lbfgs.bounded`) and keeps the trial's pair where the step rule
(:func:`hdm_optax.pieces.lbfgs.step_rule.evidence_step`) trusts it.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation with
  Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial point and the null step);
  Liu and Nocedal, *On the limited memory BFGS method for large scale optimization*, Math.
  Programming 45, 1989 (the operator and the scaling of :math:`H_0`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _blocks
from hdm_optax import _checks
from hdm_optax import _numerics
from hdm_optax import _oracle
from hdm_optax.pieces import box as box_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces.lbfgs import bounded
from hdm_optax.pieces.lbfgs import memory as memory_lib

__all__ = (
  "LBFGSState",
  "lbfgs_direction",
)


class LBFGSState(NamedTuple):
  """State of :func:`lbfgs_direction`.

  Attributes:
    memory: the last m secant pairs (:class:`hdm_optax.pieces.lbfgs.memory.SecantMemory`).
    gamma: the scalar of :math:`H_0 = \\gamma I`, from the newest accepted kept pair
      (0 before the first: then :math:`\\min(1, 1/\\|u\\|)`).
    box: the :class:`hdm_optax.pieces.box.Box` of ``lower=`` / ``upper=`` (``None``
      without bounds).
  """

  memory: memory_lib.SecantMemory
  gamma: jax.Array
  box: Optional[box_lib.Box] = None

  def driver_box(self) -> Optional[box_lib.Box]:
    """The box, which the iteration's state tells a driver (``IterationState.driver_box``)."""
    return self.box

  def driver_preconditioner(self, free=None):
    """:math:`H_m` of the pairs on the ``free`` variables
    (:func:`hdm_optax.pieces.lbfgs.memory.preconditioner`)."""
    return memory_lib.preconditioner(self.memory, free)


class _Proposed(NamedTuple):
  """What ``propose`` hands on: the free set (packed; ``None`` without a box) and the step
  packed as the memory is."""

  free: Any
  step: Any


class _Observed(NamedTuple):
  """What ``observe`` hands on to ``learn``: the free set, s and y (packed) and the pair's
  products."""

  free: Any
  step: Any
  change: Any
  products: memory_lib.PairProducts


# A step that moves no coordinate by more than this, relative to the coordinate, is below
# x's resolution in float64 (1024 eps); in float32, whose eps is 5e8 times larger, a step
# that leaves x (and so the gradient) unchanged shows it by the gradient's change alone.
# Coordinate by coordinate, so that a step along a coordinate far smaller than the largest
# one counts.
_RESOLUTION = 1024 * float(np.finfo(np.float64).eps)


def _below_resolution(step, params, resolution) -> jax.Array:
  """Whether the step moves no coordinate by more than ``resolution`` relative to it:
  :math:`|s_i| \\le r|x_i|` for every i."""
  over = jax.tree.map(lambda s, x: jnp.any(jnp.abs(s) > resolution * jnp.abs(x)), step, params)
  return ~functools.reduce(jnp.logical_or, jax.tree.leaves(over))


def _first_gamma(updates) -> jax.Array:
  """:math:`\\min(1, 1/\\|u\\|)` (1 where u = 0), H_0's scale before a pair sets gamma."""
  grad_norm = _numerics.scaled_norm(updates)
  first = jnp.minimum(1, _numerics.safe_div(jnp.ones([], grad_norm.dtype), grad_norm))
  return jnp.where(grad_norm > 0, first, 1).astype(grad_norm.dtype)


def _pairs_count(memory_size) -> Union[int, Callable[[int], int], None]:
  """``memory_size`` as an int or a function of n; ``None`` where it is traced
  (``optax.inject_hyperparams`` injects it as an array, traced in a jitted update: the
  state's pairs then fix m)."""
  if callable(memory_size):
    return memory_size
  dtype = getattr(memory_size, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jnp.integer) and jnp.shape(memory_size) == ():
    if isinstance(memory_size, jax.core.Tracer):
      return None
    memory_size = int(memory_size)
  if not isinstance(memory_size, int) or isinstance(memory_size, bool) or memory_size < 1:
    raise ValueError(
      f"memory_size must be an int >= 1, got {memory_size!r}; pass e.g. memory_size=10 (or a "
      "function of the params' number of entries n that returns one)."
    )
  return memory_size


def _diagonal_rule(diagonal) -> Optional[Callable[..., tuple[Any, jax.Array]]]:
  """``diagonal``'s ``(memory, gamma) -> (h, on)``: a rule's ``apply`` (such as
  :func:`hdm_optax.pieces.lbfgs.memory.pairs_diagonal`'s), or the function itself."""
  if diagonal is None:
    return None
  apply = getattr(diagonal, "apply", None)
  if callable(apply):
    return apply
  if callable(diagonal):
    return diagonal
  raise ValueError(
    f"diagonal must be None, a rule with a method apply(memory, gamma) -> (h, on) or a "
    f"function (memory, gamma) -> (h, on), got {diagonal!r}; "
    "pass e.g. diagonal=hdm_optax.pieces.lbfgs.memory.pairs_diagonal()."
  )


def _check(pair_tol, lower, upper):
  _checks.check_interval("pair_tol", pair_tol, 0, 1, hi_open=True)
  box_lib.check_order(lower, upper)


def lbfgs_direction(
  memory_size: int = 10,
  *,
  pair_tol: Any = 1e-10,
  lower: Any = None,
  upper: Any = None,
  diagonal: Any = None,
) -> shell.Direction:
  r"""The L-BFGS operator of the trials' secant pairs: :math:`-\alpha H_m u`.

  :math:`H_m` is the L-BFGS inverse-Hessian operator
  (:func:`hdm_optax.pieces.lbfgs.memory.inverse_hessian_product`) of the last m pairs
  :math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla f(x))` of finite trials, kept when
  :math:`\langle s, y\rangle > \epsilon_p \sum_i |s_i y_i|` and the step rule trusts the pair
  (:attr:`hdm_optax.pieces.shell.Verdict.keep_pair`). :math:`H_0 = \gamma I` with
  :math:`\gamma = \langle s, y\rangle / \langle y, y\rangle` of the newest accepted kept pair
  (:math:`\min(1, 1/\|u\|)` before one exists), or, with ``diagonal``, the diagonal it
  returns where it says so; alpha is the step rule's factor. A step that moves no
  coordinate by more than :math:`1024\,\epsilon_{64}|x_i|` or a trial whose gradient
  equals :math:`\nabla f(x)` carries no curvature: the memory empties, gamma comes from
  the gradient again and the step rule restarts.

  In a box (``lower=``, ``upper=``) the trial is projected, :math:`x^+ = P(x - \alpha d)`,
  with :math:`d = H_F u` on the free variables F (:func:`hdm_optax.pieces.box.free_mask`,
  computed once per update) and :math:`\gamma u` on the binding ones
  (:func:`hdm_optax.pieces.lbfgs.bounded.two_metric_step`); the pair's s is the projected
  step taken; gamma is that of the pair restricted to F
  (:func:`hdm_optax.pieces.lbfgs.bounded.free_scaling`). Without bounds the program is the
  unbounded one.

  A coordinate whose incoming update is zero where :math:`\nabla f(x)` is not was held by a
  transformation before the method (``optax.masked(optax.set_to_zero(), mask)``): the step
  keeps it, as it keeps a binding variable in a box (:math:`H_m` mixes the coordinates, so
  :math:`H_m u` would move it). Alone, u is :math:`\nabla f(x)` and no coordinate is held.

  The operator, the pair and the memory work on the params packed into a few flat blocks
  (:mod:`hdm_optax._blocks`), so the program does not grow with the number of leaves of
  the params: they are unpacked only into the trial step.

  Args:
    memory_size: m, the number of pairs kept: an int, a 0-d integer array (as
      ``optax.inject_hyperparams`` injects it), concrete where the state is built (traced in
      ``update``, the state's pairs fix m), or a function ``m(n)`` of the params' number of
      entries, called where the state is built.
    pair_tol: :math:`\epsilon_p`, the fraction of :math:`\sum_i |s_i y_i|` that
      :math:`\langle s, y\rangle` must exceed for the pair to be kept.
    lower: the box's lower bound: ``None`` (none), a number, or a pytree shaped like
      the params; -inf for an open side.
    upper: the upper bound, like ``lower``.
    diagonal: ``None`` (:math:`H_0 = \gamma I`), a rule with a method
      ``rule.apply(memory, gamma) -> (h, on)``
      (:func:`hdm_optax.pieces.lbfgs.memory.pairs_diagonal`) or a function
      ``diagonal(memory, gamma) -> (h, on)``: :math:`H_0 = \operatorname{diag}(h)` where
      ``on``. Not used in a box, nor where the params have fewer entries than
      ``memory_size`` (there the pairs determine the operator).

  Returns:
    A :class:`hdm_optax.pieces.shell.Direction` (its state a :class:`LBFGSState`).

  Raises:
    ValueError: a ``memory_size``, ``pair_tol``, ``diagonal`` or box out of range.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import direction
    >>> state = direction.lbfgs_direction(5).init(jnp.zeros(3))
    >>> state.memory.rho.shape, float(state.gamma)
    ((5,), 0.0)
  """
  count, rule = _pairs_count(memory_size), _diagonal_rule(diagonal)
  _check(pair_tol, lower, upper)
  cfg = _Config(count, pair_tol, rule, lower, upper)
  part = lambda f: functools.partial(f, cfg)
  return shell.Direction(
    init=part(_init), propose=part(_propose), learn=part(_learn), observe=part(_observe)
  )


class _Config(NamedTuple):
  """:func:`lbfgs_direction`'s arguments, as its parts read them: ``memory_size`` an int
  or a function of n (``None`` where traced), ``diagonal`` the function ``(memory, gamma) -> (h, on)``."""

  memory_size: Union[int, Callable[[int], int], None]
  pair_tol: Any
  diagonal: Optional[Callable[..., tuple[Any, jax.Array]]]
  lower: Any
  upper: Any


def _init(cfg: _Config, params):
  if cfg.memory_size is None:
    raise ValueError(
      "memory_size is traced where the state is built, but it sets the state's shapes: pass "
      "it as a Python int (under optax.inject_hyperparams, "
      'static_args=("memory_size",)).'
    )
  memory_size = cfg.memory_size
  if callable(memory_size):
    n = sum(jnp.size(leaf) for leaf in jax.tree.leaves(params))
    memory_size = memory_size(n)
    if callable(memory_size):
      raise ValueError(f"memory_size(n) must return an int >= 1, got {memory_size!r} at n={n}.")
    memory_size = _pairs_count(memory_size)
  memory = memory_lib.secant_memory(params, memory_size)
  dtype = _numerics.params_dtype(params)
  box = box_lib.make_box(params, cfg.lower, cfg.upper)
  return LBFGSState(memory=memory, gamma=jnp.zeros([], dtype), box=box)


def _operator(cfg: _Config, memory, gamma, updates):
  n = sum(jnp.size(leaf) for leaf in jax.tree.leaves(updates))
  if cfg.diagonal is None or n < memory.rho.shape[0]:  # fewer dimensions than pairs: gamma I
    return memory_lib.inverse_hessian_product(memory, gamma, updates)
  # H_0 = diag(h) where the rule says so, gamma I elsewhere: one program, no branch (a
  # lax.cond over the pairs made XLA copy them at every update).
  h0, on = cfg.diagonal(memory, gamma)
  h0 = jax.tree.map(lambda h: jnp.where(on, h, gamma).astype(h.dtype), h0)
  return memory_lib.inverse_hessian_product(memory, h0, updates)


def _propose(cfg: _Config, state, ctx):
  held_pairs = state.memory.rho.shape[0]
  if isinstance(cfg.memory_size, int) and cfg.memory_size != held_pairs:
    raise ValueError(
      f"memory_size={cfg.memory_size}, but the state holds {held_pairs} pairs: the pairs' "
      "number is set where the state is built; build the state with this memory_size."
    )
  dtype = ctx.value.dtype
  # The free set of this update, once: the proposal, H_0's first scale and gamma use it.
  held = _oracle.held_coordinates(ctx.updates, ctx.grad)
  free = None if state.box is None else box_lib.free_mask(state.box, ctx.params, ctx.updates)
  if free is not None and held is not None:
    free = jax.tree.map(lambda f, h: f & ~h, free, held)
  packed_free = None if free is None else _blocks.pack(free)
  # The operator acts on the incoming updates u (grad f(x) when alone or first in a chain).
  updates = _blocks.pack(ctx.updates)
  # H_0's first scale needs a pass over u: only where no pair has set gamma yet.
  gamma = jax.lax.cond(
    state.gamma > 0,
    lambda: state.gamma,
    lambda: _first_gamma(updates if free is None else bounded.free_part(packed_free, updates)),
  )
  if state.box is None:  # x+ = x - alpha H_m u.
    step = optax.tree.scale(-ctx.step_size, _operator(cfg, state.memory, gamma, updates))
    if held is not None:
      step = _oracle.hold(step, _blocks.pack(held))
    return _blocks.unpack(step, ctx.params), _Proposed(None, step)
  # In a box: P(x - alpha d), H acting on the free variables.
  tol = _numerics.cast(cfg.pair_tol, dtype)
  on_free = lambda v, free: memory_lib.two_loop_recursion(
    bounded.restricted_memory(state.memory, free, tol), gamma, v
  )
  step = bounded.two_metric_step(
    state.box, ctx.params, ctx.updates, free, ctx.step_size, gamma, on_free
  )
  return step, _Proposed(packed_free, _blocks.pack(step))


def _observe(cfg: _Config, state, trial, ctx):
  change = optax.tree.sub(_blocks.pack(trial.grad), _blocks.pack(ctx.grad))
  products = memory_lib.pair_products(trial.aux.step, change)
  # A finite <s, y> needs every y_i = g+_i - g_i finite (s_i * inf is inf or NaN), so every
  # g+_i finite: no separate pass over grad f(x+).
  finite = trial.finite & jnp.isfinite(products.sy)
  observed = _Observed(trial.aux.free, trial.aux.step, change, products)
  return state, trial._replace(finite=finite, aux=observed)


def _learn(cfg: _Config, state, trial, verdict, ctx):
  c = lambda x: _numerics.cast(x, ctx.value.dtype)
  finite, (free, step, change, products) = trial.finite, trial.aux
  sy = products.sy
  # ||y|| and gamma = <s, y> / ||y||^2 where ||y||^2 overflows (gradients of 1e19 in
  # float32) from the rescaled norm: a pair of such an f still enters the memory.
  overflow = ~jnp.isfinite(products.yy)
  change_norm = _numerics.scaled_norm(change, products.yy)
  # A step below the resolution of x (or a rejected one that left the gradient as it was)
  # carries no curvature: H has collapsed along g; the memory restarts from H_0 = gamma_0 I.
  # An accepted step that left the gradient as it was found f linear along s: no pair, and
  # the step rule lengthens the next trial (a restart would reset it to alpha = 1 each time).
  short = _below_resolution(step, _blocks.pack(ctx.params), c(_RESOLUTION))
  lost = finite & (short | ((change_norm == 0) & ~verdict.accepted))
  # A finite trial's pair with enough positive curvature enters the memory where the step
  # rule trusts it (an accepted trial's, a rejected one's whose values agree with its slopes).
  # Enough: <s, y> above pair_tol times the size of its terms, sum_i |s_i y_i|, a test that a
  # rescaling of the coordinates leaves as it is (the cosine of s and y does not: in a valley
  # where s is along a coordinate of 1e4 and y along one of 1e-6, it is 1e-11 for a pair
  # whose curvature is all of <s, y>).
  curved = sy > c(cfg.pair_tol) * products.sy_abs
  keep = finite & curved & ~lost & verdict.keep_pair
  memory = memory_lib.secant_record(state.memory, step, change, keep, sy=sy)
  memory = memory_lib.reset(memory, lost)
  scaling = jnp.where(
    overflow,
    _numerics.safe_div(_numerics.safe_div(sy, change_norm), change_norm),
    _numerics.safe_div(sy, products.yy),
  )
  if free is not None:  # the scale of H on the free variables the step was taken on
    scaling = bounded.free_scaling(free, step, change, scaling)
  gamma = jnp.where(keep & verdict.accepted, scaling, state.gamma)
  gamma = jnp.where(lost, 0, gamma).astype(state.gamma.dtype)
  return shell.Learned(LBFGSState(memory, gamma, state.box), lost)
