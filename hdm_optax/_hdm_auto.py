"""hdm_auto: HDM-Best with a tuning-free configuration (issue 12), composed of the pieces."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax import acceptance as acceptance_lib
from hdm_optax import candidates as candidates_lib
from hdm_optax import curvature as curvature_lib
from hdm_optax import hypergradient as hypergradient_lib
from hdm_optax import learners as learners_lib
from hdm_optax import trial as trial_lib

# The smallest entry of P, so that log P stays finite.
_MIN_PRECOND = 1e-30


class HDMAutoState(NamedTuple):
  """State of :func:`hdm_auto` (symbols of Algorithm 4).

  Attributes:
    count: updates made (the probes included).
    precond: P, the diagonal preconditioner, shaped like the params.
    momentum: beta, the scalar momentum.
    precond_learner_state: the learner state of log P; ``sum_sq`` is U.
    momentum_learner_state: AdaGrad state of beta; ``sum_sq`` is v.
    curvature: the curvature estimate (:class:`hdm_optax.curvature.CurvatureState`).
    value: f(x) (+inf before the first update).
    grad: grad f(x).
    prev_params: x^-, the previous iterate.
    lipschitz: L: the largest probe ratio so far while probing (0 before
      the first probe), then the probe's L_0, then L_hat.
    trial_scale: s, the damping of the trial step after a non-finite trial.
    info: :class:`hdm_optax.HDMInfo` diagnostics.
  """

  count: jax.Array
  precond: Any
  momentum: jax.Array
  precond_learner_state: learners_lib.AdagradState
  momentum_learner_state: learners_lib.AdagradState
  curvature: curvature_lib.CurvatureState
  value: jax.Array
  grad: Any
  prev_params: Any
  lipschitz: jax.Array
  trial_scale: jax.Array
  info: _common.HDMInfo


def hdm_auto(
  *,
  precond_lr: Any = 0.5,
  precond_decay: Any = 0.9,
  momentum_lr: Any = 1.0,
  null_shrink: Any = 0.5,
  seed: int = 0,
  horizon: int = 1000,
  num_probes: int = 3,
  probe_size: Any = 1e-4,
) -> optax.GradientTransformationExtraArgs:
  r"""HDM-Best that needs no argument: the recommended entry point.

  Algorithm 4's iteration (diagonal P, scalar beta, hypergradient feedback,
  null step), with the refinements of :func:`hdm_optax.hdm_best` (P_1 from L,
  beta_1 = 0.95, the curvature estimate L_hat and its denominator
  :math:`\|g\|^2 + \frac{\hat L^2}{4}\|x - x^-\|^2`, x^- <- x after every
  iteration), and four departures, each chosen on the development problems
  (``docs/robust_default.md``):

  - P is learned in log space (:func:`hdm_optax.learners.learn_log`): the
    learner sees :math:`P \circ G_P` and P moves by factors,

    .. math::
      U \leftarrow \rho U + (P \circ G_P)^2, \qquad
      P \leftarrow \Pi_{[10^{-30}, 10^{10}/L]}\bigl[P \exp(-\eta\,
        (P \circ G_P) / \sqrt{U})\bigr],

    :math:`\eta` = ``precond_lr``, :math:`\rho` = ``precond_decay``
    (:func:`hdm_optax.learners.decayed_adagrad`). The step of log P does not
    depend on the scale of f or on L, so no eta_p has to be chosen and no
    decay schedule is needed; P_1 = 1/L_0.
  - On a null step (or a non-finite trial) P <- ``null_shrink`` P: a null
    step says P is too long, and the additive AdaGrad step of the paper
    shrinks P by at most eta_p per step.
  - L_0 from ``num_probes`` random unit directions (as OSGM-Best:
    :func:`hdm_optax.curvature.random_probe`, one counted gradient call each)
    instead of one probe along -grad f, which sees the curvature of one
    direction only.
  - Where f's difference is below its rounding, the decrease is the
    gradients' estimate 0.5 <g + g+, x+ - x>
    (:func:`hdm_optax.acceptance.resolved_decrease`): at float32 resolution
    the values of distinct points near a minimizer coincide, or differ by
    the rounding of the sum that computes f, and a test on f alone then
    rejects trials at random; every rejection shrinks P, and P collapses
    (libsvm32, 54 instances x 5 starts: 175 of 270 solved with ties and a
    1024-ulp band, 248 with the gradients' estimate).

  The trial step acts on the incoming ``updates`` u (grad f(x) when
  ``hdm_auto`` is first or alone in a chain): :math:`x^+ = x - P u + \beta
  (x - x^-)`, so a clip or weight decay before it is honoured
  (``docs/pitfalls.md``). A non-finite trial leaves the learners untouched and
  the next trial step is halved; once a damped trial is finite, P and beta
  continue from sP and s beta (as in :func:`hdm_optax.hdm_best`). The state is 4 vectors of n (P,
  U, x^-, the cached gradient) plus scalars, as :func:`hdm_optax.hdm_best`;
  every update is one value-and-gradient call: the first ``num_probes``
  updates are the probes (each evaluates the oracle at :math:`x + \delta d_i`
  and leaves x in place; the last sets P_1), every later one an iteration.
  Probe and iteration share one traced body (no ``lax.cond`` over the state),
  so an iteration costs what Algorithm 4's does.

  Args:
    precond_lr: eta, the step of log P.
    precond_decay: rho, the forgetting factor of U, in (0, 1] (1: AdaGrad).
    momentum_lr: eta_b, AdaGrad's step for beta.
    null_shrink: the factor of P after a null step, in (0, 1] (1: off).
    seed: seed of the probe directions.
    horizon: K, the step budget, used by the curvature threshold.
    num_probes: number of probe directions.
    probe_size: the probe's step delta.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> result = hdm_optax.solve(hdm_optax.hdm_auto(), fun, jnp.ones(3), max_steps=500, tol=1e-4)
    >>> bool(result.converged)
    True

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025
    (Algorithm 4, Appendix A); *Gradient Methods with Online Scaling Part II*,
    arXiv:2509.11007, 2025 (the random probe).
  """
  for name, val in (
    ("precond_lr", precond_lr),
    ("precond_decay", precond_decay),
    ("momentum_lr", momentum_lr),
    ("null_shrink", null_shrink),
    ("horizon", horizon),
    ("num_probes", num_probes),
    ("probe_size", probe_size),
  ):
    _common.check_positive(name, val)
  for name, val in (("precond_decay", precond_decay), ("null_shrink", null_shrink)):
    _common.check_bounds(name, val, "1 (which switches it off)", 1.0)
  diag = candidates_lib.diagonal()
  scal = candidates_lib.scalar()
  precond_learner = learners_lib.decayed_adagrad(precond_decay, _MIN_PRECOND)
  momentum_learner = learners_lib.adagrad(1e-12)
  acceptance = acceptance_lib.resolved_decrease()
  denominator = hypergradient_lib.curvature_tau(1e-12)
  curvature_estimate = curvature_lib.running_mean(horizon, 1e-3)

  def init_fn(params):
    dtype = _common.params_dtype(params)
    precond = diag.init(params, 0.0)
    momentum = scal.init(params, 0.95)
    return HDMAutoState(
      **_common.oracle_fields(params, dtype),
      precond=precond,
      momentum=momentum,
      precond_learner_state=precond_learner.init(precond),
      momentum_learner_state=momentum_learner.init(momentum),
      curvature=curvature_estimate.init(dtype),
      lipschitz=jnp.zeros([], dtype),
    )

  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      "hdm_auto", value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    dtype = state.value.dtype
    c = lambda x: _common.cast(x, dtype)
    lip = state.lipschitz
    # The first num_probes updates probe L_0 (one call each, x stays); every
    # later one is an iteration. Both evaluate the oracle at one point.
    probing = state.count < num_probes
    last_probe = state.count == num_probes - 1
    diff = optax.tree.sub(params, state.prev_params)  # x - x^-
    s = state.trial_scale
    direction, s_diff = optax.tree.scale(s, updates), optax.tree.scale(s, diff)
    # Algorithm 4, line 2: x+ = x - P u + beta (x - x^-), u the incoming updates.
    step = trial_lib.trial_step(diag, state.precond, direction, scal, state.momentum, s_diff)
    offset = curvature_lib.probe_offset(
      jax.random.key(seed), state.count, params, probe_size, probing
    )
    point = optax.tree.add(params, optax.tree.where(probing, offset, step))
    trial_value, trial_grad = _common.value_and_grad(value_fn, point)
    grad_change = optax.tree.norm(optax.tree.sub(trial_grad, grad))
    probed, lip_0 = curvature_lib.running_max_probe(lip, grad_change, probe_size, probing)
    finite = jnp.isfinite(trial_value) & jnp.isfinite(grad_change)
    live = finite & ~probing
    # Lines 3-4: the hypergradients (0 on a non-finite trial or a probe).
    den = denominator(
      optax.tree.vdot(grad, grad), optax.tree.vdot(diff, diff), state.curvature.l_hat
    )
    inv_den = hypergradient_lib.reciprocal(den, live)
    # At the damped sP, s beta of this trial, where the learners continue (trial.kept_scale).
    grad_p, grad_b = hypergradient_lib.momentum_hypergradients(
      diag, scal, trial_grad, updates, diff, inv_den, live
    )
    kept = trial_lib.kept_scale(s, finite)
    # Lines 5-8, P in log space; the learners keep their state on a non-finite trial.
    precond, precond_learner_state = learners_lib.learn_log(
      diag,
      precond_learner,
      optax.tree.scale(kept, state.precond),
      grad_p,
      state.precond_learner_state,
      c(precond_lr),
      c(_MIN_PRECOND),
      c(1e10) / lip,
    )
    momentum, momentum_learner_state = learners_lib.learn(
      scal,
      momentum_learner,
      kept * state.momentum,
      grad_b,
      state.momentum_learner_state,
      c(momentum_lr),
      0.0,
      0.9995,
      check_finite=False,
    )
    precond_learner_state = _common.keep_if(
      live, precond_learner_state, state.precond_learner_state
    )
    # Line 9, by the gradients' decrease below f's rounding; a null step shrinks P.
    accepted = live & acceptance.accept(trial_value, value, trial_grad, grad, step=step)
    precond = _common.keep_if(accepted, precond, optax.tree.scale(c(null_shrink), precond))
    precond = diag.project(precond, c(_MIN_PRECOND), None)
    # While probing P stays 0; the last probe sets P_1 = 1 / L_0.
    probe_precond = _common.keep_if(
      last_probe, optax.tree.full_like(state.precond, 1 / lip_0), state.precond
    )
    precond = _common.keep_if(probing, probe_precond, precond)
    curv = curvature_estimate.record(
      state.curvature,
      accepted=accepted,
      step_norm=optax.tree.norm(step),
      grad_change=grad_change,
      frozen=probing,
    )
    curv, fired = curvature_estimate.fire(curv)
    precond_learner_state = _common.keep_if(
      fired, precond_learner.init(precond), precond_learner_state
    )
    lip = jnp.where(probing, jnp.where(last_probe, lip_0, probed), lip)
    new_state = HDMAutoState(
      count=state.count + 1,
      precond=precond,
      momentum=jnp.where(live, momentum, state.momentum).astype(dtype),
      precond_learner_state=precond_learner_state,
      momentum_learner_state=_common.keep_if(
        live, momentum_learner_state, state.momentum_learner_state
      ),
      curvature=curv,
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      prev_params=params,
      lipschitz=jnp.where(fired, curv.l_hat, lip).astype(dtype),
      trial_scale=trial_lib.next_trial_scale(s, finite | probing),
      info=_common.next_info(
        state.info,
        accepted=accepted,
        hypergrad_norm=jnp.sqrt(optax.tree.vdot(grad_p, grad_p) + grad_b**2),
        calls=1,
      ),
    )
    return _common.keep_if(accepted, step, optax.tree.zeros_like(params)), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
