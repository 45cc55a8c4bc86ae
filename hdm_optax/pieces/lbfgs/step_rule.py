r"""trial_lbfgs's step rule: accept, the next alpha and the pair's trust, from f, f+ and two slopes.

The shell hands the rule one :class:`hdm_optax.pieces.shell.Evidence` per trial: f and f+ at
the two ends of the step s and the slopes :math:`d_0 = \langle \nabla f(x), s\rangle`,
:math:`d_1 = \langle \nabla f(x^+), s\rangle`. From these four numbers :func:`evidence_step`
decides whether the trial is accepted, the factor alpha of the next trial, and whether the
trial's secant pair describes f along s (so that the direction may keep it). The models of f
along s it reads are :func:`secant_minimiser`, :func:`cubic_minimiser` and
:func:`models_agree`; the acceptance test is :func:`curvature_checked`.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation with
  Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithm 1, line 3 (the null step);
  Nocedal and Wright, *Numerical Optimization*, 2nd ed., Section 3.5 (interpolation by the
  cubic through two values and two slopes, eq. (3.59)); Hager, Zhang, SIAM J. Optim. 16(1),
  2005 (a decision by slopes where values cancel).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hdm_optax import _checks
from hdm_optax import _numerics
from hdm_optax.pieces import shell

__all__ = (
  "EvidenceState",
  "cubic_minimiser",
  "curvature_checked",
  "evidence_step",
  "models_agree",
  "noise_sample",
  "secant_minimiser",
  "unseen_decrease",
)

# The strong Wolfe constant of the acceptance test (curvature_checked's default).
_WOLFE = 0.9
# The null steps in a row after which an increase within f's noise may be accepted: one null
# step is the ordinary interpolation; a second means the cubic's step failed as well.
_NULL_RUN = 2


def secant_minimiser(slope, trial_slope):
  r"""The minimiser along s of the quadratic with the two slopes: :math:`t_s = d_0 / (d_0 - d_1)`.

  t in units of the step (t = 1 is the trial). It is where the L-BFGS operator updated by
  this pair puts the minimum along s. NaN where the curvature along s, :math:`d_1 - d_0`, is
  not positive.

  Examples:
    >>> from hdm_optax.pieces.lbfgs import step_rule
    >>> float(step_rule.secant_minimiser(-2.0, 2.0))
    0.5
  """
  slope, trial_slope = jnp.asarray(slope), jnp.asarray(trial_slope)
  curved = trial_slope > slope
  return jnp.where(curved, slope / jnp.where(curved, slope - trial_slope, 1), jnp.nan)


def cubic_minimiser(value, trial_value, slope, trial_slope):
  r"""The minimiser in t of the cubic through :math:`(0, f, d_0)` and :math:`(1, f^+, d_1)`.

  Nocedal and Wright, eq. (3.59), on [0, 1]; NaN where the cubic has no local minimiser.
  Unlike :func:`secant_minimiser` it uses the two values as well, so it sees where the
  quadratic model along s is wrong (a wall, a flat stretch).

  Examples:
    >>> from hdm_optax.pieces.lbfgs import step_rule
    >>> float(step_rule.cubic_minimiser(1.0, 1.0, -2.0, 2.0))  # f = 1 + 2 t (t - 1)
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
  """Whether :func:`cubic_minimiser` and :func:`secant_minimiser` agree within ``factor``.

  Both must be finite. Where they agree, the pair's curvature describes f along s; where
  they do not (a step into an exponential wall), the pair would make the operator collapse
  along the gradient.

  Examples:
    >>> from hdm_optax.pieces.lbfgs import step_rule
    >>> bool(step_rule.models_agree(1.0, 1.0, -2.0, 2.0, 4.0))
    True
  """
  cubic = cubic_minimiser(value, trial_value, slope, trial_slope)
  ratio = cubic / secant_minimiser(slope, trial_slope)
  return jnp.isfinite(ratio) & (ratio >= 1 / factor) & (ratio <= factor)


