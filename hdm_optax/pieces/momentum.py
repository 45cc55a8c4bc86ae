r"""Algorithm 4's direction, written once, for the diagonal-P, scalar-beta family.

:func:`hdm_optax.hdm_best`, :func:`hdm_optax.hdm_auto` and
:func:`hdm_optax.osgm_best` are the direction :func:`momentum_direction` in
:func:`hdm_optax.pieces.shell.iteration` with HDM's damping
(:func:`hdm_optax.pieces.step_control.damping`): they differ only in the pieces
passed to it and in the acceptance rule,

- ``learner``: how P learns from its hypergradient (:func:`additive`, the
  paper's AdaGrad on P; :func:`log_space`, the learner on log P);
- ``precond_rule``: eta_p and the bounds of P from L, the curvature estimate
  and the schedule's factor;
- ``null_action``: what a null step does to P (:func:`keep`, :func:`shrink`);
- ``probe``: how L_0 is measured when no L is given
  (:func:`hdm_optax.pieces.curvature.gradient_probe`,
  :func:`hdm_optax.pieces.curvature.random_probe`);
- ``lookahead``: an optional step from the trial point before the acceptance
  test (:func:`hdm_optax.pieces.backtracking.gated_lookahead`);
- ``denominator``, ``schedule``, ``curvature_estimate``
  (:mod:`hdm_optax.pieces.hypergradient`, :mod:`hdm_optax.pieces.decay`,
  :mod:`hdm_optax.pieces.curvature`);

Rules every configuration shares: the trial step acts on the incoming
``updates`` u (grad f(x) when the variant is first or alone in a chain); a
non-finite trial leaves P, beta and the learners as they are and the next
trial is damped by s (halved each time); once a damped trial is finite, P,
beta and the schedule's factor continue from sP, s beta and s
(:func:`hdm_optax.pieces.step_control.kept_scale`); probes leave x, P, beta and the learners
in place (the last one may set P_1 = 1/L_0); every update is counted in
``info``.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithm 4 and
  Appendix A; *Gradient Methods with Online Scaling Part II*, arXiv:2509.11007,
  2025.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _blocks
from hdm_optax import _numerics
from hdm_optax.pieces import candidates as candidates_lib
from hdm_optax.pieces import curvature as curvature_lib
from hdm_optax.pieces import decay as decay_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces import learners as learners_lib
from hdm_optax.pieces import step_control as step_control_lib

__all__ = (
  "MomentumState",
  "PrecondLearner",
  "additive",
  "keep",
  "log_space",
  "momentum_direction",
  "shrink",
)

_DIAG = candidates_lib.diagonal()
_SCALAR = candidates_lib.scalar()


class MomentumState(NamedTuple):
  """State of Algorithm 4's direction (symbols of Algorithm 4).

  Attributes:
    precond: P_k, the diagonal preconditioner, shaped like the params.
    momentum: beta_k, the scalar momentum.
    precond_learner_state: the state of P's learner (``sum_sq`` is U_k).
    momentum_learner_state: AdaGrad state of beta (``sum_sq`` is v_k).
    curvature: the curvature estimate (:class:`hdm_optax.pieces.curvature.CurvatureState`;
      ``curvature.l_hat`` is L_hat, 0 until it is formed).
    schedule: the decay of eta_p (:class:`hdm_optax.pieces.decay.DecayState`).
    prev_params: x^{k-1} (x^0 = x^1).
    lipschitz: L: the caller's, else 0 before the probe, the largest probe
      ratio while probing, then L_0; L_hat once it is formed.
    precond_lr: eta_p used by the last update.
    num_probes: probes made so far.
  """

  precond: Any
  momentum: jax.Array
  precond_learner_state: Any
  momentum_learner_state: learners_lib.AdagradState
  curvature: curvature_lib.CurvatureState
  schedule: decay_lib.DecayState
  prev_params: Any
  lipschitz: jax.Array
  precond_lr: jax.Array
  num_probes: jax.Array


class PrecondLearner(NamedTuple):
  """How P learns from its hypergradient G_P.

  Attributes:
    init: ``init(P) -> state``.
    learn: ``learn(P, G, state, lr, lower, upper) -> (P, state)``: one round,
      P projected onto [lower, upper] (``None``: unbounded).
  """

  init: Callable[[Any], Any]
  learn: Callable[..., tuple[Any, Any]]


def additive(learner: learners_lib.OnlineLearner) -> PrecondLearner:
  """The paper's learner on P itself (Algorithm 4, lines 5-7; :func:`hdm_optax.pieces.learners.learn`).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import learners, momentum
    >>> rule = momentum.additive(learners.ogd())
    >>> p, _ = rule.learn(jnp.array([1.0]), jnp.array([-2.0]), rule.init(None), 0.5, 0.0, None)
    >>> float(p[0])
    2.0
  """

  def learn(p, g, state, lr, lower, upper):
    # G is finite by construction and |G| / sqrt(U) <= 1: no finiteness check.
    return learners_lib.learn(_DIAG, learner, p, g, state, lr, lower, upper, check_finite=False)

  return PrecondLearner(init=learner.init, learn=learn)


def log_space(learner: learners_lib.OnlineLearner) -> PrecondLearner:
  """The learner on log P (:func:`hdm_optax.pieces.learners.learn_log`): P moves by factors.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import learners, momentum
    >>> rule = momentum.log_space(learners.ogd())
    >>> p, _ = rule.learn(jnp.array([1.0]), jnp.array([0.0]), rule.init(None), 0.5, 0.0, None)
    >>> float(p[0])
    1.0
  """

  def learn(p, g, state, lr, lower, upper):
    return learners_lib.learn_log(_DIAG, learner, p, g, state, lr, lower, upper)

  return PrecondLearner(init=learner.init, learn=learn)


def keep() -> Callable[[Any, jax.Array], Any]:
  """A null step leaves P as its learner made it (Algorithm 4).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import momentum
    >>> float(momentum.keep()(jnp.asarray(0.5), jnp.asarray(False)))
    0.5
  """
  return lambda precond, accepted: precond


def shrink(factor: Any, floor: Any) -> Callable[[Any, jax.Array], Any]:
  """A null step (or a non-finite trial) multiplies P by ``factor``; P >= ``floor`` always.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import momentum
    >>> [float(v) for v in momentum.shrink(0.5, 0.3)(jnp.array([1.0, 0.4]), jnp.asarray(False))]
    [0.5, 0.3]
  """

  def action(precond, accepted):
    dtype = jax.tree.leaves(precond)[0].dtype
    shrunk = optax.tree.scale(_numerics.cast(factor, dtype), precond)
    return _DIAG.project(
      _numerics.keep_if(accepted, precond, shrunk), _numerics.cast(floor, dtype), None
    )

  return action


class _Observed(NamedTuple):
  """What ``observe`` hands to ``learn`` (in :attr:`hdm_optax.pieces.shell.Trial.aux`)."""

  start: Any  # P after a probe: P_1 = 1/L_0 after the last one, else P as it was
  lipschitz: jax.Array  # L of this update
  grad_change: jax.Array  # ||grad f(x+) - grad f(x)|| of the (looked-ahead) trial
  hypergrad_norm: jax.Array


class _Momentum(NamedTuple):
  """:func:`momentum_direction`'s arguments, as its parts read them."""

  learner: PrecondLearner
  precond_rule: Callable[..., tuple[Any, Any, Any]]
  momentum_lr: Callable[[jax.Array], jax.Array]
  denominator: hypergradient_lib.Denominator
  curvature_estimate: curvature_lib.CurvatureEstimate
  schedule: decay_lib.Schedule
  null_action: Callable[[Any, jax.Array], Any]
  probe: Optional[curvature_lib.Probe]
  precond_from_probe: bool
  lookahead: Optional[Callable[..., Any]]
  lipschitz: Optional[Any]
  init_precond: Any
  init_momentum: Any
  momentum_learner: Any
  beta_lo: Any
  beta_hi: Any


