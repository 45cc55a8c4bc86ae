"""The objective of :func:`hdm_optax.minimize` as SciPy takes it: ``fun``, ``jac``, ``args``.

SciPy's ``minimize`` calls ``fun(x, *args)`` (and ``jac(x, *args)``) with NumPy arrays;
``hdm_optax.minimize`` runs one compiled program. :func:`objective` makes of SciPy's
arguments a function ``f(x, *dynamic_args) -> scalar`` that :func:`hdm_optax.solve`
differentiates:

- ``jac=None`` and a ``fun`` JAX can trace: ``fun`` itself, differentiated by JAX.
- ``jac=True`` (``fun`` returns ``(value, gradient)``) or a callable ``jac``: a
  ``jax.custom_vjp`` whose gradient is the user's, so one oracle call is one call of
  ``fun`` (and of ``jac``).
- a ``fun`` JAX cannot trace (NumPy code: it converts its argument to a NumPy array, or
  branches on a value): ``fun`` (and ``jac``) run on the host through
  ``jax.pure_callback``, called with NumPy arrays, as SciPy calls them; with ``jac=None``
  (or ``"2-point"``) the gradient is SciPy's forward difference with absolute step
  ``eps``, ``n + 1`` calls of ``fun`` per gradient.

``args`` leaves that are arrays or numbers enter the program as arguments (new data
reuse the program); other leaves (strings, functions, objects) are static, and must be
hashable.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ("Objective", "objective", "split_args")

# Raised when ``fun`` cannot be traced: it needs concrete values (NumPy code).
_UNTRACEABLE = (
  jax.errors.TracerArrayConversionError,
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerIntegerConversionError,
)


def _dynamic(leaf) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.number, int, float)) and not isinstance(
    leaf, bool
  )


def split_args(args) -> tuple[tuple, tuple]:
  """``(dynamic, static)``: the array and number leaves of ``args``, and the rest with its layout.

  Raises:
    TypeError: a static leaf is not hashable (it keys the compiled program).
  """
  leaves, treedef = jax.tree.flatten(tuple(args))
  dynamic = tuple(leaf for leaf in leaves if _dynamic(leaf))
  static = tuple(None if _dynamic(leaf) else leaf for leaf in leaves)
  try:
    hash(static)
  except TypeError:
    bad = next(leaf for leaf in static if leaf is not None and not _hashable(leaf))
    raise TypeError(
      f"args holds {type(bad).__name__} {bad!r:.60}, neither an array nor a number nor "
      "hashable: minimize compiles its program for such a value. Pass arrays or numbers, "
      "or a hashable object."
    ) from None
  return dynamic, (treedef, static)


def _hashable(value) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def _merge(layout, dynamic) -> tuple:
  treedef, static = layout
  it = iter(dynamic)
  return jax.tree.unflatten(treedef, [next(it) if s is None else s for s in static])


def _scalar(value, dtype):
  """SciPy's scalar: a number or an array of one entry, as ``dtype``."""
  if jnp.size(value) != 1:
    raise ValueError(
      f"fun must return a scalar (or an array of one entry), got shape {jnp.shape(value)}."
    )
  return jnp.reshape(value, ()).astype(dtype)


def _one_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _like(grad, x):
  """The user's gradient as a pytree of x's leaves' shapes and dtype."""
  leaves, treedef = jax.tree.flatten(x)
  g_leaves = [grad] if _one_array(x) else treedef.flatten_up_to(grad)
  out = []
  for g, leaf in zip(g_leaves, leaves):
    if jnp.size(g) != jnp.size(leaf):
      raise ValueError(f"jac returned {jnp.shape(g)} entries for x of shape {jnp.shape(leaf)}.")
    out.append(jnp.reshape(jnp.asarray(g), jnp.shape(leaf)).astype(leaf.dtype))
  return jax.tree.unflatten(treedef, out)


