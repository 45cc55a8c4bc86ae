"""Watching a run from the host: a callback after every step, and a progress line.

A front door opens a *session* (:func:`watched`) holding the user's callback and the
progress line, and passes its integer handle into the compiled program as an argument. The
run (:mod:`hdm_optax.driver.runs`) calls :func:`host_call` after every step: one host call
(:func:`hdm_optax.driver.host.call`) to one dispatcher, which looks the session up by its
handle. The program is compiled once per :class:`Hook` (whether there is a callback, whether
there is a progress line), so a new callback object does not compile a new one. Without a
callback or progress line nothing here is traced.

Under batching (``jax.vmap``, :func:`hdm_optax.sweep`, :func:`hdm_optax.solve_batch`) the
dispatcher is called once per step of the batched loop with the whole batch
(``vmap_method="expand_dims"``); a batch run in stages passes its members' indices, and the
session keeps a table of every member, so that the callback and the line see the whole batch.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax import _numerics
from hdm_optax.driver import host
from hdm_optax.driver import interrupts
from hdm_optax.driver import programs
from hdm_optax.driver import results
from hdm_optax.driver.results import Status
from hdm_optax.driver.results import converged

__all__ = (
  "Handle",
  "Hook",
  "REFRESH_SECONDS",
  "Snapshot",
  "check_hook",
  "watchable",
  "watched",
)

# The progress line is redrawn at most this often on a terminal, and written as a new line
# at most this often elsewhere (a log file).
REFRESH_SECONDS = 0.2
LOG_SECONDS = 10.0


class Snapshot(NamedTuple):
  """Where a run is after a step, as ``callback`` receives it (host NumPy values).

  Under batching every field has the batch's leading axis (every member of the batch, the
  finished ones with their final values).

  Attributes:
    params: the iterate after the step.
    value: f(params).
    grad_norm: ``||grad f(params)||_inf`` (the projected gradient's with a box).
    num_steps: updates made.
    num_value_evals: objective evaluations so far.
    num_grad_evals: gradient evaluations so far.
    num_null_steps: rejected updates so far.
    status: the :class:`Status` the run would end with here (``STOPPED`` while it goes on).
  """

  params: Any
  value: Any
  grad_norm: Any
  num_steps: Any
  num_value_evals: Any
  num_grad_evals: Any
  num_null_steps: Any
  status: Any


class Hook(NamedTuple):
  """What a program watches (static: one compiled program per value).

  Attributes:
    callback: the session has a callback.
    progress: the session draws a progress line.
    members: the number of members of a batch run in stages (the session's table), or 0.
  """

  callback: bool
  progress: bool
  members: int = 0


class Handle(NamedTuple):
  """What a program gets from its call's host side (an argument: it does not compile anew).

  Attributes:
    hook: the session's handle (int32), or ``None`` without a callback or progress line.
    watch: the Ctrl-C check's ``[id, first chunk]`` (:func:`hdm_optax.driver.interrupts.
      watching`), or ``None`` where the run is not checked.
  """

  hook: Any = None
  watch: Any = None

  @classmethod
  def like(cls, hook: bool, watch: bool) -> "Handle":
    """A handle of the shapes a call's would have (to compile a program before the call)."""
    return cls(np.int32(0) if hook else None, np.zeros(2, np.int32) if watch else None)


class HookState(NamedTuple):
  """What a run carries for its hook: the session's handle and the member."""

  handle: jax.Array
  member: jax.Array


def check_hook(callback, progress, members: int = 0) -> Optional[Hook]:
  """The :class:`Hook` of a front door's ``callback`` and ``progress``, or ``None``."""
  if callback is not None and not callable(callback):
    raise TypeError(f"callback must be callable or None, got {callback!r}.")
  if not isinstance(progress, (bool, np.bool_)):
    raise TypeError(f"progress must be True or False, got {progress!r}.")
  if callback is None and not progress:
    return None
  return Hook(callback=callback is not None, progress=bool(progress), members=members)


# --- the host side ------------------------------------------------------------------------


class _Session:
  """One call's callback, progress line, table of members and the callback's error."""

  def __init__(self, callback, progress, staged, view):
    self.callback, self.progress, self.staged, self.view = callback, progress, staged, view
    self.caller = None if staged else host.Caller()  # a staged run's caller is not known
    self.members = 0
    self.table: dict = {}
    self.error: Optional[BaseException] = None
    self.stopped_by = 0  # the code of what raised self.error (SolveResult.stopped_by)
    self.begun = None
    self.drawn = -np.inf
    self.terminal = _terminal()

  def merge(self, member, fields: dict) -> dict:
    """``fields`` of the members given, merged into the table of every member (a batch run
    in stages; else ``fields`` as they are)."""
    if not self.members:
      return fields
    rows = np.asarray(member).ravel()
    for name, value in fields.items():
      leaves, treedef = jax.tree.flatten(value)
      held = self.table.get(name)
      if held is None:
        held = [np.zeros((self.members,) + np.shape(v)[1:], np.asarray(v).dtype) for v in leaves]
        self.table[name] = held
      for full, part in zip(held, leaves):
        full[rows] = np.reshape(part, (rows.size,) + full.shape[1:])
      fields = {**fields, name: jax.tree.unflatten(treedef, [np.copy(h) for h in held])}
    return fields

  def draw(self, final: bool, fields: dict) -> None:
    now = time.perf_counter()
    self.begun = now if self.begun is None else self.begun
    wait = REFRESH_SECONDS if self.terminal else LOG_SECONDS
    if not final and now - self.drawn < wait:
      return
    self.drawn = now
    text = f"hdm_optax: {_line(fields)} | {now - self.begun:.1f} s"
    status = np.asarray(fields["status"])
    if final:
      text += f" | {Status(int(status.ravel()[0])).name if status.size == 1 else 'batch'}"
    end = "\n" if final or not self.terminal else ""
    sys.stderr.write(("\r" if self.terminal else "") + text + end)
    sys.stderr.flush()


def _line(fields) -> str:
  names = ("num_steps", "num_grad_evals", "value", "grad_norm", "num_null_steps", "status")
  steps, calls, value, gnorm, nulls, status = (np.asarray(fields[n]) for n in names)
  if steps.size == 1:
    return (
      f"steps {steps.item()} | calls {calls.item()} | f {value.item():.6e} | "
      f"||grad f|| {gnorm.item():.2e} | null steps {nulls.item()}"
    )
  done = status != Status.STOPPED
  return (
    f"batch {steps.size}: {int(converged(status).sum())} converged, {int(done.sum())} done | "
    f"steps {int(steps.max())} (max) | calls {int(calls.max())} (max) | "
    f"f {float(np.nanmedian(value)):.6e} (median) | ||grad f|| {float(np.nanmax(gnorm)):.2e} "
    f"(max) | null steps {int(nulls.max())} (max)"
  )


def _terminal() -> bool:
  return sys.stderr.isatty()


_SESSIONS: dict = {}
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()


def watchable(dynamic) -> bool:
  """Whether a front door's run can be stopped by Ctrl-C (:mod:`~hdm_optax.driver.interrupts`):
  called at the top (nothing of ``dynamic`` traced, not staged out), so that the program
  runs within the call."""
  return interrupts.ENABLED and not programs.tracers(dynamic) and not programs.staged()


def watched(
  run: Callable[[Any], Any],
  callback,
  progress,
  *,
  watch: bool = False,
  key=None,
  view=None,
  ready: bool = False,
):
  """``run(handle)`` in a session of ``callback`` and ``progress``.

  ``handle`` is a :class:`Handle`: its ``hook`` is the session's (an int32, ``None`` without
  a callback or progress line). ``view`` maps the params the program hands the host to the
  user's layout (the separate path runs on packed params).

  An exception the callback raised is raised again with the partial result as its
  ``.result`` (its own type): the program ran within the call, also under an un-jitted
  ``jax.grad``, ``jax.vjp`` or ``jax.vmap`` (their programs run at once; a host call after
  the call, such as a checkpointed iteration recomputed in a backward pass, finds no session
  and leaves the user's callback alone). Where the caller is staged (inside ``jax.jit``, a
  ``lax.scan`` body: the program runs later, maybe many times) the session stays open for
  the life of the process, and the callback's exception propagates from the host call.
  With ``watch`` (a program whose ``Program.watch`` is on; ``key`` names it and its shapes,
  :func:`hdm_optax.driver.interrupts.watching`) a SIGINT during the call stops the run and
  raises ``KeyboardInterrupt`` with the partial result, as does one seen by a callback's or
  progress line's host call. ``ready``: ``run`` returns its result ready (it has waited).
  """
  staged = programs.staged()
  hook = None
  if callback is not None or progress:
    with _LOCK:
      hook = np.int32(next(_HANDLES))
      _SESSIONS[int(hook)] = _Session(callback, progress, staged, view)
  try:
    with interrupts.catching(not staged and (watch or hook is not None)):
      with interrupts.watching(key) if watch else contextlib.nullcontext() as checks:
        result = run(Handle(hook, checks))
        if not ready and (hook is not None or checks is not None):  # its errors known
          result = jax.block_until_ready(result)
        current = None if hook is None else _SESSIONS[int(hook)]
        if current is not None and current.error is not None:
          _raise_with(current.error, result, "the callback raised this")
        if interrupts.seen():
          _raise_with(KeyboardInterrupt(), result, "Ctrl-C (SIGINT) during the run")
  finally:
    if hook is not None and not staged:
      _SESSIONS.pop(int(hook), None)
  return result


def _primal(x):
  """A leaf of a result under an un-jitted ``jax.grad``/``jax.jvp``/``jax.vmap``, as values
  (the batch first), or ``None`` where it is not reachable."""
  if not isinstance(x, jax.core.Tracer):
    return x
  if hasattr(x, "primal"):
    return _primal(x.primal)
  inner = _primal(getattr(x, "val", None))
  axis = getattr(x, "batch_dim", None)
  if inner is None or isinstance(inner, jax.core.Tracer):
    return None
  return np.moveaxis(np.asarray(inner), axis, 0) if isinstance(axis, int) else inner


def _raise_with(error_: BaseException, result, why: str) -> None:
  error_.result = jax.block_until_ready(jax.tree.map(_primal, result))
  error_.add_note(f"hdm_optax: {why}; the run stopped, and the result so far is in .result.")
  raise error_


def _halts(returned) -> bool:
  """Whether what the callback returned stops the run (its truth value), refused where it
  has none (an array of several entries)."""
  try:
    return bool(returned)
  except (ValueError, TypeError):
    raise TypeError(
      f"the callback's return value, of type {type(returned).__name__}"
      f"{_numerics.shown(returned)}, is neither true nor false: return None or False to go "
      "on, True (or raise StopIteration) to stop the run; for an array, reduce it (e.g. "
      "bool(flags.any()))."
    ) from None


def _host_step(final: bool, members: int, handle, member, params, *fields):
  """The host's side of :func:`host_call`: every member's code of what stops it here
  (``SolveResult.stopped_by``), 0 where it goes on."""
  status = np.asarray(fields[-1])
  stops = lambda code: np.full(status.shape, code, np.int32)
  current = _SESSIONS.get(int(np.asarray(handle).ravel()[0]))
  if current is None:  # a call after the call's end (a step recomputed in a backward pass)
    return stops(0 if final else results.BY_CALLBACK)
  if current.error is not None and not final:
    return stops(current.stopped_by)
  if not final and interrupts.seen():  # Ctrl-C: the run stops, the call raises
    current.error, current.stopped_by = KeyboardInterrupt(), results.BY_CTRL_C
    return stops(current.stopped_by)
  current.members = members
  merged = current.merge(member, dict(zip(Snapshot._fields[1:], fields)))
  if current.progress:  # the final line ends the progress line, after an error too
    current.draw(final, merged)
  if final or current.callback is None:
    return stops(0)
  params = current.merge(member, {"params": params})["params"]
  params = jax.tree.map(np.asarray, params if current.view is None else current.view(params))
  snapshot = Snapshot(params=params, **merged)
  try:
    caller = current.caller
    halt = _halts(
      current.callback(snapshot) if caller is None else caller.run(current.callback, snapshot)
    )
    code = results.BY_CALLBACK if halt else 0
  except StopIteration as err:
    code = results.raised_code(err)
  except BaseException as err:  # pylint: disable=broad-except
    if current.staged:
      raise
    # KeyboardInterrupt and SystemExit too: raised at the end.
    current.error, current.stopped_by = err, results.raised_code(err)
    code = current.stopped_by
  return stops(code)


# --- the program side ----------------------------------------------------------------------


def begin(hook: Optional[Hook], handle, member) -> Optional[HookState]:
  """The hook's state at the start of a run (``None`` without a hook)."""
  if hook is None:
    return None
  return HookState(handle=handle, member=jnp.asarray(-1 if member is None else member, jnp.int32))


def host_call(hook: Optional[Hook], hs: Optional[HookState], s, status, final: bool = False):
  """The host call after a step: the int32 code of what stops the run (the callback, Ctrl-C:
  ``SolveResult.stopped_by``), 0 where it goes on, or ``None`` without a hook. With
  ``final``, the progress line's summary: a code that is 0 once the line is drawn (the run
  uses it, so the call stays in the program), or ``None`` without a line."""
  if hook is None or (final and not hook.progress):
    return None
  params = s.params if hook.callback and not final else ()
  fields = [getattr(s, name) for name in Snapshot._fields[1:-1]]  # params and status apart
  return host.call(
    lambda *a: (_host_step(final, hook.members, *a),),
    (jax.ShapeDtypeStruct(jnp.shape(status), jnp.int32),),
    hs.handle,
    hs.member,
    params,
    *fields,
    status,
    vmap_method="expand_dims",
  )[0]