def momentum_direction(
  *,
  learner: PrecondLearner,
  precond_rule: Callable[..., tuple[Any, Any, Any]],
  momentum_lr: Callable[[jax.Array], jax.Array],
  denominator: hypergradient_lib.Denominator,
  curvature_estimate: curvature_lib.CurvatureEstimate,
  schedule: Optional[decay_lib.Schedule] = None,
  null_action: Optional[Callable[[Any, jax.Array], Any]] = None,
  probe: Optional[curvature_lib.Probe] = None,
  precond_from_probe: bool = False,
  lookahead: Optional[Callable[..., Any]] = None,
  lipschitz: Optional[Any] = None,
  init_precond: Any = 0.0,
  init_momentum: Any = 0.95,
  momentum_bounds: tuple[Any, Any] = (0.0, 0.9995),
  adagrad_eps: float = 1e-12,
) -> shell.Direction:
  r"""Algorithm 4's direction (diagonal P, scalar beta) with its variation points passed in.

  .. math::
    x^+ &= x - s\,H u + s\,\beta (x - x^-), \qquad
    G_P = -\frac{\nabla f(x^+) \circ u}{den}, \qquad
    G_\beta = \frac{\langle \nabla f(x^+), x - x^-\rangle}{den}, \\
    P &\leftarrow \text{learner}(sP, G_P, \eta_p) \text{ on }
      [\text{lower}, \text{upper}], \qquad
    \beta \leftarrow \Pi[s\beta - \eta_\beta v^{-1/2} G_\beta], \\
    x &\leftarrow x^+ \text{ if accepted, else } x, \quad P \leftarrow
      \text{null\_action}(P), \qquad x^- \leftarrow x,

  with u the incoming updates, H u = P u, s the trial damping
  (:func:`hdm_optax.pieces.step_control.damping`) and den the ``denominator``. Until L is known the
  updates are the ``probe``'s (one oracle call each; x stays).

  Args:
    learner: P's learner (:func:`additive`, :func:`log_space`).
    precond_rule: ``rule(lip, curvature_state, factor) -> (eta_p, lower,
      upper)``: eta_p and P's bounds from L, the curvature estimate's state
      and the schedule's factor.
    momentum_lr: ``momentum_lr(lip) -> eta_beta``.
    denominator: the feedback's denominator.
    curvature_estimate: the L_hat estimator; its learner state restarts when
      L_hat is formed.
    schedule: the schedule of eta_p's factor (``None``: constant).
    null_action: what a null step does to P (``None``: :func:`keep`).
    probe: how L_0 is measured (``None``: ``lipschitz`` must be given).
    precond_from_probe: the last probe sets P_1 = 1/L_0.
    lookahead: ``lookahead(vg, trial, value, grad, direction, *, finite,
      estimating, grad_norm) -> LookaheadResult`` or ``None``.
    lipschitz: the caller's L (``None``: probed).
    init_precond: P_1 (when the probe does not set it).
    init_momentum: beta_1.
    momentum_bounds: the interval of beta.
    adagrad_eps: added to sqrt(v) in beta's AdaGrad.

  Returns:
    A :class:`hdm_optax.pieces.shell.Direction` (its state a :class:`MomentumState`);
    in :func:`hdm_optax.pieces.shell.iteration` with
    :func:`hdm_optax.pieces.step_control.damping` it is Algorithm 4.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> from hdm_optax.pieces import acceptance, curvature, hypergradient, learners, shell
    >>> from hdm_optax.pieces import momentum, step_control
    >>> direction = momentum.momentum_direction(
    ...   learner=momentum.additive(learners.adagrad()),
    ...   precond_rule=lambda lip, curv, factor: (10 / lip, 0.0, None),
    ...   momentum_lr=lambda lip: jnp.ones([], lip.dtype),
    ...   denominator=hypergradient.curvature_tau(),
    ...   curvature_estimate=curvature.running_mean(),
    ...   lipschitz=200.0)
    >>> rule = step_control.damping(acceptance.strict_decrease())
    >>> opt = shell.iteration("example", direction, step_rule=rule)
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> bool(hdm_optax.solve(opt, fun, jnp.ones(3), max_steps=500).converged)
    True

  References:
    Chu, Gao, Ye, Udell, arXiv:2502.11229, 2025: Algorithm 4 and Appendix A.
  """
  if (probe is None) == (lipschitz is None):
    raise TypeError("momentum_direction: pass exactly one of lipschitz= and probe=.")
  c = _Momentum(
    learner=learner,
    precond_rule=precond_rule,
    momentum_lr=momentum_lr,
    denominator=denominator,
    curvature_estimate=curvature_estimate,
    schedule=decay_lib.constant() if schedule is None else schedule,
    null_action=keep() if null_action is None else null_action,
    probe=probe,
    precond_from_probe=precond_from_probe,
    lookahead=lookahead,
    lipschitz=lipschitz,
    init_precond=init_precond,
    init_momentum=init_momentum,
    momentum_learner=learners_lib.adagrad(adagrad_eps),
    beta_lo=momentum_bounds[0],
    beta_hi=momentum_bounds[1],
  )
  part = lambda f: functools.partial(f, c)
  return shell.Direction(
    init=part(_init), propose=part(_propose), learn=part(_learn), observe=part(_observe)
  )


