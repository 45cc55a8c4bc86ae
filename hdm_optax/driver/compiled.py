"""The library's compiled programs, kept up to a bound, least recently used out.

Every program a front door compiles (the fused run of a method and an objective, the
method's own program, an objective's value and gradient) is held here, keyed on what it
was built from and the abstract values (shapes, dtypes, weak types) of its arguments. The
cache holds at most :func:`cache_size` programs (``HDM_OPTAX_CACHE_SIZE``, default
:data:`DEFAULT_SIZE`); the least recently used goes first. :func:`clear_caches` empties it
and JAX's own caches, so that the memory of the executables is returned.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import sys
import threading
import weakref
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = (
  "DEFAULT_SIZE",
  "abstract",
  "abstract_of",
  "cache_size",
  "clear_caches",
  "dispatched",
  "lookup",
  "prepare",
  "releases",
  "set_cache_size",
)

# Programs kept at most (a method's program on a CPU holds a few MB of code).
DEFAULT_SIZE = 64


def _size_from_environment() -> int:
  text = os.environ.get("HDM_OPTAX_CACHE_SIZE", "")
  try:
    size = int(text) if text else DEFAULT_SIZE
  except ValueError:
    raise ValueError(
      f"HDM_OPTAX_CACHE_SIZE must be an int >= 1 (programs kept), got {text!r}; unset it "
      f"for the default {DEFAULT_SIZE}."
    ) from None
  return max(size, 1)


class _Programs:
  """An LRU map from keys to compiled programs (thread-safe)."""

  def __init__(self, size: int):
    self.size = size
    self.entries: collections.OrderedDict = collections.OrderedDict()
    self.lock = threading.RLock()
    self.compiles = 0

  def get(self, key):
    with self.lock:
      program = self.entries.get(key)
      if program is not None:
        self.entries.move_to_end(key)
      return program

  def put(self, key, program) -> None:
    with self.lock:
      self.entries[key] = program
      self.entries.move_to_end(key)
      while len(self.entries) > self.size:
        self.entries.popitem(last=False)


_CACHE = _Programs(_size_from_environment())


@functools.lru_cache(maxsize=64)
def _canonical_name(dtype, x64: bool) -> str:
  del x64  # a key: canonicalize_dtype reads it
  return jax.dtypes.canonicalize_dtype(dtype).name


def _leaf_key(x) -> tuple:
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):  # canonical already
    return (x.shape, _canonical_name(x.dtype, True), x.weak_type)
  if isinstance(x, (np.ndarray, np.generic)):
    return (x.shape, _canonical_name(x.dtype, jax.config.jax_enable_x64), False)
  if isinstance(x, jax.ShapeDtypeStruct):
    return (x.shape, _canonical_name(x.dtype, jax.config.jax_enable_x64), x.weak_type)
  if isinstance(x, jax.core.Tracer):
    raise TypeError("a traced value has no compiled program of its own")
  weak = isinstance(x, (float, int, complex)) or bool(getattr(x, "weak_type", False))
  return (np.shape(x), jnp.result_type(x).name, weak)


def abstract(tree) -> tuple:
  """``tree``'s structure and the abstract value of each leaf, as a key."""
  leaves, treedef = jax.tree.flatten(tree)
  return (treedef, tuple(map(_leaf_key, leaves)))


def dispatched(program) -> Callable:
  """``program``'s call on JAX's C++ dispatch, kept while ``program`` lives.

  JAX calls a compiled program that calls the host on its Python path alone (each
  argument handled in Python, and runtime tokens for the host calls), though ``jax.jit``
  calls such programs on its C++ path. The front doors' programs make pure host calls (no
  effects) and their runs wait for their outputs, which come after every host call: their
  C++ call is made as for a program without host calls. Its cache keys on the arguments'
  abstract values; a new key takes the checked Python path. A program with effects, or
  where this JAX's compiled object lacks the parts, is called as it is.
  """
  call = _CALLS.get(program)
  if call is None:
    with _CALLS_LOCK:  # one build per program: the flag below is the executable's own
      call = _CALLS.get(program)
      if call is None:
        call = _CALLS[program] = _cpp_call(program) or program
  return call


_CALLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CALLS_LOCK = threading.Lock()


def _cpp_call(program):
  executable, params = getattr(program, "_executable", None), getattr(program, "_params", None)
  execute = getattr(getattr(params, "executable", None), "unsafe_call", None)
  if not hasattr(executable, "create_cpp_call") or not hasattr(execute, "has_host_callbacks"):
    return None
  if getattr(execute, "ordered_effects", True) or getattr(execute, "has_unordered_effects", True):
    return None
  host_calls, execute.has_host_callbacks = execute.has_host_callbacks, False  # read once, here
  try:
    return executable.create_cpp_call(params)
  finally:
    execute.has_host_callbacks = host_calls


def lookup(key: Hashable, build: Callable[[], Any]) -> Any:
  """The program cached under ``key``, else ``build()``'s, cached (least recently used out).

  A build of ``key`` under way (:func:`prepare`) is waited for, not started again.
  """
  program = _CACHE.get(key)
  if program is not None:
    return program
  with _CACHE.lock:
    pending = _PENDING.get(key)
  if pending is not None and pending[1] is not threading.current_thread():
    pending[0].wait()
    program = _CACHE.get(key)
    if program is not None:
      return program
  program = build()
  with _CACHE.lock:
    _CACHE.compiles += 1
  _CACHE.put(key, program)
  return program


_PENDING: dict = {}


def prepare(key: Hashable, build: Callable[[], Any]) -> None:
  """Builds the program of ``key`` in a background thread (XLA's compile releases the GIL),
  unless it is cached or under way; :func:`lookup` of ``key`` then waits for it.

  The thread is not a daemon: the interpreter waits for a build under way before it
  finalizes (a thread that leaves XLA's compile during finalization aborts the process), so
  a process that ends just after starting one exits when the build ends. Callers wait for
  the build's event, never ``Thread.join``: a join that Ctrl-C interrupts marks a running
  thread as ended (CPython 3.11's ``Thread._wait_for_tstate_lock``), and the interpreter
  then finalizes without waiting for it."""
  done = threading.Event()

  def work():
    program = None
    try:
      program = build()
    except Exception:  # pylint: disable=broad-except
      pass  # the foreground lookup builds it again and raises what it raises
    finally:
      with _CACHE.lock:
        if program is not None:
          _CACHE.compiles += 1
          _CACHE.put(key, program)
        _PENDING.pop(key, None)
      done.set()

  with _CACHE.lock:
    if key in _PENDING or key in _CACHE.entries:
      return
    thread = threading.Thread(target=work, name="hdm_optax compile", daemon=False)
    _PENDING[key] = (done, thread)
  thread.start()


def building() -> bool:
  """Whether a build is under way (:func:`prepare`)."""
  with _CACHE.lock:
    return bool(_PENDING)


def wait() -> None:
  """Waits for the builds under way (:func:`prepare`)."""
  while True:
    with _CACHE.lock:
      pending = list(_PENDING.values())
    if not pending:
      return
    for done, _ in pending:
      done.wait()


def _wait_at_exit() -> None:
  """At exit, waits for the builds under way (:func:`prepare`), through any Ctrl-C.

  The interpreter's own wait for non-daemon threads ends at a Ctrl-C (the join it makes is
  interrupted, and the thread counts as ended), and JAX's exit handler, which runs after
  this one (registered later, run first), then clears the backends with a compile still
  inside XLA: the process aborts ("terminate called after throwing an instance of ''"). A
  build ends within seconds, so this wait does not give way to Ctrl-C (SIGKILL ends it).
  """
  while building():
    try:
      wait()
    except KeyboardInterrupt:
      print("hdm_optax: a background compile is ending; exiting after it.", file=sys.stderr)


