"""trial_lbfgs: HDM's trial point and null step with an L-BFGS operator from every trial's secant pair."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common
from hdm_optax.methods import secant as secant_lib

__all__ = ("TrialLBFGSState", "trial_lbfgs")


class TrialLBFGSState(NamedTuple):
  """State of :func:`trial_lbfgs`.

  Attributes:
    count: updates made.
    memory: the last m secant pairs (:class:`hdm_optax.secant.SecantMemory`), from every finite trial.
    gamma: the scalar of :math:`H_0 = \\gamma I`, from the newest accepted pair
      (0 before the first: then :math:`\\min(1, 1/\\|g\\|)`).
    step_size: alpha, the factor of the quasi-Newton step.
    value: f(x) (+inf before the first update).
    grad: grad f(x).
    info: :class:`hdm_optax.HDMInfo` diagnostics (``hypergrad_norm`` is 0:
      nothing is learned by a hypergradient).
  """

  count: jax.Array
  memory: secant_lib.SecantMemory
  gamma: jax.Array
  step_size: jax.Array
  value: jax.Array
  grad: Any
  info: _common.HDMInfo


# A step shorter than this, relative to x, is below x's resolution in float64 (1024 eps);
# in float32, whose eps is 5e8 times larger, a step that leaves x (and so the gradient)
# unchanged shows it by the gradient's change alone.
_RESOLUTION = 1024 * float(np.finfo(np.float64).eps)


def _first_gamma(gamma, direction, dtype):
  """The scalar of H_0: the state's gamma, or min(1, 1/||u||) before a pair set it."""
  norm = optax.tree.norm(direction)
  first = jnp.minimum(1, _common.safe_div(jnp.ones([], dtype), norm))
  first = jnp.where(norm > 0, first, 1).astype(dtype)
  return jnp.where(gamma > 0, gamma, first)


def _pair_kept(*, finite, accepted, agreed, sy, step_norm, change_norm, lost, pair_tol):
  """Whether the trial's pair enters the memory: finite, enough positive curvature, not a
  restart, and from an accepted trial or one whose values agree with its slopes."""
  curved = sy > pair_tol * step_norm * change_norm
  return finite & curved & ~lost & (accepted | agreed)