def _init(c: _Momentum, params):
  dtype = _numerics.params_dtype(params)
  lip = jnp.zeros([], dtype) if c.lipschitz is None else _numerics.cast(c.lipschitz, dtype)
  precond = _DIAG.init(params, c.init_precond)
  momentum = _SCALAR.project(_SCALAR.init(params, c.init_momentum), c.beta_lo, c.beta_hi)
  curvature = c.curvature_estimate.init(dtype)
  sched = c.schedule.init(dtype)
  eta_p, _, _ = c.precond_rule(jnp.where(lip > 0, lip, 1), curvature, sched.factor)
  return MomentumState(
    precond=precond,
    momentum=momentum,
    precond_learner_state=c.learner.init(precond),
    momentum_learner_state=c.momentum_learner.init(momentum),
    curvature=curvature,
    schedule=sched,
    prev_params=_numerics.copy_tree(params),
    lipschitz=lip,
    precond_lr=jnp.asarray(eta_p, dtype),
    num_probes=jnp.zeros([], jnp.int32),
  )


def _probing(c: _Momentum, state):
  return jnp.asarray(False) if c.probe is None else state.num_probes < c.probe.num


def _propose(c: _Momentum, state, ctx):
  diff = optax.tree.sub(ctx.params, state.prev_params)  # x - x^-
  # Algorithm 4, line 2: x^+ = x - P u + beta (x - x^-), damped by s.
  direction, s_diff = (
    optax.tree.scale(ctx.step_size, ctx.updates),
    optax.tree.scale(ctx.step_size, diff),
  )
  step = candidates_lib.trial_step(_DIAG, state.precond, direction, _SCALAR, state.momentum, s_diff)
  if c.probe is None:
    return step, None
  offset, delta = c.probe.offset(state.num_probes, ctx.params, ctx.grad, _probing(c, state))
  return optax.tree.where(_probing(c, state), offset, step), delta


