"""HDM-Best (Algorithm 4, Appendix A) as an optax transformation."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax import candidates as candidates_lib
from hdm_optax import learners as learners_lib

# The one default configuration: eta_p = DEFAULT_PRECOND_LR_TIMES_L / L and
# eta_b = DEFAULT_MOMENTUM_LR, the point of the paper's grid (eta_p L in
# {0.1, 1, 10, 100}, eta_b in {1, 3, 5, 10, 100}) that solves the most of the
# 54 LIBSVM instances (40 of 54, also when each dataset's point is chosen on the
# others): ``python -m experiments.fidelity`` (README, "Choosing the defaults").
DEFAULT_PRECOND_LR_TIMES_L = 100.0
DEFAULT_MOMENTUM_LR = 1.0


class HDMBestState(NamedTuple):
  """State of :func:`hdm_best` (symbols of Algorithm 4).

  Attributes:
    count: k - 1, the number of iterations taken (the probe excluded).
    precond: P_k, the diagonal preconditioner, shaped like the params.
    momentum: beta_k, the scalar momentum.
    precond_accum: AdaGrad state of P; ``sum_sq`` is U_k.
    momentum_accum: AdaGrad state of beta; ``sum_sq`` is v_k.
    prev_params: x^{k-1} (x^0 = x^1).
    value: f(x^k) (+inf before the first update).
    grad: grad f(x^k).
    precond_lr: eta_p used by the last update (eta_p0 times the decay
      factor, or 1/L_hat once L_hat exists); eta_p0 itself is the
      ``precond_lr`` hyper-parameter (or its default), read at every update
      so ``optax.inject_hyperparams`` can change it.
    precond_lr_decay: the decay factor of eta_p0 (1, 0.8, 0.64, ... >= the floor).
    smoothness: L, the caller's ``lipschitz`` (or the probe's; 0 until the
      probe ran when ``lipschitz=None``).
    curvature: L_hat, the curvature estimate (0 until it exists).
    curvature_sum: sum of the recorded ratios ||grad f(x+) - grad f(x)|| / ||x+ - x||.
    curvature_count: number of recorded ratios.
    curvature_counter: +1 per accepted step, -2 (floor 0) per null step.
    estimating: whether the curvature estimate is still being formed.
    trial_scale: s, the damping of the trial step (see :func:`hdm_best`).
    info: :class:`hdm_optax.HDMInfo` diagnostics.
  """

  count: jax.Array
  precond: Any
  momentum: jax.Array
  precond_accum: learners_lib.AdagradState
  momentum_accum: learners_lib.AdagradState
  prev_params: Any
  value: jax.Array
  grad: Any
  precond_lr: jax.Array
  precond_lr_decay: jax.Array
  smoothness: jax.Array
  curvature: jax.Array
  curvature_sum: jax.Array
  curvature_count: jax.Array
  curvature_counter: jax.Array
  estimating: jax.Array
  trial_scale: jax.Array
  info: _common.HDMInfo


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
  max_precond_times_l: Optional[Any] = 1e10,
  probe_size: Any = 1e-4,
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
    estimation and decay stop; P is clipped to [0, ``max_precond_times_l``/L]
    (L_hat once it exists; ``None``: [0, inf)). x^{k-1} <- x^k after every
    iteration, accepted or not, so after a null step the momentum term is 0.
  - Null step on f (Appendix A), not on the heavy-ball potential. A non-finite
    trial value or gradient is a null step that leaves P, beta and the
    accumulators untouched; the next trial step is then halved (x^+ = x +
    s(-P g + beta d), s <- s/2, back to 1 after a finite trial) so the run does
    not stall on the same point (a safeguard, not in the paper).
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
    max_precond_times_l: P <= max_precond_times_l / L (``None``: no bound).
    probe_size: relative probe length when ``lipschitz`` is ``None``.

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

  References:
    Chu, Gao, Ye, Udell, Algorithm 4 and Appendix A; Section 5.1.
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
    ("decay_rate", decay_rate),
    ("probe_size", probe_size),
    ("max_precond_times_l", max_precond_times_l),
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
  momentum_lr = DEFAULT_MOMENTUM_LR if momentum_lr is None else momentum_lr

  def base_precond_lr(lip):
    """eta_p0: ``precond_lr``, or the default multiple of 1/L."""
    if precond_lr is None:
      return DEFAULT_PRECOND_LR_TIMES_L / lip
    return jnp.asarray(precond_lr).astype(lip.dtype)

  def init_fn(params):
    dtype = _common.params_dtype(params)
    lip = jnp.zeros([], dtype) if lipschitz is None else _common.cast(lipschitz, dtype)
    precond = diag.init(params, init_precond)
    momentum = jnp.clip(_common.cast(init_momentum, dtype), momentum_min, momentum_max)
    zero = jnp.zeros([], dtype)
    return HDMBestState(
      count=jnp.zeros([], jnp.int32),
      precond=precond,
      momentum=momentum.astype(dtype),
      precond_accum=adagrad.init(precond),
      momentum_accum=adagrad.init(momentum),
      prev_params=_common.copy_tree(params),
      value=jnp.asarray(jnp.inf, dtype),
      grad=optax.tree.zeros_like(params),
      precond_lr=base_precond_lr(jnp.where(lip > 0, lip, 1)).astype(dtype),
      precond_lr_decay=jnp.ones([], dtype),
      smoothness=lip,
      curvature=zero,
      curvature_sum=jnp.zeros([], dtype),
      curvature_count=jnp.zeros([], jnp.int32),
      curvature_counter=jnp.zeros([], jnp.int32),
      estimating=jnp.asarray(estimate_curvature),
      trial_scale=jnp.ones([], dtype),
      info=_common.init_info(dtype),
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
    step = optax.tree.add_scale(
      optax.tree.scale(-1.0, diag.apply(state.precond, direction)), state.momentum, s_diff
    )
    trial = optax.tree.add(params, step)
    grad_sq = optax.tree.vdot(grad, grad)
    if lipschitz is None:  # the probe step, see the docstring
      probing = state.smoothness == 0
      delta = c(probe_size) * jnp.maximum(1, optax.tree.norm(params))
      probe = optax.tree.add_scale(params, -_common.safe_div(delta, jnp.sqrt(grad_sq)), grad)
      point = _common.keep_if(probing, probe, trial)
    else:
      probing = jnp.asarray(False)
      point = trial
    trial_value, trial_grad = _common.value_and_grad(value_fn, point)
    grad_change = optax.tree.norm(optax.tree.sub(trial_grad, grad))
    if lipschitz is None:
      probed = grad_change / delta
      probed = jnp.where(jnp.isfinite(probed) & (probed > 0), probed, 1).astype(dtype)
      smoothness = jnp.where(probing, probed, state.smoothness)
    else:
      smoothness = c(lipschitz)
    # A non-finite g_t makes ||g_t - g|| non-finite: no pass over n needed.
    finite = jnp.isfinite(trial_value) & jnp.isfinite(grad_change) & ~probing
    # Lines 3-4 with the denominator refinement.
    has_curv = state.curvature > 0
    diff_sq = optax.tree.vdot(diff, diff)
    if tau is not None:
      den = grad_sq + 0.5 * c(tau) * diff_sq
    else:
      den = jnp.where(
        has_curv, grad_sq + 0.25 * state.curvature**2 * diff_sq, grad_sq + c(denominator_eps)
      )
    # 1/den, zeroed on a rejected trial: then G = 0 and AdaGrad leaves P, beta,
    # U and v exactly as they are.
    inv_den = jnp.where(finite & (den > 0), 1 / jnp.where(den > 0, den, 1), 0)
    grad_p = jax.tree.map(
      lambda t, u: jnp.where(finite, -t * u * inv_den, 0), trial_grad, direction
    )
    grad_b = jnp.where(finite, optax.tree.vdot(trial_grad, s_diff) * inv_den, 0)
    # eta_p: 1/L_hat once L_hat exists; before, eta_p0 times the decay factor,
    # which shrinks at iterations k = 50, 100, ... (before that iteration's
    # update of P).
    count = state.count + (~probing).astype(jnp.int32)
    lr_decay_factor = state.precond_lr_decay
    if lr_decay:
      decay = state.estimating & ~probing & (count % decay_every == 0)
      lr_decay_factor = jnp.where(
        decay, jnp.maximum(c(decay_rate) * lr_decay_factor, c(decay_floor)), lr_decay_factor
      )
    eta_p = jnp.where(
      has_curv, _common.safe_div(1, state.curvature), base_precond_lr(smoothness) * lr_decay_factor
    )
    # Lines 5-8: AdaGrad on P and beta, then the projections. G is finite by
    # construction and |G| / sqrt(U) <= 1, so no finiteness check is needed.
    lip_now = jnp.where(has_curv, state.curvature, smoothness)
    p_max = None if max_precond_times_l is None else c(max_precond_times_l) / lip_now
    precond, precond_accum = learners_lib.learn(
      diag,
      adagrad,
      state.precond,
      grad_p,
      state.precond_accum,
      eta_p,
      0.0,
      p_max,
      check_finite=False,
    )
    momentum, momentum_accum = learners_lib.learn(
      scal,
      adagrad,
      state.momentum,
      grad_b,
      state.momentum_accum,
      c(momentum_lr),
      momentum_min,
      momentum_max,
      check_finite=False,
    )
    # Line 9: the null step on f.
    accepted = finite & (trial_value < value)
    # Curvature estimate.
    step_norm = optax.tree.norm(step)
    record = accepted & state.estimating & (step_norm > c(curvature_min_step))
    curv_sum = state.curvature_sum + jnp.where(
      record, _common.safe_div(grad_change, step_norm), 0
    ).astype(dtype)
    curv_count = state.curvature_count + record.astype(jnp.int32)
    counter = jnp.where(
      accepted, state.curvature_counter + 1, jnp.maximum(state.curvature_counter - 2, 0)
    )
    counter = jnp.where(probing, state.curvature_counter, counter)
    estimating = state.estimating
    curvature = state.curvature
    if estimate_curvature:
      k_budget = jnp.asarray(horizon, dtype)
      threshold = jnp.maximum(jnp.minimum(k_budget / 4, 200), 20)
      fire = estimating & (counter > threshold) & (curv_count > 0)
      curvature = jnp.where(fire, _common.safe_div(curv_sum, curv_count), curvature)
      precond_accum = _common.keep_if(fire, adagrad.init(precond), precond_accum)
      estimating = estimating & ~fire
    new_state = HDMBestState(
      count=count,
      precond=precond,
      momentum=momentum,
      precond_accum=precond_accum,
      momentum_accum=momentum_accum,
      prev_params=params,
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      precond_lr=jnp.asarray(eta_p, dtype),
      precond_lr_decay=lr_decay_factor.astype(dtype),
      smoothness=smoothness.astype(dtype),
      curvature=curvature.astype(dtype),
      curvature_sum=curv_sum,
      curvature_count=curv_count,
      curvature_counter=counter,
      estimating=estimating,
      trial_scale=jnp.where(probing, s, _common.next_trial_scale(s, finite)),
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
