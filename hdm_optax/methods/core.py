r"""Algorithm 4's iteration, written once, for the diagonal-P, scalar-beta family.

:func:`hdm_optax.hdm_best`, :func:`hdm_optax.hdm_auto` and
:func:`hdm_optax.osgm_best` are configurations of :func:`momentum_hdm`: they
differ only in the pieces passed to it,

- ``learner``: how P learns from its hypergradient (:func:`additive`, the
  paper's AdaGrad on P; :func:`log_space`, the learner on log P);
- ``precond_rule``: eta_p and the bounds of P from L, the curvature estimate
  and the schedule's factor;
- ``null_action``: what a null step does to P (:func:`keep`, :func:`shrink`);
- ``probe``: how L_0 is measured when no L is given
  (:func:`hdm_optax.curvature.gradient_probe`,
  :func:`hdm_optax.curvature.random_probe`);
- ``lookahead``: an optional step from the trial point before the acceptance
  test (:func:`hdm_optax.lookahead.gated_lookahead`);
- ``acceptance``, ``denominator``, ``schedule``, ``curvature_estimate``
  (:mod:`hdm_optax.acceptance`, :mod:`hdm_optax.hypergradient`,
  :mod:`hdm_optax.schedules`, :mod:`hdm_optax.curvature`);
- ``operator``: the preconditioner operator that turns the incoming updates
  into the step (:func:`diagonal_operator`, P u).

Rules every configuration shares: the trial step acts on the incoming
``updates`` u (grad f(x) when the variant is first or alone in a chain); a
non-finite trial leaves P, beta and the learners as they are and the next
trial is damped by s (halved each time); once a damped trial is finite, P,
beta and the schedule's factor continue from sP, s beta and s
(:func:`hdm_optax.trial.kept_scale`); probes leave x, P, beta and the learners
in place (the last one may set P_1 = 1/L_0); every update is counted in
``info``.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithm 4 and
  Appendix A; *Gradient Methods with Online Scaling Part II*, arXiv:2509.11007,
  2025.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax.methods import acceptance as acceptance_lib
from hdm_optax.methods import candidates as candidates_lib
from hdm_optax.methods import curvature as curvature_lib
from hdm_optax.methods import hypergradient as hypergradient_lib
from hdm_optax.methods import learners as learners_lib
from hdm_optax.methods import schedules as schedules_lib
from hdm_optax.methods import trial as trial_lib

__all__ = (
  "MomentumHDMState",
  "Operator",
  "PrecondLearner",
  "additive",
  "diagonal_operator",
  "keep",
  "log_space",
  "momentum_hdm",
  "shrink",
)

_DIAG = candidates_lib.diagonal()
_SCALAR = candidates_lib.scalar()


class MomentumHDMState(NamedTuple):
  """State of every configuration of :func:`momentum_hdm` (symbols of Algorithm 4).

  Attributes:
    count: k - 1, the iterations taken (probes excluded).
    precond: P_k, the diagonal preconditioner, shaped like the params.
    momentum: beta_k, the scalar momentum.
    precond_learner_state: the state of P's learner (``sum_sq`` is U_k).
    momentum_learner_state: AdaGrad state of beta (``sum_sq`` is v_k).
    operator: the preconditioner operator's state (empty for the diagonal).
    curvature: the curvature estimate (:class:`hdm_optax.curvature.CurvatureState`;
      ``curvature.l_hat`` is L_hat, 0 until it is formed).
    schedule: the schedule of eta_p (:class:`hdm_optax.schedules.DecayState`).
    value: f(x^k) (+inf before the first update).
    grad: grad f(x^k).
    prev_params: x^{k-1} (x^0 = x^1).
    lipschitz: L: the caller's, else 0 before the probe, the largest probe
      ratio while probing, then L_0; L_hat once it is formed.
    precond_lr: eta_p used by the last update.
    num_probes: probes made so far.
    trial_scale: s, the damping of the trial step after non-finite trials.
    info: :class:`hdm_optax.HDMInfo` diagnostics.
  """

  count: jax.Array
  precond: Any
  momentum: jax.Array
  precond_learner_state: Any
  momentum_learner_state: learners_lib.AdagradState
  operator: Any
  curvature: curvature_lib.CurvatureState
  schedule: schedules_lib.DecayState
  value: jax.Array
  grad: Any
  prev_params: Any
  lipschitz: jax.Array
  precond_lr: jax.Array
  num_probes: jax.Array
  trial_scale: jax.Array
  info: _common.HDMInfo


class PrecondLearner(NamedTuple):
  """How P learns from its hypergradient G_P.

  Attributes:
    init: ``init(P) -> state``.
    learn: ``learn(P, G, state, lr, lower, upper) -> (P, state)``: one round,
      P projected onto [lower, upper] (``None``: unbounded).
  """

  init: Callable[[Any], Any]
  learn: Callable[..., tuple[Any, Any]]


class Operator(NamedTuple):
  r"""The preconditioner operator: turns a direction u into the step's :math:`H u`.

  The diagonal P is learned by the core whatever the operator; the operator
  decides how P (and anything it keeps itself) acts on a direction. The
  hypergradient of P is the diagonal one, :math:`-\nabla f(x^+) \circ u /
  den`.

  Attributes:
    init: ``init(params) -> state``.
    apply: ``apply(precond, state, direction) -> tree``: :math:`H u`, shaped
      like the params (the trial step is :math:`-s H u + s \beta (x - x^-)`;
      the lookahead goes along :math:`H \nabla f(x^+)`).
    update: ``update(state, *, step, grad_change, accepted) -> state``: after
      each iteration, with the tree ``step`` = x^+ - x and ``grad_change`` =
      grad f(x^+) - grad f(x) (e.g. a secant pair, kept where ``accepted``).
  """

  init: Callable[[Any], Any]
  apply: Callable[[Any, Any, Any], Any]
  update: Callable[..., Any]


def diagonal_operator() -> Operator:
  """:math:`H u = P \\circ u`, with no state of its own (Algorithm 4).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import core
    >>> op = core.diagonal_operator()
    >>> [float(v) for v in op.apply(jnp.array([0.5, 2.0]), op.init(None), jnp.array([2.0, 1.0]))]
    [1.0, 2.0]
  """
  return Operator(
    init=lambda params: optax.EmptyState(),
    apply=lambda precond, state, direction: _DIAG.apply(precond, direction),
    update=lambda state, **kwargs: state,
  )


def additive(learner: learners_lib.OnlineLearner) -> PrecondLearner:
  """The paper's learner on P itself (Algorithm 4, lines 5-7; :func:`hdm_optax.learners.learn`)."""

  def learn(p, g, state, lr, lower, upper):
    # G is finite by construction and |G| / sqrt(U) <= 1: no finiteness check.
    return learners_lib.learn(_DIAG, learner, p, g, state, lr, lower, upper, check_finite=False)

  return PrecondLearner(init=learner.init, learn=learn)


