r"""Acceptance rules: when the trial point becomes the next iterate.

Every HDM variant keeps the better of the current point and its trial point
(the null step of Algorithm 1, line 3 and Algorithm 4, line 9):

.. math::
  x^{k+1} = \operatorname{argmin}_{x \in \{x^k, x^{k+1/2}\}} f(x).

An :class:`AcceptanceRule` decides the argmin from the values (f, or HDM-HB's
potential psi) and the gradients at both points:

- :func:`strict_decrease`: ``f(trial) < f(x)``, the printed rule;
- :func:`always`: every finite trial (vanilla HDM, no null step);
- :func:`no_increase`: ``f(trial) <= f(x)``, the argmin with ties going to
  the trial point (Algorithm 3's argmin over its candidates);
- :func:`tie_tolerant`: a strict decrease, or a tie within a few units in the
  last place of ``|f(x)|`` (at the params' dtype) where the gradient norm
  decreases (HDM-HB's default, whose potential is not f);
- :func:`resolved_decrease`: f's decrease where it is above f's rounding, the
  decrease computed from the two gradients along the step where it is not;
  the default of every HDM variant whose values are f;

trial_lbfgs decides the null step in its step rule
(:func:`hdm_optax.pieces.lbfgs.step_rule.curvature_checked`).

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithm 1 line 3,
  Algorithm 3 line 4, Algorithm 4 line 9, Appendix A.
  Hager, Zhang, *A New Conjugate Gradient Method with Guaranteed Descent and
  an Efficient Line Search*, SIAM J. Optim. 16(1), 2005 (the approximate
  Wolfe conditions: a decrease estimated from derivatives where values
  cancel).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = (
  "AcceptanceRule",
  "always",
  "no_increase",
  "resolved_decrease",
  "strict_decrease",
  "tie_tolerant",
)


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


def always() -> AcceptanceRule:
  """Every finite trial: the iterate always moves (vanilla HDM, eqs. (1)-(2) of the paper).

  Returns:
    An :class:`AcceptanceRule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import acceptance
    >>> bool(acceptance.always().accept(jnp.asarray(2.0), jnp.asarray(1.0), None, None))
    True
  """
  return AcceptanceRule(accept=lambda trial_value, value, trial_grad, grad, step=None: True)


def strict_decrease() -> AcceptanceRule:
  """``f(trial) < f(x)``: the null step as printed in the paper.

  Returns:
    An :class:`AcceptanceRule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import acceptance
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
    >>> from hdm_optax.pieces import acceptance
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
    >>> from hdm_optax.pieces import acceptance
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


def resolved_decrease(ulps: float = 64.0) -> AcceptanceRule:
  r"""f's decrease where f resolves it, the gradients' decrease where it does not.

  .. math::
    \text{accept} =
    \begin{cases}
      f(x^+) < f(x) & \text{if } |f(x^+) - f(x)| > r, \\
      d < 0 & \text{otherwise,}
    \end{cases}
    \qquad
    d = \tfrac12 \langle \nabla f(x) + \nabla f(x^+),\, x^+ - x \rangle,
    \qquad
    r = u\,\epsilon \max(|f(x)|, |f(x^+)|),

  with :math:`\epsilon` the machine epsilon of the values' dtype and u =
  ``ulps``. d is the trapezoid rule for :math:`\int_0^1 \langle \nabla
  f(x + t s), s\rangle dt = f(x^+) - f(x)`: exact on quadratics, second
  order near a minimiser, and free of the cancellation of two rounded values
  of f (Hager and Zhang's approximate Wolfe conditions use the same
  estimate). r bounds the rounding of a computed f of magnitude
  :math:`|f|`: a sum of m terms of one sign is off by about
  :math:`\sqrt{m}\,\epsilon |f|` in a random-walk model and by
  :math:`\log_2(m)\,\epsilon |f|` in a pairwise reduction, so u = 64 covers
  the sums of 10^3 - 10^4 rows of the LIBSVM problems in any order; a larger
  u only hands more decisions to d, which is the better of the two estimates
  there. Where the difference exceeds r the decision is the paper's
  comparison of values (a float64 run whose values are resolved is
  unchanged). A departure from the paper, which compares exact values.

  Without a ``step`` (HDM-HB's potential is not f) the rule is
  :func:`tie_tolerant` with the same u.

  Args:
    ulps: u, the rounding of f in units of :math:`\epsilon |f|`.

  Returns:
    An :class:`AcceptanceRule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import acceptance
    >>> rule = acceptance.resolved_decrease()
    >>> f = jnp.asarray(1000.0, jnp.float32)
    >>> f_trial = jnp.nextafter(f, jnp.float32(2000))  # one ulp above f: rounding
    >>> g, g_trial = jnp.array([0.1]), jnp.array([0.05])
    >>> bool(rule.accept(f_trial, f, g_trial, g, step=jnp.array([-1e-3])))  # d < 0
    True
    >>> bool(rule.accept(f_trial, f, g_trial, g, step=jnp.array([1e-3])))  # d > 0
    False
    >>> bool(rule.accept(f - 1.0, f, g_trial, g, step=jnp.array([1e-3])))  # f decides
    True

  References:
    Hager, Zhang, SIAM J. Optim. 16(1), 2005, Section 4 (approximate Wolfe).
  """
  fallback = tie_tolerant(ulps)

  def accept(trial_value, value, trial_grad, grad, step=None):
    if step is None:
      return fallback.accept(trial_value, value, trial_grad, grad)
    eps = jnp.finfo(jnp.result_type(value)).eps
    diff = trial_value - value
    rounding = ulps * eps * jnp.maximum(jnp.abs(value), jnp.abs(trial_value))
    mean_grad = optax.tree.scale(0.5, optax.tree.add(grad, trial_grad))
    decrease = optax.tree.vdot(mean_grad, step)
    # A non-finite difference is never rounding: f decides (and rejects +inf, NaN).
    by_f = ~jnp.isfinite(diff) | (jnp.abs(diff) > rounding)
    return jnp.where(by_f, diff < 0, decrease < 0)

  return AcceptanceRule(accept=accept)
