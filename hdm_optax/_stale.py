"""Stale-cache detection: ``update`` never acts on f and grad f cached at another point
(:func:`track_point`, :func:`values_at_params`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
import weakref
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _info
from hdm_optax import _oracle


_POINT_EPS = 256


def point_fingerprint(params) -> tuple[jax.Array, jax.Array]:
  r"""A point's summary in two scalars: :math:`(\sum_i w_i x_i,\ \sum_i |x_i|)`.

  The weights :math:`w_i \in [0.5, 1.5)` are a fixed hash of each entry's position
  (over the leaves in order), so a change whose entries sum to zero (a gradient step
  on a translation-invariant f) still moves the weighted sum. Each leaf is one pass
  that XLA fuses into the kernel that reads or produces it.

  Args:
    params: a pytree of float arrays of one dtype.

  Returns:
    ``(weighted_sum, absolute_sum)``, scalars of the params' dtype.
  """
  sums, scales, offset = [], [], 0
  for leaf in jax.tree.leaves(params):
    leaf = jnp.asarray(leaf)
    index = jax.lax.iota(jnp.uint32, leaf.size).reshape(leaf.shape) + jnp.uint32(offset % 2**32)
    mixed = (index * jnp.uint32(0x9E3779B1)) >> jnp.uint32(8)  # Knuth's multiplicative hash
    weight = 0.5 + mixed.astype(leaf.dtype) * 2.0**-24
    sums.append(jnp.sum(weight * leaf))
    scales.append(jnp.sum(jnp.abs(leaf)))
    offset += leaf.size
  return functools.reduce(jnp.add, sums), functools.reduce(jnp.add, scales)


# Entries of each leaf of the gradient compared with the cached gradient's, evenly spaced.
_GRAD_SAMPLES = 8


def _sample(tree) -> list:
  """A few entries of each leaf, evenly spaced (the first and the last among them)."""
  out = []
  for leaf in jax.tree.leaves(tree):
    flat = jnp.reshape(leaf, -1)
    index = np.unique(np.linspace(0, flat.size - 1, min(flat.size, _GRAD_SAMPLES)).astype(int))
    out.append(flat[index])
  return out


def _is_stale(state, params, value, grad, point_sum, point_scale) -> jax.Array:
  """Whether ``update`` received a stale cache.

  Stale: the params are not the point of the cache (beyond rounding) while the value and
  gradient received are the cached ones (the value bit for bit, and a few entries of the
  gradient). A fresh evaluation at the params differs from the cache unless f and grad f
  agree at the two points, and then nothing is wrong. The gradient's entries are read, not
  reduced: no pass over the gradient. Before the first update no point is recorded (a
  cache set from outside, as ``hdm_optax.solve`` sets it at x0, is not checked).
  """
  old = state.info
  dtype = old.point_sum.dtype
  tol = _POINT_EPS * float(jnp.finfo(dtype).eps) * (point_scale + old.point_scale)
  recorded = (old.num_grad_evals > 0) & (old.point_scale >= 0)
  elsewhere = recorded & (jnp.abs(point_sum - old.point_sum) > tol)
  same_value = jnp.isfinite(state.value) & (jnp.asarray(value).astype(dtype) == state.value)
  same_grad = jnp.all(
    jnp.stack([jnp.all(a == b) for a, b in zip(_sample(grad), _sample(state.grad))])
  )
  return elsewhere & same_value & same_grad


def _stale_warning(name: str) -> str:
  return (
    f"{name}.update received params other than the point where it cached f and grad f, "
    "together with that cached value: value= and grad= belong to another point. It "
    "evaluated f and grad f at the params instead (one more oracle call at every such "
    "update, counted in info.num_stale_updates). A transformation after it in optax.chain "
    f"changed its update (e.g. optax.chain({name}(), optax.scale(0.5))) and "
    f"optax.value_and_grad_from_state returned the cache. Put {name} last in the chain, or "
    "call hdm_optax.value_and_grad_from_state(fun), which evaluates f at the params then "
    "(docs/pitfalls.md)."
  )


def _refresh(state, params, value, grad, value_fn, fingerprint, report):
  """``(value, grad, stale)``: f and grad f at ``params`` where the cache received was stale.

  Concrete values (outside ``jit``) branch in Python; traced ones in ``lax.cond``, whose
  evaluation branch reports through ``jax.debug.callback``. Under ``jax.vmap`` the batch
  takes one ``lax.cond`` on whether any member is stale (:func:`_fresh_where_stale`): a
  correct loop pays no evaluation and no host call.
  """
  dtype = state.value.dtype
  stale = _is_stale(state, params, value, grad, *fingerprint)
  kept = (jnp.asarray(value).astype(dtype), grad)

  def evaluate(params, *consts):
    fresh_value, fresh_grad = _oracle.value_and_grad(lambda p: evaluate_fn(p, *consts), params)
    fresh_grad = jax.tree.map(lambda new, old: jnp.asarray(new).astype(old.dtype), fresh_grad, grad)
    return jnp.asarray(fresh_value).astype(dtype), fresh_grad

  if not isinstance(stale, jax.core.Tracer):
    evaluate_fn = lambda p: value_fn(p)
    if bool(stale):
      report(True)
      return (*evaluate(params), stale)
    return value, grad, stale
  evaluate_fn, consts = jax.closure_convert(value_fn, params)
  return (*_fresh_where_stale(evaluate, report)(stale, kept, params, consts), stale)


def _fresh_where_stale(evaluate, report):
  """``pick(stale, kept, params, consts)``: ``evaluate(params, *consts)`` where stale, else kept."""

  @jax.custom_batching.custom_vmap
  def pick(stale, kept, params, consts):
    def fresh():
      jax.debug.callback(report, stale)
      return evaluate(params, *consts)

    return jax.lax.cond(stale, fresh, lambda: kept)

  @pick.def_vmap
  def _batched(axis_size, in_batched, stale, kept, params, consts):
    spread = lambda tree, flags: jax.tree.map(
      lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a)), tree, flags
    )
    stale, kept, params = (spread(*pair) for pair in zip((stale, kept, params), in_batched))
    axes = jax.tree.map(lambda b: 0 if b else None, in_batched[3])

    def fresh():
      jax.debug.callback(report, stale)  # one host call for the batch
      new = jax.vmap(evaluate, in_axes=(0, *axes))(params, *consts)
      row = lambda a, b: jnp.where(jnp.reshape(stale, (-1,) + (1,) * (a.ndim - 1)), a, b)
      return jax.tree.map(row, new, kept)

    out = jax.lax.cond(jnp.any(stale), fresh, lambda: kept)
    return out, jax.tree.map(lambda _: True, out)

  return pick


def _recorded(info: _info.HDMInfo, params, updates, point_scale, stale) -> _info.HDMInfo:
  """``info`` with the fingerprint of the new cache's point and the stale update's call."""
  dtype = info.point_sum.dtype
  next_point, _ = point_fingerprint(optax.apply_updates(params, updates))
  calls = jnp.asarray(stale).astype(jnp.int32)
  return info._replace(
    num_value_evals=info.num_value_evals + calls,
    num_grad_evals=info.num_grad_evals + calls,
    num_stale_updates=info.num_stale_updates + calls,
    point_sum=next_point.astype(dtype),
    point_scale=point_scale.astype(dtype),
  )


_VALUES_AT_PARAMS = contextvars.ContextVar("hdm_optax_values_at_params", default=False)


@contextlib.contextmanager
def values_at_params():
  """A context in which ``update`` takes ``value`` and ``grad`` as f and grad f at the params.

  Updates traced or run inside it leave :func:`track_point`'s stale-cache check out of
  the program (under ``jax.vmap`` that check's evaluation at the params runs at every
  update). The drivers trace their loops inside it, since they always evaluate at the
  params; a loop of your own that does the same can too. It is the form of the extra
  argument ``value_at_params=True`` for chains with ``optax.lbfgs``, whose linesearch
  passes extra arguments on to ``value_fn`` and rejects that one.

  Returns:
    A context manager.

  Examples:
    >>> import jax, jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(x ** 2)
    >>> opt = hdm_optax.trial_lbfgs()
    >>> x = jnp.ones((4, 3))
    >>> state = jax.vmap(opt.init)(x)
    >>> def step(x, state):
    ...   value, grad = jax.value_and_grad(fun)(x)
    ...   return opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    >>> with hdm_optax.values_at_params():
    ...   updates, state = jax.jit(jax.vmap(step))(x, state)
    >>> updates.shape
    (4, 3)
  """
  token = _VALUES_AT_PARAMS.set(True)
  try:
    yield
  finally:
    _VALUES_AT_PARAMS.reset(token)


# The step the last method's update returned, as (its name, weak references to its leaves):
# a method whose incoming updates are those very arrays follows another method in a chain.
_LAST_STEP: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar(
  "hdm_optax_last_step", default=None
)


def _record_step(name: str, updates) -> None:
  """Notes that the method ``name`` returned ``updates`` (weakly held: nothing is kept alive)."""
  try:
    refs = tuple(weakref.ref(leaf) for leaf in jax.tree.leaves(updates))
  except TypeError:  # a leaf without weak references: nothing to compare later
    refs = ()
  _LAST_STEP.set((name, refs) if refs else None)


def _refuse_method_step(name: str, updates) -> None:
  """Refuses ``updates`` that are the step another method's update returned.

  ``optax.chain(trial_lbfgs(), hdm_auto())`` hands the second method the first one's step
  where it expects a gradient (or a transformed one): two methods that each choose their
  own step cannot be chained, and the second would reject every trial (only null steps).
  The test compares the arrays' identity at trace time: it costs nothing at run time.

  Raises:
    ValueError: naming both methods and the fix.
  """
  last = _LAST_STEP.get()
  if last is None:
    return
  maker, refs = last
  leaves = jax.tree.leaves(updates)
  if len(leaves) != len(refs) or not all(r() is leaf for r, leaf in zip(refs, leaves)):
    return
  raise ValueError(
    f"{name}.update received, as its updates, the step {maker}.update returned: "
    f"optax.chain({maker}(...), {name}(...)) chains two methods that each choose their own "
    f"step and judge it on f. {name} would take {maker}'s step for a gradient and reject "
    f"every trial (only null steps). Use one of them alone, e.g. "
    f"hdm_optax.solve(hdm_optax.{maker}(), fun, x0); a transformation that changes the "
    f"gradient (such as optax.clip_by_global_norm) goes before the method."
  )


def track_point(
  name: str, untransformed_only: Optional[str] = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorates an ``update_fn``: it never acts on a cache of another point.

  A transformation caches f and grad f at ``params + u``, ``u`` the update it
  returns. The next ``update`` must receive that point; when it receives another
  one (a later transformation in ``optax.chain`` changed ``u``) together with the
  cached ``value`` (``optax.value_and_grad_from_state`` returns the cache it finds),
  the value and gradient it was given belong to another point. The decorated
  ``update_fn`` then evaluates f and grad f at the params with ``value_fn`` (one
  more oracle call, counted in ``info``'s calls) and acts on those, counts the
  update in ``info.num_stale_updates`` and warns, once per transformation, under
  ``jit`` too (through ``jax.debug.callback``). Incoming ``updates`` that are the
  received gradient itself (the method first in the chain) are replaced by the
  fresh gradient; updates that a transformation before the method made from the
  stale gradient are kept as they are.

  The check compares :func:`point_fingerprint` of the params with the one
  recorded for the cache (two scalars in ``info``, no vector of n kept), within
  rounding: a change of the point below ``256 eps`` of its entries' magnitudes
  goes unseen. Under ``jit`` the evaluation is a ``lax.cond``; under ``vmap`` a
  cond runs both branches, so a vmapped loop of one's own pays the call at every
  update. A caller that always passes f and grad f at the params (as
  ``hdm_optax.solve``, ``sweep``, ``minibatch_step`` and
  ``hdm_optax.value_and_grad_from_state`` loops do) says so with the extra argument
  ``value_at_params=True`` (where no optax linesearch is in the chain: it passes extra
  arguments on to ``value_fn``) or by calling ``update`` within :func:`values_at_params`,
  as the drivers do: the check is then left out of the program.

  Args:
    name: the transformation's name, for the warning.
    untransformed_only: for a transformation that cannot honour updates a transformation
      before it in ``optax.chain`` changed, why (the reason the refusal gives): updates
      that are not the received gradient are refused (:func:`_oracle.require_untransformed`).

  Returns:
    The decorator.
  """

  def decorate(update_fn):
    warned = []

    def report(stale):
      if np.any(stale) and not warned:
        warned.append(True)
        warnings.warn(_stale_warning(name), stacklevel=5)

    @functools.wraps(update_fn)
    def checked(
      updates,
      state,
      params=None,
      *,
      value=None,
      grad=None,
      value_fn=None,
      value_at_params=False,
      **extra_args,
    ):
      if params is None:
        raise TypeError(
          f"{name}.update needs params, the point where value= and grad= were taken: "
          f"update(updates, state, params, value=..., grad=..., value_fn=...)."
        )
      _refuse_method_step(name, updates)
      value, received = _oracle.require_oracle(
        name, value, grad, value_fn, updates, params=params, state_grad=state.grad
      )
      same = _oracle.untransformed(updates, received)
      if untransformed_only is not None:
        _oracle.require_untransformed(name, same, untransformed_only)
      if value_at_params or _VALUES_AT_PARAMS.get():  # the check is off: nothing of it runs
        out, new_state = update_fn(
          updates, state, params, value=value, grad=received, value_fn=value_fn, **extra_args
        )
        unknown = -jnp.ones_like(new_state.info.point_scale)  # no point recorded
        _record_step(name, out)
        return out, new_state._replace(info=new_state.info._replace(point_scale=unknown))
      point_sum, point_scale = point_fingerprint(params)
      value, fresh, stale = _refresh(
        state, params, value, received, value_fn, (point_sum, point_scale), report
      )
      if same is True:
        updates = fresh
      elif same is not False:  # separate arguments of the program: fresh where they are equal
        updates = jax.tree.map(lambda f, u: jnp.where(same, f, u), fresh, updates)
      out, new_state = update_fn(
        updates, state, params, value=value, grad=fresh, value_fn=value_fn, **extra_args
      )
      info = _recorded(new_state.info, params, out, point_scale, stale)
      _record_step(name, out)
      return out, new_state._replace(info=info)

    if isinstance(update_fn, functools.partial):  # no source to point inspect.getsource to
      del checked.__wrapped__
    return checked

  return decorate