def log_space(learner: learners_lib.OnlineLearner) -> PrecondLearner:
  """The learner on log P (:func:`hdm_optax.learners.learn_log`): P moves by factors."""

  def learn(p, g, state, lr, lower, upper):
    return learners_lib.learn_log(_DIAG, learner, p, g, state, lr, lower, upper)

  return PrecondLearner(init=learner.init, learn=learn)


def keep() -> Callable[[Any, jax.Array], Any]:
  """A null step leaves P as its learner made it (Algorithm 4)."""
  return lambda precond, accepted: precond


def shrink(factor: Any, floor: Any) -> Callable[[Any, jax.Array], Any]:
  """A null step (or a non-finite trial) multiplies P by ``factor``; P >= ``floor`` always."""

  def action(precond, accepted):
    dtype = jax.tree.leaves(precond)[0].dtype
    shrunk = optax.tree.scale(_common.cast(factor, dtype), precond)
    return _DIAG.project(
      _common.keep_if(accepted, precond, shrunk), _common.cast(floor, dtype), None
    )

  return action


def momentum_hdm(
  name: str,
  *,
  learner: PrecondLearner,
  precond_rule: Callable[..., tuple[Any, Any, Any]],
  momentum_lr: Callable[[jax.Array], jax.Array],
  acceptance: acceptance_lib.AcceptanceRule,
  denominator: hypergradient_lib.Denominator,
  curvature_estimate: curvature_lib.CurvatureEstimate,
  schedule: Optional[schedules_lib.Schedule] = None,
  null_action: Optional[Callable[[Any, jax.Array], Any]] = None,
  probe: Optional[curvature_lib.Probe] = None,
  precond_from_probe: bool = False,
  lookahead: Optional[Callable[..., Any]] = None,
  operator: Optional[Operator] = None,
  lipschitz: Optional[Any] = None,
  init_precond: Any = 0.0,
  init_momentum: Any = 0.95,
  momentum_bounds: tuple[Any, Any] = (0.0, 0.9995),
  adagrad_eps: float = 1e-12,
) -> optax.GradientTransformationExtraArgs:
  r"""Algorithm 4 (diagonal P, scalar beta) with its variation points passed in.

  .. math::
    x^+ &= x - s\,H u + s\,\beta (x - x^-), \qquad
    G_P = -\frac{\nabla f(x^+) \circ u}{den}, \qquad
    G_\beta = \frac{\langle \nabla f(x^+), x - x^-\rangle}{den}, \\
    P &\leftarrow \text{learner}(sP, G_P, \eta_p) \text{ on }
      [\text{lower}, \text{upper}], \qquad
    \beta \leftarrow \Pi[s\beta - \eta_\beta v^{-1/2} G_\beta], \\
    x &\leftarrow x^+ \text{ if accepted, else } x, \quad P \leftarrow
      \text{null\_action}(P), \qquad x^- \leftarrow x,

  with u the incoming updates, H the ``operator`` (P u for the diagonal), s
  the trial damping and den the ``denominator``. Until L is known the
  updates are the ``probe``'s (one oracle call each; x stays).

  Args:
    name: the variant's name, for error messages.
    learner: P's learner (:func:`additive`, :func:`log_space`).
    precond_rule: ``rule(lip, curvature_state, factor) -> (eta_p, lower,
      upper)``: eta_p and P's bounds from L, the curvature estimate's state
      and the schedule's factor.
    momentum_lr: ``momentum_lr(lip) -> eta_beta``.
    acceptance: the null-step rule.
    denominator: the feedback's denominator.
    curvature_estimate: the L_hat estimator; its learner state restarts when
      L_hat is formed.
    schedule: the schedule of eta_p's factor (``None``: constant).
    null_action: what a null step does to P (``None``: :func:`keep`).
    probe: how L_0 is measured (``None``: ``lipschitz`` must be given).
    precond_from_probe: the last probe sets P_1 = 1/L_0.
    lookahead: ``lookahead(vg, trial, value, grad, direction, *, finite,
      estimating, grad_norm) -> LookaheadResult`` or ``None``.
    operator: the preconditioner operator (``None``: :func:`diagonal_operator`).
    lipschitz: the caller's L (``None``: probed).
    init_precond: P_1 (when the probe does not set it).
    init_momentum: beta_1.
    momentum_bounds: the interval of beta.
    adagrad_eps: added to sqrt(v) in beta's AdaGrad.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> from hdm_optax import acceptance, core, curvature, hypergradient, learners
    >>> opt = core.momentum_hdm(
    ...   "example",
    ...   learner=core.additive(learners.adagrad()),
    ...   precond_rule=lambda lip, curv, factor: (10 / lip, 0.0, None),
    ...   momentum_lr=lambda lip: jnp.ones([], lip.dtype),
    ...   acceptance=acceptance.strict_decrease(),
    ...   denominator=hypergradient.curvature_tau(),
    ...   curvature_estimate=curvature.running_mean(),
    ...   lipschitz=200.0)
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> bool(hdm_optax.solve(opt, fun, jnp.ones(3), max_steps=500).converged)
    True

  References:
    Chu, Gao, Ye, Udell, arXiv:2502.11229, 2025: Algorithm 4 and Appendix A.
  """
  if (probe is None) == (lipschitz is None):
    raise TypeError(f"{name}: pass exactly one of lipschitz= and probe=.")
  schedule = schedules_lib.constant() if schedule is None else schedule
  null_action = keep() if null_action is None else null_action
  operator = diagonal_operator() if operator is None else operator
  momentum_learner = learners_lib.adagrad(adagrad_eps)
  beta_lo, beta_hi = momentum_bounds

  def init_fn(params):
    dtype = _common.params_dtype(params)
    lip = jnp.zeros([], dtype) if lipschitz is None else _common.cast(lipschitz, dtype)
    precond = _DIAG.init(params, init_precond)
    momentum = _SCALAR.project(_SCALAR.init(params, init_momentum), beta_lo, beta_hi)
    curvature = curvature_estimate.init(dtype)
    sched = schedule.init(dtype)
    eta_p, _, _ = precond_rule(jnp.where(lip > 0, lip, 1), curvature, sched.factor)
    return MomentumHDMState(
      **_common.oracle_fields(params, dtype),
      prev_params=_common.copy_tree(params),
      trial_scale=jnp.ones([], dtype),
      precond=precond,
      momentum=momentum,
      precond_learner_state=learner.init(precond),
      momentum_learner_state=momentum_learner.init(momentum),
      operator=operator.init(params),
      curvature=curvature,
      schedule=sched,
      lipschitz=lip,
      precond_lr=jnp.asarray(eta_p, dtype),
      num_probes=jnp.zeros([], jnp.int32),
    )

  def known_lipschitz(state, dtype):
    """L before this update: the state's, or L_hat once formed, else the caller's."""
    if lipschitz is None:
      return state.lipschitz
    l_hat = state.curvature.l_hat
    return jnp.where(l_hat > 0, l_hat, _common.cast(lipschitz, dtype)).astype(dtype)

  def iterate(updates, state, params, value, grad, value_fn, probing, offset, delta):
    """One update: a probe (where ``probing``) or an iteration of Algorithm 4."""
    dtype = state.value.dtype
    vg = lambda p: _common.value_and_grad(value_fn, p)
    diff = optax.tree.sub(params, state.prev_params)  # x - x^-
    s = state.trial_scale
    # Algorithm 4, line 2: x^+ = x - P u + beta (x - x^-), damped by s.
    direction, s_diff = optax.tree.scale(s, updates), optax.tree.scale(s, diff)
    step = optax.tree.add(
      optax.tree.scale(-1.0, operator.apply(state.precond, state.operator, direction)),
      _SCALAR.apply(state.momentum, s_diff),
    )
    point = optax.tree.add(
      params, step if offset is None else optax.tree.where(probing, offset, step)
    )
    trial_value, trial_grad = vg(point)
    grad_change = optax.tree.norm(optax.tree.sub(trial_grad, grad))
    lip = known_lipschitz(state, dtype)
    last_probe = jnp.asarray(False)
    if offset is not None:
      running = jnp.where(probing, jnp.maximum(lip, grad_change / delta), lip).astype(dtype)
      last_probe = probing & (state.num_probes == probe.num - 1)
      lip = jnp.where(last_probe, probe.finish(running), running).astype(dtype)
    finite = jnp.isfinite(trial_value) & jnp.isfinite(grad_change)
    live = finite & ~probing
    # Lines 3-4: the hypergradients, at the damped sP, s beta of this trial;
    # 1/den is 0 on a probe or a non-finite trial, so G = 0.
    grad_sq = optax.tree.vdot(grad, grad)
    den = denominator(grad_sq, optax.tree.vdot(diff, diff), state.curvature.l_hat)
    inv_den = hypergradient_lib.reciprocal(den, live)
    grad_p, grad_b = hypergradient_lib.momentum_hypergradients(
      _DIAG, _SCALAR, trial_grad, updates, diff, inv_den, live
    )
    count = state.count + (~probing).astype(jnp.int32)
    lr_schedule = schedule.update(state.schedule, count, state.curvature.active & ~probing)
    kept = trial_lib.kept_scale(s, live)
    lr_schedule = lr_schedule._replace(factor=lr_schedule.factor * kept)
    eta_p, lower, upper = precond_rule(lip, state.curvature, lr_schedule.factor)
    # Lines 5-8: the learners, from sP and s beta; kept on a probe or a non-finite trial.
    precond, precond_learner_state = learner.learn(
      optax.tree.scale(kept, state.precond),
      grad_p,
      state.precond_learner_state,
      eta_p,
      lower,
      upper,
    )
    momentum, momentum_learner_state = learners_lib.learn(
      _SCALAR,
      momentum_learner,
      kept * state.momentum,
      grad_b,
      state.momentum_learner_state,
      momentum_lr(lip),
      beta_lo,
      beta_hi,
      check_finite=False,
    )
    momentum, precond_learner_state, momentum_learner_state = _common.keep_if(
      live,
      (momentum, precond_learner_state, momentum_learner_state),
      (state.momentum, state.precond_learner_state, state.momentum_learner_state),
    )
    new_step, new_change, calls = step, grad_change, 1
    if lookahead is not None:
      look = lookahead(
        vg,
        point,
        trial_value,
        trial_grad,
        operator.apply(precond, state.operator, trial_grad),
        finite=live,
        estimating=state.curvature.active,
        grad_norm=jnp.sqrt(grad_sq),
      )
      trial_value, trial_grad, calls = look.value, look.grad, 1 + look.calls
      new_step = optax.tree.sub(look.params, params)
      new_change = optax.tree.norm(optax.tree.sub(look.grad, grad))
    # Line 9: the null step on f.
    accepted = live & acceptance.accept(trial_value, value, trial_grad, grad, step=new_step)
    precond = null_action(precond, accepted)
    if precond_from_probe:
      start = _common.keep_if(
        last_probe, optax.tree.full_like(state.precond, 1 / lip), state.precond
      )
    else:
      start = state.precond
    precond = _common.keep_if(probing, start, precond)
    curv = curvature_estimate.record(
      state.curvature,
      accepted=accepted,
      step_norm=optax.tree.norm(new_step),
      grad_change=new_change,
      frozen=probing,
    )
    curv, fired = curvature_estimate.fire(curv)
    precond_learner_state = _common.keep_if(fired, learner.init(precond), precond_learner_state)
    new_state = MomentumHDMState(
      count=count,
      precond=precond,
      momentum=momentum,
      precond_learner_state=precond_learner_state,
      momentum_learner_state=momentum_learner_state,
      operator=operator.update(
        state.operator,
        step=new_step,
        grad_change=optax.tree.sub(trial_grad, grad),
        accepted=accepted,
      ),
      curvature=curv,
      schedule=lr_schedule,
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      prev_params=params,
      lipschitz=jnp.where(fired, curv.l_hat, lip).astype(dtype),
      precond_lr=jnp.asarray(eta_p, dtype),
      num_probes=state.num_probes + probing.astype(jnp.int32),
      trial_scale=jnp.where(probing, s, trial_lib.next_trial_scale(s, finite)).astype(dtype),
      info=_common.next_info(
        state.info,
        accepted=accepted,
        hypergrad_norm=jnp.sqrt(optax.tree.vdot(grad_p, grad_p) + grad_b**2),
        calls=calls,
      ),
    )
    return _common.keep_if(accepted, new_step, optax.tree.zeros_like(params)), new_state

  @_common.track_point(name)
  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      name, value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    no_probe = jnp.asarray(False)
    if probe is None:
      return iterate(updates, state, params, value, grad, value_fn, no_probe, None, None)
    probing = state.num_probes < probe.num
    offset, delta = probe.offset(state.num_probes, params, grad, probing)
    return iterate(updates, state, params, value, grad, value_fn, probing, offset, delta)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
