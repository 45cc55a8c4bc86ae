"""What every HDM state holds besides its method's own fields: :class:`HDMInfo` (the
update's diagnostics and oracle counts) and the oracle cache's fields as ``init`` sets them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


class HDMInfo(NamedTuple):
  """Diagnostics of the last update, kept in every HDM state as ``info``.

  Attributes:
    accepted: whether the trial point became the new iterate (False on a null
      step or on a non-finite trial point).
    hypergrad_norm: Euclidean norm of the hypergradient used to update P
      (and B or beta when learned), at the last update (0 if it was not finite).
    num_null_steps: number of updates so far that kept the iterate.
    null_run: number of consecutive null steps up to and including the last
      update (0 after an accepted one); a run that only makes null steps has
      stalled (``hdm_optax.solve`` reports it).
    num_value_evals: objective evaluations made by ``update`` so far.
    num_grad_evals: gradient evaluations made by ``update`` so far.
    num_stale_updates: updates so far that received params other than the
      point of the cached f and grad f together with the cached ``value``:
      the value and gradient they were given belong to another point
      (``hdm_optax._stale.track_point``). 0 in every correct loop.
    point_sum: the fingerprint of the point of the cached f and grad f
      (a weighted sum of its entries, ``hdm_optax._stale.point_fingerprint``).
    point_scale: the sum of the absolute entries of the params the last
      update received, the scale of ``point_sum``'s rounding; -1 where the last update
      ran without the check (``values_at_params``): no point is recorded.
    num_uphill_trials: rejected trials whose step went down the received updates u but not
      down f (:math:`\\langle u, s\\rangle < 0 \\le \\langle \\nabla f(x), s\\rangle`). Always 0
      where the method is first or alone in a chain (u is grad f); where a transformation
      before it changed u (a weight decay, whose term f leaves out), the run stalls on such
      trials: put the term in f (:func:`uphill_advice`).
    nonfinite_run: updates since the last accepted one before the last update (the last
      update included) whose evaluations met a non-finite f or grad f; after an accepted
      update, 1 where one of its own candidates did, else 0. The stop rule reads it: a
      small decrease right after such trials is the edge of the region where f is finite,
      not a sign of convergence (:func:`hdm_optax.driver.engine.judge`).
  """

  accepted: jax.Array
  hypergrad_norm: jax.Array
  num_null_steps: jax.Array
  null_run: jax.Array
  num_value_evals: jax.Array
  num_grad_evals: jax.Array
  num_stale_updates: jax.Array
  point_sum: jax.Array
  point_scale: jax.Array
  num_uphill_trials: jax.Array
  nonfinite_run: jax.Array


def init_info(dtype) -> HDMInfo:
  zero = jnp.zeros([], jnp.int32)
  return HDMInfo(
    accepted=jnp.asarray(True),
    hypergrad_norm=jnp.zeros([], dtype),
    num_null_steps=zero,
    null_run=zero,
    num_value_evals=zero,
    num_grad_evals=zero,
    num_stale_updates=zero,
    point_sum=jnp.zeros([], dtype),
    point_scale=jnp.zeros([], dtype),
    num_uphill_trials=zero,
    nonfinite_run=zero,
  )


def uphill_trials(state) -> int:
  """The sum of :attr:`HDMInfo.num_uphill_trials` over every HDM state in ``state``
  (concrete values: an optimizer state after a run, or a state with a leading batch axis)."""
  infos = [
    leaf
    for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, HDMInfo))
    if isinstance(leaf, HDMInfo)
  ]
  return sum(int(np.sum(np.asarray(info.num_uphill_trials))) for info in infos)


def uphill_advice(state) -> str:
  """What to do where a transformation before an HDM method stalls it ("" where nothing).

  Reads :func:`uphill_trials` of ``state``.
  """
  uphill = uphill_trials(state)
  if not uphill:
    return ""
  return (
    f"{uphill} rejected trials went down the updates the method received but not down f: a "
    "transformation before it in the chain (such as optax.add_decayed_weights) changed the "
    "direction by a term that f does not contain, so the method rejects the steps that term "
    "asks for; put the term in f (for a weight decay, f(x) + 0.5 * wd * ||x||^2) and drop "
    "the transformation"
  )


def oracle_fields(params, dtype) -> dict:
  """The fields every state of the package shares, as ``init`` sets them.

  ``count`` 0, ``value`` +inf and ``grad`` 0 (nothing evaluated yet) and
  fresh ``info``.
  """
  return dict(
    count=jnp.zeros([], jnp.int32),
    value=jnp.asarray(jnp.inf, dtype),
    grad=optax.tree.zeros_like(params),
    info=init_info(dtype),
  )


def next_info(
  info: HDMInfo, *, accepted, hypergrad_norm, calls: int, uphill=False, finite=True
) -> HDMInfo:
  """Info after one update that made ``calls`` value-and-gradient calls.

  ``uphill``: the trial was rejected and went down the received updates but not down f
  (:attr:`HDMInfo.num_uphill_trials`). ``finite``: f and grad f were finite at every point
  the update evaluated (:attr:`HDMInfo.nonfinite_run`).
  """
  nonfinite = (~jnp.asarray(finite)).astype(jnp.int32)
  return info._replace(
    nonfinite_run=jnp.where(accepted, nonfinite, info.nonfinite_run + nonfinite).astype(jnp.int32),
    num_uphill_trials=info.num_uphill_trials + jnp.asarray(uphill).astype(jnp.int32),
    accepted=jnp.asarray(accepted),
    # 0 when the trial point was not finite (no hypergradient was used).
    hypergrad_norm=jnp.where(jnp.isfinite(hypergrad_norm), hypergrad_norm, 0).astype(
      info.hypergrad_norm.dtype
    ),
    num_null_steps=info.num_null_steps + (~accepted).astype(jnp.int32),
    null_run=jnp.where(accepted, 0, info.null_run + 1).astype(jnp.int32),
    num_value_evals=info.num_value_evals + calls,
    num_grad_evals=info.num_grad_evals + calls,
  )
