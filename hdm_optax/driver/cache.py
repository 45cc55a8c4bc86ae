"""The cache contract: where a transformation's cached f and grad f are, and what it spent.

A transformation may cache ``value`` and ``grad`` in its state (every
hdm_optax transformation, optax's linesearches and so ``optax.lbfgs``) and
count its oracle calls (hdm_optax's ``info``, optax's
``num_linesearch_steps``). The driver reads both from the state's structure:
:func:`cache_at_params` says whether the cache is at the new params (then a
loop step costs no extra call), :func:`calls_in_update` how many calls an
``update`` made.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax.driver import programs

__all__ = (
  "cache_at_params",
  "caches_anywhere",
  "calls_in_update",
  "value_and_grad_from_state",
)


def _total(state, key):
  """Sum of every ``key`` field in ``state`` (0 if there is none)."""
  found = optax.tree.get_all_with_path(state, key)
  return sum((jnp.asarray(v, jnp.int32) for _, v in found), jnp.zeros([], jnp.int32))


def calls_in_update(old_state, new_state):
  """(value, grad) evaluations that ``update`` made between the two states.

  Args:
    old_state: the state passed to ``update``.
    new_state: the state it returned.

  Returns:
    ``(value_evals, grad_evals)``, int32 scalars.

  hdm_optax states count them in ``info`` (``num_value_evals``,
  ``num_grad_evals``); optax's linesearches (``optax.lbfgs``) make one
  value-and-gradient call per linesearch step (``num_linesearch_steps``); other
  transformations do not call the oracle. Every occurrence in the state counts
  (several HDM transformations in one chain).
  """
  searched = _total(new_state, "num_linesearch_steps")
  values = _total(new_state, "num_value_evals") - _total(old_state, "num_value_evals")
  grads = _total(new_state, "num_grad_evals") - _total(old_state, "num_grad_evals")
  return values + searched, grads + searched


# Wrappers whose update is their inner transformation's update, unchanged (or,
# for apply_if_finite, zero together with the inner state put back).
_FORWARDING_STATES = tuple(
  getattr(optax, name)
  for name in ("InjectHyperparamsState", "InjectStatefulHyperparamsState", "ApplyIfFiniteState")
  if hasattr(optax, name)
)


def cache_at_params(state) -> Optional[Any]:
  r"""The state whose cached ``value`` and ``grad`` are f and grad f at the new params.

  The contract: a transformation that caches ``value`` and ``grad`` in its
  state (every hdm_optax transformation, optax's linesearches and so
  ``optax.lbfgs``) caches them at ``params + u``, ``u`` the update *it*
  returned. They are f and grad f at ``optax.apply_updates(params, updates)``
  only if ``u`` reaches the params unchanged, that is if the cache holder is the
  last transformation: the state itself, the last state of an ``optax.chain``
  (a plain tuple), or the inner state of ``optax.inject_hyperparams`` or
  ``optax.apply_if_finite``, recursively. Anything else (``optax.chain(hdm_best(),
  optax.scale(0.5))``, a named chain, ``optax.MultiSteps``, ...) has no cache at
  the params. The test reads the structure of the state only: it costs nothing
  at run time.

  Args:
    state: an optimizer state.

  Returns:
    The cache-holding state (with fields ``value`` and ``grad``), or ``None``.
  """
  while True:
    if type(state) is tuple and state:  # pylint: disable=unidiomatic-typecheck
      state = state[-1]  # optax.chain: the last transformation's update is the chain's
    elif isinstance(state, _FORWARDING_STATES):
      state = state.inner_state
    else:
      break
  fields = getattr(state, "_fields", ())
  if "value" in fields and "grad" in fields and state.grad is not None:
    return state
  return None


def caches_anywhere(state) -> bool:
  """Whether some transformation in ``state`` caches ``value`` and ``grad`` (wherever they are)."""
  return bool(optax.tree.get_all_with_path(state, "value")) and bool(
    optax.tree.get_all_with_path(state, "grad")
  )


def value_and_grad_from_state(
  fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., Any]:
  """``optax.value_and_grad_from_state`` that never returns a stale cache.

  ``value_and_grad(params, *args, state=state)`` returns the state's cached
  value and gradient only when :func:`cache_at_params` finds them at the params
  (the caching transformation is the last one); otherwise, or before the first
  update (a cached value of +inf), it evaluates ``fun``. optax's function reuses
  any cache it finds, e.g. the one of ``hdm_best`` inside ``optax.chain(hdm_best(),
  optax.scale(0.5))``, which is at another point.

  The returned function runs a program compiled (``jax.jit``) once per
  structure of its arguments: called in a Python loop it costs one dispatch and
  a trace of ``fun``, not a new ``lax.cond`` each time. Create it once, outside
  the loop. ``args`` and the arrays ``fun`` reads from outside its arguments
  (closure cells, globals, a bound method's object) are arguments of the
  program, read at each call, as in :func:`hdm_optax.solve`.

  Args:
    fun: ``fun(params, *args) -> scalar`` (``-> (scalar, aux)`` with ``has_aux``).
    has_aux: as in ``jax.value_and_grad``; the aux output needs an evaluation,
      so the cache is never used with it.

  Returns:
    ``value_and_grad(params, *args, state) -> (value, grad)``.

  Examples:
    >>> import jax.numpy as jnp, optax, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> opt = optax.chain(hdm_optax.hdm_best(lipschitz=20.0), optax.scale(0.5))
    >>> x = jnp.ones(2)
    >>> state = opt.init(x)
    >>> value_and_grad = hdm_optax.value_and_grad_from_state(fun)
    >>> for _ in range(5):
    ...   value, grad = value_and_grad(x, state=state)
    ...   updates, state = opt.update(grad, state, x, value=value, grad=grad,
    ...                               value_fn=fun)
    ...   x = optax.apply_updates(x, updates)
    >>> bool(jnp.allclose(value_and_grad(x, state=state)[0], fun(x)))
    True
  """

  def compiled(closed, params, *args, state):
    def evaluate():
      return _common.value_and_grad(lambda p: closed(p, *args), params, has_aux=has_aux)

    holder = None if has_aux else cache_at_params(state)
    if holder is None:
      return evaluate()
    fresh = jnp.isfinite(holder.value)
    return jax.lax.cond(fresh, lambda: (holder.value, holder.grad), evaluate)

  compiled = jax.jit(compiled, static_argnums=0)

  def value_and_grad(params, *args, state):
    # The arrays fun reads from outside its arguments, as they are at this call.
    closed, hoisted = programs.hoist(fun, params, args)
    return compiled(closed, params, *hoisted, state=state)

  return value_and_grad