def _zero_cotangent(leaf):
  """A zero cotangent for ``leaf`` (float0 for integer and boolean arrays, as JAX wants)."""
  if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
    return jnp.zeros_like(leaf)
  return np.zeros(jnp.shape(leaf), jax.dtypes.float0)


@dataclasses.dataclass(frozen=True)
class Objective:
  """``f(x, *dynamic_args)``: SciPy's ``fun`` / ``jac`` for :func:`hdm_optax.solve`.

  Static (a key of the compiled program): equal for equal ``fun``, ``jac``, mode and
  static args.

  Attributes:
    fun: the user's ``fun``.
    jac: ``None`` (JAX's gradient, or forward differences on the host), ``True`` or a
      callable.
    host: run ``fun`` on the host (it is not traceable).
    layout: where ``args``' dynamic leaves go (:func:`split_args`).
    eps: the forward-difference step (host, ``jac=None``).
  """

  fun: Callable[..., Any]
  jac: Any
  host: bool
  layout: Any
  eps: float = 1e-8

  def __call__(self, x, *dynamic):
    dtype = jax.tree.leaves(x)[0].dtype
    if self.jac is None and not self.host:
      return _scalar(self.fun(x, *_merge(self.layout, dynamic)), dtype)
    return self._custom(functools.partial(self._value_and_grad, dtype=dtype), x, dynamic)

  def _value_and_grad(self, x, dynamic, *, dtype):
    """``(f(x), grad f(x))`` from the user's ``fun`` and ``jac`` (or on the host)."""
    if self.host:
      return self._on_host(x, dynamic, dtype)
    args = _merge(self.layout, dynamic)
    if self.jac is True:
      return self._pair(self.fun(x, *args), x, dtype)
    return _scalar(self.fun(x, *args), dtype), _like(self.jac(x, *args), x)

  @staticmethod
  def _pair(out, x, dtype):
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        f"with jac=True, fun must return (value, gradient), got {type(out).__name__}."
      )
    return _scalar(out[0], dtype), _like(out[1], x)

  @staticmethod
  def _custom(pair, x, dynamic):
    """f with the gradient of ``pair(x, dynamic) -> (value, grad)``: one call per oracle call.

    ``dynamic`` is an argument, not closed over, so that the function can be traced and
    its trace evaluated with new arrays (:func:`hdm_optax.driver.closure.hoist`). The user's
    ``jac`` gives the derivative in x only: the one in ``dynamic`` is reported as zero.
    """

    @jax.custom_vjp
    def f(x, dynamic):
      return pair(x, dynamic)[0]

    def forward(x, dynamic):
      value, grad = pair(x, dynamic)
      return value, (grad, dynamic)

    def backward(residual, cotangent):
      grad, dynamic = residual
      return jax.tree.map(lambda g: cotangent * g, grad), jax.tree.map(_zero_cotangent, dynamic)

    f.defvjp(forward, backward)
    return f(x, dynamic)

  def _on_host(self, x, dynamic, dtype):
    shapes = (
      jax.ShapeDtypeStruct((), dtype),
      jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), x),
    )

    def host(x, dynamic):
      args = _merge(self.layout, dynamic)
      x = jax.tree.map(np.array, x)  # copies: fun may write into x
      if self.jac is True:
        value, grad = self._pair_host(self.fun(x, *args))
      elif self.jac is not None:
        value, grad = self.fun(x, *args), self.jac(x, *args)
      else:
        value, grad = _forward_differences(lambda x: self.fun(x, *args), x, self.eps)
      value = np.asarray(value, dtype).reshape(())
      leaves, treedef = jax.tree.flatten(x)
      grads = [grad] if _one_array(x) else treedef.flatten_up_to(grad)
      grads = [np.asarray(g, dtype).reshape(leaf.shape) for g, leaf in zip(grads, leaves)]
      return value, jax.tree.unflatten(treedef, grads)

    return jax.pure_callback(host, shapes, x, dynamic, vmap_method="sequential")

  @staticmethod
  def _pair_host(out):
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        f"with jac=True, fun must return (value, gradient), got {type(out).__name__}."
      )
    return out


