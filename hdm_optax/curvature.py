r"""Estimates of the smoothness constant L used by HDM-Best.

Two pieces, both from the authors' published HDM-Best implementation (the
paper's Appendix A says only that "a local estimator of the smoothness
constant L can significantly enhance algorithm performance"):

- the *probe* (:func:`probe_point`, :func:`probe_lipschitz`): when no L is
  given, one gradient at :math:`x - \delta \nabla f(x)/\|\nabla f(x)\|` gives
  :math:`L \approx \|\nabla f(x_\delta) - \nabla f(x)\| / \delta`;
- the *curvature estimate* :math:`\hat L` (:func:`running_mean`): the mean
  of the ratios :math:`\|\nabla f(x^+) - \nabla f(x)\| / \|x^+ - x\|` over
  accepted steps, formed once a counter of accepted steps (+1 per accepted
  step, -2 down to 0 per null step) exceeds a threshold. Its whole state is
  one :class:`CurvatureState`.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Appendix A.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common

__all__ = (
  "CurvatureEstimate",
  "CurvatureState",
  "probe_lipschitz",
  "probe_offset",
  "probe_point",
  "random_direction",
  "random_directions",
  "random_probe",
  "running_max_probe",
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
    >>> from hdm_optax import curvature
    >>> est = curvature.running_mean(horizon=40)  # threshold 20
    >>> state = est.init(jnp.float32)
    >>> for _ in range(21):
    ...   state = est.record(state, accepted=jnp.asarray(True), step_norm=jnp.asarray(0.5),
    ...                      grad_change=jnp.asarray(1.0), frozen=jnp.asarray(False))
    >>> state, fired = est.fire(state)
    >>> bool(fired), float(state.l_hat), bool(state.active)
    (True, 2.0, False)
  """

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
    keep = accepted & state.active & (step_norm > _common.cast(min_step, dtype))
    ratio = jnp.where(keep, _common.safe_div(grad_change, step_norm), 0).astype(dtype)
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
    mean = _common.safe_div(state.ratio_sum, state.ratio_count.astype(dtype))
    l_hat = jnp.where(fired, mean, state.l_hat)
    return state._replace(l_hat=l_hat.astype(dtype), active=state.active & ~fired), fired

  return CurvatureEstimate(init=init, record=record, fire=fire)


def probe_point(params: Any, grad: Any, grad_sq: jax.Array, probe_size: Any) -> tuple[Any, Any]:
  r"""The probe point :math:`x - \delta \nabla f(x) / \|\nabla f(x)\|`.

  Args:
    params: x.
    grad: :math:`\nabla f(x)`.
    grad_sq: :math:`\|\nabla f(x)\|^2`.
    probe_size: relative length; :math:`\delta` = ``probe_size`` max(1, ||x||).

  Returns:
    ``(point, delta)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import curvature
    >>> x, g = jnp.array([3.0, 4.0]), jnp.array([0.0, 2.0])
    >>> point, delta = curvature.probe_point(x, g, jnp.asarray(4.0), 1e-2)
    >>> [round(float(v), 6) for v in point], round(float(delta), 6)
    ([3.0, 3.95], 0.05)
  """
  dtype = grad_sq.dtype
  delta = _common.cast(probe_size, dtype) * jnp.maximum(1, optax.tree.norm(params))
  point = optax.tree.add_scale(params, -_common.safe_div(delta, jnp.sqrt(grad_sq)), grad)
  return point, delta


def probe_lipschitz(grad_change: jax.Array, delta: jax.Array) -> jax.Array:
  """L from the probe: ``grad_change / delta``, or 1 if that is 0 or not finite.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import curvature
    >>> float(curvature.probe_lipschitz(jnp.asarray(0.5), jnp.asarray(0.05)))
    10.0
  """
  probed = grad_change / delta
  return jnp.where(jnp.isfinite(probed) & (probed > 0), probed, 1).astype(grad_change.dtype)


def random_directions(key: jax.Array, params: Any, num: int = 3) -> list[Any]:
  """``num`` directions shaped like ``params``, standard normal, each of unit norm.

  Args:
    key: a ``jax.random`` key.
    params: a pytree of floating arrays (their shapes and dtype).
    num: how many directions.

  Returns:
    A list of ``num`` pytrees like ``params``, each of Euclidean norm 1.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax import curvature
    >>> d = curvature.random_directions(jax.random.key(0), jnp.zeros(4), num=2)
    >>> [round(float(jnp.linalg.norm(v)), 6) for v in d]
    [1.0, 1.0]
  """
  leaves, treedef = jax.tree.flatten(params)
  out = []
  for k in jax.random.split(key, num):
    keys = jax.random.split(k, len(leaves))
    d = treedef.unflatten(
      [jax.random.normal(kk, jnp.shape(x), jnp.result_type(x)) for kk, x in zip(keys, leaves)]
    )
    out.append(optax.tree.scale(1 / optax.tree.norm(d), d))
  return out