def _rounding_width(value, band: Any = 1e-10, ulps=1024.0) -> jax.Array:
  r""":math:`\max(b, u\epsilon)\,|f|`: the change of f still treated as its rounding."""
  eps = jnp.finfo(jnp.result_type(value)).eps
  return jnp.maximum(jnp.asarray(band, value.dtype), ulps * eps) * jnp.abs(value)


def curvature_checked(
  value, trial_value, slope, trial_slope, band: Any = 1e-10, curvature: Any = 0.9, ulps=1024.0
) -> jax.Array:
  r"""No increase of f, or an increase within rounding along which the slope shrank.

  .. math::
    f(x^+) \le f(x) \quad\text{or}\quad
    \bigl(f(x^+) \le f(x) + \max(b, u\epsilon)\,|f(x)| \ \text{and}\ |d_1| \le c\,|d_0|\bigr),

  b = ``band``, c = ``curvature`` (the strong Wolfe constant), u = ``ulps`` and
  :math:`\epsilon` the dtype's machine epsilon. Where f's change is below its rounding, the
  values cannot rank the two points, but the directional derivative can: a trial whose slope
  along the step fell by the Wolfe factor has passed the minimum along the step or come close
  to it.

  Args:
    value: f(x).
    trial_value: :math:`f(x^+)`.
    slope: :math:`d_0 = \langle \nabla f(x), s\rangle`.
    trial_slope: :math:`d_1 = \langle \nabla f(x^+), s\rangle`.
    band: b, the relative increase of f still treated as rounding (float64).
    curvature: c, in (0, 1).
    ulps: u, the band in units of the dtype's eps (float32's b).

  Returns:
    Whether the trial is accepted (a boolean 0-d array).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces.lbfgs import step_rule
    >>> f = jnp.asarray(1.0, jnp.float32)  # float32: the band is 1024 eps = 1.2e-4
    >>> bool(step_rule.curvature_checked(f, f + 1e-5, -1.0, 0.1))
    True
    >>> bool(step_rule.curvature_checked(f, f + 1e-5, -1.0, -0.95))
    False
  """
  near = trial_value <= value + _rounding_width(value, band, ulps)
  flat = jnp.abs(trial_slope) <= curvature * jnp.abs(slope)
  return (trial_value <= value) | (near & flat)


def unseen_decrease(value, trial_value, slope, trial_slope, curvature: Any = 0.9) -> jax.Array:
  r"""A trial whose decrease the slopes show and the values cannot: too short for f's rounding.

  :math:`d_0 < 0`, :math:`|d_1 - d_0| \le (1 - c)\,|d_0|` (the slope barely moved: f falls
  all along s, by about :math:`|d_0|`) and :math:`f^+ \le f + \max(10^{-10},
  1024\epsilon)\,|f|` (:func:`curvature_checked`'s band: f's change is below what its values
  resolve). Such a trial is rejected where f's rounding makes :math:`f^+` compare higher;
  a shorter trial along the same line would show a smaller decrease under the same rounding.
  :func:`evidence_step` lengthens the next one instead (alpha times ``extrapolate``) where
  the memory already restarted at this x (without it, the shortened trials reach x's
  resolution and the memory restarts, which is what a collapsed operator needs). A rise
  beyond the band along an unmoved slope (a bump of f between x and :math:`x^+`) is
  interpolated as any other rejected trial.

  Examples:
    >>> from hdm_optax.pieces.lbfgs import step_rule
    >>> bool(step_rule.unseen_decrease(63.4, 63.4 + 6e-11, -6e-12, -6e-12))
    True
    >>> bool(step_rule.unseen_decrease(1.5e5, 2.6e5, -1.5e5, -1.6e5))  # beyond the band
    False
  """
  value, trial_value = jnp.asarray(value), jnp.asarray(trial_value)
  slope, trial_slope = jnp.asarray(slope), jnp.asarray(trial_slope)
  linear = (slope < 0) & (jnp.abs(trial_slope - slope) <= (1 - curvature) * jnp.abs(slope))
  return linear & (trial_value <= value + _rounding_width(value))