def _lipschitz_now(c: _Momentum, state, grad_change, delta):
  """L of this update (a probe's ratio enters it) and whether the probe was the last."""
  dtype = state.lipschitz.dtype
  if c.lipschitz is None:
    lip = state.lipschitz
  else:
    l_hat = state.curvature.l_hat
    lip = jnp.where(l_hat > 0, l_hat, _numerics.cast(c.lipschitz, dtype)).astype(dtype)
  if c.probe is None:
    return lip, jnp.asarray(False)
  running = jnp.where(_probing(c, state), jnp.maximum(lip, grad_change / delta), lip).astype(dtype)
  last_probe = _probing(c, state) & (state.num_probes == c.probe.num - 1)
  return jnp.where(last_probe, c.probe.finish(running), running).astype(dtype), last_probe


def _learn_online(c: _Momentum, state, trial, ctx, lip, live):
  """Lines 3-8: the hypergradients at the damped sP, s beta and the learners' round.

  On a probe or a non-finite trial 1/den is 0, so G = 0, and the learners keep
  their state. Returns the state with P, beta, the learners, the schedule and
  eta_p updated, and the hypergradient's norm.
  """
  diff = optax.tree.sub(ctx.params, state.prev_params)
  grad_sq = _blocks.vdot(ctx.grad, ctx.grad)
  den = c.denominator(grad_sq, _blocks.vdot(diff, diff), state.curvature.l_hat)
  inv_den = hypergradient_lib.reciprocal(den, live)
  grad_p, grad_b = hypergradient_lib.momentum_hypergradients(
    _DIAG, _SCALAR, trial.grad, ctx.updates, diff, inv_den, live
  )
  count = ctx.count + (~_probing(c, state)).astype(jnp.int32)
  lr_schedule = c.schedule.update(
    state.schedule, count, state.curvature.active & ~_probing(c, state)
  )
  kept = step_control_lib.kept_scale(ctx.step_size, live)
  lr_schedule = lr_schedule._replace(factor=lr_schedule.factor * kept)
  eta_p, lower, upper = c.precond_rule(lip, state.curvature, lr_schedule.factor)
  precond, precond_learner_state = c.learner.learn(
    optax.tree.scale(kept, state.precond),
    grad_p,
    state.precond_learner_state,
    eta_p,
    lower,
    upper,
  )
  momentum, momentum_learner_state = learners_lib.learn(
    _SCALAR,
    c.momentum_learner,
    kept * state.momentum,
    grad_b,
    state.momentum_learner_state,
    c.momentum_lr(lip),
    c.beta_lo,
    c.beta_hi,
    check_finite=False,
  )
  momentum, precond_learner_state, momentum_learner_state = _numerics.keep_if(
    live,
    (momentum, precond_learner_state, momentum_learner_state),
    (state.momentum, state.precond_learner_state, state.momentum_learner_state),
  )
  learned = state._replace(
    precond=precond,
    momentum=momentum,
    precond_learner_state=precond_learner_state,
    momentum_learner_state=momentum_learner_state,
    schedule=lr_schedule,
    precond_lr=jnp.asarray(eta_p, ctx.value.dtype),
  )
  return learned, _numerics.sqrt(_blocks.vdot(grad_p, grad_p) + grad_b**2)