def _forward_differences(fun, x, eps):
  """SciPy L-BFGS-B's gradient for ``jac=None``: ``(f(x + h e_i) - f(x)) / h``, h = ``eps``."""
  if not isinstance(x, np.ndarray):
    raise TypeError(
      "finite differences (jac=None with a fun JAX cannot trace) need x0 as one array; "
      "pass jac= or write fun with jax.numpy."
    )
  value = float(np.asarray(fun(x)).reshape(()))
  grad = np.empty(x.size)
  flat = x.ravel()
  steps = np.broadcast_to(np.asarray(eps, np.float64), flat.shape)
  for i in range(flat.size):
    moved = flat.copy()
    moved[i] += steps[i]
    grad[i] = (float(np.asarray(fun(moved.reshape(x.shape))).reshape(())) - value) / steps[i]
  return value, grad.reshape(x.shape)


_MODES: dict = {}


def _traceable(fun, x0, args) -> bool:
  """Whether JAX can trace ``fun(x0, *args)`` (cached on ``fun`` and the shapes)."""
  key = None
  try:
    key = (fun, jax.tree.structure((x0, args)), tuple(map(jnp.shape, jax.tree.leaves((x0, args)))))
    if key in _MODES:
      return _MODES[key]
  except TypeError:  # an unhashable fun: probe every time
    key = None
  try:
    jax.eval_shape(lambda x, a: fun(x, *a), x0, args)
    mode = True
  except _UNTRACEABLE:
    mode = False
  if key is not None:
    _MODES[key] = mode
  return mode


def objective(fun, jac, x0, args, eps=None) -> tuple[Objective, tuple]:
  """``(f, dynamic_args)``: SciPy's ``fun``, ``jac`` and ``args`` as ``f(x, *dynamic_args)``.

  Args:
    fun: ``fun(x, *args)`` (``-> (value, grad)`` with ``jac=True``).
    jac: ``None``, ``True``, ``"2-point"`` (forward differences, host functions only) or a
      callable ``jac(x, *args)``.
    x0: the start.
    args: SciPy's ``args``.
    eps: SciPy's ``eps`` option (forward differences only), or ``None``.

  Returns:
    The :class:`Objective` and the dynamic leaves of ``args``.

  Raises:
    ValueError: a ``jac`` or ``eps`` this mode does not use.
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r}.")
  if isinstance(jac, str):
    if jac != "2-point":
      raise ValueError(
        f"jac={jac!r}: minimize takes jac=None (JAX's gradient, or SciPy's forward "
        "differences for a fun JAX cannot trace), jac=True, a callable or '2-point'."
      )
  elif not (jac is None or jac is True or callable(jac)):
    if jac is not False:
      raise ValueError(f"jac must be None, True, '2-point' or a callable, got {jac!r}.")
    jac = None  # SciPy reads a false jac as None
  dynamic, layout = split_args(args)
  args = _merge(layout, dynamic)
  host = not _traceable(fun, x0, args)
  if not host and callable(jac) and jac is not True:  # NumPy's jac with a JAX-traceable fun
    host = not _traceable(jac, x0, args)
  differences = host and jac in (None, "2-point")
  if jac == "2-point" and not host:
    raise ValueError(
      "jac='2-point' asks for finite differences, but JAX differentiates this fun exactly: "
      "pass jac=None."
    )
  if eps is not None and not differences:
    raise ValueError(
      f"options eps={eps!r} is the finite-difference step, but the gradient here is "
      f"{'JAX' if jac is None else 'jac'}'s: drop eps."
    )
  jac = None if jac == "2-point" else jac
  step = 1e-8 if eps is None else eps
  if not isinstance(step, float):
    step = float(np.asarray(step)) if np.ndim(step) == 0 else tuple(np.ravel(step).tolist())
  return Objective(fun=fun, jac=jac, host=host, layout=layout, eps=step), dynamic
