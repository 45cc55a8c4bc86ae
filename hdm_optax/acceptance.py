r"""Acceptance rules: when the trial point becomes the next iterate.

Every HDM variant keeps the better of the current point and its trial point
(the null step of Algorithm 1, line 3 and Algorithm 4, line 9):

.. math::
  x^{k+1} = \operatorname{argmin}_{x \in \{x^k, x^{k+1/2}\}} f(x).

An :class:`AcceptanceRule` decides the argmin from the values (f, or HDM-HB's
potential psi) and the gradients at both points:

- :func:`strict_decrease`: ``f(trial) < f(x)``, the printed rule;
- :func:`no_increase`: ``f(trial) <= f(x)``, the argmin with ties going to
  the trial point (Algorithm 3's argmin over its candidates);
- :func:`tie_tolerant`: a strict decrease, or a tie within a few units in the
  last place of ``|f(x)|`` (at the params' dtype) where the gradient norm
  decreases; the default of every variant. In float32 the values of a nearly
  solved problem tie long before the gradient is small; the strict rule then
  rejects every trial and the run stalls (L2-regularised logistic regression
  on breast cancer: no step accepted after ~400 of 3000, ``||g||`` 2e-3). In
  float64 ties are rare, and the runs of the paper's problems are unchanged
  (the Table 1 rows of w1a and heart_scale are the same with either rule).

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithm 1 line 3,
  Algorithm 3 line 4, Algorithm 4 line 9, Appendix A.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ("AcceptanceRule", "no_increase", "strict_decrease", "tie_tolerant")


class AcceptanceRule(NamedTuple):
  """A rule that accepts or rejects a trial point.

  Attributes:
    accept: ``accept(trial_value, value, trial_grad, grad, step=None) -> bool
      array``, whether the trial point (value ``trial_value``, gradient
      ``trial_grad``) replaces the current one (``value``, ``grad``). Both
      values are finite when it is called for a decision that counts
      (variants reject non-finite trials themselves). Gradients are pytrees
      like the params; ``step`` is the tree :math:`x^+ - x` where the variant
      has it (``None`` where the values are not f at the two points, as
      HDM-HB's potential). Every rule takes the keyword, and a rule that does
      not read an argument costs nothing under ``jax.jit``.
  """

  accept: Callable[..., jax.Array]


def strict_decrease() -> AcceptanceRule:
  """``f(trial) < f(x)``: the null step as printed in the paper.

  Returns:
    An :class:`AcceptanceRule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import acceptance
    >>> rule = acceptance.strict_decrease()
    >>> bool(rule.accept(jnp.asarray(1.0), jnp.asarray(1.0), None, None))
    False
  """
  return AcceptanceRule(
    accept=lambda trial_value, value, trial_grad, grad, step=None: trial_value < value
  )


def no_increase() -> AcceptanceRule:
  """``f(trial) <= f(x)``: an argmin whose ties go to the trial point.

  Returns:
    An :class:`AcceptanceRule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import acceptance
    >>> rule = acceptance.no_increase()
    >>> bool(rule.accept(jnp.asarray(1.0), jnp.asarray(1.0), None, None))
    True
  """
  return AcceptanceRule(
    accept=lambda trial_value, value, trial_grad, grad, step=None: trial_value <= value
  )


def tie_tolerant(ulps: float = 4.0, base: AcceptanceRule | None = None) -> AcceptanceRule:
  r"""A strict decrease, or a tie at the dtype's resolution with a smaller gradient.

  .. math::
    f(x^+) < f(x) \quad\text{or}\quad
    \bigl(|f(x^+) - f(x)| \le u\,\epsilon\,|f(x)| \ \text{and}\
    \|\nabla f(x^+)\| < \|\nabla f(x)\|\bigr),

  with :math:`\epsilon` the machine epsilon of the values' dtype and u =
  ``ulps``. A tie is not a failure to decrease: at float32 resolution the
  values of distinct points near a minimizer coincide, and a smaller gradient
  there is progress. The gradient condition keeps the run from drifting
  between tied points. A departure from the paper, which compares exact
  values.

  Args:
    ulps: u, the width of a tie in units of :math:`\epsilon |f(x)|`.
    base: the rule extended by ties (``None``: :func:`strict_decrease`;
      HDM-AGD extends :func:`no_increase`).

  Returns:
    An :class:`AcceptanceRule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import acceptance
    >>> rule = acceptance.tie_tolerant()
    >>> f = jnp.asarray(0.3, jnp.float32)
    >>> f_trial = jnp.nextafter(f, jnp.float32(1))  # one ulp above f
    >>> bool(rule.accept(f_trial, f, jnp.array([0.1]), jnp.array([0.2])))
    True
    >>> bool(rule.accept(f_trial, f, jnp.array([0.3]), jnp.array([0.2])))
    False
  """

  base = strict_decrease() if base is None else base

  def accept(trial_value, value, trial_grad, grad, step=None):
    eps = jnp.finfo(jnp.result_type(value)).eps
    tie = jnp.abs(trial_value - value) <= ulps * eps * jnp.abs(value)
    smaller = optax.tree.vdot(trial_grad, trial_grad) < optax.tree.vdot(grad, grad)
    return base.accept(trial_value, value, trial_grad, grad, step=step) | (tie & smaller)

  return AcceptanceRule(accept=accept)
