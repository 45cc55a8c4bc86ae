r"""Secant pieces: the last m pairs (s, y) of a run and the L-BFGS operator they define.

Every trial of an HDM-style iteration evaluates the gradient at a trial point;
:math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla f(x))` is a secant pair,
exact curvature information along s, free whether the trial is accepted or
not. :class:`SecantMemory` keeps the last m of them, :func:`two_loop` applies
the L-BFGS inverse-Hessian operator :math:`H_m` they define (O(mn), no n x n
matrix; a preconditioner operator ``P v = two_loop(memory, gamma, v)``), and
:func:`curvature_checked` is the acceptance rule that
:func:`hdm_optax.trial_lbfgs` uses with it.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial point whose
  gradient gives the pair); Liu and Nocedal, *On the limited memory BFGS method for large scale
  optimization*, Math. Programming 45, 1989; Nocedal and Wright, *Numerical
  Optimization*, 2nd ed., Algorithm 7.4.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax.methods import acceptance as acceptance_lib

__all__ = (
  "SecantMemory",
  "StepControl",
  "capped_step",
  "cubic_step",
  "curvature_checked",
  "evidence_step",
  "models_agree",
  "reset",
  "secant_memory",
  "secant_record",
  "secant_step",
  "two_loop",
)


class SecantMemory(NamedTuple):
  """The last m secant pairs, a circular buffer (the L-BFGS memory).

  Attributes:
    s: the steps :math:`s_i = x_i^+ - x_i`, each leaf with a leading axis of size m.
    y: the gradient changes :math:`y_i = \\nabla f(x_i^+) - \\nabla f(x_i)`, like ``s``.
    rho: (m,) :math:`1 / \\langle s_i, y_i \\rangle`; 0 marks an empty slot.
    head: the slot the next pair is written to (the newest pair is in ``head - 1``).
  """

  s: Any
  y: Any
  rho: jax.Array
  head: jax.Array


def secant_memory(params, size: int) -> SecantMemory:
  """An empty memory of ``size`` pairs shaped like ``params`` (2 ``size`` vectors of n).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import secant
    >>> mem = secant.secant_memory(jnp.zeros(3), 10)
    >>> mem.s.shape, int(mem.head)
    ((10, 3), 0)
  """
  zeros = jax.tree.map(lambda p: jnp.zeros((size,) + jnp.shape(p), jnp.result_type(p)), params)
  dtype = _common.params_dtype(params)
  return SecantMemory(
    s=zeros,
    y=jax.tree.map(jnp.copy, zeros),
    rho=jnp.zeros([size], dtype),
    head=jnp.zeros([], jnp.int32),
  )


def secant_record(memory: SecantMemory, s, y, keep) -> SecantMemory:
  """The memory with the pair (s, y) written over its oldest one where ``keep``.

  The caller decides ``keep`` (:func:`hdm_optax.trial_lbfgs`: a finite pair with
  :math:`\\langle s, y\\rangle > \\epsilon_p \\|s\\|\\|y\\|`); s and y must be finite.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import secant
    >>> mem = secant.secant_memory(jnp.zeros(2), 2)
    >>> mem = secant.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([2.0, 0.0]), True)
    >>> float(mem.rho[0]), int(mem.head)
    (0.5, 1)
  """
  size = memory.rho.shape[0]
  sy = optax.tree.vdot(s, y)
  rho = jnp.where(keep, 1 / jnp.where(keep, sy, 1), 0).astype(memory.rho.dtype)
  put = lambda stacked, new: jax.tree.map(
    lambda a, b: a.at[memory.head].set(jnp.where(keep, b, a[memory.head])), stacked, new
  )
  return SecantMemory(
    s=put(memory.s, s),
    y=put(memory.y, y),
    rho=memory.rho.at[memory.head].set(jnp.where(keep, rho, memory.rho[memory.head])),
    head=jnp.where(keep, (memory.head + 1) % size, memory.head).astype(jnp.int32),
  )


def reset(memory: SecantMemory, where) -> SecantMemory:
  """The memory emptied where ``where`` (every slot marked empty, the next pair in slot 0).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import secant
    >>> mem = secant.secant_memory(jnp.zeros(2), 2)
    >>> mem = secant.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([2.0, 0.0]), True)
    >>> float(secant.reset(mem, True).rho[0])
    0.0
  """
  return memory._replace(
    rho=jnp.where(where, 0, memory.rho).astype(memory.rho.dtype),
    head=jnp.where(where, 0, memory.head).astype(jnp.int32),
  )


def two_loop(memory: SecantMemory, gamma, vector):
  r"""The L-BFGS inverse-Hessian operator applied to ``vector``: :math:`H_m v`.

  The two-loop recursion (Nocedal and Wright, Algorithm 7.4) over the pairs
  of ``memory``, newest first, with :math:`H_0 = \gamma I`; empty slots
  (:math:`\rho_i = 0`) contribute nothing. O(mn) work, no n x n matrix. With
  no pair it is :math:`\gamma v`; with pairs, :math:`H_m y_i = s_i` for the
  newest pair :math:`(s_i, y_i)`.

  Args:
    memory: the pairs (:class:`SecantMemory`).
    gamma: the scalar of :math:`H_0`.
    vector: v, shaped like the params.

  Returns:
    :math:`H_m v`, shaped like ``vector``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import secant
    >>> mem = secant.secant_memory(jnp.zeros(2), 3)
    >>> mem = secant.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([4.0, 0.0]), True)
    >>> [float(v) for v in secant.two_loop(mem, 0.5, jnp.array([4.0, 2.0]))]
    [1.0, 1.0]
  """
  size = memory.rho.shape[0]
  dtype = memory.rho.dtype
  at = lambda stacked, i: jax.tree.map(lambda a: a[i], stacked)

  def first(k, carry):
    q, alphas = carry
    i = (memory.head - 1 - k.astype(jnp.int32)) % size  # newest to oldest
    alpha = memory.rho[i] * optax.tree.vdot(at(memory.s, i), q)
    q = optax.tree.add_scale(q, -alpha, at(memory.y, i))
    return q, alphas.at[i].set(alpha)

  q, alphas = jax.lax.fori_loop(0, size, first, (vector, jnp.zeros([size], dtype)))
  r = optax.tree.scale(jnp.asarray(gamma, dtype), q)

  def second(k, r):
    i = (memory.head + k.astype(jnp.int32)) % size  # oldest to newest
    beta = memory.rho[i] * optax.tree.vdot(at(memory.y, i), r)
    return optax.tree.add_scale(r, alphas[i] - beta, at(memory.s, i))

  return jax.lax.fori_loop(0, size, second, r)


def curvature_checked(
  band: float = 1e-10, curvature: float = 0.9, ulps: float = 1024.0
) -> acceptance_lib.AcceptanceRule:
  r"""No increase, or an increase within rounding along which the slope shrank.

  .. math::
    f(x^+) \le f(x) \quad\text{or}\quad
    \bigl(f(x^+) \le f(x) + \max(b, u\epsilon)\,|f(x)| \ \text{and}\
    |\langle \nabla f(x^+), s\rangle| \le c\,|\langle \nabla f(x), s\rangle|\bigr),

  s = x+ - x, b = ``band``, c = ``curvature`` (the strong Wolfe constant),
  u = ``ulps`` and :math:`\epsilon` the dtype's machine epsilon. Where f's
  change is below its rounding, the values cannot rank the two points, but
  the directional derivative can: a trial whose slope along the step fell by
  the Wolfe factor has passed the minimum along the step or come close to it.

  Args:
    band: b, the relative increase of f still treated as rounding (float64).
    curvature: c, in (0, 1).
    ulps: u, the band in units of the dtype's eps (float32's b).

  Returns:
    An :class:`hdm_optax.acceptance.AcceptanceRule` (it needs ``step=``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import secant
    >>> rule = secant.curvature_checked()
    >>> f = jnp.asarray(1.0, jnp.float32)  # float32: the band is 1024 eps = 1.2e-4
    >>> g, s = jnp.array([-1.0], jnp.float32), jnp.array([1.0], jnp.float32)
    >>> bool(rule.accept(f + 1e-5, f, jnp.array([0.1], jnp.float32), g, step=s))
    True
    >>> bool(rule.accept(f + 1e-5, f, jnp.array([-0.95], jnp.float32), g, step=s))
    False
  """

  def accept(trial_value, value, trial_grad, grad, step=None):
    eps = jnp.finfo(jnp.result_type(value)).eps
    width = jnp.maximum(jnp.asarray(band, value.dtype), ulps * eps) * jnp.abs(value)
    near = trial_value <= value + width
    slope, trial_slope = optax.tree.vdot(grad, step), optax.tree.vdot(trial_grad, step)
    flat = jnp.abs(trial_slope) <= curvature * jnp.abs(slope)
    return (trial_value <= value) | (near & flat)

  return acceptance_lib.AcceptanceRule(accept=accept)


# ----------------------------------------------------------------------------
# What a trial says about the line along its step, and the step control built on it
# ----------------------------------------------------------------------------


def secant_step(slope, trial_slope):
  r"""The minimiser along s of the quadratic with the two slopes: :math:`t_s = d_0 / (d_0 - d_1)`.

  :math:`d_0 = \langle \nabla f(x), s\rangle`, :math:`d_1 = \langle \nabla f(x^+),
  s\rangle`; t in units of the step (t = 1 is the trial). It is where the L-BFGS operator
  updated by this pair puts the minimum along s. NaN where the curvature along s,
  :math:`d_1 - d_0`, is not positive.

  Examples:
    >>> from hdm_optax import secant
    >>> float(secant.secant_step(-2.0, 2.0))
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
    >>> from hdm_optax import secant
    >>> float(secant.cubic_step(1.0, 1.0, -2.0, 2.0))  # f = 1 + 2 t (t - 1): the minimum at 0.5
    0.5
  """
  d1 = slope + trial_slope - 3 * (trial_value - value)
  disc = d1 * d1 - slope * trial_slope
  d2 = jnp.sqrt(jnp.where(disc > 0, disc, 0))
  den = trial_slope - slope + 2 * d2
  t = 1 - (trial_slope + d2 - d1) / jnp.where(den != 0, den, 1)
  return jnp.where((disc >= 0) & (den != 0) & jnp.isfinite(t), t, jnp.nan)


def models_agree(value, trial_value, slope, trial_slope, factor):
  """Whether :func:`cubic_step` and :func:`secant_step` agree within ``factor`` (both finite).

  Where they do, the pair's curvature describes f along s; where they do not (a step into
  an exponential wall: the secant's t is 1e-11, the cubic's 0.1), the pair would make the
  operator collapse along the gradient.

  Examples:
    >>> from hdm_optax import secant
    >>> bool(secant.models_agree(1.0, 1.0, -2.0, 2.0, 4.0))
    True
  """
  ratio = cubic_step(value, trial_value, slope, trial_slope) / secant_step(slope, trial_slope)
  return jnp.isfinite(ratio) & (ratio >= 1 / factor) & (ratio <= factor)


class StepControl(NamedTuple):
  r"""The factor alpha of a direction's proposal, updated from what each trial revealed.

  Attributes:
    init: ``init(dtype) -> alpha`` (a scalar of the params' dtype).
    update: ``update(alpha, *, value, trial_value, slope, trial_slope, finite, accepted,
      restart) -> alpha``: f(x), f(x+), :math:`\langle \nabla f(x), s\rangle`,
      :math:`\langle \nabla f(x^+), s\rangle` (s = x+ - x), whether the trial was finite
      and accepted, and the direction's restart signal (its memory emptied).
  """

  init: Callable[[Any], jax.Array]
  update: Callable[..., jax.Array]


def _ones(dtype):
  return jnp.ones([], dtype)


def capped_step(shrink: float = 0.5, grow: float = 1.5) -> StepControl:
  """alpha <= 1: ``shrink`` after a null step or a non-finite trial, ``min(1, grow alpha)``
  after an accepted one, 1 after a restart (the rule of ``trial_lbfgs`` until it learned
  from its trials; ``docs/secant.md``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import secant
    >>> rule = secant.capped_step()
    >>> a = rule.update(rule.init(jnp.float32), value=1.0, trial_value=2.0, slope=-1.0,
    ...                 trial_slope=3.0, finite=True, accepted=False, restart=False)
    >>> float(a)
    0.5
  """

  def update(alpha, *, value, trial_value, slope, trial_slope, finite, accepted, restart):
    del value, trial_value, slope, trial_slope, finite
    new = jnp.where(accepted, jnp.minimum(1, alpha * grow), alpha * shrink)
    return jnp.where(restart, 1, new).astype(alpha.dtype)

  return StepControl(init=_ones, update=update)


def _accepted_factor(alpha, slope, trial_slope, steep, extrapolate, lo):
  """alpha after an accepted trial (see :func:`evidence_step`)."""
  steep_still = trial_slope < steep * slope
  overshot = trial_slope > 0
  back = jnp.maximum(1, alpha * jnp.clip(secant_step(slope, trial_slope), lo, 1))
  above = jnp.where(overshot & jnp.isfinite(back), back, alpha)
  return jnp.where(steep_still, alpha * extrapolate, jnp.where(alpha > 1, above, 1))


def _null_factor(value, trial_value, slope, trial_slope, agree, lo, hi, shrink):
  """The factor of alpha after a finite rejected trial (see :func:`evidence_step`)."""
  cubic = cubic_step(value, trial_value, slope, trial_slope)
  agreed = models_agree(value, trial_value, slope, trial_slope, agree)
  t = jnp.where(agreed, cubic / secant_step(slope, trial_slope), cubic)
  return jnp.where(jnp.isfinite(t), jnp.clip(t, lo, hi), shrink)


def evidence_step(
  shrink: float = 0.5,
  steep: float = 0.9,
  extrapolate: float = 4.0,
  max_step: float = 1e6,
  bracket: tuple = (0.1, 0.5),
  agree: float = 3.0,
) -> StepControl:
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
    A :class:`StepControl`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import secant
    >>> rule = secant.evidence_step()
    >>> one = rule.init(jnp.float32)
    >>> float(rule.update(one, value=1.0, trial_value=0.5, slope=-1.0, trial_slope=-0.95,
    ...                   finite=True, accepted=True, restart=False))  # still steep: x4
    4.0
  """
  lo, hi = bracket

  def update(alpha, *, value, trial_value, slope, trial_slope, finite, accepted, restart):
    up = _accepted_factor(alpha, slope, trial_slope, steep, extrapolate, lo)
    null = _null_factor(value, trial_value, slope, trial_slope, agree, lo, hi, shrink)
    new = jnp.where(accepted, jnp.minimum(up, max_step), alpha * jnp.where(finite, null, shrink))
    return jnp.where(restart, 1, new).astype(alpha.dtype)

  return StepControl(init=_ones, update=update)
