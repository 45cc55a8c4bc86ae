r"""The trial step of every HDM variant and its damping after non-finite trials.

Every variant evaluates f at a trial point

.. math::
  x^{+} = x + s\,(-P \nabla f(x) + B (x - x^{-})),

built from the learned stepsize P, the learned momentum B (absent in HDM and
HDM-AGD) and the damping s, which is 1 unless the last trial was not finite.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: eq. (1) (HDM) and
  Algorithm 2, line 3 / Algorithm 4, line 2 (heavy-ball momentum).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import optax

from hdm_optax.methods import candidates as candidates_lib

__all__ = ("kept_scale", "next_trial_scale", "trial_step")


def trial_step(
  precond_set: candidates_lib.CandidateSet,
  precond: Any,
  direction: Any,
  momentum_set: Optional[candidates_lib.CandidateSet] = None,
  momentum: Any = None,
  momentum_direction: Any = None,
) -> Any:
  r"""The trial step :math:`x^+ - x = -P d + B m`.

  Args:
    precond_set: the candidate set of P (its ``apply``).
    precond: P.
    direction: d, shaped like the params (usually s times the gradient).
    momentum_set: the candidate set of B (``None``: no momentum term).
    momentum: B.
    momentum_direction: m, shaped like the params (usually s (x - x^-)).

  Returns:
    The step, a pytree shaped like ``direction``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import candidates, trial
    >>> step = trial.trial_step(
    ...   candidates.diagonal(), jnp.array([0.5, 0.25]), jnp.array([2.0, 4.0]),
    ...   candidates.scalar(), jnp.asarray(0.5), jnp.array([1.0, 0.0]))
    >>> [float(v) for v in step]
    [-0.5, -1.0]
  """
  step = optax.tree.scale(-1.0, precond_set.apply(precond, direction))
  if momentum_set is None:
    return step
  return optax.tree.add(step, momentum_set.apply(momentum, momentum_direction))


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
    >>> from hdm_optax import trial
    >>> float(trial.next_trial_scale(jnp.asarray(1.0), jnp.asarray(False)))
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
    >>> from hdm_optax import trial
    >>> float(trial.kept_scale(jnp.asarray(0.25), jnp.asarray(True)))
    0.25
    >>> float(trial.kept_scale(jnp.asarray(0.25), jnp.asarray(False)))
    1.0
  """
  return jax.numpy.where(finite, scale, 1).astype(scale.dtype)
