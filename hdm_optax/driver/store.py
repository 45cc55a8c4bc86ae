"""The method's programs on disk: a new process loads the program instead of compiling it.

A program of the separate path (:mod:`hdm_optax.driver.separate`) holds the method and
the engine, and no user code or data: its objective is reached through host entry points
(:class:`~hdm_optax.driver.oracle.Site`). Once compiled it is written to a private
directory, and a later process that needs the same program (same configuration, shapes,
dtypes, library and JAX versions, backend and CPU) loads it: no tracing, no compile.

JAX's own persistent cache does not keep a program that calls the host (its host callbacks
are Python objects of the process that compiled it), and ``jax.experimental.
serialize_executable`` cannot pickle them. Here the executable is serialized by the
backend, the host entry points are written as :class:`~hdm_optax.driver.oracle.Site`
values (or :class:`~hdm_optax.driver.host.Filler` of them, a buffer callback), and at load
the backend is given this process's entry points.

The directory: ``$HDM_OPTAX_PROGRAM_CACHE`` if set (``0``, ``off`` or an empty string
turn the store off), else ``$XDG_CACHE_HOME/hdm_optax/programs``
(``~/.cache/hdm_optax/programs``). It is created with mode 0700; a directory that is a
symbolic link, belongs to another user, or that others can write to is refused (a warning,
and the store is off), since loading a program runs its code. Its files are read only
after the same checks, and each holds the SHA-256 digest of its contents: a file damaged
on disk (a partial write, a flipped bit) is compiled again, not run.

The store holds at most ``$HDM_OPTAX_PROGRAM_CACHE_MB`` megabytes (default
:data:`DEFAULT_MB`; a program is about 0.5 MB): after each write the least recently used
programs (by modification time, which a load renews) are removed until it fits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import io
import os
import pickle
import stat
import tempfile
import time
import types
import warnings
from typing import Any, Optional

import jax
import numpy as np

from hdm_optax._private_dir import private_dir
from hdm_optax.driver import host
from hdm_optax.driver import interrupts
from hdm_optax.driver import oracle as oracle_lib

__all__ = ("DEFAULT_MB", "counts", "describe", "directory", "load", "save")

_COUNTS = {"saved": 0, "loaded": 0}


def counts() -> dict:
  """How many programs this process wrote to the store and loaded from it."""
  return dict(_COUNTS)


_SUFFIX = ".program"
# A write in progress; one older than this (a write takes well under a second) was left by
# a process that died while writing.
_PARTIAL = ".partial"
_ABANDONED_SECONDS = 3600.0
DEFAULT_MB = 512
_MAGIC = b"hdm_optax program\n"
# Modules whose classes a stored program may name (pickle's find_class).
_TRUSTED = ("jax", "jaxlib", "numpy", "ml_dtypes", "hdm_optax", "optax", "builtins", "collections")


def _private(path: str) -> Optional[str]:
  """``path`` as a private directory (:func:`hdm_optax._private_dir.private_dir`), or ``None``
  with a warning."""
  try:
    return private_dir(path, name="HDM_OPTAX_PROGRAM_CACHE")
  except ValueError as error:
    warnings.warn(
      f"hdm_optax: the program store is off: {error} Loading a program runs its code; set "
      "HDM_OPTAX_PROGRAM_CACHE to a private directory, or to 0 to turn the store off.",
      stacklevel=4,
    )
    return None


@functools.lru_cache(maxsize=None)
def _directory(setting: Optional[str], base: str) -> Optional[str]:
  if setting is not None and setting.strip().lower() in ("", "0", "off", "false", "no"):
    return None
  return _private(setting if setting is not None else os.path.join(base, "hdm_optax", "programs"))


def directory() -> Optional[str]:
  """The store's directory, or ``None`` where it is off (see the module)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return _directory(os.environ.get("HDM_OPTAX_PROGRAM_CACHE"), base)


# --- what a program is keyed on ------------------------------------------------------------


class _Unstable(Exception):
  """A value with no description that another process would give the same way."""