def _observe(c: _Momentum, state, trial, ctx):
  grad_change = _numerics.norm(optax.tree.sub(trial.grad, ctx.grad))
  lip, last_probe = _lipschitz_now(c, state, grad_change, trial.aux)
  finite = trial.finite & jnp.isfinite(grad_change)
  live = finite & ~_probing(c, state)
  learned, hypergrad_norm = _learn_online(c, state, trial, ctx, lip, live)
  start = state.precond
  if c.precond_from_probe:
    start = _numerics.keep_if(last_probe, optax.tree.full_like(state.precond, 1 / lip), start)
  observed = _Observed(start, lip, grad_change, hypergrad_norm)
  trial = trial._replace(finite=finite, probe=_probing(c, state), aux=observed)
  if c.lookahead is None:
    return learned, trial
  look = c.lookahead(
    ctx.value_and_grad,
    optax.tree.add(ctx.params, trial.step),
    trial.value,
    trial.grad,
    _DIAG.apply(learned.precond, trial.grad),
    finite=live,
    estimating=state.curvature.active,
    grad_norm=_numerics.sqrt(_blocks.vdot(ctx.grad, ctx.grad)),
  )
  observed = observed._replace(grad_change=_numerics.norm(optax.tree.sub(look.grad, ctx.grad)))
  trial = trial._replace(
    step=optax.tree.sub(look.params, ctx.params),
    value=look.value,
    grad=look.grad,
    calls=1 + look.calls,
    aux=observed,
  )
  return learned, trial


def _learn(c: _Momentum, state, trial, verdict, ctx):
  accepted, observed = verdict.accepted, trial.aux
  # Line 9: the null step's action on P; a probe leaves P (the last one sets P_1 = 1/L_0).
  precond = c.null_action(state.precond, accepted)
  precond = _numerics.keep_if(_probing(c, state), observed.start, precond)
  curv = c.curvature_estimate.record(
    state.curvature,
    accepted=accepted,
    step_norm=_numerics.norm(trial.step),
    grad_change=observed.grad_change,
    frozen=_probing(c, state),
  )
  curv, fired = c.curvature_estimate.fire(curv)
  learned = state._replace(
    precond=precond,
    precond_learner_state=_numerics.keep_if(
      fired, c.learner.init(precond), state.precond_learner_state
    ),
    curvature=curv,
    prev_params=ctx.params,
    lipschitz=jnp.where(fired, curv.l_hat, observed.lipschitz).astype(state.lipschitz.dtype),
    num_probes=state.num_probes + _probing(c, state).astype(jnp.int32),
  )
  return shell.Learned(learned, jnp.asarray(False), observed.hypergrad_norm)
