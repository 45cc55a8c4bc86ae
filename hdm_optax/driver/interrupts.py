"""Ctrl-C during a compiled run: the run stops within a fraction of a second and keeps its result.

Python runs its SIGINT handler only between bytecodes of the main thread, and a compiled run
is one call into XLA: without help, Ctrl-C would wait for the run's end and then lose the
result. So for the duration of a front door's call (outside ``jax.jit``, ``jax.grad`` and
``jax.vmap``, in the main thread, where the SIGINT handler is Python's default), the call
installs a handler that only records the signal, with a wakeup socket that the C-level
handler writes to at once (:func:`catching`), and the program asks the host, between
chunks of steps (:func:`chunked`), whether a SIGINT came. The chunks are sized so that a
check comes about every :data:`POLL_SECONDS` (the host measures the time per step and
remembers it per program and shapes), so a check costs one host call per
:data:`POLL_SECONDS`, not one per step. A run with a callback or a progress line checks
at every step, in the same host call. Once a SIGINT is seen the run stops (status
``STOPPED``), the call raises ``KeyboardInterrupt`` with the partial result in its
``.result``, and the handler that was there before is back.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import socket
import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax.driver import compiled
from hdm_optax.driver import host

try:  # signal's own functions, without its conversions of handlers to enums
  import _signal as _raw_signal
except ImportError:  # pragma: no cover (CPython has it)
  _raw_signal = signal

__all__ = ("ENABLED", "POLL_SECONDS", "catching", "chunked", "seen", "watching")

# A run without a callback asks the host about Ctrl-C about this often.
POLL_SECONDS = 0.2
# False: programs compiled from now on have no check (Ctrl-C then waits for a run's end).
ENABLED = True
# The most steps between two checks (a chunk's size is int32).
_MOST_STEPS = 1 << 30


class _Signal:
  """The process's SIGINT state while a front door's call is in progress."""

  def __init__(self):
    self.active = False
    self.seen = False
    self.previous = None
    self.previous_fd = None
    self.reader: Optional[socket.socket] = None
    self.writer: Optional[socket.socket] = None

  def drain(self) -> bool:
    """Whether the wakeup socket received a SIGINT (reading what it holds)."""
    if self.reader is None:
      return False
    got = False
    try:
      while True:
        data = self.reader.recv(256)
        if not data:
          break
        got = got or signal.SIGINT in data
    except (BlockingIOError, InterruptedError, OSError):
      pass
    return got

  def install(self) -> None:
    """Records SIGINTs from now on: the handler :func:`_record` and the wakeup socket.

    What it replaces is noted before each change, so that :meth:`uninstall` undoes exactly
    what was done, also after a Ctrl-C that landed part way through (Python's handler was
    still the default one there, and raised).
    """
    self.previous, self.previous_fd = None, None
    self.active, self.seen = True, False
    if self.reader is None:
      self.reader, self.writer = socket.socketpair()
      atexit.register(self.close)
      self.reader.setblocking(False)
      self.writer.setblocking(False)
    self.drain()
    self.previous = _raw_signal.signal(signal.SIGINT, _record)
    try:
      self.previous_fd = _raw_signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
      self.previous_fd = None

  def uninstall(self) -> None:
    """Puts back the handler and the wakeup descriptor that :meth:`install` replaced."""
    if self.previous_fd is not None:
      _raw_signal.set_wakeup_fd(self.previous_fd)
    if _raw_signal.getsignal(signal.SIGINT) is _record:
      _raw_signal.signal(signal.SIGINT, self.previous or signal.default_int_handler)
    self.active = False

  def close(self) -> None:
    """Closes the wakeup socket (at exit: it is kept for the process's later calls)."""
    for end in (self.reader, self.writer):
      if end is not None:
        end.close()
    self.reader = self.writer = None


_STATE = _Signal()


def _record(signum, frame):  # the handler while a call is in progress
  del signum, frame
  _STATE.seen = True


def _can_install() -> bool:
  return threading.current_thread() is threading.main_thread() and _raw_signal.getsignal(
    signal.SIGINT
  ) in (signal.default_int_handler, _record)


@contextlib.contextmanager
def catching(enabled: bool = True):
  """While open, a SIGINT is recorded (:func:`seen`) instead of raising at once.

  Installed only in the main thread and where SIGINT has Python's default handler (a
  handler of the user's is left alone); nested calls share the outermost one's. The
  handler and the wakeup file descriptor that were there before are restored on exit.
  The outermost call is told by the handler in place, and everything it changes is undone
  in one ``finally``: a Ctrl-C that lands while the handler is being set up (and raises
  ``KeyboardInterrupt`` there) leaves no state behind that would keep later calls from
  installing theirs.
  """
  if not enabled or not _can_install():
    yield False
    return
  outermost = _raw_signal.getsignal(signal.SIGINT) is not _record
  try:
    if outermost:
      _STATE.install()
    yield True
  finally:
    if outermost:
      _STATE.uninstall()


def seen() -> bool:
  """Whether a SIGINT came while :func:`catching` was open (in any thread's view)."""
  if not _STATE.active:
    return False
  _STATE.seen = _STATE.seen or _STATE.drain()
  return _STATE.seen


# --- the program side -----------------------------------------------------------------------


class _Watch:
  """One call's checks: the steps between them, and when the last one was."""

  def __init__(self, key, steps: int):
    self.key, self.steps, self.last, self.at = key, steps, time.perf_counter(), 0


_WATCHES: dict = {}
_WATCHES_LOCK = threading.Lock()
# The steps between checks that the last call of a program (and shapes) ended with.
_LEARNED: dict = {}
_LEARNED_MOST = 256
compiled.releases(_LEARNED.clear)


@contextlib.contextmanager
def watching(key):
  """Yields the ``watch`` argument of a watched program, an int32 ``[id, first_chunk]``.

  ``key`` names the program and its shapes: the chunk size learned by its last call is the
  first chunk of this one (1 for its first call, whose compile hides the extra checks, and
  where ``key`` is ``None``: a program whose steps cost what its caller's objective costs,
  the separate path's, learns anew at each call). The last :data:`_LEARNED_MOST` keys are
  kept.
  """
  steps = _LEARNED.get(key, 1) if key is not None else 1
  ident = host.opened(_WATCHES, _Watch(key, steps), _WATCHES_LOCK)
  try:
    yield np.asarray([ident, steps], np.int32)
  finally:
    watch = _WATCHES.pop(ident)
    if key is not None:
      if len(_LEARNED) >= _LEARNED_MOST and key not in _LEARNED:
        _LEARNED.pop(next(iter(_LEARNED)))
      _LEARNED[key] = watch.steps


def _poll(watch, steps):
  """The host's answer after a chunk: the next chunk's steps, or 0 to stop (a SIGINT)."""
  found = _WATCHES.get(int(np.asarray(watch).ravel()[0]))
  if found is None:
    return np.int32(_MOST_STEPS)
  if seen():
    return np.int32(0)
  now, steps = time.perf_counter(), int(np.asarray(steps).ravel()[0])
  done = max(steps - found.at, 1)
  per_step = (now - found.last) / done
  found.last, found.at = now, steps
  found.steps = int(min(max(POLL_SECONDS / max(per_step, 1e-9), 1), _MOST_STEPS))
  return np.int32(found.steps)


def chunked(primitive, steps_of, *, watch, cause):
  """``primitive`` run in chunks with a host check between them.

  Args:
    primitive: a run's loop, ``primitive(steps, member, carry)``
      (:class:`hdm_optax.driver.runs.Steps`: ``running``, ``body``, ``room``, ``stop``).
    steps_of: ``steps_of(carry)``: the steps made (int32).
    watch: the int32 ``[id, first_chunk]`` of :func:`watching` (an argument of the program).
    cause: the :attr:`hdm_optax.SolveResult.stopped_by` code of a stop by Ctrl-C.

  Returns:
    The primitive of the same signature: each chunk is ``primitive`` until the run stops
    or the chunk's steps are made (its ``running`` and ``room`` also ask that); after a
    SIGINT the run ends ``STOPPED`` (``steps.stop``).
  """

  def run(steps, member, carry):
    def chunk(inner):
      carry, size = inner
      limit = steps_of(carry) + size
      within = steps._replace(
        running=lambda c: steps.running(c) & (steps_of(c) < limit),
        room=lambda m, c, more: steps.room(m, c, more) & (steps_of(c) + more <= limit),
      )
      carry = primitive(within, member, carry)
      size = jax.lax.cond(steps.running(carry), lambda: _ask(watch, steps_of(carry)), lambda: size)
      stopped = lambda c: steps.stop(member, c, jnp.int32(cause))
      carry = jax.lax.cond(size == 0, stopped, lambda c: c, carry)
      return carry, size

    first = jnp.asarray(watch, jnp.int32)[1]
    return jax.lax.while_loop(lambda inner: steps.running(inner[0]), chunk, (carry, first))[0]

  run.batch = False
  return run


def _polled(watch, steps) -> tuple:
  """:func:`_poll`'s answer as a host call's outputs."""
  return (_poll(watch, steps),)


def _ask(watch, steps) -> Any:
  shapes = (jax.ShapeDtypeStruct((), jnp.int32),)
  return host.call(_polled, shapes, watch, steps, vmap_method="expand_dims")[0]
