r"""Step controls: the factor of each proposal, from what the trials revealed.

A :class:`hdm_optax.pieces.iteration.StepControl` keeps a small state and scales the
direction's next proposal:

- :func:`damping`: HDM's s, halved after a non-finite trial and 1 after a
  finite one (the learned P and B carry the damping on, :func:`kept_scale`);
  a safeguard that is not in the paper, inert on finite runs;
- :func:`halve_or_grow`: trial_lbfgs's alpha, halved after a null step,
  grown after an accepted one (up to 1), 1 again when the direction restarts.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: eq. (1) (HDM) and
  Algorithm 2, line 3 / Algorithm 4, line 2 (the trial step the factor scales).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hdm_optax import _common
from hdm_optax.pieces import iteration as iteration_lib

__all__ = ("damping", "halve_or_grow", "kept_scale", "next_trial_scale")


def damping() -> iteration_lib.StepControl:
  """HDM's damping s: the next trial is damped by s, halved after each non-finite trial.

  A probe (``trial.iteration`` False) leaves s as it is.

  Returns:
    A :class:`hdm_optax.pieces.iteration.StepControl` whose state is s.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import iteration, step_control
    >>> control = step_control.damping()
    >>> trial = iteration.Trial(None, None, None, jnp.asarray(False), jnp.asarray(True))
    >>> float(control.update(control.init(jnp.float32), trial, accepted=False, learned=None,
    ...                      ctx=None))
    0.5
  """

  def update(s, trial, *, accepted, learned, ctx):
    del accepted, learned, ctx
    return jnp.where(trial.iteration, next_trial_scale(s, trial.finite), s).astype(s.dtype)

  return iteration_lib.StepControl(
    init=lambda dtype: jnp.ones([], dtype), scale=lambda s: s, update=update
  )


def halve_or_grow(shrink: Any = 0.5, grow: Any = 1.5) -> iteration_lib.StepControl:
  r"""alpha: times ``shrink`` after a null step, times ``grow`` (up to a cap) after an accepted one.

  .. math::
    \alpha \leftarrow \begin{cases} \min(c, \text{grow}\,\alpha) & \text{accepted} \\
      \text{shrink}\,\alpha & \text{null step or non-finite trial} \\
      1 & \text{the direction restarted,} \end{cases}

  with c the direction's ``step_cap`` (1 unless a box bounds the step).

  Args:
    shrink: the factor after a null step, in (0, 1).
    grow: the factor after an accepted step, >= 1.

  Returns:
    A :class:`hdm_optax.pieces.iteration.StepControl` whose state is alpha.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import step_control
    >>> control = step_control.halve_or_grow()
    >>> from hdm_optax.pieces import iteration
    >>> learned = iteration.Learned(None, False, 0.0)
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

  return iteration_lib.StepControl(
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