atexit.register(_wait_at_exit)


def peek(key: Hashable) -> Any:
  """The program cached under ``key``, or ``None`` (it is then the most recently used)."""
  return _CACHE.get(key)


def store(key: Hashable, program: Any) -> None:
  """Caches ``program`` under ``key``."""
  _CACHE.put(key, program)


def cache_size() -> int:
  """The number of compiled programs the cache keeps at most."""
  return _CACHE.size


def set_cache_size(size: int) -> None:
  """Keeps at most ``size`` compiled programs (the least recently used go first).

  Each program holds memory mappings of its own: XLA:CPU maps every compiled kernel
  apart, about 200 mappings for a ``minimize`` or ``solve`` program. A Linux process
  that passes ``vm.max_map_count`` (65,530 by default) fails inside XLA's next compile,
  so a size in the hundreds of large programs needs that limit raised, or
  :func:`hdm_optax.clear_caches` from time to time.

  Raises:
    ValueError: ``size`` is not an int >= 1.
  """
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
    raise ValueError(f"size must be an int >= 1 (programs kept), got {size!r}.")
  with _CACHE.lock:
    _CACHE.size = int(size)
    while len(_CACHE.entries) > _CACHE.size:
      _CACHE.entries.popitem(last=False)


def count() -> int:
  """The number of programs held now."""
  return len(_CACHE.entries)


def compiles() -> int:
  """The number of programs built (compiled or loaded from disk) in this process, the builds
  under way included (waited for)."""
  wait()
  return _CACHE.compiles


# Values kept by :func:`kept`, the most recently used last.
_KEPT: collections.OrderedDict = collections.OrderedDict()
_KEPT_SIZE = 32


def kept(key: Hashable, make: Callable[[], Any]) -> Any:
  """``make()``, kept by ``key`` (the last :data:`_KEPT_SIZE` keys; :func:`clear_caches`
  releases them). A kept value is never changed: it is passed alike at every call."""
  with _CACHE.lock:
    value = _KEPT.pop(key, None)
    value = make() if value is None else value
    _KEPT[key] = value
    while len(_KEPT) > _KEPT_SIZE:
      _KEPT_ABSTRACT.pop(id(_KEPT.popitem(last=False)[1]), None)
  return value


# abstract() of the kept values, by identity (each entry holds its value, so an id stays its own).
_KEPT_ABSTRACT: dict = {}


def abstract_of(value) -> tuple:
  """:func:`abstract` of ``value``, remembered while ``value`` is kept (:func:`kept`)."""
  entry = _KEPT_ABSTRACT.get(id(value))
  if entry is not None and entry[0] is value:
    return entry[1]
  result = abstract(value)
  with _CACHE.lock:
    if any(v is value for v in _KEPT.values()):
      _KEPT_ABSTRACT[id(value)] = (value, result)
  return result


# What clear_caches also calls: the other modules' tables (:func:`releases`).
_RELEASES: list = []


def releases(clear: Callable[[], Any]) -> None:
  """Makes :func:`clear_caches` call ``clear``: a table's of another module that holds what
  the user's calls were keyed on or read."""
  _RELEASES.append(clear)


def clear_caches() -> None:
  """Releases every compiled program of the library, every table it keeps of the user's
  calls (what they were keyed on, how often each was run), and JAX's caches
  (``jax.clear_caches``).

  The memory the executables held is returned; the next call of a front door compiles its
  program again (or loads it from the disk cache, :mod:`hdm_optax.driver.store`), and a JAX
  objective runs on the separate path again before its fused program serves it.
  """
  wait()
  with _CACHE.lock:
    _CACHE.entries.clear()
    _KEPT.clear()
    _KEPT_ABSTRACT.clear()
    for clear in _RELEASES:
      clear()
  jax.clear_caches()
