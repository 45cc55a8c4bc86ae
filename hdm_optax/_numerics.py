"""Numeric helpers of the methods: the params' dtype, casts, safe division, norms."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _blocks


def shown(obj) -> str:
  """`` (repr)`` of ``obj`` for a message, or nothing where the repr is long."""
  text = repr(obj)
  return f" ({text})" if len(text) <= 60 else ""


def dtype_of(leaf) -> jnp.dtype:
  """The dtype ``leaf`` has as a JAX array, without making one (a NumPy array's would be a
  transfer)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    try:
      return jnp.asarray(leaf).dtype
    except TypeError:
      raise TypeError(
        f"a params leaf of type {type(leaf).__name__}{shown(leaf)} is not an array: pass "
        "only the arrays, e.g. for an equinox model params, static = "
        "eqx.partition(model, eqx.is_array), with eqx.combine(params, static) inside the "
        "objective."
      ) from None
  return jax.dtypes.canonicalize_dtype(dtype)


def params_dtype(params) -> jnp.dtype:
  """The floating dtype of ``params``; raises for integer, complex or mixed."""
  leaves = jax.tree.leaves(params)
  if not leaves:
    raise ValueError("params is an empty pytree: there is nothing to optimize.")
  if not any(math.prod(jnp.shape(leaf)) for leaf in leaves):
    shapes = [jnp.shape(leaf) for leaf in leaves]
    raise ValueError(
      f"params has no entries (leaves of shapes {shapes}): there is nothing to optimize; "
      "pass params with at least one entry."
    )
  dtypes = {dtype_of(leaf) for leaf in leaves}
  for dt in dtypes:
    if not jnp.issubdtype(dt, jnp.floating):
      raise TypeError(
        f"params must be real floating-point arrays, got dtype {dt}; "
        "cast them, e.g. jnp.asarray(x, jnp.float32)."
      )
  if len(dtypes) > 1:
    raise TypeError(
      f"all params leaves must share one dtype, got {sorted(map(str, dtypes))}; cast them to "
      "one, e.g. jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)."
    )
  return dtypes.pop()


def refuse_float16(name: str, dtype) -> None:
  """Raises where ``dtype`` is float16, for a method whose constants are outside its range."""
  if dtype == jnp.float16:
    raise ValueError(
      f"{name} cannot run on params of dtype float16: its constants (such as 1e-12) "
      "are outside float16's range, where they round to 0 or inf and the method stalls; "
      "cast the params to float32 or bfloat16, e.g. "
      "jax.tree.map(lambda x: x.astype(jnp.float32), params)."
    )


def cast(value, dtype) -> jax.Array:
  """A hyper-parameter as a 0-d array of the params dtype (no promotion)."""
  return jnp.asarray(value).astype(dtype)


def all_finite(*trees) -> jax.Array:
  return _blocks.all_finite(*trees)


def safe_div(num, den):
  """``num / den`` with 0 where ``den == 0`` (the gradient is exactly zero)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def sqrt(x):
  """``jnp.sqrt(x)``, whose derivative is 0 where ``x == 0`` rather than infinite.

  The values are ``jnp.sqrt``'s. At 0 the square root of a quantity that is identically 0
  there (a first step's AdaGrad sum, the norm of a null step) has derivative 0 along it;
  ``jnp.sqrt``'s infinite derivative times that quantity's zero tangent is NaN, which would
  spread through a differentiated run (``UnrolledAdjoint``).
  """
  zero = x == 0
  return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, x)))


def norm(tree) -> jax.Array:
  """The Euclidean norm of a pytree over its packed blocks (``optax.tree.norm``'s value),
  with derivative 0 where the tree is 0 (see :func:`sqrt`)."""
  return sqrt(optax.tree.norm(_blocks.pack(tree), squared=True))


def scaled_norm(tree, square=None) -> jax.Array:
  """The Euclidean norm of a pytree, without overflow where its square overflows.

  Where the sum of squares (``square``, computed here when not given) is finite, its square
  root; where it is not (entries of 1e19 in float32, 1e155 in float64), ``m * ||tree / m||``
  with ``m`` the largest magnitude. The rescaled norm is computed only where it is needed
  (``lax.cond``; under ``jax.vmap``, for every member).
  """
  if square is None:
    square = optax.tree.vdot(tree, tree)
  norm = sqrt(square)

  def rescaled():
    biggest = optax.tree.norm(tree, ord=jnp.inf).astype(norm.dtype)
    unit = optax.tree.scale(safe_div(jnp.ones([], norm.dtype), biggest), tree)
    return (biggest * optax.tree.norm(unit)).astype(norm.dtype)

  return jax.lax.cond(jnp.isfinite(norm), lambda: norm, rescaled)


def copy_tree(tree):
  """Fresh buffers (so a state built by ``init`` can be donated)."""
  return jax.tree.map(jnp.array, tree)


def keep_if(pred, new, old):
  """``new`` where ``pred`` else ``old``, leaf by leaf (a null step)."""
  return optax.tree.where(pred, new, old)
