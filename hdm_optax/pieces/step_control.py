r"""Step controls: the factor of each proposal, from what the trials revealed.

A :class:`hdm_optax.pieces.shell.StepControl` keeps a small state and scales the
direction's next proposal:

- :func:`damping`: HDM's s, halved after a non-finite trial and 1 after a
  finite one (the learned P and B carry the damping on, :func:`kept_scale`);
  a safeguard that is not in the paper, inert on finite runs;
- :func:`evidence_step`: trial_lbfgs's alpha, from what each trial revealed along its
  step (f, f+ and the two slopes: :func:`slopes`, :func:`secant_step`,
  :func:`cubic_step`, :func:`models_agree`): extrapolated while an accepted trial's slope
  stays steep, interpolated after a null step;
- :func:`capped_step`: the former rule, alpha halved after a null step, grown after an
  accepted one (up to 1), 1 again when the direction restarts.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: eq. (1) (HDM) and
  Algorithm 2, line 3 / Algorithm 4, line 2 (the trial step the factor scales);
  Nocedal and Wright, *Numerical Optimization*, 2nd ed., Section 3.5 (interpolation by
  the cubic through two values and two slopes, eq. (3.59)).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax.pieces import shell

__all__ = (
  "capped_step",
  "cubic_step",
  "damping",
  "evidence_step",
  "kept_scale",
  "models_agree",
  "next_trial_scale",
  "secant_step",
  "slopes",
)


def damping() -> shell.StepControl:
  """HDM's damping s: the next trial is damped by s, halved after each non-finite trial.

  A probe (``trial.iteration`` False) leaves s as it is.

  Returns:
    A :class:`hdm_optax.pieces.shell.StepControl` whose state is s.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import shell, step_control
    >>> control = step_control.damping()
    >>> trial = shell.Trial(None, None, None, jnp.asarray(False), jnp.asarray(True))
    >>> float(control.update(control.init(jnp.float32), trial, accepted=False, learned=None,
    ...                      ctx=None))
    0.5
  """

  def update(s, trial, *, accepted, learned, ctx):
    del accepted, learned, ctx
    return jnp.where(trial.iteration, next_trial_scale(s, trial.finite), s).astype(s.dtype)

  return shell.StepControl(init=lambda dtype: jnp.ones([], dtype), scale=lambda s: s, update=update)


def capped_step(shrink: Any = 0.5, grow: Any = 1.5) -> shell.StepControl:
  r"""alpha <= 1: times ``shrink`` after a null step, ``grow`` (up to a cap) after an accepted one.

  .. math::
    \alpha \leftarrow \begin{cases} \min(c, \text{grow}\,\alpha) & \text{accepted} \\
      \text{shrink}\,\alpha & \text{null step or non-finite trial} \\
      1 & \text{the direction restarted,} \end{cases}

  with c the direction's ``step_cap`` (1 unless a box bounds the step). The rule of
  :func:`hdm_optax.trial_lbfgs` before :func:`evidence_step` (``docs/secant.md``).

  Args:
    shrink: the factor after a null step, in (0, 1).
    grow: the factor after an accepted step, >= 1.

  Returns:
    A :class:`hdm_optax.pieces.shell.StepControl` whose state is alpha.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import step_control
    >>> control = step_control.capped_step()
    >>> from hdm_optax.pieces import shell
    >>> learned = shell.Learned(None, False, 0.0)
    >>> alpha = control.update(control.init(jnp.float32), None, accepted=False, learned=learned,
    ...                        ctx=None)
    >>> float(alpha), float(control.update(alpha, None, accepted=True, learned=learned, ctx=None))
    (0.5, 0.75)
  """
  _common.check_interval("shrink", shrink, 0, 1, lo_open=True, hi_open=True)
  _common.check_at_least("grow", grow, 1)
  _common.check_finite("grow", grow)

  def update(alpha, trial, *, accepted, learned, ctx):
    del trial, ctx
    c = lambda x: _common.cast(x, alpha.dtype)
    grown = jnp.minimum(learned.step_cap, alpha * c(grow))
    alpha = jnp.where(accepted, grown, alpha * c(shrink))
    return jnp.where(learned.restart, 1, alpha).astype(alpha.dtype)

  return shell.StepControl(
    init=lambda dtype: jnp.ones([], dtype), scale=lambda alpha: alpha, update=update
  )


def next_trial_scale(scale: jax.Array, finite: jax.Array) -> jax.Array:
  """The damping s of the next trial: halved after a non-finite trial, 1 after a finite one.

  A non-finite trial leaves P, B and the learners untouched; without the
  damping the next trial would be the same point and the run would stall.
  Once a damped trial is finite, :func:`kept_scale` carries s into P and B,
  so s returns to 1 without the too-long trial returning with it. This
  safeguard is not in the paper.

  Args:
    scale: s of the trial just made.
    finite: whether that trial's value and gradient were finite.

  Returns:
    s of the next trial, of ``scale``'s dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import step_control
    >>> float(step_control.next_trial_scale(jnp.asarray(1.0), jnp.asarray(False)))
    0.5
  """
  return jax.numpy.where(finite, 1, 0.5 * scale).astype(scale.dtype)


def kept_scale(scale: jax.Array, finite: jax.Array) -> jax.Array:
  """The factor that carries the damping into the learned P and B: s after a finite trial, else 1.

  A finite trial made with damping s was the trial of sP and sB; the online
  learners continue from there (and their hypergradient is taken at sP, sB),
  so what comes after non-finite trials stays short until the learners
  lengthen it again. After a non-finite trial the factor is 1 (P and B are
  kept and the next trial is damped instead). Without this, P was left as it
  was and the same too-long trial returned after every finite one. Not in the
  paper; it changes nothing on runs without non-finite trials (s = 1).

  Args:
    scale: s of the trial just made.
    finite: whether that trial's value and gradient were finite.

  Returns:
    The factor, of ``scale``'s dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import step_control
    >>> float(step_control.kept_scale(jnp.asarray(0.25), jnp.asarray(True)))
    0.25
    >>> float(step_control.kept_scale(jnp.asarray(0.25), jnp.asarray(False)))
    1.0
  """
  return jax.numpy.where(finite, scale, 1).astype(scale.dtype)


def slopes(trial, ctx) -> tuple[jax.Array, jax.Array]:
  r""":math:`d_0 = \langle \nabla f(x), s\rangle` and :math:`d_1 = \langle \nabla f(x^+), s\rangle`.

  The slopes of f along the trial's step s at both ends: with f and f+ they say where the
  minimum along s lies (:func:`secant_step`, :func:`cubic_step`). Free: the acceptance
  rule reads the same products.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import shell, step_control
    >>> ctx = shell.Context(None, None, None, jnp.array([-2.0, 0.0]), 0, 1.0, None)
    >>> trial = shell.Trial(jnp.array([1.0, 1.0]), None, jnp.array([1.0, 3.0]), True, True)
    >>> [float(d) for d in step_control.slopes(trial, ctx)]
    [-2.0, 4.0]
  """
  return optax.tree.vdot(ctx.grad, trial.step), optax.tree.vdot(trial.grad, trial.step)


def secant_step(slope, trial_slope):
  r"""The minimiser along s of the quadratic with the two slopes: :math:`t_s = d_0 / (d_0 - d_1)`.

  :math:`d_0 = \langle \nabla f(x), s\rangle`, :math:`d_1 = \langle \nabla f(x^+),
  s\rangle`; t in units of the step (t = 1 is the trial). It is where the L-BFGS operator
  updated by this pair puts the minimum along s. NaN where the curvature along s,
  :math:`d_1 - d_0`, is not positive.

  Examples:
    >>> from hdm_optax.pieces import step_control
    >>> float(step_control.secant_step(-2.0, 2.0))
    0.5
  """
  slope, trial_slope = jnp.asarray(slope), jnp.asarray(trial_slope)
  curved = trial_slope > slope
  return jnp.where(curved, slope / jnp.where(curved, slope - trial_slope, 1), jnp.nan)


def cubic_step(value, trial_value, slope, trial_slope):
  r"""The minimiser in t of the cubic through :math:`(0, f, d_0)` and :math:`(1, f^+, d_1)`.

  Nocedal and Wright, eq. (3.59), on [0, 1]; NaN where the cubic has no local minimiser.
  Unlike :func:`secant_step` it uses the two values as well, so it sees where the
  quadratic model along s is wrong (a wall, a flat stretch).

  Examples:
    >>> from hdm_optax.pieces import step_control
    >>> float(step_control.cubic_step(1.0, 1.0, -2.0, 2.0))  # f = 1 + 2 t (t - 1): the minimum at 0.5
    0.5
  """
  d1 = slope + trial_slope - 3 * (trial_value - value)
  disc = d1 * d1 - slope * trial_slope
  # sqrt at 1, not 0, where unused: a finite derivative for a run differentiated through
  d2 = jnp.where(disc > 0, jnp.sqrt(jnp.where(disc > 0, disc, 1)), 0)
  den = trial_slope - slope + 2 * d2
  t = 1 - (trial_slope + d2 - d1) / jnp.where(den != 0, den, 1)
  return jnp.where((disc >= 0) & (den != 0) & jnp.isfinite(t), t, jnp.nan)


def models_agree(value, trial_value, slope, trial_slope, factor):
  """Whether :func:`cubic_step` and :func:`secant_step` agree within ``factor`` (both finite).

  Where they do, the pair's curvature describes f along s; where they do not (a step into
  an exponential wall: the secant's t is 1e-11, the cubic's 0.1), the pair would make the
  operator collapse along the gradient.

  Examples:
    >>> from hdm_optax.pieces import step_control
    >>> bool(step_control.models_agree(1.0, 1.0, -2.0, 2.0, 4.0))
    True
  """
  ratio = cubic_step(value, trial_value, slope, trial_slope) / secant_step(slope, trial_slope)
  return jnp.isfinite(ratio) & (ratio >= 1 / factor) & (ratio <= factor)


def _accepted_factor(alpha, slope, trial_slope, steep, extrapolate, lo):
  """alpha after an accepted trial (see :func:`evidence_step`)."""
  steep_still = trial_slope < steep * slope
  overshot = trial_slope > 0
  t_s = secant_step(slope, trial_slope)
  curved = ~jnp.isnan(t_s)  # NaN (no minimiser) kept out of the product's derivative
  back = jnp.maximum(1, alpha * jnp.clip(jnp.where(curved, t_s, 1), lo, 1))
  above = jnp.where(overshot & curved, back, alpha)
  return jnp.where(steep_still, alpha * extrapolate, jnp.where(alpha > 1, above, 1))


def _null_factor(value, trial_value, slope, trial_slope, agree, lo, hi, shrink):
  """The factor of alpha after a finite rejected trial (see :func:`evidence_step`)."""
  cubic = cubic_step(value, trial_value, slope, trial_slope)
  agreed = models_agree(value, trial_value, slope, trial_slope, agree)
  secant = jnp.where(agreed, secant_step(slope, trial_slope), 1)  # NaN kept out, as above
  t = jnp.where(agreed, cubic / secant, cubic)
  return jnp.where(jnp.isfinite(t), jnp.clip(t, lo, hi), shrink)


def evidence_step(
  shrink: float = 0.5,
  steep: float = 0.9,
  extrapolate: float = 4.0,
  max_step: float = 1e6,
  bracket: tuple = (0.1, 0.5),
  agree: float = 3.0,
) -> shell.StepControl:
  r"""alpha from what each trial revealed: f, f+ and the slopes :math:`d_0, d_1` along s.

  After an accepted trial whose slope is still steep, :math:`d_1 < c\,d_0` (c = ``steep``,
  the strong Wolfe constant: the trial has not come near the minimum along s), alpha is
  multiplied by ``extrapolate`` (up to ``max_step``): L-BFGS's line search would have
  extrapolated there too, and a memory whose pairs were dropped (negative curvature) or a
  clip before the method scales the quasi-Newton step down by a factor nothing else
  corrects. After other accepted trials, alpha returns to 1 (the quasi-Newton step); above 1
  it stays, or, where the trial passed the minimum along s (:math:`d_1 > 0`), falls by the secant's
  :math:`t_s` (not below 1). After a rejected trial alpha is multiplied by the minimiser of
  the cubic through f, f+, :math:`d_0, d_1` (:func:`cubic_step`) relative to the secant's
  (the operator, updated by this pair, already moves the minimum along s to :math:`t_s`),
  or by the cubic's own where the two disagree (:func:`models_agree`: the pair is then not
  kept), clipped to ``bracket``; ``shrink`` where the cubic has no minimiser or the trial
  was not finite. A restart of the direction's memory sets alpha = 1.

  Args:
    shrink: the factor after a non-finite trial, or a rejected one without a cubic minimiser.
    steep: c in (0, 1).
    extrapolate: the factor while steep, >= 1.
    max_step: the largest alpha.
    bracket: (lo, hi), the safeguard of the interpolated factor after a rejected trial.
    agree: the factor within which the cubic and the secant must agree.

  Returns:
    A :class:`hdm_optax.pieces.shell.StepControl` whose state is alpha.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import shell, step_control
    >>> rule = step_control.evidence_step()
    >>> ctx = shell.Context(None, None, jnp.asarray(1.0), jnp.array([-1.0]), 0, 1.0, None)
    >>> trial = shell.Trial(  # s = 1, f+ = 0.5, <g+, s> = -0.95: still steep
    ...   jnp.array([1.0]), jnp.asarray(0.5), jnp.array([-0.95]), jnp.asarray(True),
    ...   jnp.asarray(True))
    >>> learned = shell.Learned(None, jnp.asarray(False), 0.0)
    >>> float(rule.update(rule.init(jnp.float32), trial, accepted=True, learned=learned, ctx=ctx))
    4.0
  """
  lo, hi = bracket
  _common.check_interval("shrink", shrink, 0, 1, lo_open=True, hi_open=True)
  _common.check_interval("steep", steep, 0, 1, lo_open=True, hi_open=True)
  _common.check_at_least("extrapolate", extrapolate, 1)
  _common.check_at_least("agree", agree, 1)
  _common.check_finite("agree", agree)

  def update(alpha, trial, *, accepted, learned, ctx):
    slope, trial_slope = slopes(trial, ctx)
    up = _accepted_factor(alpha, slope, trial_slope, steep, extrapolate, lo)
    null = _null_factor(ctx.value, trial.value, slope, trial_slope, agree, lo, hi, shrink)
    factor = jnp.where(trial.finite, null, shrink)
    new = jnp.where(accepted, jnp.minimum(up, max_step), alpha * factor)
    return jnp.where(learned.restart, 1, new).astype(alpha.dtype)

  return shell.StepControl(
    init=lambda dtype: jnp.ones([], dtype), scale=lambda alpha: alpha, update=update
  )
