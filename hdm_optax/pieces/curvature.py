r"""Estimates of the smoothness constant L used by the momentum variants.

Two pieces:

- a *probe* (:class:`Probe`): when no L is given, gradients at
  :math:`x + o_i` give :math:`L_0 = \max_i \|\nabla f(x + o_i) - \nabla
  f(x)\| / \delta_i`; one offset along :math:`-\nabla f(x)`
  (:func:`gradient_probe`, the authors' HDM-Best code) or along random
  directions (:func:`random_probe`, the authors' OSGM-Best code);
- the *curvature estimate* :math:`\hat L` (:func:`running_mean`, the
  authors' HDM-Best code; the paper's Appendix A says only that "a local
  estimator of the smoothness constant L can significantly enhance algorithm
  performance"): the mean of the ratios :math:`\|\nabla f(x^+) - \nabla
  f(x)\| / \|x^+ - x\|` over accepted steps, formed once a counter of
  accepted steps (+1 per accepted step, -2 down to 0 per null step) exceeds a
  threshold. Its whole state is one :class:`CurvatureState`.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Appendix A; *Gradient
  Methods with Online Scaling Part II*, arXiv:2509.11007, 2025.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from hdm_optax import _blocks
from hdm_optax import _checks
from hdm_optax import _numerics

__all__ = (
  "CurvatureEstimate",
  "CurvatureState",
  "Probe",
  "gradient_probe",
  "probe_direction",
  "random_probe",
  "running_mean",
)


class CurvatureState(NamedTuple):
  """State of the curvature estimate.

  Attributes:
    ratio_sum: sum of the recorded ratios ||grad f(x+) - grad f(x)|| / ||x+ - x||.
    ratio_count: number of recorded ratios.
    counter: +1 per accepted step, -2 (floor 0) per null step.
    l_hat: L_hat, the estimate (0 until it is formed).
    active: whether the estimate is still being formed (ratios are recorded
      and, in HDM-Best, eta_p decays only while it is).
  """

  ratio_sum: jax.Array
  ratio_count: jax.Array
  counter: jax.Array
  l_hat: jax.Array
  active: jax.Array


class CurvatureEstimate(NamedTuple):
  """A curvature estimator: three pure functions over :class:`CurvatureState`.

  Attributes:
    init: ``init(dtype) -> CurvatureState``.
    record: ``record(state, *, accepted, step_norm, grad_change, frozen)``
      ``-> CurvatureState``: one iteration's evidence (``frozen``: leave the
      counter as it is, e.g. on HDM-Best's probe).
    fire: ``fire(state) -> (state, fired)``: forms L_hat when the counter
      exceeds the threshold; ``fired`` tells the caller to reset what depends
      on it (HDM-Best restarts AdaGrad's U).
  """

  init: Callable[[Any], CurvatureState]
  record: Callable[..., CurvatureState]
  fire: Callable[[CurvatureState], tuple[CurvatureState, jax.Array]]


def running_mean(
  horizon: Any = 1000, min_step: Any = 1e-3, enabled: bool = True
) -> CurvatureEstimate:
  r"""L_hat as the mean of the recorded gradient-change ratios.

  On each accepted step with :math:`\|x^+ - x\| >` ``min_step`` while the
  estimate is active, records :math:`\|\nabla f(x^+) - \nabla f(x)\| /
  \|x^+ - x\|`. Once the counter exceeds
  :math:`\max(\min(K/4, 200), 20)`, K = ``horizon``, and at least one ratio
  is recorded, :math:`\hat L` is their mean and the estimate stops.

  Args:
    horizon: K, the step budget of the run.
    min_step: shortest step whose ratio is recorded.
    enabled: ``False`` never forms L_hat (the state is inactive from the start).

  Returns:
    A :class:`CurvatureEstimate`.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import curvature
    >>> est = curvature.running_mean(horizon=40)  # threshold 20
    >>> state = est.init(jnp.float32)
    >>> for _ in range(21):
    ...   state = est.record(state, accepted=jnp.asarray(True), step_norm=jnp.asarray(0.5),
    ...                      grad_change=jnp.asarray(1.0), frozen=jnp.asarray(False))
    >>> state, fired = est.fire(state)
    >>> bool(fired), float(state.l_hat), bool(state.active)
    (True, 2.0, False)
  """
  _checks.check_positive("horizon", horizon)
  _checks.check_nonnegative("min_step", min_step)

  def init(dtype):
    return CurvatureState(
      ratio_sum=jnp.zeros([], dtype),
      ratio_count=jnp.zeros([], jnp.int32),
      counter=jnp.zeros([], jnp.int32),
      l_hat=jnp.zeros([], dtype),
      active=jnp.asarray(enabled),
    )

  def record(state, *, accepted, step_norm, grad_change, frozen):
    dtype = state.ratio_sum.dtype
    keep = accepted & state.active & (step_norm > _numerics.cast(min_step, dtype))
    ratio = jnp.where(keep, _numerics.safe_div(grad_change, step_norm), 0).astype(dtype)
    counter = jnp.where(accepted, state.counter + 1, jnp.maximum(state.counter - 2, 0))
    return state._replace(
      ratio_sum=state.ratio_sum + ratio,
      ratio_count=state.ratio_count + keep.astype(jnp.int32),
      counter=jnp.where(frozen, state.counter, counter),
    )

  def fire(state):
    if not enabled:
      return state, jnp.asarray(False)
    dtype = state.ratio_sum.dtype
    threshold = jnp.maximum(jnp.minimum(jnp.asarray(horizon, dtype) / 4, 200), 20)
    fired = state.active & (state.counter.astype(dtype) > threshold) & (state.ratio_count > 0)
    mean = _numerics.safe_div(state.ratio_sum, state.ratio_count.astype(dtype))
    l_hat = jnp.where(fired, mean, state.l_hat)
    return state._replace(l_hat=l_hat.astype(dtype), active=state.active & ~fired), fired

  return CurvatureEstimate(init=init, record=record, fire=fire)


class Probe(NamedTuple):
  r"""A measurement of L_0: ``num`` oracle calls at :math:`x + o_i`, x left in place.

  .. math::
    L_0 = \max_i \|\nabla f(x + o_i) - \nabla f(x)\| / \delta_i,

  ``finish`` turning a ratio that is not finite or not positive into a fallback.

  Attributes:
    num: the number of probes (one value-and-gradient call each).
    offset: ``offset(index, params, grad, active) -> (o_i, delta_i)``; ``index``
      may be traced; where ``active`` is False the offset may be zeros (the
      update does not probe).
    finish: ``finish(running_max) -> L_0``.
  """

  num: int
  offset: Callable[..., tuple[Any, jax.Array]]
  finish: Callable[[jax.Array], jax.Array]


def _finisher(fallback):
  def finish(running):
    ok = jnp.isfinite(running) & (running > 0)
    return jnp.where(ok, running, _numerics.cast(fallback, running.dtype)).astype(running.dtype)

  return finish


def gradient_probe(size: Any = 1e-4, fallback: Any = 1.0) -> Probe:
  r"""One probe along :math:`-\nabla f(x)`, as the authors' HDM-Best code measures L.

  :math:`o = -\delta \nabla f(x) / \|\nabla f(x)\|`, :math:`\delta` =
  ``size`` max(1, ||x||); ``fallback`` if the ratio is 0 or not finite.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import curvature
    >>> probe = curvature.gradient_probe(1e-2)
    >>> offset, delta = probe.offset(0, jnp.array([3.0, 4.0]), jnp.array([1.5, 2.0]), True)
    >>> [round(float(v), 6) for v in offset], round(float(delta), 6)
    ([-0.03, -0.04], 0.05)
    >>> float(probe.finish(jnp.asarray(jnp.nan)))
    1.0
  """

  _checks.check_positive("size", size)

  def offset(index, params, grad, active):
    del index, active
    grad_sq = _blocks.vdot(grad, grad)
    delta = _numerics.cast(size, grad_sq.dtype) * jnp.maximum(1, _numerics.norm(params))
    return optax.tree.scale(-_numerics.safe_div(delta, _numerics.sqrt(grad_sq)), grad), delta

  return Probe(num=1, offset=offset, finish=_finisher(fallback))


def probe_direction(key: jax.Array, index: Any, params: Any) -> Any:
  """The ``index``-th random direction shaped like ``params``: standard normal, unit norm.

  Drawn over the flattened params from ``jax.random.fold_in(key, index)``, so
  the directions do not depend on how the params split into leaves, and
  ``index`` may be traced.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax.pieces import curvature
    >>> d = curvature.probe_direction(jax.random.key(0), 2, {"w": jnp.zeros(3), "b": jnp.zeros(())})
    >>> round(float(jnp.sqrt(jnp.sum(d["w"] ** 2) + d["b"] ** 2)), 6)
    1.0
  """
  flat, unravel = ravel_pytree(params)
  key = jax.random.split(jax.random.fold_in(key, index), 1)[0]
  d = jax.random.normal(key, flat.shape, flat.dtype)
  return unravel(optax.tree.scale(1 / optax.tree.norm(d), d))


def random_probe(num: int = 3, seed: int = 0, size: Any = 1e-4, fallback: Any = 1e-5) -> Probe:
  r"""``num`` probes along random unit directions (:func:`probe_direction`), as OSGM-Best's.

  :math:`o_i = \delta d_i`, :math:`\delta` = ``size``; ``fallback`` if the
  largest ratio is 0 or not finite. On a CPU the direction is drawn only where
  the update probes (under a ``lax.cond``); elsewhere it is drawn at every
  update and selected (``lax.platform_dependent``): a GPU reads a
  ``lax.cond``'s predicate on the host, a round trip that stalls every
  iteration, while the draw costs one kernel that writes a vector of n. Both give
  the same offsets.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax.pieces import curvature
    >>> probe = curvature.random_probe(num=2, size=0.5)
    >>> offset, delta = probe.offset(1, jnp.zeros(3), jnp.zeros(3), jnp.asarray(True))
    >>> round(float(jnp.linalg.norm(offset)), 6), float(delta)
    (0.5, 0.5)
  """
  _checks.check_positive("size", size)
  _checks.check_positive("num", num)
  key = jax.random.key(seed)

  def offset(index, params, grad, active):
    del grad
    delta = _numerics.cast(size, _numerics.params_dtype(params))
    drawn = lambda: optax.tree.scale(delta, probe_direction(key, index, params))
    zeros = lambda: optax.tree.zeros_like(params)
    off = jax.lax.platform_dependent(
      cpu=lambda: jax.lax.cond(active, drawn, zeros),
      default=lambda: optax.tree.where(active, drawn(), zeros()),
    )
    return off, delta

  return Probe(num=num, offset=offset, finish=_finisher(fallback))
