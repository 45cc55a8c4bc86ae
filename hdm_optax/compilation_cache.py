"""JAX's persistent compilation cache, turned on in one call for the programs of this package.

A process that runs ``solve``, ``minimize`` or ``solve_batch`` compiles its programs at the
first call (seconds on a CPU: most of a one-off problem's first answer). With the cache on,
each compiled program is written to disk, keyed on the program, the shapes and dtypes, the
versions of jax and jaxlib and the backend, and a later process that builds the same
program loads it instead of compiling it: only the tracing and lowering remain.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from hdm_optax._private_dir import private_dir

__all__ = ("enable_compilation_cache",)


def _default_path() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "hdm_optax", "jax")


def enable_compilation_cache(
  path: Optional[str] = None, *, min_compile_seconds: float = 0.0
) -> str:
  """Turns on JAX's persistent compilation cache in ``path``; returns the directory.

  Call it once, at the start of a script, before the first ``solve`` or ``minimize``:
  the cache serves the programs compiled after the call. A second process (the script run
  again, a worker) that compiles the same program with the same shapes loads it from disk.

  Args:
    path: the cache's directory, created with mode 0700 if missing. ``None``:
      ``$XDG_CACHE_HOME/hdm_optax/jax`` (``~/.cache/hdm_optax/jax``). Anyone who can write
      to it can run code in the processes that read it (JAX's warning), so it must be
      private (:func:`hdm_optax._private_dir.private_dir`'s rules): not a symbolic link,
      yours, and not writable by your group or others.
    min_compile_seconds: programs that compiled faster than this are not written (JAX's
      default is 1 s; the default here, 0, writes every one, the small helper programs of a
      run too).

  Returns:
    The directory, as an absolute path.

  Raises:
    ValueError: the cache is already on in another directory in this process (JAX reads
      one directory per process); ``path`` is a symbolic link (dangling or not), not a
      directory, another user's or writable by others; ``min_compile_seconds`` is negative.

  Example (at the top of a script; it changes the process's JAX configuration)::

    import hdm_optax

    hdm_optax.enable_compilation_cache()
    result = hdm_optax.minimize(f, x0)  # compiled once, loaded by the next run
  """
  if not min_compile_seconds >= 0:
    raise ValueError(
      f"min_compile_seconds must be >= 0, got {min_compile_seconds!r}; pass e.g. 0.0."
    )
  path = os.path.abspath(os.path.expanduser(_default_path() if path is None else path))
  current = jax.config.jax_compilation_cache_dir
  if current and os.path.abspath(os.path.expanduser(current)) != path:
    raise ValueError(
      f"the persistent compilation cache is already on in {current!r} in this process, "
      f"and JAX reads one directory per process; pass path={current!r} or call "
      "enable_compilation_cache in a new process."
    )
  path = private_dir(path, name="path")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path
