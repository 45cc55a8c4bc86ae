r"""The iteration every one-call method runs: propose a trial, evaluate it once, keep or stay.

Every method of the package but HDM-AGD is one iteration with two slots
(Algorithm 1, line 3 and Algorithm 4, lines 2 and 9 of Chu et al.):

.. math::
  x^+ = x + \text{direction}(\text{state}, u;\ \alpha), \qquad
  x \leftarrow \begin{cases} x^+ & \text{if the step rule accepts the trial} \\
    x & \text{otherwise (the null step),} \end{cases}

with u the incoming updates (grad f(x) when the method is first or alone in a
chain) and one value-and-gradient call at :math:`x^+`:

- a :class:`Direction` proposes the step from its state and u, and learns
  from the trial: HDM's learned P (:func:`hdm_optax.hdm`), HDM-HB's (P, B)
  (:func:`hdm_optax.hdm_hb`), the diagonal-P, scalar-beta family of Algorithm 4
  (:func:`hdm_optax.pieces.momentum.momentum_direction`), the L-BFGS operator of the
  trials' secant pairs (:func:`hdm_optax.pieces.lbfgs.direction.lbfgs_direction`);
- a :class:`StepRule` sets the step size :math:`\alpha` of each trial and, from the
  :class:`Evidence` the shell computes once per trial (the merit at both points and the
  slopes along the step), returns a :class:`Verdict`: whether the trial is accepted, its
  next state and whether the trial's secant pair may be kept
  (:func:`hdm_optax.pieces.step_control.damping`: HDM's acceptance test and damping;
  :func:`hdm_optax.pieces.lbfgs.step_rule.evidence_step`: trial_lbfgs's).

The shell does what every method shares: it requires the oracle, evaluates the
trial once, rejects a non-finite trial (the direction sees ``finite`` and keeps its
learned quantities), restarts the step rule when the direction says so, caches f and
grad f at the iterate, counts every oracle call in ``info`` and returns the step to the
new iterate (zero on a null step). HDM-AGD evaluates three points per update and keeps
its own update (:func:`hdm_optax.hdm_agd`).

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithms 1, 2 and 4.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _blocks
from hdm_optax import _info
from hdm_optax import _numerics
from hdm_optax import _oracle
from hdm_optax import _stale

__all__ = (
  "Context",
  "Direction",
  "Evidence",
  "IterationState",
  "Learned",
  "StepRule",
  "Trial",
  "Verdict",
  "iteration",
)


class Context(NamedTuple):
  """What an update knows before its trial (read-only for the slots).

  The slots see the vectors packed (``hdm_optax._blocks.pack``: the params' small leaves
  raveled into one vector per dtype), and the direction's state with its fields shaped like
  the params packed the same way; the steps they return are packed too. The iteration
  unpacks at its edges: the state and the update keep the params' layout. An iteration
  built with ``pack_params=False`` hands them the params' own layout.

  Attributes:
    params: x, the current iterate.
    updates: u, the incoming updates.
    value: f(x).
    grad: grad f(x).
    count: the iterations made before this update.
    step_size: the step rule's factor for this trial (alpha; HDM's damping s).
    value_and_grad: ``value_and_grad(point) -> (value, grad)``, one oracle
      call (for a direction that refines its trial; count it in
      :attr:`Trial.calls`).
  """

  params: Any
  updates: Any
  value: jax.Array
  grad: Any
  count: jax.Array
  step_size: jax.Array
  value_and_grad: Callable[[Any], tuple[jax.Array, Any]]


class Trial(NamedTuple):
  """One trial and what it revealed.

  Attributes:
    step: :math:`x^+ - x`, the point evaluated is ``params + step``.
    value: :math:`f(x^+)`.
    grad: :math:`\\nabla f(x^+)`.
    finite: the value and gradient are finite (the shell sets it from the
      value; :attr:`Direction.observe` adds the gradient's test).
    probe: the update is a probe that measures curvature and leaves x (not
      counted in ``count``, never accepted).
    calls: the value-and-gradient calls the update made.
    aux: what :attr:`Direction.propose` (then :attr:`Direction.observe`)
      hands on to the direction's later phases.
  """

  step: Any
  value: jax.Array
  grad: Any
  finite: jax.Array
  probe: jax.Array
  calls: Any = 1
  aux: Any = None


class Evidence(NamedTuple):
  """What the trial showed, computed once by the shell for the step rule.

  The vectors are packed (``hdm_optax._blocks.pack``: the params' small leaves raveled
  into one vector), so that a rule's reductions over them are one per block, not one per
  leaf of the params.

  Attributes:
    value: the merit at x (f(x), or HDM-HB's potential).
    trial_value: the merit at :math:`x^+`.
    grad: :math:`\\nabla f(x)`, packed.
    trial_grad: :math:`\\nabla f(x^+)`, packed.
    step: s, :math:`x^+ - x` packed (``None`` where the merit is not f).
    slope: :math:`\\langle \\nabla f(x), s\\rangle` (``None`` without ``step``).
    trial_slope: :math:`\\langle \\nabla f(x^+), s\\rangle` (``None`` without ``step``).
    finite: the trial's value and gradient are finite.
    probe: the trial is a probe (never accepted).
  """

  value: jax.Array
  trial_value: jax.Array
  grad: Any
  trial_grad: Any
  step: Any
  slope: Optional[jax.Array]
  trial_slope: Optional[jax.Array]
  finite: jax.Array
  probe: jax.Array


class Verdict(NamedTuple):
  """What a :class:`StepRule` decides from the :class:`Evidence`.

  Attributes:
    accepted: the trial becomes the iterate (False on a probe and a non-finite trial).
    state: the rule's next state (its step size for the next trial).
    keep_pair: the trial's values and slopes describe f along s, so its secant pair may
      enter a memory (a direction that keeps none ignores it).
  """

  accepted: jax.Array
  state: Any
  keep_pair: jax.Array


class Learned(NamedTuple):
  """What :attr:`Direction.learn` returns.

  Attributes:
    state: the direction's new state.
    restart: the step rule starts again from its initial state (trial_lbfgs: the memory
      lost the curvature along the gradient).
    hypergrad_norm: the norm of the hypergradient the direction learned from, for
      ``info`` (``None`` for a direction that learns none: ``info`` reports 0).
  """

  state: Any
  restart: jax.Array
  hypergrad_norm: Optional[jax.Array] = None


def _uphill(seen: Evidence, updates, accepted) -> jax.Array:
  """A rejected finite trial that went down the updates u but not down f.

  Only where u is not grad f (a transformation before the method changed it): then
  :math:`\\langle u, s\\rangle < 0 \\le \\langle \\nabla f(x), s\\rangle` says the step follows
  a term f does not contain (:attr:`hdm_optax.HDMInfo.num_uphill_trials`).
  """
  if seen.slope is None:  # the merit is not f (HDM-HB's potential): no slope to compare
    return jnp.asarray(False)
  along_updates = optax.tree.vdot(_blocks.pack(updates), seen.step)  # the step is packed
  return ~accepted & seen.finite & (seen.slope >= 0) & (along_updates < 0)


def _finite_gradient(state, trial: Trial, ctx: Context):
  del ctx
  return state, trial._replace(finite=trial.finite & _numerics.all_finite(trial.grad))


def _values(state, trial: Trial, ctx: Context):
  del state
  return trial.value, ctx.value, trial.step


class Direction(NamedTuple):
  """Where the trial goes, and what the direction learns from it.

  Attributes:
    init: ``init(params) -> state``.
    propose: ``propose(state, ctx) -> (step, aux)``: the tree :math:`x^+ - x`
      (the direction applies ``ctx.step_size`` itself) and anything it hands on
      to ``observe`` and ``learn`` in :attr:`Trial.aux`.
    learn: ``learn(state, trial, verdict, ctx) -> Learned``, after the step rule's
      :class:`Verdict`. A trial that is not ``finite`` must leave the learned
      quantities as they are.
    observe: ``observe(state, trial, ctx) -> (state, trial)``, before the
      step rule: adds the gradient's finiteness to ``trial.finite``,
      and may learn or refine the trial (a lookahead, with its calls counted).
      Default: ``finite`` also requires a finite gradient.
    merit: ``merit(state, trial, ctx) -> (trial_value, value, step)``: what
      the step rule compares (default: f at both points and the step;
      HDM-HB's potential, with no step since it is not f).
  """

  init: Callable[[Any], Any]
  propose: Callable[[Any, Context], Any]
  learn: Callable[..., Learned]
  observe: Callable[..., tuple[Any, Trial]] = _finite_gradient
  merit: Callable[..., tuple[jax.Array, jax.Array, Optional[Any]]] = _values


class StepRule(NamedTuple):
  """The step size of each trial and the decision on it, from the trial's :class:`Evidence`.

  Attributes:
    init: ``init(dtype) -> state`` (also the state after a restart of the direction).
    step_size: ``step_size(state) -> factor`` (a 0-d array of the params' dtype).
    judge: ``judge(state, evidence) -> Verdict``: whether the trial is accepted, the
      next state and whether its pair may be kept.
    restart: ``restart(state, dtype) -> state``, the state after a restart of the direction
      (default ``None``: ``init(dtype)``), for a rule that carries what a restart leaves true.
  """

  init: Callable[[Any], Any]
  step_size: Callable[[Any], jax.Array]
  judge: Callable[[Any, Evidence], Verdict]
  restart: Optional[Callable[[Any, Any], Any]] = None


class IterationState(NamedTuple):
  """State of every method built by :func:`iteration`.

  Attributes:
    count: the iterations made (probes excluded).
    direction: the direction's state.
    rule: the step rule's state.
    value: f(x) at the iterate (+inf before the first update).
    grad: grad f(x) at the iterate.
    info: :class:`hdm_optax.HDMInfo` diagnostics.
  """

  count: jax.Array
  direction: Any
  rule: Any
  value: jax.Array
  grad: Any
  info: _info.HDMInfo

  # What a driver reads (hdm_optax.driver.protocol.OptimizerState): the step rule's verdict,
  # and the box and the preconditioner the direction holds, if any.

  def driver_verdict(self) -> jax.Array:
    """Whether the last trial became the iterate (``info.accepted``)."""
    return self.info.accepted

  def driver_box(self):
    """The direction's box (``trial_lbfgs(lower=, upper=)``), or ``None``."""
    held = getattr(self.direction, "driver_box", None)
    return None if held is None else held()

  def driver_preconditioner(self, free=None):
    """The direction's approximation of the inverse Hessian (its secant pairs), or ``None``."""
    held = getattr(self.direction, "driver_preconditioner", None)
    return None if held is None else held(free)


def _packed_context(packing: _blocks.Packing, ctx: Context) -> Context:
  """``ctx`` with x, u and grad f(x) packed, and an oracle that takes and gives blocks."""
  if not packing.on:
    return ctx
  grad = packing.pack(ctx.grad)
  # u that is grad f(x) stays grad f(x) packed, so the slots can tell (held_coordinates).
  updates = grad if _oracle.same_leaves(ctx.updates, ctx.grad) else packing.pack(ctx.updates)
  return ctx._replace(
    params=packing.pack(ctx.params),
    updates=updates,
    grad=grad,
    value_and_grad=packing.oracle(ctx.value_and_grad),
  )


def iteration(
  name: str,
  direction: Direction,
  *,
  step_rule: StepRule,
  pack_params: bool = True,
  float16: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""The one-call iteration with its two slots filled.

  Args:
    name: the method's name, for error messages.
    direction: proposes the trial step and learns from the trial.
    step_rule: the step size of each trial, the null step's decision and whether the
      trial's secant pair may be kept.
    pack_params: whether the slots see the vectors packed (:class:`Context`); ``False`` for a
      direction that packs what it needs itself and reads the params' layout otherwise.
    float16: whether the method runs on float16 params; ``False``: ``init`` refuses them
      (a method whose constants, such as AdaGrad's eps 1e-12, round to 0 or inf in float16).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> from hdm_optax.pieces import acceptance, shell, step_control
    >>> gd = shell.Direction(
    ...   init=lambda params: (),
    ...   propose=lambda state, ctx: (-0.01 * ctx.step_size * ctx.updates, None),
    ...   learn=lambda state, trial, verdict, ctx: shell.Learned(state, jnp.asarray(False)))
    >>> rule = step_control.damping(acceptance.strict_decrease())
    >>> opt = shell.iteration("gd", gd, step_rule=rule)
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> bool(hdm_optax.solve(opt, fun, jnp.ones(2), max_steps=2000).converged)
    True
  """

  parts = _Parts(name, direction, step_rule, pack_params, float16)
  update_fn = _stale.track_point(name)(functools.partial(_update, parts))
  return optax.GradientTransformationExtraArgs(functools.partial(_init, parts), update_fn)


class _Parts(NamedTuple):
  """:func:`iteration`'s arguments, as its update reads them."""

  name: str
  direction: Direction
  step_rule: StepRule
  pack_params: bool
  float16: bool


def _init(parts: _Parts, params) -> IterationState:
  dtype = _numerics.params_dtype(params)
  if not parts.float16:
    _numerics.refuse_float16(parts.name, dtype)
  return IterationState(
    **_info.oracle_fields(params, dtype),
    direction=parts.direction.init(params),
    rule=parts.step_rule.init(dtype),
  )


def _evidence(direction: Direction, direction_state, trial: Trial, ctx: Context) -> Evidence:
  """The merit at both points and the slopes along the step, once per update."""
  trial_value, value, step = direction.merit(direction_state, trial, ctx)
  grad, trial_grad = _blocks.pack(ctx.grad), _blocks.pack(trial.grad)
  slope = trial_slope = None
  if step is not None:
    step = _blocks.pack(step)
    slope, trial_slope = optax.tree.vdot(grad, step), optax.tree.vdot(trial_grad, step)
  return Evidence(
    value, trial_value, grad, trial_grad, step, slope, trial_slope, trial.finite, trial.probe
  )


def _update(parts: _Parts, updates, state, params, *, value=None, grad=None, value_fn=None, **_):
  direction, step_rule = parts.direction, parts.step_rule
  value, grad = _oracle.require_oracle(
    parts.name, value, grad, value_fn, updates, params=params, state_grad=state.grad
  )
  dtype = state.value.dtype
  ctx = Context(
    params=params,
    updates=grad if updates is None else updates,
    value=jnp.asarray(value, dtype),
    grad=grad,
    count=state.count,
    step_size=step_rule.step_size(state.rule),
    value_and_grad=lambda point: _oracle.value_and_grad(value_fn, point),
  )
  # The direction works on packed vectors; the state and the result keep the params' layout.
  packed = _blocks.Packing(params if parts.pack_params else None)
  user_ctx, ctx = ctx, _packed_context(packed, ctx)
  direction_in = packed.pack(state.direction)
  step, aux = direction.propose(direction_in, ctx)
  trial_value, trial_grad = ctx.value_and_grad(optax.tree.add(ctx.params, step))
  trial_value = jnp.asarray(trial_value, dtype)
  trial = Trial(
    step, trial_value, trial_grad, jnp.isfinite(trial_value), jnp.asarray(False), aux=aux
  )
  direction_state, trial = direction.observe(direction_in, trial, ctx)
  seen = _evidence(direction, direction_state, trial, ctx)
  verdict = step_rule.judge(state.rule, seen)
  learned = direction.learn(direction_state, trial, verdict, ctx)
  trial = trial._replace(step=packed.unpack(trial.step), grad=packed.unpack(trial.grad))
  new_state = _next_state(parts, state, packed, learned, verdict, trial, seen, user_ctx)
  return _numerics.keep_if(verdict.accepted, trial.step, optax.tree.zeros_like(params)), new_state


def _next_state(parts: _Parts, state, packed, learned, verdict, trial, seen, ctx):
  """The state after the update: the trial's value and gradient where it was accepted."""
  dtype, accepted, rule = state.value.dtype, verdict.accepted, parts.step_rule
  hypergrad_norm = learned.hypergrad_norm
  fresh = rule.init(dtype) if rule.restart is None else rule.restart(verdict.state, dtype)
  return IterationState(
    count=state.count + (~trial.probe).astype(jnp.int32),
    direction=packed.unpack_as(learned.state, state.direction),
    rule=_numerics.keep_if(learned.restart, fresh, verdict.state),
    value=jnp.where(accepted, trial.value, ctx.value).astype(dtype),
    grad=_numerics.keep_if(accepted, trial.grad, ctx.grad),
    info=_info.next_info(
      state.info,
      accepted=accepted,
      hypergrad_norm=jnp.zeros([], dtype) if hypergrad_norm is None else hypergrad_norm,
      calls=trial.calls,
      uphill=_uphill(seen, ctx.updates, accepted) if ctx.updates is not ctx.grad else False,
      finite=trial.finite,
    ),
  )
