r"""The iteration every one-call method runs: propose a trial, evaluate it once, keep or stay.

Every method of the package but HDM-AGD is one iteration with three slots
(Algorithm 1, line 3 and Algorithm 4, lines 2 and 9 of Chu et al.):

.. math::
  x^+ = x + \text{direction}(\text{state}, u;\ \text{scale}), \qquad
  x \leftarrow \begin{cases} x^+ & \text{if acceptance}(f(x^+), f(x),
    \nabla f(x^+), \nabla f(x), x^+ - x) \\ x & \text{otherwise (the null step),}
  \end{cases}

with u the incoming updates (grad f(x) when the method is first or alone in a
chain) and one value-and-gradient call at :math:`x^+`:

- a :class:`Direction` proposes the step from its state and u, and learns
  from the trial (its step, value and gradient, whether they are finite and
  whether the trial was accepted): HDM's learned P
  (:func:`hdm_optax.hdm`), HDM-HB's (P, B) (:func:`hdm_optax.hdm_hb`), the
  diagonal-P, scalar-beta family of Algorithm 4
  (:func:`hdm_optax.pieces.momentum.momentum_direction`), the L-BFGS operator of the trials'
  secant pairs (:func:`hdm_optax.trial_lbfgs`);
- an acceptance rule (:mod:`hdm_optax.pieces.acceptance`) decides the null step;
- a :class:`StepControl` scales the next proposal from what the trial
  revealed (:func:`hdm_optax.pieces.step_control.damping`: HDM's halving after a
  non-finite trial; :func:`hdm_optax.pieces.step_control.evidence_step`:
  trial_lbfgs's alpha from what each trial showed).

The shell does what every method shares: it requires the oracle, evaluates the
trial once, rejects a non-finite trial (the direction and the control see
``finite`` and keep their learned quantities), caches f and grad f at the
iterate, counts every oracle call in ``info`` and returns the step to the new
iterate (zero on a null step). HDM-AGD evaluates three points per update and
keeps its own update (:func:`hdm_optax.hdm_agd`).

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithms 1, 2 and 4.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax.pieces import acceptance as acceptance_lib

__all__ = (
  "Context",
  "Direction",
  "IterationState",
  "Learned",
  "StepControl",
  "Trial",
  "iteration",
)


class Context(NamedTuple):
  """What an update knows before its trial (read-only for the slots).

  Attributes:
    params: x, the current iterate.
    updates: u, the incoming updates.
    value: f(x).
    grad: grad f(x).
    count: the iterations made before this update.
    scale: the step control's factor for this trial.
    value_and_grad: ``value_and_grad(point) -> (value, grad)``, one oracle
      call (for a direction that refines its trial; count it in
      :attr:`Trial.calls`).
  """

  params: Any
  updates: Any
  value: jax.Array
  grad: Any
  count: jax.Array
  scale: jax.Array
  value_and_grad: Callable[[Any], tuple[jax.Array, Any]]


class Trial(NamedTuple):
  """One trial and what it revealed.

  Attributes:
    step: :math:`x^+ - x`, the point evaluated is ``params + step``.
    value: :math:`f(x^+)`.
    grad: :math:`\\nabla f(x^+)`.
    finite: the value and gradient are finite (the shell sets it from the
      value; :attr:`Direction.observe` adds the gradient's test).
    iteration: the update is an iteration (counted in ``count``, may be
      accepted); False on a probe that measures curvature and leaves x.
    calls: the value-and-gradient calls the update made.
    aux: what :attr:`Direction.propose` (then :attr:`Direction.observe`)
      hands on to the direction's later phases.
  """

  step: Any
  value: jax.Array
  grad: Any
  finite: jax.Array
  iteration: jax.Array
  calls: Any = 1
  aux: Any = None


class Learned(NamedTuple):
  """What :attr:`Direction.learn` returns.

  Attributes:
    state: the direction's new state.
    restart: the step control restarts (trial_lbfgs: the memory lost the
      curvature along the gradient).
    hypergrad_norm: the norm of the hypergradient the direction learned from
      (0 when it learns none), for ``info``.
    step_cap: the largest factor the step control may reach after this trial
      (trial_lbfgs in a box: no cap where the box bounds a step of negative
      curvature, :func:`hdm_optax.pieces.box.step_cap`).
  """

  state: Any
  restart: jax.Array
  hypergrad_norm: jax.Array
  step_cap: Any = 1


def _finite_gradient(state, trial: Trial, ctx: Context):
  del ctx
  return state, trial._replace(finite=trial.finite & _common.all_finite(trial.grad))


def _values(state, trial: Trial, ctx: Context):
  del state
  return trial.value, ctx.value, trial.step


class Direction(NamedTuple):
  """Where the trial goes, and what the direction learns from it.

  Attributes:
    init: ``init(params) -> state``.
    propose: ``propose(state, ctx) -> (step, aux)``: the tree :math:`x^+ - x`
      (the direction applies ``ctx.scale`` itself) and anything it hands on
      to ``observe`` and ``learn`` in :attr:`Trial.aux`.
    learn: ``learn(state, trial, accepted, ctx) -> Learned``, after the
      acceptance test. A trial that is not ``finite`` must leave the learned
      quantities as they are.
    observe: ``observe(state, trial, ctx) -> (state, trial)``, before the
      acceptance test: adds the gradient's finiteness to ``trial.finite``,
      and may learn or refine the trial (a lookahead, with its calls counted).
      Default: ``finite`` also requires a finite gradient.
    merit: ``merit(state, trial, ctx) -> (trial_value, value, step)``: what
      the acceptance rule compares (default: f at both points and the step;
      HDM-HB's potential, with no step since it is not f).
  """

  init: Callable[[Any], Any]
  propose: Callable[[Any, Context], Any]
  learn: Callable[..., Learned]
  observe: Callable[..., tuple[Any, Trial]] = _finite_gradient
  merit: Callable[..., tuple[jax.Array, jax.Array, Optional[Any]]] = _values


class StepControl(NamedTuple):
  """The factor of the next proposal, from what the trial revealed.

  Attributes:
    init: ``init(dtype) -> state``.
    scale: ``scale(state) -> factor`` (a 0-d array of the params' dtype).
    update: ``update(state, trial, *, accepted, learned, ctx) -> state``, with
      ``learned`` the direction's :class:`Learned` (its ``restart`` and ``step_cap``).
  """

  init: Callable[[Any], Any]
  scale: Callable[[Any], jax.Array]
  update: Callable[..., Any]


class IterationState(NamedTuple):
  """State of every method built by :func:`iteration`.

  Attributes:
    count: the iterations made (probes excluded).
    direction: the direction's state.
    control: the step control's state.
    value: f(x) at the iterate (+inf before the first update).
    grad: grad f(x) at the iterate.
    info: :class:`hdm_optax.HDMInfo` diagnostics.
  """

  count: jax.Array
  direction: Any
  control: Any
  value: jax.Array
  grad: Any
  info: _common.HDMInfo


def iteration(
  name: str,
  direction: Direction,
  *,
  acceptance: acceptance_lib.AcceptanceRule,
  step_control: StepControl,
) -> optax.GradientTransformationExtraArgs:
  r"""The one-call iteration with its three slots filled.

  Args:
    name: the method's name, for error messages.
    direction: proposes the trial step and learns from the trial.
    acceptance: the null step's rule.
    step_control: the factor of each proposal.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> from hdm_optax.pieces import acceptance, shell, step_control
    >>> gd = shell.Direction(
    ...   init=lambda params: (),
    ...   propose=lambda state, ctx: (-0.01 * ctx.scale * ctx.updates, None),
    ...   learn=lambda state, trial, accepted, ctx: shell.Learned(
    ...     state, jnp.asarray(False), jnp.zeros([])))
    >>> opt = shell.iteration("gd", gd, acceptance=acceptance.strict_decrease(),
    ...                           step_control=step_control.damping())
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> bool(hdm_optax.solve(opt, fun, jnp.ones(2), max_steps=2000).converged)
    True
  """

  def init_fn(params):
    dtype = _common.params_dtype(params)
    return IterationState(
      **_common.oracle_fields(params, dtype),
      direction=direction.init(params),
      control=step_control.init(dtype),
    )

  @_common.track_point(name)
  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      name, value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    dtype = state.value.dtype
    ctx = Context(
      params=params,
      updates=grad if updates is None else updates,
      value=jnp.asarray(value, dtype),
      grad=grad,
      count=state.count,
      scale=step_control.scale(state.control),
      value_and_grad=lambda point: _common.value_and_grad(value_fn, point),
    )
    step, aux = direction.propose(state.direction, ctx)
    trial_value, trial_grad = ctx.value_and_grad(optax.tree.add(params, step))
    trial_value = jnp.asarray(trial_value, dtype)
    trial = Trial(
      step, trial_value, trial_grad, jnp.isfinite(trial_value), jnp.asarray(True), aux=aux
    )
    direction_state, trial = direction.observe(state.direction, trial, ctx)
    trial_merit, merit, merit_step = direction.merit(direction_state, trial, ctx)
    accepted = (
      trial.iteration
      & trial.finite
      & acceptance.accept(trial_merit, merit, trial.grad, grad, step=merit_step)
    )
    learned = direction.learn(direction_state, trial, accepted, ctx)
    new_state = IterationState(
      count=state.count + trial.iteration.astype(jnp.int32),
      direction=learned.state,
      control=step_control.update(
        state.control, trial, accepted=accepted, learned=learned, ctx=ctx
      ),
      value=jnp.where(accepted, trial.value, ctx.value).astype(dtype),
      grad=_common.keep_if(accepted, trial.grad, grad),
      info=_common.next_info(
        state.info, accepted=accepted, hypergrad_norm=learned.hypergrad_norm, calls=trial.calls
      ),
    )
    return _common.keep_if(accepted, trial.step, optax.tree.zeros_like(params)), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
