"""OSGM-Best, the authors' tuning-free method (Part II), composed of the shared pieces."""

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
from hdm_optax import lookahead as lookahead_lib
from hdm_optax import schedules as schedules_lib
from hdm_optax import trial as trial_lib


class OSGMBestState(NamedTuple):
  """State of :func:`osgm_best`.

  Attributes:
    count: iterations taken (the probe excluded).
    precond: P, the diagonal preconditioner, shaped like the params.
    momentum: beta, the scalar momentum.
    precond_learner_state: AdaGrad state of P.
    momentum_learner_state: AdaGrad state of beta.
    curvature: the curvature estimate (:class:`hdm_optax.curvature.CurvatureState`).
    schedule: the decay of lr_P while L is being estimated.
    value: f(x) (+inf before the first update).
    grad: grad f(x).
    prev_params: x^-, the previous iterate (x^- = x at the start).
    lipschitz: L: 0 until the probe ran, then the probe's L_0, then L_hat.
    trial_scale: s, the damping of the trial step after a non-finite trial.
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
  trial_scale: jax.Array
  info: _common.HDMInfo


def probe_update(state, params, value, grad, value_fn, seed, num_probes, probe_size):
  """The first update of OSGM-Best: L_0 from random probes, as the authors' code.

  Sets ``state.lipschitz`` to :func:`hdm_optax.curvature.random_probe`'s L_0
  (``num_probes`` gradient calls in this one update, counted), caches f and
  grad f and leaves x in place (the update is 0). (:func:`hdm_optax.hdm_auto`
  spreads its probes over its first updates instead, one call each.)
  """
  vg = lambda p: _common.value_and_grad(value_fn, p)
  directions = curvature_lib.random_directions(jax.random.key(seed), params, num_probes)
  lip = curvature_lib.random_probe(vg, params, grad, directions, probe_size)
  new_state = state._replace(
    value=jnp.asarray(value, state.value.dtype),
    grad=grad,
    prev_params=params,
    lipschitz=lip,
    info=_common.next_info(
      state.info, accepted=jnp.asarray(False), hypergrad_norm=jnp.zeros([]), calls=num_probes
    ),
  )
  return optax.tree.zeros_like(params), new_state


def osgm_best(
  *,
  seed: int = 0,
  horizon: int = 1000,
  probe_size: float = 1e-4,
  num_probes: int = 3,
) -> optax.GradientTransformationExtraArgs:
  r"""OSGM-Best: online-scaled gradient method with momentum, tuning-free.

  The authors' practical method of Part II, as their public implementation
  runs it (diagonal P, scalar beta, three random L probes). Each iteration:

  .. math::
    x^+ &= x - P \nabla f(x) + \beta (x - x^-), \\
    G_P &= -\frac{\nabla f(x^+) \circ \nabla f(x)}{den}, \qquad
    G_\beta = \frac{\langle \nabla f(x^+), x - x^-\rangle}{den}, \\
    P &\leftarrow \Pi_{[0, 10^5/L]}[P - \eta_P U^{-1/2} G_P], \qquad
    \beta \leftarrow \Pi_{[0, 0.9995]}[\beta - \eta_\beta v^{-1/2} G_\beta],

  AdaGrad accumulators U, v from 0 (1e-12 added to their square roots),
  :math:`den = \|\nabla f(x)\|^2 + 10^{-12}` while L is being estimated and
  :math:`\|\nabla f(x)\|^2 + \frac{\hat L^2}{4}\|x - x^-\|^2` after,
  :math:`\eta_P = 1/L`, :math:`\eta_\beta = \min(1, L)`; x^+ is accepted when
  :math:`f(x^+) < f(x)` where f resolves the difference and when the
  gradients' estimate of the decrease is negative where it does not
  (:func:`hdm_optax.acceptance.resolved_decrease`; the authors' code accepts
  :math:`f(x^+) \le f(x)`, which in float32 decides by rounding near a
  minimizer), and x^- <- x after every iteration.

  - L_0 (the first update, which leaves x in place): the largest of
    :math:`\|\nabla f(x_0 + \delta d_i) - \nabla f(x_0)\| / \delta` over
    ``num_probes`` random unit directions d_i (:func:`hdm_optax.curvature.random_directions`
    from ``jax.random.key(seed)``), delta = ``probe_size``; 1e-5 if that is
    not finite or 0. One gradient call per direction.
  - While L is being estimated: every 50 iterations
    :math:`\eta_P \leftarrow \max(0.8\,\eta_P, 10^{-3}/L)`; a counter goes up
    by 1 per accepted step and down by 2 (floor 0) per null step; once it
    exceeds :math:`\max(\min(K/4, 200), 20)` (K = ``horizon``), L <- L_hat, the
    mean of :math:`\|\nabla f(x^+) - \nabla f(x)\| / \|x^+ - x\|` over the
    accepted steps longer than 1e-3, :math:`\eta_P` and :math:`\eta_\beta` are
    reset from it, U <- 0, and the lookahead is switched on
    (:func:`hdm_optax.curvature.running_mean`).
  - Lookahead: when :math:`\|\nabla f(x^+)\| > 2 \|\nabla f(x)\|`, Armijo
    backtracking from x^+ along :math:`-P \nabla f(x^+)` (the P just
    updated; eta = 1, 0.8, ... down to 1e-6, sufficient decrease 0.5;
    :func:`hdm_optax.lookahead.armijo_lookahead`) replaces x^+ by the point
    it finds before the acceptance test.

  Departures from the authors' code:

  - Each point of the backtracking costs one value-and-gradient call (theirs
    evaluates f there and then the gradient at the point found once more): one
    call less per successful lookahead, and every call is a full oracle call
    in ``info``.
  - Their optional stepsize-space regularisation (omega) is left out; their
    runs use omega = 0.
  - A trial whose value or gradient is not finite is a null step that leaves
    P, beta and the learners untouched, and the next trial step is halved;
    once a damped trial is finite, P, beta and the decay of lr_P continue from
    sP, s beta and s (as in :func:`hdm_optax.hdm_best`; a safeguard that finite
    runs never reach).
  - The trial step acts on the incoming ``updates`` u in place of
    :math:`\nabla f(x)` (the same when ``osgm_best`` is first or alone in a
    chain), so a transformation before it is honoured (``docs/pitfalls.md``).
  - Their stop at f < -1e20 is :func:`hdm_optax.solve`'s ``min_value``.

  Args:
    seed: seed of the probe directions.
    horizon: K, the step budget, used by the curvature threshold.
    probe_size: delta of the L probe.
    num_probes: number of probe directions.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate (0 on a
    null step and on the probe).

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> result = hdm_optax.solve(hdm_optax.osgm_best(), fun, jnp.ones(3), max_steps=500, tol=1e-4)
    >>> bool(result.converged)
    True

  References:
    Chu, Gao, Ye, Udell, *Gradient Methods with Online Scaling Part II.
    Practical Aspects*, arXiv:2509.11007, 2025; Part I, arXiv:2505.23081, 2025.
  """
  _common.check_positive("horizon", horizon)
  _common.check_positive("probe_size", probe_size)
  _common.check_positive("num_probes", num_probes)
  diag = candidates_lib.diagonal()
  scal = candidates_lib.scalar()
  adagrad = learners_lib.adagrad(1e-12)
  acceptance = acceptance_lib.resolved_decrease()
  denominator = hypergradient_lib.curvature_tau(1e-12)
  schedule = schedules_lib.step_decay(50, 0.8, 1e-3)
  curvature_estimate = curvature_lib.running_mean(horizon, 1e-3)

  def init_fn(params):
    dtype = _common.params_dtype(params)
    precond = diag.init(params, 0.0)
    momentum = scal.init(params, 0.95)
    return OSGMBestState(
      **_common.oracle_fields(params, dtype),
      precond=precond,
      momentum=momentum,
      precond_learner_state=adagrad.init(precond),
      momentum_learner_state=adagrad.init(momentum),
      curvature=curvature_estimate.init(dtype),
      schedule=schedule.init(dtype),
      lipschitz=jnp.zeros([], dtype),
    )

  def iterate(updates, state, params, value, grad, value_fn):
    dtype = state.value.dtype
    vg = lambda p: _common.value_and_grad(value_fn, p)
    lip = state.lipschitz
    diff = optax.tree.sub(params, state.prev_params)  # x - x^-
    s = state.trial_scale
    direction, s_diff = optax.tree.scale(s, updates), optax.tree.scale(s, diff)
    step = trial_lib.trial_step(diag, state.precond, direction, scal, state.momentum, s_diff)
    trial = optax.tree.add(params, step)
    trial_value, trial_grad = vg(trial)
    grad_change = optax.tree.norm(optax.tree.sub(trial_grad, grad))
    finite = jnp.isfinite(trial_value) & jnp.isfinite(grad_change)
    grad_sq = optax.tree.vdot(grad, grad)
    den = denominator(grad_sq, optax.tree.vdot(diff, diff), state.curvature.l_hat)
    inv_den = hypergradient_lib.reciprocal(den, finite)
    # At the damped sP, s beta of this trial, where the learners continue (trial.kept_scale).
    grad_p, grad_b = hypergradient_lib.momentum_hypergradients(
      diag, scal, trial_grad, updates, diff, inv_den, finite
    )
    kept = trial_lib.kept_scale(s, finite)
    count = state.count + 1
    active = state.curvature.active
    lr_schedule = schedule.update(state.schedule, count, active)
    lr_schedule = lr_schedule._replace(factor=lr_schedule.factor * kept)
    eta_p = jnp.where(active, lr_schedule.factor, 1) / lip
    precond, precond_learner_state = learners_lib.learn(
      diag,
      adagrad,
      optax.tree.scale(kept, state.precond),
      grad_p,
      state.precond_learner_state,
      eta_p,
      0.0,
      1e5 / lip,
      check_finite=False,
    )
    momentum, momentum_learner_state = learners_lib.learn(
      scal,
      adagrad,
      kept * state.momentum,
      grad_b,
      state.momentum_learner_state,
      jnp.minimum(1, lip),
      0.0,
      0.9995,
      check_finite=False,
    )
    # The lookahead, once L_hat exists, when the trial gradient doubled.
    trial_grad_norm = optax.tree.norm(trial_grad)
    look = lookahead_lib.armijo_lookahead(
      vg,
      trial,
      trial_value,
      trial_grad,
      diag.apply(precond, trial_grad),
      enabled=finite & ~active & (trial_grad_norm > 2 * jnp.sqrt(grad_sq)),
    )
    new_step = optax.tree.sub(look.params, params)
    accepted = finite & acceptance.accept(look.value, value, look.grad, grad, step=new_step)
    curv = curvature_estimate.record(
      state.curvature,
      accepted=accepted,
      step_norm=optax.tree.norm(new_step),
      grad_change=optax.tree.norm(optax.tree.sub(look.grad, grad)),
      frozen=jnp.asarray(False),
    )
    curv, fired = curvature_estimate.fire(curv)
    precond_learner_state = _common.keep_if(fired, adagrad.init(precond), precond_learner_state)
    new_state = OSGMBestState(
      count=count,
      precond=precond,
      momentum=momentum,
      precond_learner_state=precond_learner_state,
      momentum_learner_state=momentum_learner_state,
      curvature=curv,
      schedule=lr_schedule,
      value=jnp.where(accepted, look.value, value).astype(dtype),
      grad=_common.keep_if(accepted, look.grad, grad),
      prev_params=params,
      lipschitz=jnp.where(fired, curv.l_hat, lip).astype(dtype),
      trial_scale=trial_lib.next_trial_scale(s, finite),
      info=_common.next_info(
        state.info,
        accepted=accepted,
        hypergrad_norm=jnp.sqrt(optax.tree.vdot(grad_p, grad_p) + grad_b**2),
        calls=1 + look.calls,
      ),
    )
    return _common.keep_if(accepted, new_step, optax.tree.zeros_like(params)), new_state

  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      "osgm_best", value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    return jax.lax.cond(
      state.lipschitz == 0,
      lambda: probe_update(state, params, value, grad, value_fn, seed, num_probes, probe_size),
      lambda: iterate(updates, state, params, value, grad, value_fn),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
