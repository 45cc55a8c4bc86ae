"""HDM-Best (Algorithm 4, Appendix A) as an optax transformation, composed of pieces."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax import acceptance as acceptance_lib
from hdm_optax import candidates as candidates_lib
from hdm_optax import curvature as curvature_lib
from hdm_optax import hypergradient as hypergradient_lib
from hdm_optax import learners as learners_lib
from hdm_optax import schedules as schedules_lib
from hdm_optax import trial as trial_lib

# The default eta_p = DEFAULT_PRECOND_LR_TIMES_L / L and eta_b = DEFAULT_MOMENTUM_LR:
# of the paper's grid (eta_p L in {0.1, 1, 10, 100}, eta_b in {1, 3, 5, 10, 100}),
# this point solves the most of the 54 LIBSVM instances of Table 1 (40 of 54, also
# when each dataset's point is chosen on the others; results/fidelity.txt).
DEFAULT_PRECOND_LR_TIMES_L = 100.0
DEFAULT_MOMENTUM_LR = 1.0


class HDMBestState(NamedTuple):
  """State of :func:`hdm_best` (symbols of Algorithm 4).

  Attributes:
    count: k - 1, the number of iterations taken (the probe excluded).
    precond: P_k, the diagonal preconditioner, shaped like the params.
    momentum: beta_k, the scalar momentum.
    precond_learner_state: AdaGrad state of P; ``sum_sq`` is U_k.
    momentum_learner_state: AdaGrad state of beta; ``sum_sq`` is v_k.
    curvature: the curvature estimate (:class:`hdm_optax.curvature.CurvatureState`;
      ``curvature.l_hat`` is L_hat, 0 until it exists).
    schedule: the eta_p schedule (:class:`hdm_optax.schedules.DecayState`;
      ``schedule.factor`` multiplies eta_p0 until L_hat exists).
    value: f(x^k) (+inf before the first update).
    grad: grad f(x^k).
    prev_params: x^{k-1} (x^0 = x^1).
    lipschitz: L, the caller's ``lipschitz`` (or the probe's; 0 until the
      probe ran when ``lipschitz=None``).
    precond_lr: eta_p used by the last update (eta_p0 times the schedule's
      factor, or 1/L_hat once L_hat exists); eta_p0 itself is the
      ``precond_lr`` hyper-parameter (or its default), read at every update
      so ``optax.inject_hyperparams`` can change it.
    trial_scale: s, the damping of the trial step (see :func:`hdm_best`).
    info: :class:`hdm_optax.HDMInfo` diagnostics.
  """

  count: jax.Array
  precond: Any
  momentum: jax.Array
  precond_learner_state: learners_lib.AdagradState
  momentum_learner_state: learners_lib.AdagradState
  curvature: curvature_lib.CurvatureState
  schedule: schedules_lib.DecayState
  value: jax.Array
  grad: Any
  prev_params: Any
  lipschitz: jax.Array
  precond_lr: jax.Array
  trial_scale: jax.Array
  info: _common.HDMInfo


_common.deprecated_field(HDMBestState, "precond_accum", "precond_learner_state")
_common.deprecated_field(HDMBestState, "momentum_accum", "momentum_learner_state")
_common.deprecated_field(HDMBestState, "smoothness", "lipschitz")


@_common.renamed_keywords(max_precond_times_l="precond_max_times_lipschitz")
def hdm_best(
  *,
  lipschitz: Optional[Any] = None,
  precond_lr: Optional[Any] = None,
  momentum_lr: Optional[Any] = None,
  horizon: Any = 1000,
  init_precond: Any = 0.0,
  init_momentum: Any = 0.95,
  momentum_min: Any = 0.0,
  momentum_max: Any = 0.9995,
  adagrad_eps: float = 1e-12,
  tau: Optional[Any] = None,
  denominator_eps: Any = 1e-12,
  lr_decay: bool = True,
  decay_every: int = 50,
  decay_rate: Any = 0.8,
  decay_floor: Any = 1e-3,
  estimate_curvature: bool = True,
  curvature_min_step: Any = 1e-3,
  precond_max_times_lipschitz: Optional[Any] = 1e10,
  probe_size: Any = 1e-4,
  acceptance: Optional[acceptance_lib.AcceptanceRule] = None,
  denominator: Optional[hypergradient_lib.Denominator] = None,
  schedule: Optional[schedules_lib.Schedule] = None,
  curvature_estimate: Optional[curvature_lib.CurvatureEstimate] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""HDM-Best: diagonal HDM with heavy-ball momentum and AdaGrad (Algorithm 4).

  .. math::
    x^{k+1/2} &= x^k - P_k \nabla f(x^k) + \beta_k (x^k - x^{k-1}) \\
    \nabla_P h &= -\frac{\nabla f(x^{k+1/2}) \circ \nabla f(x^k)}{den_k},
    \qquad \nabla_\beta h = \frac{\langle \nabla f(x^{k+1/2}),
      x^k - x^{k-1}\rangle}{den_k} \\
    P_{k+1} &= \Pi_{[0, p_{max}]}[P_k - \eta_p U_{k+1}^{-1/2} \nabla_P h], \quad
    \beta_{k+1} = \Pi_{[0, 0.9995]}[\beta_k - \eta_b v_{k+1}^{-1/2}
      \nabla_\beta h] \\
    x^{k+1} &= \operatorname{argmin}_{x \in \{x^k, x^{k+1/2}\}} f(x),

  with AdaGrad accumulators :math:`U_{k+1} = U_k + (\nabla_P h)^2` and
  :math:`v_{k+1} = v_k + (\nabla_\beta h)^2` (the shared
  :func:`hdm_optax.learners.adagrad`). Departures from the printed algorithm:

  - Sign: Algorithm 4 prints :math:`\nabla_P h` without the minus sign; the
    gradient of h (Section 1, Appendix D.1) has it, and it is used here.
  - The refinements of the authors' published implementation, each an option
    that is on by default: P_1 = 0 (``init_precond``), beta_1 = 0.95
    (``init_momentum``), U_1 = v_1 = 0 and ``adagrad_eps`` = 1e-12 added to
    sqrt(U); den = ||g||^2 + ``denominator_eps`` until a curvature estimate
    L_hat exists, then den = ||g||^2 + (L_hat^2/4) ||x - x^-||^2
    (tau = L_hat^2/2; pass ``tau`` to use a fixed tau instead); until L_hat
    exists, at iterations k = 50, 100, ... (``decay_every``) eta_p <-
    eta_p0 d with d <- max(``decay_rate`` d, ``decay_floor``) before P is
    updated (``lr_decay``); the curvature estimate
    (``estimate_curvature``): on each accepted step with ||x+ - x|| >
    ``curvature_min_step`` record ||grad f(x+) - grad f(x)|| / ||x+ - x||; a
    counter goes up by 1 per accepted step and down by 2 (floor 0) per null
    step; once it exceeds max(min(K/4, 200), 20), K = ``horizon``, L_hat is the
    mean of the records, eta_p <- 1/L_hat, U <- 0, and
    estimation and decay stop; P is clipped to
    [0, ``precond_max_times_lipschitz``/L]
    (L_hat once it exists; ``None``: [0, inf)). x^{k-1} <- x^k after every
    iteration, accepted or not, so after a null step the momentum term is 0.
  - Null step on f (Appendix A), not on the heavy-ball potential, accepting
    by default a decrease of f where f resolves it and a decrease of the
    gradients' estimate 0.5 <g + g+, x+ - x> where f's difference is below
    its rounding (:func:`hdm_optax.acceptance.resolved_decrease`: in float32
    a comparison of values near a minimizer is decided by rounding, and the
    strict rule stalls in every summation order but one on the breast-cancer
    logistic regression; in float64 the paper's runs are unchanged;
    ``acceptance=hdm_optax.acceptance.strict_decrease()`` is the printed
    rule).
  - A non-finite trial value or gradient is a null step that leaves P, beta
    and the accumulators untouched; the next trial step is then halved (x^+ =
    x + s(-P g + beta d), s <- s/2) until a trial is finite. That trial is the
    one of (sP, s beta): its hypergradients are taken there, P and beta
    continue from sP and s beta, and eta_p0's decay factor is multiplied by s
    (s back to 1), so the too-long trial does not return after every finite
    one (a safeguard, not in the paper; :func:`hdm_optax.trial.kept_scale`).
    On f = sum(x - log x) from x = 5 this takes the default from 561 steps
    (550 null) to 16 (12 null) in float64; in float32 the old rule did not
    converge in 3000 steps.
  - Without ``lipschitz``, the first update is a probe: it evaluates f at
    x - delta g/||g||, delta = ``probe_size`` max(1, ||x||), takes
    L = ||grad f(probe) - g|| / delta (1 if that is 0 or not finite), and
    leaves x, P and beta unchanged (one extra oracle call per run). With P_1 = 0
    and x^0 = x^1 the first iteration would otherwise evaluate f at x^1 itself.

  Each update costs one value-and-gradient call.

  Args:
    lipschitz: L, a smoothness estimate (``None``: probed, see above).
    precond_lr: eta_p (``None``: ``DEFAULT_PRECOND_LR_TIMES_L`` / L).
    momentum_lr: eta_b (``None``: ``DEFAULT_MOMENTUM_LR``).
    horizon: K, the step budget, used by the curvature threshold.
    init_precond: P_1 = init_precond * I.
    init_momentum: beta_1.
    momentum_min: lower end of the beta interval, in [-1, 1).
    momentum_max: upper end of the beta interval, in [-1, 1).
    adagrad_eps: added to sqrt(U) and sqrt(v).
    tau: a fixed tau (``None``: the refinement described above).
    denominator_eps: added to ||g||^2 before L_hat exists.
    lr_decay: decay eta_p until L_hat exists.
    decay_every: decay period, in iterations.
    decay_rate: decay factor.
    decay_floor: eta_p never decays below ``decay_floor`` * eta_p0.
    estimate_curvature: form L_hat as described above.
    curvature_min_step: shortest step recorded by the curvature estimate.
    precond_max_times_lipschitz: the L-relative bound of P:
      P <= precond_max_times_lipschitz / L (L_hat once it exists; ``None``: no
      bound). Formerly ``max_precond_times_l``.
    probe_size: relative probe length when ``lipschitz`` is ``None``.
    acceptance: the null-step rule (:mod:`hdm_optax.acceptance`; ``None``:
      :func:`~hdm_optax.acceptance.resolved_decrease`, a decrease of f where
      f resolves it, of the gradients' estimate where it does not; pass
      :func:`~hdm_optax.acceptance.strict_decrease` for the paper's rule).
    denominator: the feedback's denominator (:mod:`hdm_optax.hypergradient`;
      ``None``: ``fixed_tau(tau)`` if ``tau`` is given, else
      ``curvature_tau(denominator_eps)``).
    schedule: the schedule of eta_p until L_hat exists
      (:mod:`hdm_optax.schedules`; ``None``: ``step_decay(decay_every,
      decay_rate, decay_floor)`` if ``lr_decay``, else ``constant()``).
    curvature_estimate: the L_hat estimator (:mod:`hdm_optax.curvature`;
      ``None``: ``running_mean(horizon, curvature_min_step,
      estimate_curvature)``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns ``x^{k+1} - x^k``.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> opt = hdm_optax.hdm_best(lipschitz=200.0)
    >>> result = hdm_optax.solve(opt, fun, jnp.ones(3), max_steps=500, tol=1e-4)
    >>> bool(result.converged)
    True

  Each departure above is one of the pieces this function is composed of
  (trial step, hypergradient, acceptance rule, denominator, eta_p schedule,
  curvature estimate, L probe); a variant passes other pieces
  (``acceptance=``, ``denominator=``, ``schedule=``, ``curvature_estimate=``)
  without changing this function.

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025:
    Algorithm 4, Appendix A and Section 5.1.
  """
  diag = candidates_lib.diagonal()
  scal = candidates_lib.scalar()
  adagrad = learners_lib.adagrad(adagrad_eps)
  for name, val in (
    ("lipschitz", lipschitz),
    ("precond_lr", precond_lr),
    ("momentum_lr", momentum_lr),
    ("horizon", horizon),
    ("adagrad_eps", adagrad_eps),
    ("decay_every", decay_every),
    ("probe_size", probe_size),
    ("precond_max_times_lipschitz", precond_max_times_lipschitz),
  ):
    if val is not None:
      _common.check_positive(name, val)
  for name, val in (
    ("tau", tau),
    ("denominator_eps", denominator_eps),
    ("decay_floor", decay_floor),
    ("init_precond", init_precond),
    ("curvature_min_step", curvature_min_step),
  ):
    if val is not None:
      _common.check_nonnegative(name, val)
  _common.check_momentum_bounds(momentum_min, momentum_max)
  _common.check_init_momentum(init_momentum, momentum_min, momentum_max)
  _common.check_interval("decay_rate", decay_rate, 0, 1, lo_open=True)
  momentum_lr = DEFAULT_MOMENTUM_LR if momentum_lr is None else momentum_lr
  if acceptance is None:
    acceptance = acceptance_lib.resolved_decrease()
  if denominator is None:
    denominator = (
      hypergradient_lib.curvature_tau(denominator_eps)
      if tau is None
      else hypergradient_lib.fixed_tau(tau)
    )
  if schedule is None:
    schedule = (
      schedules_lib.step_decay(decay_every, decay_rate, decay_floor)
      if lr_decay
      else schedules_lib.constant()
    )
  if curvature_estimate is None:
    curvature_estimate = curvature_lib.running_mean(
      horizon, curvature_min_step, enabled=estimate_curvature
    )

  def base_precond_lr(lip):
    """eta_p0: ``precond_lr``, or the default multiple of 1/L."""
    if precond_lr is None:
      return DEFAULT_PRECOND_LR_TIMES_L / lip
    return jnp.asarray(precond_lr).astype(lip.dtype)

  def init_fn(params):
    dtype = _common.params_dtype(params)
    lip = jnp.zeros([], dtype) if lipschitz is None else _common.cast(lipschitz, dtype)
    precond = diag.init(params, init_precond)
    momentum = scal.project(scal.init(params, init_momentum), momentum_min, momentum_max)
    return HDMBestState(
      **_common.oracle_fields(params, dtype),
      precond=precond,
      momentum=momentum,
      precond_learner_state=adagrad.init(precond),
      momentum_learner_state=adagrad.init(momentum),
      curvature=curvature_estimate.init(dtype),
      schedule=schedule.init(dtype),
      lipschitz=lip,
      precond_lr=base_precond_lr(jnp.where(lip > 0, lip, 1)).astype(dtype),
    )

  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      "hdm_best", value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    dtype = state.value.dtype
    c = lambda x: _common.cast(x, dtype)
    diff = optax.tree.sub(params, state.prev_params)  # x^k - x^{k-1}
    s = state.trial_scale
    direction, s_diff = optax.tree.scale(s, updates), optax.tree.scale(s, diff)
    # Algorithm 4, line 2: x^{k+1/2} = x^k - P_k grad f(x^k) + beta_k (x^k - x^{k-1}).
    step = trial_lib.trial_step(diag, state.precond, direction, scal, state.momentum, s_diff)
    trial = optax.tree.add(params, step)
    grad_sq = optax.tree.vdot(grad, grad)
    if lipschitz is None:  # the first update probes L instead (see the docstring)
      probing = state.lipschitz == 0
      probe, delta = curvature_lib.probe_point(params, grad, grad_sq, probe_size)
      point = _common.keep_if(probing, probe, trial)
    else:
      probing = jnp.asarray(False)
      point = trial
    trial_value, trial_grad = _common.value_and_grad(value_fn, point)
    grad_change = optax.tree.norm(optax.tree.sub(trial_grad, grad))
    if lipschitz is None:
      probed = curvature_lib.probe_lipschitz(grad_change, delta)
      lip = jnp.where(probing, probed, state.lipschitz)
    else:
      lip = c(lipschitz)
    # A non-finite g_t makes ||g_t - g|| non-finite: no pass over n needed.
    finite = jnp.isfinite(trial_value) & jnp.isfinite(grad_change) & ~probing
    # Lines 3-4: the hypergradients; 1/den is 0 on a rejected trial, so G = 0
    # and AdaGrad leaves P, beta, U and v exactly as they are.
    l_hat = state.curvature.l_hat
    den = denominator(grad_sq, optax.tree.vdot(diff, diff), l_hat)
    inv_den = hypergradient_lib.reciprocal(den, finite)
    # (At the damped sP_k, s beta_k of this trial, where the learners continue.)
    grad_p, grad_b = hypergradient_lib.momentum_hypergradients(
      diag, scal, trial_grad, updates, diff, inv_den, finite
    )
    # eta_p: eta_p0 times the schedule's factor (updated before this
    # iteration's P update) until L_hat exists, then 1/L_hat.
    count = state.count + (~probing).astype(jnp.int32)
    lr_schedule = schedule.update(state.schedule, count, state.curvature.active & ~probing)
    # After damped trials, eta_p0's factor keeps the damping too (trial.kept_scale).
    kept = trial_lib.kept_scale(s, finite)
    lr_schedule = lr_schedule._replace(factor=lr_schedule.factor * kept)
    has_l_hat = l_hat > 0
    eta_p = jnp.where(
      has_l_hat, _common.safe_div(1, l_hat), base_precond_lr(lip) * lr_schedule.factor
    )
    # Lines 5-8: AdaGrad on P and beta, then the projections. G is finite by
    # construction and |G| / sqrt(U) <= 1, so no finiteness check is needed.
    lip_now = jnp.where(has_l_hat, l_hat, lip)
    p_max = (
      None if precond_max_times_lipschitz is None else c(precond_max_times_lipschitz) / lip_now
    )
    precond, precond_learner_state = learners_lib.learn(
      diag,
      adagrad,
      optax.tree.scale(kept, state.precond),
      grad_p,
      state.precond_learner_state,
      eta_p,
      0.0,
      p_max,
      check_finite=False,
    )
    momentum, momentum_learner_state = learners_lib.learn(
      scal,
      adagrad,
      kept * state.momentum,
      grad_b,
      state.momentum_learner_state,
      c(momentum_lr),
      momentum_min,
      momentum_max,
      check_finite=False,
    )
    # Line 9: the null step on f.
    accepted = finite & acceptance.accept(trial_value, value, trial_grad, grad, step=step)
    # The curvature estimate; U restarts from 0 when L_hat is formed.
    curv = curvature_estimate.record(
      state.curvature,
      accepted=accepted,
      step_norm=optax.tree.norm(step),
      grad_change=grad_change,
      frozen=probing,
    )
    curv, fired = curvature_estimate.fire(curv)
    precond_learner_state = _common.keep_if(fired, adagrad.init(precond), precond_learner_state)
    new_state = HDMBestState(
      count=count,
      precond=precond,
      momentum=momentum,
      precond_learner_state=precond_learner_state,
      momentum_learner_state=momentum_learner_state,
      curvature=curv,
      schedule=lr_schedule,
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      prev_params=params,
      lipschitz=lip.astype(dtype),
      precond_lr=jnp.asarray(eta_p, dtype),
      trial_scale=jnp.where(probing, s, trial_lib.next_trial_scale(s, finite)),
      info=_common.next_info(
        state.info,
        accepted=accepted,
        hypergrad_norm=jnp.sqrt(optax.tree.vdot(grad_p, grad_p) + grad_b**2),
        calls=1,
      ),
    )
    out = _common.keep_if(accepted, step, optax.tree.zeros_like(params))
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