def trial_lbfgs(
  memory_size: int = 10,
  *,
  shrink: Any = 0.5,
  pair_tol: Any = 1e-10,
  agree: Any = 3.0,
  step_control: Optional[secant_lib.StepControl] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""L-BFGS directions at HDM's cost: one trial point, one oracle call, a null step.

  Each update evaluates f and grad f once, at the trial point

  .. math::
    x^+ = x - \alpha H_m \nabla f(x),

  where :math:`H_m` is the L-BFGS inverse-Hessian operator (:func:`hdm_optax.secant.two_loop`)
  of the last m secant pairs :math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla
  f(x))`, one from every finite trial, kept when
  :math:`\langle s, y\rangle > \epsilon_p \|s\|\|y\|` (nonconvex problems give
  pairs of negative curvature) and the trial was accepted or, rejected, its values and
  slopes agree on where the minimum along s lies (the cubic through f, f+ and the two
  slopes and the secant of the slopes, within a factor ``agree``:
  :func:`hdm_optax.secant.models_agree`; the pair of a step into an exponential wall
  says the minimum is 1e-11 of the way, and kept, it collapsed every later step). :math:`H_0 = \gamma I` with
  :math:`\gamma = \langle s, y\rangle / \langle y, y\rangle` of the newest
  *accepted* kept pair (a long rejected trial in a direction of high
  curvature would otherwise shrink every step outside the pairs' span), and
  :math:`\gamma = \min(1, 1/\|\nabla f(x_0)\|)` before one exists (as
  ``optax.scale_by_lbfgs``). The trial becomes the iterate when
  :func:`hdm_optax.secant.curvature_checked` accepts it; otherwise x stays (HDM's null step).
  alpha, the step control (``step_control``, default
  :func:`hdm_optax.secant.evidence_step`), is updated from what the trial revealed: x4 while
  an accepted trial's slope along s is still steep (:math:`\langle \nabla f(x^+), s\rangle
  < 0.9 \langle \nabla f(x), s\rangle`, up to 1e6), back to 1 after other accepted trials
  (or kept above 1, falling by the secant's minimiser where the trial passed the minimum),
  and after a null step scaled by the cubic's minimiser along s (relative to the secant's,
  which the new pair already applies), safeguarded to [0.1, 0.5]; halved after a non-finite
  trial. :func:`hdm_optax.secant.capped_step` is the former rule (halve, grow x1.5 up to
  1). A step shorter than
  :math:`1024\,\epsilon_{64}\|x\|` (float64's eps, in every dtype) or a
  trial whose gradient equals :math:`\nabla f(x)` carries no curvature: the
  memory restarts (:math:`\gamma` from the gradient again, alpha = 1). With
  the dtype's own eps, float32's threshold (1.2e-4 relative) caught the short
  steps of ordinary convergence near a large x, and every restart ended in
  null steps.

  How it relates to HDM and L-BFGS. From HDM (Algorithm 1 and 4 of Chu et
  al.) it keeps the trial point, the null step and the single oracle call
  per iteration; it learns nothing by a hypergradient: the preconditioner P
  of HDM is replaced by :math:`\alpha H_m`, which the secant pairs determine.
  Learning alpha or a diagonal :math:`H_0` by HDM's hypergradient made it
  worse on the development problems (``docs/secant.md``). From L-BFGS it
  keeps the two-loop operator; it has no line search (L-BFGS spends extra
  calls on it), takes pairs from rejected trials too (each is exact
  curvature information along an explored direction), and accepts a trial on
  the value and its slope instead of the Wolfe conditions.

  The operator acts on the incoming ``updates`` u (grad f(x) when
  ``trial_lbfgs`` is first or alone in a chain): :math:`x^+ = x - \alpha H_m
  u`, so a clip or weight decay before it is honoured, while the pairs, the
  acceptance test and the reported values stay those of f
  (``docs/pitfalls.md``). The state is 2m + 1 vectors of n (the pairs and the cached gradient) plus
  O(m) scalars. A non-finite trial changes nothing but alpha.

  Args:
    memory_size: m, the number of pairs kept.
    shrink: the factor of alpha after a non-finite trial (or a null step whose cubic has
      no minimiser), in (0, 1).
    pair_tol: :math:`\epsilon_p`, the cosine below which a pair is not kept.
    agree: the factor within which a rejected trial's cubic and secant minimisers along s
      must agree for its pair to be kept (also the step control's, by default), >= 1.
    step_control: a :class:`hdm_optax.secant.StepControl` (default
      ``evidence_step(shrink=shrink, agree=agree)``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> result = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.ones(3), max_steps=100, tol=1e-6)
    >>> bool(result.converged), int(result.num_grad_evals) < 30
    (True, True)

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial
    point and the null step, Algorithm 1 line 3); Liu and Nocedal, *On the
    limited memory BFGS method for large scale optimization*, Math.
    Programming 45, 1989 (the operator and the scaling of H_0); Nocedal and
    Wright, *Numerical Optimization*, 2nd ed., Algorithm 7.4.
  """
  if not isinstance(memory_size, int) or isinstance(memory_size, bool) or memory_size < 1:
    raise ValueError(
      f"memory_size must be an int >= 1, got {memory_size!r}; pass e.g. memory_size=10."
    )
  _common.check_interval("shrink", shrink, 0, 1, lo_open=True, hi_open=True)
  _common.check_interval("pair_tol", pair_tol, 0, 1, hi_open=True)
  _common.check_at_least("agree", agree, 1)
  _common.check_finite("agree", agree)
  acceptance = secant_lib.curvature_checked()
  if step_control is None:
    step_control = secant_lib.evidence_step(shrink=shrink, agree=agree)

  def init_fn(params):
    dtype = _common.params_dtype(params)
    return TrialLBFGSState(
      **_common.oracle_fields(params, dtype),
      memory=secant_lib.secant_memory(params, memory_size),
      gamma=jnp.zeros([], dtype),
      step_size=step_control.init(dtype),
    )

  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      "trial_lbfgs", value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    dtype = state.value.dtype
    c = lambda x: _common.cast(x, dtype)
    value = jnp.asarray(value, dtype)
    # The operator acts on the incoming updates u (grad f(x) when alone or first in a chain).
    direction = grad if updates is None else updates
    gamma = _first_gamma(state.gamma, direction, dtype)
    # x+ = x - alpha H_m u.
    step = optax.tree.scale(-state.step_size, secant_lib.two_loop(state.memory, gamma, direction))
    trial_value, trial_grad = _common.value_and_grad(value_fn, optax.tree.add(params, step))
    trial_value = jnp.asarray(trial_value, dtype)
    change = optax.tree.sub(trial_grad, grad)
    sy = optax.tree.vdot(step, change)
    finite = jnp.isfinite(trial_value) & jnp.isfinite(sy) & _common.all_finite(trial_grad)
    accepted = finite & acceptance.accept(trial_value, value, trial_grad, grad, step=step)
    slope, trial_slope = optax.tree.vdot(grad, step), optax.tree.vdot(trial_grad, step)
    step_norm, change_norm = optax.tree.norm(step), optax.tree.norm(change)
    # A step below the resolution of x (or one that left the gradient as it was) carries
    # no curvature: H has collapsed along g; the memory restarts from H_0 = gamma_0 I.
    lost = finite & ((step_norm <= c(_RESOLUTION) * optax.tree.norm(params)) | (change_norm == 0))
    agreed = secant_lib.models_agree(value, trial_value, slope, trial_slope, c(agree))
    keep = _pair_kept(
      finite=finite,
      accepted=accepted,
      agreed=agreed,
      sy=sy,
      step_norm=step_norm,
      change_norm=change_norm,
      lost=lost,
      pair_tol=c(pair_tol),
    )
    safe = lambda tree: optax.tree.where(finite, tree, optax.tree.zeros_like(tree))
    memory = secant_lib.secant_record(state.memory, safe(step), safe(change), keep)
    memory = secant_lib.reset(memory, lost)
    yy = optax.tree.vdot(change, change)
    new_gamma = jnp.where(keep & accepted, _common.safe_div(sy, yy), state.gamma)
    new_gamma = jnp.where(lost, 0, new_gamma)
    step_size = step_control.update(
      state.step_size,
      value=value,
      trial_value=trial_value,
      slope=slope,
      trial_slope=trial_slope,
      finite=finite,
      accepted=accepted,
      restart=lost,
    )
    new_state = TrialLBFGSState(
      count=state.count + 1,
      memory=memory,
      gamma=new_gamma.astype(dtype),
      step_size=step_size.astype(dtype),
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      info=_common.next_info(
        state.info, accepted=accepted, hypergrad_norm=jnp.zeros([], dtype), calls=1
      ),
    )
    return _common.keep_if(accepted, step, optax.tree.zeros_like(params)), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