def random_probe(
  value_and_grad_fn: Callable[[Any], tuple[jax.Array, Any]],
  params: Any,
  grad: Any,
  directions: list[Any],
  probe_size: Any = 1e-4,
  fallback: Any = 1e-5,
) -> jax.Array:
  r"""L as the largest gradient change along unit directions (one call each).

  .. math::
    L = \max_i \|\nabla f(x + \delta d_i) - \nabla f(x)\| / \delta,

  ``fallback`` if that is not finite or not positive. OSGM-Best's estimate of L
  at the start point (three random directions, delta = 1e-4).

  Args:
    value_and_grad_fn: ``params -> (f, grad f)``.
    params: x.
    grad: grad f(x).
    directions: unit directions d_i shaped like ``params`` (:func:`random_directions`).
    probe_size: delta.
    fallback: L when the ratios give none.

  Returns:
    L, a scalar of the params' dtype.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax import curvature
    >>> fun = lambda x: 0.5 * jnp.sum(jnp.array([1.0, 4.0]) * x ** 2)
    >>> x = jnp.array([1.0, 1.0])
    >>> d = [jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0])]
    >>> vg = jax.value_and_grad(fun)
    >>> float(curvature.random_probe(vg, x, jax.grad(fun)(x), d, probe_size=0.5))
    4.0
  """
  dtype = _common.params_dtype(params)
  delta = _common.cast(probe_size, dtype)
  ratios = []
  for d in directions:
    _, g_d = value_and_grad_fn(optax.tree.add_scale(params, delta, d))
    ratios.append(optax.tree.norm(optax.tree.sub(g_d, grad)) / delta)
  lip = jnp.max(jnp.stack(ratios))
  ok = jnp.isfinite(lip) & (lip > 0)
  return jnp.where(ok, lip, _common.cast(fallback, dtype)).astype(dtype)


def random_direction(key: jax.Array, index: Any, params: Any) -> Any:
  """The ``index``-th direction shaped like ``params``: standard normal, unit norm.

  Drawn from ``jax.random.fold_in(key, index)``, so ``index`` may be traced:
  one direction is generated at a time (the probes of :func:`probe_offset`).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax import curvature
    >>> d = curvature.random_direction(jax.random.key(0), 2, jnp.zeros(4))
    >>> round(float(jnp.linalg.norm(d)), 6)
    1.0
  """
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.fold_in(key, index), len(leaves))
  d = treedef.unflatten(
    [jax.random.normal(k, jnp.shape(x), jnp.result_type(x)) for k, x in zip(keys, leaves)]
  )
  return optax.tree.scale(1 / optax.tree.norm(d), d)


def probe_offset(key: jax.Array, index: Any, params: Any, probe_size: Any, active: Any) -> Any:
  r""":math:`\delta d_i` (:func:`random_direction`) when ``active``, else zeros.

  The random probe spread over updates: an update that probes evaluates the
  oracle at ``params + probe_offset(...)`` in place of its trial point, so
  the iteration keeps a single oracle call and no branch over the state
  (only the direction is drawn under a ``lax.cond``, so updates that do not
  probe draw nothing).

  Args:
    key: a ``jax.random`` key.
    index: i, the probe's number (traced).
    params: x (shapes and dtype).
    probe_size: delta.
    active: whether this update probes.

  Returns:
    A pytree like ``params``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from hdm_optax import curvature
    >>> off = curvature.probe_offset(jax.random.key(0), 0, jnp.zeros(3), 0.5, jnp.asarray(False))
    >>> [float(v) for v in off]
    [0.0, 0.0, 0.0]
  """
  dtype = _common.params_dtype(params)
  delta = _common.cast(probe_size, dtype)
  return jax.lax.cond(
    active,
    lambda: optax.tree.scale(delta, random_direction(key, index, params)),
    lambda: optax.tree.zeros_like(params),
  )


def running_max_probe(
  lipschitz: jax.Array,
  grad_change: jax.Array,
  probe_size: Any,
  active: Any,
  fallback: Any = 1e-5,
) -> tuple[jax.Array, jax.Array]:
  r"""One probe of :func:`random_probe` spread over updates.

  Args:
    lipschitz: the largest ratio so far (0 before the first probe).
    grad_change: :math:`\|\nabla f(x + \delta d_i) - \nabla f(x)\|`.
    probe_size: delta.
    active: whether this update probed.
    fallback: L when the ratios give none.

  Returns:
    ``(running, final)``: the largest ratio including this one (``lipschitz``
    if not ``active``; NaN once a ratio was NaN, as :func:`random_probe`'s
    max), and L if this was the last probe (``fallback`` where ``running`` is
    not finite or not positive).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import curvature
    >>> run, final = curvature.running_max_probe(jnp.asarray(3.0), jnp.asarray(0.5), 0.1, True)
    >>> float(run), float(final)
    (5.0, 5.0)
  """
  dtype = lipschitz.dtype
  ratio = grad_change / _common.cast(probe_size, dtype)
  running = jnp.where(active, jnp.maximum(lipschitz, ratio), lipschitz).astype(dtype)
  ok = jnp.isfinite(running) & (running > 0)
  return running, jnp.where(ok, running, _common.cast(fallback, dtype)).astype(dtype)
