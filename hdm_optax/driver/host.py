"""Host calls from a compiled program.

``jax.pure_callback`` moves its arguments to a device and its results back around the
Python call; ``jax.experimental.buffer_callback`` hands the program's buffers to Python,
which costs far less (docs/research/speed.md), on the CPU and where this JAX has it.
The separate path's program (:mod:`hdm_optax.driver.separate`), which runs on the CPU only,
makes its host calls of the second kind (:func:`buffered`); every other program the first.
The targets are picklable (a :class:`~hdm_optax.driver.oracle.Site`, a module function),
so that a program that calls them can be stored and reloaded (:mod:`hdm_optax.driver.store`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax
import numpy as np

try:
  from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # a JAX before buffer callbacks
  _buffer_callback = None

__all__ = ("Filler", "buffered", "call", "opened")

_BUFFERED = contextvars.ContextVar("hdm_optax_buffered", default=False)


@contextlib.contextmanager
def buffered():
  """Host calls traced in the block are buffer callbacks (where this JAX has them)."""
  token = _BUFFERED.set(_buffer_callback is not None)
  try:
    yield
  finally:
    _BUFFERED.reset(token)


class Filler:
  """``target(*inputs)`` as a buffer callback: its outputs (a tuple) written into the
  program's buffers. ``inputs`` counts the leaves of the inputs: a stored program's targets
  (:mod:`hdm_optax.driver.store`) take flat arrays."""

  __slots__ = ("target", "inputs", "__weakref__")

  def __init__(self, target: Callable[..., tuple], inputs: int):
    self.target, self.inputs = target, inputs

  def __reduce__(self):
    return (Filler, (self.target, self.inputs))

  def __eq__(self, other):
    return isinstance(other, Filler) and (other.target, other.inputs) == (self.target, self.inputs)

  def __hash__(self):
    return hash(("filler", self.target, self.inputs))

  def __call__(self, context, out, *inputs):
    del context
    if not getattr(self.target, "reads_only", False):  # the buffers are XLA's: copies
      inputs = [_copied(b) for b in inputs]
    for buffer, value in zip(out, self.target(*inputs)):
      np.asarray(buffer)[...] = value  # in the buffer's dtype and shape

  def entry(self) -> Callable[..., tuple]:
    """What the backend calls in a reloaded program: the context, the inputs, the outputs."""
    return lambda context, *args: self(context, args[self.inputs :], *args[: self.inputs]) or ()


def opened(table: dict, value, lock) -> int:
  """``value`` put in ``table`` under the lowest free key from 1, which is returned.

  A program's host calls find their entry by this key, an argument of the program. Calls
  one after another then pass the same key, so the argument repeats and its block stays on
  the device (:class:`hdm_optax.driver.separate._Arguments`).
  """
  with lock:
    key = 1
    while key in table:
      key += 1
    table[key] = value
  return key


def _copied(node):
  if isinstance(node, (tuple, list, dict)):
    return jax.tree.map(_copied, node)
  return np.asarray(node).copy()


def call(target: Callable[..., tuple], shapes: tuple, *args, vmap_method=None) -> Any:
  """``target(*args)`` on the host, its outputs of ``shapes`` (a tuple of
  ``jax.ShapeDtypeStruct``): a buffer callback inside :func:`buffered`, else
  ``jax.pure_callback``."""
  if _BUFFERED.get():  # inputs: the leaves, as a reloaded program passes them
    filler = Filler(target, len(jax.tree.leaves(args)))
    return _buffer_callback(filler, shapes, vmap_method=vmap_method)(*args)
  return jax.pure_callback(target, shapes, *args, vmap_method=vmap_method)
