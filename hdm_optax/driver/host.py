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
import threading
from typing import Any, Callable

import jax
import numpy as np

try:
  from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # a JAX before buffer callbacks
  _buffer_callback = None

__all__ = ("Caller", "Filler", "buffered", "call", "opened")

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


class Caller:
  """The thread that opened a run's host entry (an oracle, a callback's session) and its
  ``contextvars`` context at that moment.

  XLA makes a program's host calls from whichever of its threads runs the program at that
  point: the calling thread, or one of its intra-op threads once a kernel has been split
  over them (large problems). :meth:`run` calls the user's code there in the caller's
  context, so that what the caller set through context variables (``np.errstate``, a
  ``decimal`` context, any ``ContextVar``) holds as in the caller's own thread. Values of a
  ``threading.local`` and objects bound to a thread (a ``sqlite3`` connection) stay the
  calling thread's.
  """

  __slots__ = ("thread", "context")

  def __init__(self):
    self.thread, self.context = threading.get_ident(), contextvars.copy_context()

  def run(self, fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)``: at once in the calling thread, else in a copy of the caller's context
    (a copy per call: a context is entered by one thread at a time)."""
    if threading.get_ident() == self.thread:
      return fn(*args)
    return self.context.copy().run(fn, *args)


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
