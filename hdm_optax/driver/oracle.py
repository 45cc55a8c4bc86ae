"""The objective as a program of its own, called from the method's program on the host.

A run on the *separate* path compiles the method's program once per shapes, dtypes and
settings, and serves every objective from it: inside the program the objective is a
:func:`function` whose value and gradient come from the host, through one dispatcher keyed by
an integer handle passed as an argument (as :mod:`hdm_optax.driver.hooks` does for
callbacks). On the host the handle names an :class:`Oracle`, opened for one call by
:func:`serving`:

- :class:`JaxOracle`: ``jax.value_and_grad`` of a JAX objective, compiled on its own
  (``jax.jit``: the user's cost, as with SciPy), on the method's packed params;
- :class:`HostOracle`: a NumPy ``fun`` (and ``jac``), called as SciPy calls it.

The method's program then holds no user code or data: a new objective compiles only the
objective, and a NumPy ``fun`` compiles nothing once the method's program exists.

The host entry points are :class:`Site` objects: picklable, and called with flat NumPy
arrays, so that a program that calls them can be kept on disk and reloaded in another
process (:mod:`hdm_optax.driver.store`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax import _blocks
from hdm_optax import _oracle
from hdm_optax.driver import compiled as compiled_lib
from hdm_optax.driver import engine
from hdm_optax.driver import host
from hdm_optax.driver import programs

__all__ = ("HostOracle", "JaxOracle", "Oracle", "Site", "function", "serving")


class Oracle:
  """What a handle names on the host: f and grad f on the method's params (flat arrays).

  Subclasses implement :meth:`value_and_grad` and :meth:`value`. The arrays come and go
  as the leaves of the method's params (the packed blocks of the user's params), in the
  params' dtype.
  """

  def value_and_grad(self, leaves: list) -> tuple:
    raise NotImplementedError

  def value(self, leaves: list):
    raise NotImplementedError


class _Entry:
  """An open oracle, its :class:`~hdm_optax.driver.host.Caller` and the first exception it
  raised (re-raised by the front door)."""

  __slots__ = ("oracle", "caller", "error")

  def __init__(self, oracle: Oracle):
    self.oracle, self.caller = oracle, host.Caller()
    self.error: Optional[BaseException] = None


_ORACLES: dict = {}
_LOCK = threading.Lock()


@contextlib.contextmanager
def serving(oracle: Oracle):
  """Opens ``oracle`` for the programs run in the block; yields ``(handle, entry)``.

  ``handle`` is an int32 scalar for the program's oracle argument; ``entry.error`` holds
  the exception the oracle raised, if any (the program then ends with a runtime error,
  and the caller raises this exception instead).
  """
  entry = _Entry(oracle)
  handle = host.opened(_ORACLES, entry, _LOCK)
  try:
    yield np.int32(handle), entry
  finally:
    with _LOCK:
      _ORACLES.pop(handle, None)


class Site:
  """A host entry point of the method's program: ``kind`` is ``"value_and_grad"`` or
  ``"value"``, ``shapes`` the shapes of the params' leaves and ``dtype`` theirs.

  Called with the handle and the params' leaves (NumPy arrays), it returns the flat tuple
  of outputs: the value, then (for ``"value_and_grad"``) the gradient's leaves.
  """

  __slots__ = ("kind", "shapes", "dtype")

  # It keeps nothing of its inputs past the call (a NumPy objective gets a copy of x, a JAX
  # one's program its own buffers): a buffer callback passes it the program's buffers.
  reads_only = True

  def __init__(self, kind: str, shapes: tuple, dtype: str):
    self.kind, self.shapes, self.dtype = kind, tuple(map(tuple, shapes)), str(dtype)

  def __reduce__(self):
    return (Site, (self.kind, self.shapes, self.dtype))

  def __eq__(self, other):
    return isinstance(other, Site) and self.__reduce__() == other.__reduce__()

  def __hash__(self):
    return hash(self.__reduce__())

  def out_shapes(self) -> tuple:
    scalar = jax.ShapeDtypeStruct((), self.dtype)
    if self.kind == "value":
      return (scalar,)
    return (scalar, *(jax.ShapeDtypeStruct(s, self.dtype) for s in self.shapes))

  def __call__(self, handle, *leaves):
    entry = _ORACLES.get(np.asarray(handle).item())
    if entry is None:
      raise RuntimeError("hdm_optax: the method's program called an oracle that is closed.")
    try:
      leaves = [np.asarray(x) for x in leaves]
      if self.kind == "value":
        outputs = (entry.caller.run(entry.oracle.value, leaves),)
      else:
        value, grads = entry.caller.run(entry.oracle.value_and_grad, leaves)
        outputs = (value, *grads)
    except BaseException as error:  # pylint: disable=broad-except
      if entry.error is None:
        entry.error = error
      raise
    shapes = ((),) if self.kind == "value" else ((), *self.shapes)
    return tuple(np.asarray(out, self.dtype).reshape(shape) for out, shape in zip(outputs, shapes))


def function(handle, like) -> Callable[[Any], jax.Array]:
  """The objective inside the method's program: ``f(params)`` from the host oracle.

  Args:
    handle: the int32 handle (a traced argument of the program).
    like: the params (or values of their shapes and dtype).

  Returns:
    ``f``, a ``jax.custom_vjp`` function: evaluated alone it makes one ``"value"`` call,
    under ``jax.value_and_grad`` one ``"value_and_grad"`` call, whose gradient it returns.
  """
  leaves, treedef = jax.tree.flatten(like)
  shapes = tuple(jnp.shape(x) for x in leaves)
  dtype = jnp.result_type(leaves[0]).name
  value_site, pair_site = Site("value", shapes, dtype), Site("value_and_grad", shapes, dtype)

  def call(site, x):
    # A caller may evaluate at another precision (optax's line search promotes float32
    # params under x64): the objective was compiled for the params' dtype.
    leaves = [jnp.asarray(v).astype(dtype) for v in jax.tree.leaves(x)]
    return host.call(site, site.out_shapes(), jnp.asarray(handle, jnp.int32), *leaves)

  @jax.custom_vjp
  def f(x):
    return call(value_site, x)[0]

  def forward(x):
    value, *grads = call(pair_site, x)
    grads = [g.astype(jnp.result_type(v)) for g, v in zip(grads, jax.tree.leaves(x))]
    return value, jax.tree.unflatten(treedef, grads)

  def backward(grad, cotangent):
    return (jax.tree.map(lambda g: cotangent * g, grad),)

  f.defvjp(forward, backward)
  return f


_ONE_LEAF = jax.tree.structure(0)


class _HostLayout:
  """The user's params and the method's leaves on the host: NumPy views of the packed blocks
  as the params' leaves, and the params' leaves concatenated into blocks (``packed``), or the
  leaves as they are."""

  def __init__(self, like, packed: bool):
    leaves, self.treedef = jax.tree.flatten(like)
    self.shapes = [np.shape(x) for x in leaves]
    self.groups = _blocks.groups(leaves) if packed else tuple((i,) for i in range(len(leaves)))
    self.single = self.treedef == _ONE_LEAF  # the params are one array (SciPy's x)

  @functools.cached_property
  def _spans(self) -> list:
    """(leaf, start, end) in each block."""
    ends = [np.cumsum([0] + [int(np.prod(self.shapes[i])) for i in g]) for g in self.groups]
    return [list(zip(g, e[:-1].tolist(), e[1:].tolist())) for g, e in zip(self.groups, ends)]

  def params(self, blocks) -> list:
    """The params' leaves (views of ``blocks``)."""
    if len(self.shapes) == 1 and np.shape(blocks[0]) == self.shapes[0]:
      return [blocks[0]]
    out = [None] * len(self.shapes)
    for block, spans in zip(blocks, self._spans):
      flat = np.ravel(block)
      for i, start, end in spans:
        out[i] = flat[start:end].reshape(self.shapes[i])
    return out

  def blocks(self, leaves) -> list:
    """The method's leaves of the params' ``leaves``."""
    return [
      np.asarray(leaves[g[0]]) if len(g) == 1 else np.concatenate([np.ravel(leaves[i]) for i in g])
      for g in self.groups
    ]


