r"""Schedules of HDM-Best's hypergradient step size eta_p.

Until a curvature estimate exists, HDM-Best uses
:math:`\eta_p = \eta_{p,0}\, d_k`, where the factor :math:`d_k` follows a
schedule (after that, :math:`\eta_p = 1/\hat L`). A :class:`Schedule` holds
the factor in a :class:`DecayState` and updates it once per iteration.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Appendix A (the decay
  is a refinement of the authors' published implementation).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from hdm_optax import _checks
from hdm_optax import _numerics

__all__ = ("DecayState", "Schedule", "constant", "step_decay")


class DecayState(NamedTuple):
  """State of a schedule.

  Attributes:
    factor: d_k, the multiplier of eta_p0 (1 at the start).
  """

  factor: jax.Array


class Schedule(NamedTuple):
  """A schedule of the factor d_k.

  Attributes:
    init: ``init(dtype) -> DecayState``.
    update: ``update(state, count, active) -> DecayState``: the factor of
      iteration ``count`` (1, 2, ...); ``active`` is False where the schedule
      must not move (HDM-Best: once L_hat exists, and on the probe).
  """

  init: Callable[[Any], DecayState]
  update: Callable[[DecayState, jax.Array, jax.Array], DecayState]


def constant() -> Schedule:
  """d_k = 1.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import decay
    >>> sched = decay.constant()
    >>> state = sched.update(sched.init(jnp.float32), jnp.asarray(50), jnp.asarray(True))
    >>> float(state.factor)
    1.0
  """
  return Schedule(
    init=lambda dtype: DecayState(factor=jnp.ones([], dtype)),
    update=lambda state, count, active: state,
  )


def step_decay(every: int = 50, rate: Any = 0.8, floor: Any = 1e-3) -> Schedule:
  r"""d <- max(rate d, floor) at iterations k = every, 2 every, ...

  HDM-Best applies the new factor to the P update of iteration k itself (the
  order that reproduces the published HDM-Best counts).

  Args:
    every: the period, in iterations (> 0).
    rate: the decay factor, in (0, 1].
    floor: the factor never goes below ``floor`` (>= 0).

  Returns:
    A :class:`Schedule`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import decay
    >>> sched = decay.step_decay(every=50, rate=0.5)
    >>> state = sched.init(jnp.float32)
    >>> for k in range(1, 101):
    ...   state = sched.update(state, jnp.asarray(k), jnp.asarray(True))
    >>> float(state.factor)
    0.25
  """

  _checks.check_positive("every", every)
  _checks.check_interval("rate", rate, 0, 1, lo_open=True)
  _checks.check_nonnegative("floor", floor)

  def update(state, count, active):
    factor = state.factor
    dtype = factor.dtype
    decay = active & (count % every == 0)
    new = jnp.maximum(_numerics.cast(rate, dtype) * factor, _numerics.cast(floor, dtype))
    return DecayState(factor=jnp.where(decay, new, factor).astype(dtype))

  return Schedule(init=constant().init, update=update)
