r"""The hypergradient feedback shared by every HDM variant, and its denominators.

Every variant learns its stepsize P (and momentum B) from the gradient of a
feedback function h, e.g. for HDM (Section 2.2)

.. math::
  h_x(P) = \frac{f(x - P \nabla f(x)) - f(x)}{\|\nabla f(x)\|^2}, \qquad
  \nabla h_x(P) = -\frac{\nabla f(x^+) \nabla f(x)^\top}{\|\nabla f(x)\|^2},

and for the heavy-ball variants (Appendix D.1) the denominator
:math:`\|\nabla f(x)\|^2 + \frac{\tau}{2}\|x - x^-\|^2`. The matrix
:math:`u w^\top` is reduced to the shape of P by the candidate set's ``outer``
(:mod:`hdm_optax.pieces.candidates`); :func:`hypergradient` does that and divides by
the denominator. A *denominator* is a function
``den(grad_sq, diff_sq, curvature) -> den`` of :math:`\|\nabla f(x)\|^2`,
:math:`\|x - x^-\|^2` and the current curvature estimate (0 while there is
none); :func:`fixed_tau` and :func:`curvature_tau` build the two in use.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Section 2.2, Appendix
  D.1 and Appendix A.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from hdm_optax import _checks
from hdm_optax import _numerics
from hdm_optax.pieces import candidates as candidates_lib

__all__ = (
  "Denominator",
  "curvature_tau",
  "fixed_tau",
  "hypergradient",
  "momentum_hypergradients",
  "reciprocal",
)

Denominator = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def hypergradient(
  candidate: candidates_lib.CandidateSet,
  feedback: Any,
  direction: Any,
  *,
  den: Optional[jax.Array] = None,
  inv_den: Optional[jax.Array] = None,
  negate: bool = True,
) -> Any:
  r"""The hypergradient :math:`\mp\, u w^\top / den`, reduced to the candidate set.

  Exactly one of ``den`` and ``inv_den`` is given. With ``den`` the result is
  0 where ``den == 0`` (the gradient is exactly zero); with ``inv_den`` it is
  ``outer(u, w) * (-inv_den)``, the form HDM-Best has always used (the two
  differ in the last bit, and the published trajectories are kept bit for bit).

  Args:
    candidate: the candidate set whose ``outer`` reduces :math:`u w^\top`.
    feedback: u, e.g. :math:`\nabla f(x^+)` (HDM-HB: plus
      :math:`\omega (x^+ - x)`).
    direction: w, e.g. :math:`\nabla f(x)` for P or :math:`x - x^-` for B.
    den: the feedback's denominator.
    inv_den: ``1 / den``, already formed.
    negate: ``True`` for P (:math:`-u w^\top / den`), ``False`` for B.

  Returns:
    G, shaped like the candidate set's P.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates, hypergradient
    >>> g, g_trial = jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0])
    >>> G = hypergradient.hypergradient(candidates.diagonal(), g_trial, g, den=5.0)
    >>> [round(float(v), 6) for v in G]
    [-0.1, 0.4]
    >>> round(float(hypergradient.hypergradient(candidates.scalar(), g_trial, g, den=5.0)), 6)
    0.3
  """
  if (den is None) == (inv_den is None):
    raise TypeError("hypergradient needs exactly one of den= and inv_den=.")
  outer = candidate.outer(feedback, direction)
  if inv_den is not None:
    weight = -inv_den if negate else inv_den
    return jax.tree.map(lambda t: t * weight, outer)
  return jax.tree.map(lambda t: _numerics.safe_div(-t if negate else t, den), outer)


def momentum_hypergradients(
  precond_set: candidates_lib.CandidateSet,
  momentum_set: candidates_lib.CandidateSet,
  trial_grad: Any,
  direction: Any,
  momentum_direction: Any,
  inv_den: jax.Array,
  valid: jax.Array,
) -> tuple[Any, Any]:
  r"""Algorithm 4, lines 3-4: the hypergradients of P and B, 0 where not ``valid``.

  .. math::
    G_P = -\frac{\nabla f(x^+) \otimes d}{den}, \qquad
    G_B = \frac{\nabla f(x^+) \otimes m}{den}

  (each reduced to its candidate set by ``outer``), with d the trial's
  gradient direction and m its momentum direction.

  Args:
    precond_set: the candidate set of P.
    momentum_set: the candidate set of B.
    trial_grad: :math:`\nabla f(x^+)`.
    direction: d.
    momentum_direction: m.
    inv_den: 1/den (:func:`reciprocal`).
    valid: whether the trial counts (finite; not a probe).

  Returns:
    ``(G_P, G_B)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates, hypergradient
    >>> g_p, g_b = hypergradient.momentum_hypergradients(
    ...   candidates.diagonal(), candidates.scalar(), jnp.array([1.0, 2.0]),
    ...   jnp.array([3.0, 1.0]), jnp.array([1.0, 1.0]), jnp.asarray(0.5), jnp.asarray(True))
    >>> [float(v) for v in g_p], float(g_b)
    ([-1.5, -1.0], 1.5)
  """
  grad_p = hypergradient(precond_set, trial_grad, direction, inv_den=inv_den)
  grad_b = hypergradient(
    momentum_set, trial_grad, momentum_direction, inv_den=inv_den, negate=False
  )
  return jax.tree.map(lambda t: jnp.where(valid, t, 0), (grad_p, grad_b))


def reciprocal(den: jax.Array, valid: jax.Array) -> jax.Array:
  """``1 / den`` where ``valid & (den > 0)``, else 0.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import hypergradient
    >>> float(hypergradient.reciprocal(jnp.asarray(4.0), jnp.asarray(True)))
    0.25
  """
  return jnp.where(valid & (den > 0), 1 / jnp.where(den > 0, den, 1), 0)


def fixed_tau(tau: Any) -> Denominator:
  r"""The denominator :math:`\|\nabla f(x)\|^2 + \frac{\tau}{2}\|x - x^-\|^2`.

  Args:
    tau: tau >= 0 (Appendix D.1 takes 16 L^2; 0 gives HDM's ||g||^2).

  Returns:
    A denominator ``den(grad_sq, diff_sq, curvature)`` that ignores ``curvature``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import hypergradient
    >>> den = hypergradient.fixed_tau(2.0)
    >>> float(den(jnp.asarray(1.0), jnp.asarray(3.0), jnp.asarray(0.0)))
    4.0
  """

  _checks.check_nonnegative("tau", tau)

  def den(grad_sq, diff_sq, curvature):
    del curvature
    return grad_sq + 0.5 * _numerics.cast(tau, grad_sq.dtype) * diff_sq

  return den


def curvature_tau(eps: Any = 1e-12) -> Denominator:
  r"""HDM-Best's denominator: tau = L_hat^2 / 2 once a curvature estimate exists.

  .. math::
    den = \begin{cases}
      \|\nabla f(x)\|^2 + \epsilon & \text{while } \hat L = 0, \\
      \|\nabla f(x)\|^2 + \frac{\hat L^2}{4}\|x - x^-\|^2 & \text{after,}
    \end{cases}

  a refinement of Algorithm 4 taken from the authors' published implementation.

  Args:
    eps: epsilon >= 0, added while there is no estimate.

  Returns:
    A denominator ``den(grad_sq, diff_sq, curvature)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import hypergradient
    >>> den = hypergradient.curvature_tau(0.0)
    >>> float(den(jnp.asarray(1.0), jnp.asarray(3.0), jnp.asarray(2.0)))
    4.0
  """

  _checks.check_nonnegative("eps", eps)

  def den(grad_sq, diff_sq, curvature):
    return jnp.where(
      curvature > 0,
      grad_sq + 0.25 * curvature**2 * diff_sq,
      grad_sq + _numerics.cast(eps, grad_sq.dtype),
    )

  return den