class JaxOracle(Oracle):
  """A JAX objective's value and gradient, compiled on its own (once per objective and shapes).

  The program is ``jax.value_and_grad`` of the objective on the user's params, as SciPy's
  route compiles it (the leaves are the user's cost); the method's packed blocks are split
  into the params' leaves, and the gradient's leaves joined into blocks, on the host.

  Args:
    closed: the objective as traced at the call
      (:class:`~hdm_optax.driver.programs.Closed`: ``closed(params, *args)``).
    args: its arguments at this call.
    like: the user's params (their pytree, shapes and dtype).
    packed: the method's params are ``like`` packed into blocks (:mod:`hdm_optax._blocks`).
    options: XLA's compiler options for its programs.
  """

  def __init__(self, closed, args: tuple, like, packed: bool, options=None):
    self._args, self._options = args, options or {}
    self._layout = _HostLayout(like, packed)
    treedef = self._layout.treedef

    def objective(leaves, args):
      return closed(jax.tree.unflatten(treedef, leaves), *args)

    def pair(leaves, args):  # the engine's checks of what fun returns, then its value's dtype
      fun = lambda leaves: objective(leaves, args)
      value, grads = _oracle.value_and_grad(fun, leaves, name="fun")
      engine.check_value_dtype(value, like)
      return value, grads

    leaves = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(like)]
    options_key = tuple(sorted(self._options.items()))
    key = (programs.compared(closed), compiled_lib.abstract((leaves, args)), options_key)
    self._key, self._leaves, self._objective = key, leaves, objective
    self._pair = self._program("value_and_grad", pair)
    self._value = None

  def _program(self, kind: str, fun: Callable):
    build = lambda: jax.jit(fun).lower(self._leaves, self._args).compile(self._options or None)
    return compiled_lib.lookup(("objective", kind, self._key), build)

  def value_and_grad(self, leaves):
    value, grads = self._pair(self._layout.params(leaves), self._args)
    return value, self._layout.blocks([np.asarray(g) for g in grads])

  def value(self, leaves):
    if self._value is None:
      self._value = self._program("value", self._objective)
    return self._value(self._layout.params(leaves), self._args)


class HostOracle(Oracle):
  """A NumPy objective, called as SciPy calls it.

  Args:
    pair: ``pair(x) -> (value, grad)`` on the user's params (NumPy arrays).
    value: ``value(x) -> value`` (``None``: the pair's value).
    like: the user's params (their pytree, shapes and dtype).
    packed: the method's params are ``like`` packed into blocks (:mod:`hdm_optax._blocks`).
  """

  def __init__(self, pair: Callable, value: Optional[Callable], like, packed: bool):
    self._pair, self._value = pair, value
    self._layout = _HostLayout(like, packed)

  def _params(self, blocks):  # views: the pair copies x before fun sees it (fun may write)
    if self._layout.single and np.shape(blocks[0]) == self._layout.shapes[0]:
      return blocks[0]
    return jax.tree.unflatten(self._layout.treedef, self._layout.params(blocks))

  def value_and_grad(self, leaves):
    value, grad = self._pair(self._params(leaves))
    if self._layout.single:
      return value, [grad]
    return value, self._layout.blocks(self._layout.treedef.flatten_up_to(grad))

  def value(self, leaves):
    if self._value is None:
      return self._pair(self._params(leaves))[0]
    return self._value(self._params(leaves))