def _accepted_factor(alpha, slope, trial_slope, steep, extrapolate, lo):
  """alpha after an accepted trial (see :func:`evidence_step`)."""
  steep_still = trial_slope < steep * slope
  overshot = trial_slope > 0
  t_s = secant_minimiser(slope, trial_slope)
  curved = ~jnp.isnan(t_s)  # NaN (no minimiser) kept out of the product's derivative
  back = jnp.maximum(1, alpha * jnp.clip(jnp.where(curved, t_s, 1), lo, 1))
  above = jnp.where(overshot & curved, back, alpha)
  return jnp.where(steep_still, alpha * extrapolate, jnp.where(alpha > 1, above, 1))


def _null_factor(cubic, secant, agreed, lo, hi, shrink):
  """The factor of alpha after a finite rejected trial (see :func:`evidence_step`)."""
  secant = jnp.where(agreed, secant, 1)  # NaN kept out of the quotient's derivative
  t = jnp.where(agreed, cubic / secant, cubic)
  return jnp.where(jnp.isfinite(t), jnp.clip(t, lo, hi), shrink)


class EvidenceState(NamedTuple):
  """:func:`evidence_step`'s state.

  Attributes:
    alpha: the factor of the next trial.
    nulls: the null steps in a row (a restart of the direction's memory keeps it).
    noise: the largest :func:`noise_sample` of those null steps (0 after an accepted trial).
    restarted: the direction's memory restarted since the last accepted trial (x has not
      moved since: a second restart would repeat the same trials).
  """

  alpha: jax.Array
  nulls: jax.Array
  noise: jax.Array
  restarted: jax.Array


def noise_sample(value, trial_value, slope, trial_slope, curvature: Any = 0.9) -> jax.Array:
  r"""f's noise seen by one trial: :math:`|f^+ - f - (d_0 + d_1)/2|` where the slope barely moved.

  Where :math:`d_0 < 0` and :math:`|d_1 - d_0| \le (1 - c)\,|d_0|` (c = ``curvature``), the
  gradient says f is linear along s to within a tenth of its slope, so the trapezoid
  :math:`(d_0 + d_1)/2` predicts :math:`f^+ - f` of a smooth f to within
  :math:`(1 - c)|d_0|/2`; a residual far above that is f's evaluation noise (rounding that
  the gradient does not carry). The sample is the whole residual, a smooth f's share
  included. 0 elsewhere, and where a value is not finite. A jump of f (a discontinuity)
  moves the gradient too, so its trials are not samples.

  Examples:
    >>> from hdm_optax.pieces.lbfgs import step_rule
    >>> float(step_rule.noise_sample(0.0, 0.5, -0.25, -0.25))  # up 0.5 where it falls 0.25
    0.75
    >>> float(step_rule.noise_sample(1.0, 0.5, -1.0, 0.0))  # the slope moved: no sample
    0.0
  """
  value, trial_value = jnp.asarray(value), jnp.asarray(trial_value)
  slope, trial_slope = jnp.asarray(slope), jnp.asarray(trial_slope)
  moved = jnp.abs(trial_slope - slope)
  linear = (slope < 0) & (moved <= (1 - curvature) * jnp.abs(slope))
  finite = jnp.isfinite(trial_value) & jnp.isfinite(value) & jnp.isfinite(trial_slope)
  rise = jnp.where(finite, trial_value - value - (slope + trial_slope) / 2, 0)
  return jnp.where(finite & linear, jnp.abs(rise), 0).astype(value.dtype)


def _within_noise(state: EvidenceState, e, curvature) -> jax.Array:
  """After a null run, an increase within the run's noise along which the slope shrank."""
  flat = (e.slope < 0) & (jnp.abs(e.trial_slope) <= curvature * jnp.abs(e.slope))
  rise = e.trial_value - e.value
  quiet = (state.noise > 0) & (rise <= state.noise)
  return (state.nulls >= _NULL_RUN) & flat & quiet


