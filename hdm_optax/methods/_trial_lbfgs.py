"""trial_lbfgs: HDM's trial point and null step with an L-BFGS operator from every trial's secant pair."""

from __future__ import annotations

from typing import Any, NamedTuple

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


@_common.configured
def trial_lbfgs(
  memory_size: int = 10,
  *,
  shrink: Any = 0.5,
  grow: Any = 1.5,
  pair_tol: Any = 1e-10,
) -> optax.GradientTransformationExtraArgs:
  r"""L-BFGS directions at HDM's cost: one trial point, one oracle call, a null step.

  Each update evaluates f and grad f once, at the trial point

  .. math::
    x^+ = x - \alpha H_m \nabla f(x),

  where :math:`H_m` is the L-BFGS inverse-Hessian operator (:func:`hdm_optax.secant.two_loop`)
  of the last m secant pairs :math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla
  f(x))`, one from every finite trial, accepted or not, kept when
  :math:`\langle s, y\rangle > \epsilon_p \|s\|\|y\|` (nonconvex problems give
  pairs of negative curvature). :math:`H_0 = \gamma I` with
  :math:`\gamma = \langle s, y\rangle / \langle y, y\rangle` of the newest
  *accepted* kept pair (a long rejected trial in a direction of high
  curvature would otherwise shrink every step outside the pairs' span), and
  :math:`\gamma = \min(1, 1/\|\nabla f(x_0)\|)` before one exists (as
  ``optax.scale_by_lbfgs``). The trial becomes the iterate when
  :func:`hdm_optax.secant.curvature_checked` accepts it; otherwise x stays (HDM's null step).
  alpha starts at 1, halves after a null step or a non-finite trial and grows
  by ``grow`` (up to 1) after an accepted one. A step shorter than
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
    shrink: the factor of alpha after a null step, in (0, 1).
    grow: the factor of alpha after an accepted step (alpha stays <= 1), >= 1.
    pair_tol: :math:`\epsilon_p`, the cosine below which a pair is not kept.

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
  _common.check_at_least("grow", grow, 1)
  _common.check_finite("grow", grow)
  _common.check_interval("pair_tol", pair_tol, 0, 1, hi_open=True)
  acceptance = secant_lib.curvature_checked()

  def init_fn(params):
    dtype = _common.params_dtype(params)
    return TrialLBFGSState(
      **_common.oracle_fields(params, dtype),
      memory=secant_lib.secant_memory(params, memory_size),
      gamma=jnp.zeros([], dtype),
      step_size=jnp.ones([], dtype),
    )

  @_common.track_point("trial_lbfgs")
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
    grad_norm = optax.tree.norm(direction)
    first_gamma = jnp.minimum(1, _common.safe_div(jnp.ones([], dtype), grad_norm))
    first_gamma = jnp.where(grad_norm > 0, first_gamma, 1).astype(dtype)
    gamma = jnp.where(state.gamma > 0, state.gamma, first_gamma)
    # x+ = x - alpha H_m u.
    step = optax.tree.scale(-state.step_size, secant_lib.two_loop(state.memory, gamma, direction))
    trial_value, trial_grad = _common.value_and_grad(value_fn, optax.tree.add(params, step))
    trial_value = jnp.asarray(trial_value, dtype)
    change = optax.tree.sub(trial_grad, grad)
    sy = optax.tree.vdot(step, change)
    finite = jnp.isfinite(trial_value) & jnp.isfinite(sy) & _common.all_finite(trial_grad)
    accepted = finite & acceptance.accept(trial_value, value, trial_grad, grad, step=step)
    step_norm, change_norm = optax.tree.norm(step), optax.tree.norm(change)
    # Every finite trial's pair with enough positive curvature enters the memory.
    keep = finite & (sy > c(pair_tol) * step_norm * change_norm)
    safe = lambda tree: optax.tree.where(finite, tree, optax.tree.zeros_like(tree))
    # A step below the resolution of x (or one that left the gradient as it was) carries
    # no curvature: H has collapsed along g; the memory restarts from H_0 = gamma_0 I.
    lost = finite & ((step_norm <= c(_RESOLUTION) * optax.tree.norm(params)) | (change_norm == 0))
    keep = keep & ~lost
    memory = secant_lib.secant_record(state.memory, safe(step), safe(change), keep)
    memory = secant_lib.reset(memory, lost)
    yy = optax.tree.vdot(change, change)
    new_gamma = jnp.where(keep & accepted, _common.safe_div(sy, yy), state.gamma)
    new_gamma = jnp.where(lost, 0, new_gamma)
    step_size = jnp.where(
      accepted, jnp.minimum(1, state.step_size * c(grow)), state.step_size * c(shrink)
    )
    step_size = jnp.where(lost, 1, step_size)
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