def _stable_(obj, seen: frozenset = frozenset()) -> Any:
  """``obj`` described the same way in every process (a user's function has no such
  description: its code is not the library's)."""
  if id(obj) in seen or len(seen) > 32:
    return ("seen", type(obj).__name__)
  _stable = functools.partial(_stable_, seen=seen | {id(obj)})
  if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
    return (type(obj).__name__, repr(obj))
  if isinstance(obj, np.generic):
    return (type(obj).__name__, repr(obj.item()))
  if isinstance(obj, (np.dtype, inspect.Signature, jax.tree_util.PyTreeDef)):
    return (type(obj).__name__, str(obj))
  if isinstance(obj, functools.partial):
    return ("partial", _stable(obj.func), _stable(obj.args), _stable(obj.keywords))
  if isinstance(obj, (types.FunctionType, type)):
    module = getattr(obj, "__module__", "") or ""
    if module.split(".")[0] not in ("hdm_optax", "optax", "jax"):
      raise _Unstable(obj)
    cells = [c.cell_contents for c in getattr(obj, "__closure__", None) or () if _filled(c)]
    defaults = getattr(obj, "__defaults__", None)
    return ("function", module, obj.__qualname__, _stable(cells), _stable(defaults))
  if isinstance(obj, tuple) and hasattr(obj, "_fields"):
    return ("namedtuple", _stable(type(obj)), _stable(tuple(obj)))
  if isinstance(obj, (tuple, list)):
    return (type(obj).__name__, tuple(map(_stable, obj)))
  if isinstance(obj, dict):
    return ("dict", tuple((_stable(k), _stable(v)) for k, v in obj.items()))
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    fields = tuple((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return ("dataclass", _stable(type(obj)), _stable(fields))
  describe_ = getattr(obj, "describe", None)
  if callable(describe_):
    return ("described", _stable(type(obj)), _stable(describe_()))
  raise _Unstable(obj)


@functools.lru_cache(maxsize=1)
def _environment() -> str:
  """What a program's code depends on besides its key: versions, backend, CPU, flags."""
  import jaxlib  # pylint: disable=import-outside-toplevel

  device = jax.devices()[0]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  source = hashlib.sha256()
  for folder, _, files in sorted(os.walk(root)):
    for name in sorted(files):
      if name.endswith(".py"):
        with open(os.path.join(folder, name), "rb") as file:
          source.update(name.encode() + file.read())
  cpu = ""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
      cpu = "".join(sorted({line for line in file if line.startswith(("model name", "flags"))}))
  except OSError:
    pass
  parts = (
    jax.__version__,
    jaxlib.__version__,
    device.platform,
    device.device_kind,
    device.client.platform_version,
    os.environ.get("XLA_FLAGS", ""),
    str(jax.config.jax_default_matmul_precision),
    source.hexdigest(),
    hashlib.sha256(cpu.encode()).hexdigest(),
  )
  return repr(parts)


def describe(*parts) -> Optional[str]:
  """The store's key of a program built from ``parts``, or ``None`` where some part has no
  description that another process would share (a user's function)."""
  try:
    text = repr(_stable_(parts)) + _environment()
  except _Unstable:
    return None
  return hashlib.sha256(text.encode()).hexdigest()


# --- writing and reading ---------------------------------------------------------------------


# The library's own host calls a stored program may make besides the oracle's sites (module
# functions: a new process binds its own by name).
_LIBRARY_CALLS = (interrupts._polled,)  # pylint: disable=protected-access


def _site_of(callback, depth: int = 0):
  """The :class:`~hdm_optax.driver.oracle.Site` (or one of :data:`_LIBRARY_CALLS`) a host
  callback of JAX's calls, if any."""
  if isinstance(callback, host.Filler):  # a buffer callback of a site, or of another call
    return callback if _site_of(callback.target, depth + 1) is callback.target else None
  if isinstance(callback, oracle_lib.Site) or any(callback is f for f in _LIBRARY_CALLS):
    return callback
  if depth > 6:
    return None
  inner = [getattr(callback, "callback_func", None)]
  inner += [c.cell_contents for c in getattr(callback, "__closure__", None) or () if _filled(c)]
  for candidate in inner:
    if candidate is not None and callable(candidate):
      found = _site_of(candidate, depth + 1)
      if found is not None:
        return found
  return None


def _filled(cell) -> bool:
  try:
    cell.cell_contents  # pylint: disable=pointless-statement
  except ValueError:
    return False
  return True


@functools.cache
def _executable_type() -> type:
  """The backend's class of loaded executables, seen once per process on a trivial
  program."""
  return type(jax.jit(lambda: 0).lower().compile()._executable.xla_executable)  # pylint: disable=protected-access


class _Unreadable(pickle.PicklingError):
  """A program that names a class :class:`_Restricted` does not load (params of a class of
  the user's own): not stored, where it would warn at every load."""


class _Checked(pickle.Pickler):
  """A pickler of what :class:`_Restricted` loads: a class or function of another module
  raises :class:`_Unreadable`."""

  def reducer_override(self, obj):
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
      module = getattr(obj, "__module__", None) or ""
      if module.split(".")[0] not in _TRUSTED:
        raise _Unreadable(f"{module}.{getattr(obj, '__qualname__', obj)}")
    return NotImplemented


class _Pickler(_Checked):
  def __init__(self, file, callbacks):
    super().__init__(file)
    self._callbacks = {id(c): i for i, c in enumerate(callbacks)}
    self._executable = _executable_type()

  def persistent_id(self, obj):  # pylint: disable=too-many-return-statements
    if id(obj) in self._callbacks:
      return ("callback", self._callbacks[id(obj)])
    if isinstance(obj, self._executable):
      return ("executable", obj.client.serialize_executable(obj))
    if isinstance(obj, jax.Device):
      return ("device", obj.id)
    if obj is jax.devices()[0].client:
      return ("client",)
    return None


class _Restricted(pickle.Unpickler):
  """An unpickler of the classes of the library, JAX and NumPy only."""

  def find_class(self, module, name):
    if module.split(".")[0] not in _TRUSTED:
      raise pickle.UnpicklingError(f"a stored program names {module}.{name}")
    return super().find_class(module, name)


class _Unpickler(_Restricted):
  def __init__(self, file, callbacks):
    super().__init__(file)
    self._callbacks = callbacks
    self._client = jax.devices()[0].client
    self._devices = {d.id: d for d in jax.devices()}

  def persistent_load(self, pid):
    kind = pid[0]
    if kind == "callback":
      return self._callbacks[pid[1]]
    if kind == "executable":
      return self._client.deserialize_executable(
        pid[1], _device_list(jax.devices()[:1]), None, host_callbacks=self._callbacks
      )
    if kind == "device":
      return self._devices[pid[1]]
    if kind == "client":
      return self._client
    raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


def _device_list(devices):
  from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel

  return xla_client.DeviceList(tuple(devices))


def _host_entry(site):
  """What the backend calls at a stored program's host call: the site (or library call) on
  flat arrays, its outputs as a tuple of arrays."""

  if isinstance(site, host.Filler):
    return site.entry()

  def entry(*args):
    out = site(*args)
    return tuple(map(np.asarray, out)) if isinstance(out, tuple) else (np.asarray(out),)

  return entry


def save(key: Optional[str], compiled) -> bool:
  """Writes ``compiled`` under ``key`` (where the store is on and every host call of the
  program is a :class:`~hdm_optax.driver.oracle.Site`); returns whether it was written."""
  folder = directory()
  if key is None or folder is None:
    return False
  try:
    unloaded = compiled._executable._unloaded_executable  # pylint: disable=protected-access
    callbacks = list(unloaded.host_callbacks)
    sites = [_site_of(c) for c in callbacks]
    if any(s is None for s in sites):
      return False
    buffer = io.BytesIO()
    args_info, in_tree = jax.tree.flatten(compiled.args_info)
    _Checked(buffer).dump(sites)  # read first, to give the backend this process's entry points
    _Pickler(buffer, callbacks).dump(
      (unloaded, args_info, in_tree, compiled.out_tree, compiled._no_kwargs)  # pylint: disable=protected-access
    )
    _write(folder, key + _SUFFIX, _sealed(buffer.getvalue()))
    _COUNTS["saved"] += 1
  except _Unreadable:
    return False
  except Exception as error:  # pylint: disable=broad-except
    warnings.warn(f"hdm_optax: a program was not stored ({type(error).__name__}: {error}).")
    return False
  with contextlib.suppress(OSError):  # a folder changed under us: trimmed at the next write
    _trim(folder, _limit_bytes(), keep=key + _SUFFIX)
  return True


def _write(folder: str, name: str, data: bytes) -> None:
  """Writes ``name`` whole or not at all (a temporary file renamed; removed if interrupted)."""
  handle, temporary = tempfile.mkstemp(dir=folder, suffix=_PARTIAL)
  try:
    with os.fdopen(handle, "wb") as file:
      file.write(data)
    os.replace(temporary, os.path.join(folder, name))
  finally:
    with contextlib.suppress(OSError):
      os.remove(temporary)


def _limit_bytes() -> int:
  text = os.environ.get("HDM_OPTAX_PROGRAM_CACHE_MB", "")
  try:
    megabytes = float(text) if text else DEFAULT_MB
  except ValueError:
    warnings.warn(
      f"hdm_optax: HDM_OPTAX_PROGRAM_CACHE_MB must be a number of megabytes, got {text!r}; "
      f"the store keeps the default {DEFAULT_MB} MB."
    )
    megabytes = DEFAULT_MB
  return int(max(megabytes, 0.0) * 2**20)


def _trim(folder: str, limit: int, keep: str) -> None:
  """Removes the least recently used programs of ``folder`` (oldest modification time
  first) until they hold at most ``limit`` bytes; ``keep``, the one just written, stays.

  Also removes the temporary files of writes that never finished (older than
  :data:`_ABANDONED_SECONDS`): a process killed while writing leaves its ``.partial`` file,
  which no bound would count otherwise.
  """
  programs, now = [], time.time()
  for entry in os.scandir(folder):
    if not entry.is_file(follow_symlinks=False):
      continue
    with contextlib.suppress(OSError):
      info = entry.stat(follow_symlinks=False)
      if entry.name.endswith(_SUFFIX):
        programs.append((info.st_mtime, info.st_size, entry.name))
      elif entry.name.endswith(_PARTIAL) and now - info.st_mtime > _ABANDONED_SECONDS:
        os.remove(entry.path)
  total = sum(size for _, size, _ in programs)
  for _, size, name in sorted(programs):
    if total <= limit:
      return
    if name != keep:
      with contextlib.suppress(OSError):
        os.remove(os.path.join(folder, name))
        total -= size


def _sealed(payload: bytes) -> bytes:
  return _MAGIC + hashlib.sha256(payload).digest() + payload


def _unsealed(data: bytes) -> Optional[bytes]:
  """The payload of :func:`_sealed`'s ``data``, or ``None`` where its digest does not
  match (the file was damaged)."""
  head = len(_MAGIC) + hashlib.sha256().digest_size
  payload = data[head:]
  if data[: len(_MAGIC)] != _MAGIC or hashlib.sha256(payload).digest() != data[len(_MAGIC) : head]:
    return None
  return payload


def _read(path: str) -> Optional[bytes]:
  flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
  try:
    handle = os.open(path, flags)
  except OSError:
    return None
  with os.fdopen(handle, "rb") as file:
    info = os.fstat(file.fileno())
    mine = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    if not stat.S_ISREG(info.st_mode) or not mine or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
      return None
    return file.read()


def holds(key: Optional[str]) -> bool:
  """Whether the store holds a program under ``key``."""
  folder = directory()
  return (
    key is not None and folder is not None and os.path.exists(os.path.join(folder, key + _SUFFIX))
  )


def load(key: Optional[str]):
  """The program stored under ``key``, loaded with this process's host entry points, or
  ``None`` (no store, no such program, or one that does not load)."""
  folder = directory()
  if key is None or folder is None:
    return None
  path = os.path.join(folder, key + _SUFFIX)
  data = _read(path)
  if data is None:
    return None
  payload = _unsealed(data)
  if payload is None:
    warnings.warn(
      "hdm_optax: a stored program is damaged (its digest does not match); it is compiled again."
    )
    return None
  try:
    file = io.BytesIO(payload)
    callbacks = [_host_entry(site) for site in _Restricted(file).load()]
    unloaded, args_info, in_tree, out_tree, no_kwargs = _Unpickler(file, callbacks).load()
    program = jax.stages.Compiled(
      unloaded.load(), [], in_tree.unflatten(args_info), out_tree, no_kwargs=no_kwargs
    )
    _COUNTS["loaded"] += 1
    with contextlib.suppress(OSError):
      os.utime(path)  # recently used: the last the store's bound removes
    return program
  except Exception as error:  # pylint: disable=broad-except
    warnings.warn(f"hdm_optax: a stored program did not load ({type(error).__name__}: {error}).")
    return None