def _next_state(state: EvidenceState, e, accepted, alpha, curvature) -> EvidenceState:
  """alpha, and the null run's count and noise (both 0 after an accepted trial)."""
  seen = noise_sample(e.value, e.trial_value, e.slope, e.trial_slope, curvature)
  seen = jnp.where(e.finite & ~e.probe, seen, 0)
  noise = jnp.where(accepted, 0, jnp.maximum(state.noise, seen)).astype(state.noise.dtype)
  nulls = jnp.where(accepted, 0, state.nulls + (~e.probe).astype(state.nulls.dtype))
  restarted = ~accepted & state.restarted
  return EvidenceState(alpha=alpha, nulls=nulls, noise=noise, restarted=restarted)


def evidence_step(
  shrink: float = 0.5,
  steep: float = 0.9,
  extrapolate: float = 4.0,
  max_step: float = 1e6,
  bracket: tuple = (0.1, 0.5),
  agree: float = 3.0,
) -> shell.StepRule:
  r"""trial_lbfgs's step rule: accept, alpha and the pair's trust from f, f+, :math:`d_0, d_1`.

  *Acceptance*: :func:`curvature_checked` (no increase of f, or one within rounding along
  which the slope shrank), for a finite trial that is no probe. After two or more null steps
  in a row (restarts of the memory included: x has not moved), also an increase within f's
  noise along which the slope shrank (:math:`d_0 < 0`, :math:`|d_1| \le 0.9\,|d_0|`): the
  noise is the largest :func:`noise_sample` of the null run's trials, the part of
  :math:`f^+ - f` that the slopes cannot explain where they say f is linear along s. Where f
  is computed from terms that cancel (CUTEst's PENALTY3: terms of 1e9, f = -1e-3), its
  rounding exceeds the decrease left and every trial near x compares higher than a value of
  f(x) that was rounded low; the slopes (the gradient is not rounded with them) still say
  where f goes down. *Departure*: neither HDM nor L-BFGS accepts an increase of f; the
  value reported is still f at the reported point. A jump of f moves the gradient too, so
  the run's noise stays 0 on a discontinuity whose trials are all that it sees.

  *The pair*: an accepted trial's pair may be kept; a rejected trial's only where the cubic
  through f, f+, :math:`d_0, d_1` and the secant of the slopes agree on where the minimum
  along s lies, within the factor ``agree`` (:func:`models_agree`).

  *alpha*: after an accepted trial whose slope is still steep, :math:`d_1 < c\,d_0`
  (c = ``steep``, the strong Wolfe constant), alpha is multiplied by ``extrapolate`` (up to
  ``max_step``). After other accepted trials, alpha returns to 1 (the quasi-Newton step);
  above 1 it stays, or, where the trial passed the minimum along s (:math:`d_1 > 0`), falls
  by the secant's :math:`t_s` (not below 1). After a rejected trial alpha is multiplied by
  the minimiser of the cubic (:func:`cubic_minimiser`) relative to the secant's (the
  operator, updated by this pair, already moves the minimum along s to :math:`t_s`), or by
  the cubic's own where the two disagree, clipped to ``bracket``; by ``shrink`` where the
  cubic has no minimiser or the trial was not finite; by ``extrapolate`` (up to
  ``max_step``) where the trial was too short for f's rounding (:func:`unseen_decrease`: the
  slope did not move and f rose within the acceptance band) after a restart of the memory
  at this x: shortened, the trials would reach x's resolution, where the memory restarts
  into the same trials again. A restart of the direction's memory
  sets alpha = 1 (the shell restarts the rule).

  Args:
    shrink: the factor after a non-finite trial, or a rejected one without a cubic
      minimiser, in (0, 1).
    steep: c in (0, 1).
    extrapolate: the factor while steep, >= 1.
    max_step: the largest alpha.
    bracket: (lo, hi), the safeguard of the interpolated factor after a rejected trial.
    agree: the factor within which the cubic and the secant must agree, >= 1.

  Returns:
    A :class:`hdm_optax.pieces.shell.StepRule` whose state is an :class:`EvidenceState`
    (alpha, the null steps in a row and their noise).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import shell
    >>> from hdm_optax.pieces.lbfgs import step_rule
    >>> rule = step_rule.evidence_step()
    >>> evidence = shell.Evidence(  # f = 1, f+ = 0.5, d0 = -1, d1 = -0.95: still steep
    ...   jnp.asarray(1.0), jnp.asarray(0.5), None, None, None, jnp.asarray(-1.0),
    ...   jnp.asarray(-0.95), jnp.asarray(True), jnp.asarray(False))
    >>> verdict = rule.judge(rule.init(jnp.float32), evidence)
    >>> bool(verdict.accepted), float(verdict.state.alpha), bool(verdict.keep_pair)
    (True, 4.0, True)

  References:
    Nocedal and Wright, *Numerical Optimization*, 2nd ed., Section 3.5; Hager and Zhang,
    SIAM J. Optim. 16(1), 2005 (the approximate Wolfe conditions: a decision by slopes
    where the values cannot decide); More and Wild, SIAM J. Sci. Comput. 33(3), 2011
    (f's noise estimated from its values along a line).
  """
  lo, hi = bracket
  _checks.check_interval("shrink", shrink, 0, 1, lo_open=True, hi_open=True)
  _checks.check_interval("steep", steep, 0, 1, lo_open=True, hi_open=True)
  _checks.check_at_least("extrapolate", extrapolate, 1)
  _checks.check_at_least("agree", agree, 1)
  _checks.check_finite("agree", agree)

  def judge(state, evidence):
    e, alpha = evidence, state.alpha
    c = lambda x: _numerics.cast(x, e.value.dtype)
    test = curvature_checked(e.value, e.trial_value, e.slope, e.trial_slope, curvature=_WOLFE)
    test = test | _within_noise(state, e, _WOLFE)
    accepted = ~e.probe & e.finite & test
    cubic = cubic_minimiser(e.value, e.trial_value, e.slope, e.trial_slope)
    secant = secant_minimiser(e.slope, e.trial_slope)
    ratio = cubic / secant
    agreed = jnp.isfinite(ratio) & (ratio >= 1 / c(agree)) & (ratio <= c(agree))
    up = _accepted_factor(alpha, e.slope, e.trial_slope, steep, extrapolate, lo)
    null = _null_factor(cubic, secant, agreed, lo, hi, shrink)
    # Too short for f's rounding after a restart at this x: lengthened, not shortened down to
    # x's resolution, where the memory would restart into the same trials (unseen_decrease).
    unseen = unseen_decrease(e.value, e.trial_value, e.slope, e.trial_slope, _WOLFE)
    unseen = unseen & state.restarted
    null = jnp.where(unseen, c(extrapolate), null)
    factor = jnp.where(e.finite, null, shrink)
    new = jnp.minimum(jnp.where(accepted, up, alpha * factor), max_step)
    nxt = _next_state(state, e, accepted, new.astype(alpha.dtype), _WOLFE)
    return shell.Verdict(accepted=accepted, state=nxt, keep_pair=accepted | agreed)

  def init(dtype):
    ones, zeros = jnp.ones([], dtype), jnp.zeros([], dtype)
    return EvidenceState(ones, jnp.zeros([], jnp.int32), zeros, jnp.zeros([], bool))

  def restart(state, dtype):  # x stays: the null run and its noise go on
    fresh = init(dtype)._replace(nulls=state.nulls, noise=state.noise)
    return fresh._replace(restarted=jnp.ones([], bool))

  return shell.StepRule(
    init=init, step_size=lambda state: state.alpha, judge=judge, restart=restart
  )
