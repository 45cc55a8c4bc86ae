"""A directory only this user can write to: for caches whose files run code in the process.

A compiled program loaded from a cache directory, or a shared library built into one, runs
with the rights of the process that loads it. Whoever can write to that directory can
therefore run code in that process, so a cache directory must be the user's own:
:func:`private_dir` creates one with mode 0700, or checks an existing one, and refuses
what would let someone else in.
"""

from __future__ import annotations

import os
import stat

__all__ = ("private_dir",)


def private_dir(path: str | os.PathLike, *, name: str = "path") -> str:
  """``path`` as a directory that no other user can write to; returns it as an absolute path.

  The rules, for the directory itself (its last component; the path to it is not checked,
  so ``~/.cache`` may be a link to another disk):

  - a missing directory is created with mode 0700, and so is each missing parent, whatever
    the umask;
  - it is never reached through a symbolic link: a link there, dangling or not, is refused;
  - an existing directory must belong to this user (``st_uid``) and must not be writable by
    its group or by others (``chmod 700`` makes it private);
  - anything else there (a file) is refused.

  Args:
    path: the directory (``~`` is expanded).
    name: the argument's name, for the messages.

  Returns:
    The directory, absolute.

  Raises:
    ValueError: a link, a file, a directory of another user or one that others can write
      to; the message names ``name``, the path and the fix.
  """
  path = os.path.abspath(os.path.expanduser(os.fspath(path)))
  missing, probe = [], path
  while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
    missing.append(probe)
    probe = os.path.dirname(probe)
  for directory in reversed(missing):
    try:
      os.mkdir(directory, 0o700)
    except FileExistsError:
      continue  # made meanwhile by another process: checked below (the last one)
    except OSError as error:
      raise ValueError(f"{name} {path!r}: cannot create {directory!r} ({error}).") from None
    _make_private(directory)  # the umask may have taken bits away
  _check(path, name)
  return path


def _make_private(path: str) -> None:
  """chmod 700 on the directory just created, opened without following a link."""
  if not hasattr(os, "fchmod"):
    os.chmod(path, 0o700)
    return
  fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
  try:
    os.fchmod(fd, 0o700)
  finally:
    os.close(fd)


def _check(path: str, name: str) -> None:
  info = os.lstat(path)
  if stat.S_ISLNK(info.st_mode):
    target = os.readlink(path)
    dangling = "" if os.path.exists(path) else ", which does not exist"
    raise ValueError(
      f"{name} {path!r} is a symbolic link to {target!r}{dangling}: a cache directory is "
      "never reached through a link (whoever can change the link chooses the code this "
      f"process runs). Pass the directory itself, e.g. {name}={os.path.realpath(path)!r}, "
      "or remove the link."
    )
  if not stat.S_ISDIR(info.st_mode):
    raise ValueError(f"{name} {path!r} exists and is not a directory; pass a directory.")
  uid = getattr(os, "getuid", None)
  if uid is not None and info.st_uid != uid():
    raise ValueError(
      f"{name} {path!r} belongs to another user (uid {info.st_uid}, this process runs as "
      f"{uid()}): whoever owns a cache directory can run code in the processes that read "
      "it. Pass a directory of your own."
    )
  if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise ValueError(
      f"{name} {path!r} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): "
      "whoever can write to a cache directory can run code in the processes that read it. "
      f"Make it private (chmod 700 {path!r}) or pass another directory."
    )
