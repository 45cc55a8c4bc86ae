"""Your own optax loop with the driver's cache rule: :func:`value_and_grad_from_state`.

The rule (:func:`hdm_optax.driver.protocol.cache_at_params`): a transformation's cached f
and grad f are used only where they are at the params.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from hdm_optax import _oracle
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver import resuming

__all__ = ("value_and_grad_from_state",)


def value_and_grad_from_state(
  fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., Any]:
  """``optax.value_and_grad_from_state`` that never returns a stale cache.

  ``value_and_grad(params, *args, state=state)`` returns the state's cached
  value and gradient only when :func:`~hdm_optax.driver.protocol.cache_at_params` finds them at the params
  (the caching transformation is the last one) and this call reads the data the
  previous call read; otherwise, or before the first update (a cached value of
  +inf), it evaluates ``fun``. optax's function reuses any cache it finds, e.g. the
  one of ``hdm_best`` inside ``optax.chain(hdm_best(), optax.scale(0.5))``, which is
  at another point, or one of f on the previous batch.

  The data are compared as a resumed run's are (docs/guide.md, "Resuming a run"): the
  arrays among ``args`` and those ``fun`` reads from outside its arguments by identity,
  the numbers among ``args`` by value. Called inside ``jax.jit``, where the arrays are
  traced, the cache is taken: pass the same data at every call there, as the
  ``value_fn`` of the update that made the cache read them.

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

  def compiled(closed, params, *args, state, same_data):
    def evaluate():
      return _oracle.value_and_grad(lambda p: closed(p, *args), params, has_aux=has_aux)

    holder = None if has_aux else protocol.cache_at_params(state)
    if holder is None:
      return evaluate()
    fresh = jnp.isfinite(holder.value) & same_data
    return jax.lax.cond(fresh, lambda: (holder.value, holder.grad), evaluate)

  compiled = jax.jit(compiled, static_argnums=0)
  previous = []  # what the last call outside a trace read (resuming.kept_reading)

  def value_and_grad(params, *args, state):
    # The arrays fun reads from outside its arguments, as they are at this call.
    closed, hoisted = programs.hoist(fun, params, args)
    if programs.tracers(hoisted):  # inside a trace the data's identity is not known
      same_data = True
    else:
      same_data = bool(previous) and resuming.same_reading(previous[0], hoisted)
      previous[:] = [resuming.kept_reading(hoisted)]
    same_data = jnp.asarray(same_data)
    return compiled(closed, params, *hoisted, state=state, same_data=same_data)

  return value_and_grad
