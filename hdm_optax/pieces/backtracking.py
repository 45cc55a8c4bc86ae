r"""A lookahead from the trial point: Armijo backtracking along a preconditioned gradient.

OSGM-Best (Chu, Gao, Ye, Udell, *Gradient Methods with Online Scaling Part II*)
tries, when the gradient at the trial point is large, one more step from it:

.. math::
  x_\eta = x^+ - \eta\, P \nabla f(x^+), \qquad
  \eta = 1, \rho, \rho^2, \dots \quad\text{until}\quad
  f(x_\eta) \le f(x^+) - c\, \eta \langle \nabla f(x^+), P \nabla f(x^+)\rangle,

giving up (keeping :math:`x^+`) once :math:`\eta` falls below ``min_step``.
Every tried point costs one value-and-gradient call, so the gradient of the
point found is the last call's.

References:
  Chu, Gao, Ye, Udell, *Gradient Methods with Online Scaling Part II.
  Practical Aspects*, arXiv:2509.11007, 2025 (the lookahead); *Provable and
  Practical Online Learning Rate Adaptation with Hypergradient Descent*,
  arXiv:2502.11229, 2025 (the method it complements).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _blocks
from hdm_optax import _numerics

__all__ = ("LookaheadResult", "armijo_lookahead", "gated_lookahead")


class LookaheadResult(NamedTuple):
  r"""The point a lookahead ends at.

  Attributes:
    params: :math:`x_\eta`, or the start point if no step was accepted.
    value: f there.
    grad: grad f there.
    calls: value-and-gradient calls made (0 when the lookahead was off).
    moved: whether a step was accepted.
  """

  params: Any
  value: jax.Array
  grad: Any
  calls: jax.Array
  moved: jax.Array


def armijo_lookahead(
  value_and_grad_fn: Callable[[Any], tuple[jax.Array, Any]],
  params: Any,
  value: jax.Array,
  grad: Any,
  direction: Any,
  *,
  enabled: jax.Array,
  shrink: Any = 0.8,
  sufficient_decrease: Any = 0.5,
  min_step: Any = 1e-6,
) -> LookaheadResult:
  r"""Armijo backtracking from ``params`` along ``-direction``.

  Args:
    value_and_grad_fn: ``params -> (f, grad f)``; one call per tried point.
    params: the start point :math:`x^+`.
    value: :math:`f(x^+)`.
    grad: :math:`\nabla f(x^+)`.
    direction: p, the step is :math:`-\eta p` (OSGM-Best: :math:`P \nabla f(x^+)`).
    enabled: a boolean array; ``False`` makes no call and returns the start point.
    shrink: rho, the factor of eta after a failed try, in (0, 1).
    sufficient_decrease: c in :math:`f(x_\eta) \le f(x^+) - c\,\eta \langle
      \nabla f(x^+), p\rangle`.
    min_step: the search gives up once eta falls below this.

  Returns:
    A :class:`LookaheadResult`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax.pieces import backtracking
    >>> fun = lambda x: jnp.sum(x ** 2)
    >>> x = jnp.array([1.0, -2.0])
    >>> out = backtracking.armijo_lookahead(
    ...   jax.value_and_grad(fun), x, fun(x), 2 * x, 0.8 * x, enabled=jnp.asarray(True))
    >>> [round(float(v), 6) for v in out.params], int(out.calls)
    ([0.2, -0.4], 1)
  """
  dtype = jnp.result_type(value)
  c = lambda v: _numerics.cast(v, dtype)
  slope = _blocks.vdot(grad, direction)

  def cond(carry):
    eta, _, _, _, calls, moved = carry
    return ~moved & (eta >= c(min_step))

  def body(carry):
    eta, _, _, _, calls, _ = carry
    point = optax.tree.add_scale(params, -eta, direction)
    f_eta, g_eta = value_and_grad_fn(point)
    ok = jnp.isfinite(f_eta) & (f_eta <= value - c(sufficient_decrease) * eta * slope)
    return (jnp.where(ok, eta, c(shrink) * eta), point, f_eta, g_eta, calls + 1, ok)

  start = (
    jnp.where(enabled, c(1.0), c(0.0)),
    params,
    jnp.asarray(value, dtype),
    grad,
    jnp.zeros([], jnp.int32),
    jnp.asarray(False),
  )
  _, point, f_eta, g_eta, calls, moved = jax.lax.while_loop(cond, body, start)
  # A failed search keeps the start point (its value and gradient are known).
  return LookaheadResult(
    params=_numerics.keep_if(moved, point, params),
    value=jnp.where(moved, f_eta, value).astype(dtype),
    grad=_numerics.keep_if(moved, g_eta, grad),
    calls=calls,
    moved=moved,
  )


def gated_lookahead(growth: Any = 2.0) -> Callable[..., LookaheadResult]:
  r"""OSGM-Best's lookahead: :func:`armijo_lookahead` once L_hat exists, when the gradient grew.

  It runs when the trial is finite, the curvature estimate is formed and
  :math:`\|\nabla f(x^+)\| >` ``growth`` :math:`\|\nabla f(x)\|`.

  Returns:
    ``lookahead(vg, params, value, grad, direction, *, finite, estimating,
    grad_norm) -> LookaheadResult`` (``grad_norm`` is :math:`\|\nabla f(x)\|`).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax.pieces import backtracking
    >>> fun = lambda x: jnp.sum(x ** 2)
    >>> x = jnp.array([1.0, -2.0])
    >>> look = backtracking.gated_lookahead()(jax.value_and_grad(fun), x, fun(x), 2 * x, 0.8 * x,
    ...   finite=jnp.asarray(True), estimating=jnp.asarray(False), grad_norm=jnp.asarray(1.0))
    >>> [round(float(v), 6) for v in look.params], int(look.calls)
    ([0.2, -0.4], 1)
  """

  def run(vg, params, value, grad, direction, *, finite, estimating, grad_norm):
    enabled = finite & ~estimating & (_numerics.norm(grad) > growth * grad_norm)
    return armijo_lookahead(vg, params, value, grad, direction, enabled=enabled)

  return run
