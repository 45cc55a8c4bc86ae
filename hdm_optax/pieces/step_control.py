r"""HDM's step rule: the null step's acceptance test and the damping s of the next trial.

A :class:`hdm_optax.pieces.shell.StepRule` sets the factor of each proposal and decides the
null step. :func:`damping` is the rule of every HDM variant: an
:class:`~hdm_optax.pieces.acceptance.AcceptanceRule` decides the null step, and s is halved
after a non-finite trial and 1 after a finite one (the learned P and B carry the damping on,
:func:`kept_scale`); a safeguard that is not in the paper, inert on finite runs.
trial_lbfgs's rule is :func:`hdm_optax.pieces.lbfgs.step_rule.evidence_step`.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: eq. (1) (HDM),
  Algorithm 1, line 3 and Algorithm 4, line 9 (the null step), Algorithm 2, line 3 /
  Algorithm 4, line 2 (the trial step the factor scales).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import shell

__all__ = (
  "damping",
  "kept_scale",
  "next_trial_scale",
)


def damping(acceptance: acceptance_lib.AcceptanceRule) -> shell.StepRule:
  """HDM's rule: ``acceptance`` decides the null step; s halves after each non-finite trial.

  A trial is accepted when it is no probe, finite, and ``acceptance`` accepts it. A probe
  leaves s as it is.

  Args:
    acceptance: the null step's :class:`~hdm_optax.pieces.acceptance.AcceptanceRule`.

  Returns:
    A :class:`hdm_optax.pieces.shell.StepRule` whose state is s.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import acceptance, shell, step_control
    >>> rule = step_control.damping(acceptance.strict_decrease())
    >>> evidence = shell.Evidence(jnp.asarray(1.0), jnp.asarray(jnp.nan), None, None, None,
    ...                           None, None, jnp.asarray(False), jnp.asarray(False))
    >>> verdict = rule.judge(rule.init(jnp.float32), evidence)
    >>> bool(verdict.accepted), float(verdict.state)
    (False, 0.5)
  """

  def judge(s, evidence):
    e = evidence
    test = acceptance.accept(e.trial_value, e.value, e.trial_grad, e.grad, step=e.step)
    accepted = ~e.probe & e.finite & test
    new = jnp.where(e.probe, s, next_trial_scale(s, e.finite)).astype(s.dtype)
    return shell.Verdict(accepted=accepted, state=new, keep_pair=accepted)

  return shell.StepRule(init=lambda dtype: jnp.ones([], dtype), step_size=lambda s: s, judge=judge)


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
