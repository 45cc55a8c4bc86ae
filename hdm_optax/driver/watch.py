"""Watching a compiled run: a per-step callback, a progress line, and SciPy's ``ftol`` stop.

:func:`hdm_optax.solve` runs its loop as one compiled program. With ``callback=``,
``progress=True`` or (from :func:`hdm_optax.minimize`) an ``ftol``, the loop carries a small
:class:`WatchState` beside its own and, after every step, calls the host through
``jax.pure_callback``: the callback gets a :class:`Snapshot`, the progress line is redrawn
at most :data:`REFRESH_SECONDS` apart. Without them nothing here is traced, and the
compiled program is the one of a run without this module.

``jax.pure_callback`` with ``vmap_method="expand_dims"`` is used rather than
``jax.debug.callback``: the host's answer (stop or go on) must reach the loop, and under
``jax.vmap`` ``jax.debug.callback`` is called once per member (JAX 0.10 unrolls it over
the batch), while this callback is called once per step of the batched loop with the
whole batch, so that the progress line reports the batch. Its result feeds the loop's
condition, so the call is never removed as dead code.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax.driver.results import Status

__all__ = ("REFRESH_SECONDS", "Snapshot", "Watch", "WatchState", "make_watch", "watched_loop")

# The progress line is redrawn at most this often (seconds).
REFRESH_SECONDS = 0.2

_CONVERGED = (Status.CONVERGED, Status.CONVERGED_IN_BOX, Status.CONVERGED_FTOL)


class Snapshot(NamedTuple):
  """Where a run is after a step, as ``solve(..., callback=...)`` receives it.

  Host values (NumPy arrays); under ``jax.vmap`` every field has the batch's leading axes.

  Attributes:
    params: the iterate after the step.
    value: f(params).
    grad_norm: ``||grad f(params)||_inf`` (the projected gradient's with a box).
    num_steps: updates made.
    num_value_evals: objective evaluations so far.
    num_grad_evals: gradient evaluations so far.
    num_null_steps: updates so far that left the iterate where it was.
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


class Watch(NamedTuple):
  """What a run watches (a static argument of the compiled program).

  Attributes:
    callback: ``callback(snapshot)`` on the host after every step, or ``None``; a true
      return value or ``StopIteration`` stops the run (status ``STOPPED``).
    progress: draw the progress line on stderr.
    ftol: stop on SciPy's relative decrease of f (the value is ``Limits.ftol``).
  """

  callback: Optional[Callable[[Snapshot], Any]]
  progress: bool
  ftol: bool


class WatchState(NamedTuple):
  """What the loop carries for the watch.

  Attributes:
    stop: the watch ended the run (the callback, or ``ftol``).
    code: the :class:`Status` it ended with.
    run: the host's id of this run (its progress line).
    nulls: null steps so far.
  """

  stop: jax.Array
  code: jax.Array
  run: jax.Array
  nulls: jax.Array


def make_watch(callback, progress, ftol: bool = False) -> Optional[Watch]:
  """The :class:`Watch` of ``solve``'s arguments, or ``None`` when nothing is watched."""
  if callback is not None and not callable(callback):
    raise TypeError(f"callback must be callable or None, got {callback!r}.")
  if not isinstance(progress, (bool, np.bool_)):
    raise TypeError(f"progress must be True or False, got {progress!r}.")
  if callback is None and not progress and not ftol:
    return None
  return Watch(callback=callback, progress=bool(progress), ftol=bool(ftol))


class _Line:
  """One run's progress line on stderr."""

  def __init__(self):
    self.start = time.perf_counter()
    self.drawn = -np.inf

  @staticmethod
  def _text(steps, calls, value, gnorm, nulls, status) -> str:
    if steps.size == 1:
      return (
        f"steps {int(steps.ravel()[0])} | calls {int(calls.ravel()[0])} | "
        f"f {float(value.ravel()[0]):.6e} | ||grad f|| {float(gnorm.ravel()[0]):.2e} | "
        f"null steps {int(nulls.ravel()[0])}"
      )
    done = status != Status.STOPPED
    converged = np.isin(status, np.asarray(_CONVERGED))
    return (
      f"batch {steps.size}: {int(converged.sum())} converged, {int(done.sum())} done | "
      f"steps {int(steps.max())} | calls {int(calls.max())} (max) | "
      f"f {float(np.nanmedian(value)):.6e} | ||grad f|| {float(np.nanmax(gnorm)):.2e} (max) | "
      f"null steps {int(nulls.max())} (max)"
    )

  def draw(self, final, *values):
    now = time.perf_counter()
    if not final and now - self.drawn < REFRESH_SECONDS:
      return
    self.drawn = now
    text = f"hdm_optax: {self._text(*values)} | {now - self.start:.1f} s"
    if final:
      status = values[-1]
      ended = Status(int(status.ravel()[0])).name if status.size == 1 else "batch"
      text += f" | {ended}"
    sys.stderr.write("\r" + text + ("\n" if final else ""))
    sys.stderr.flush()


_LINES: dict = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()


def _host_start(shape):
  with _LOCK:
    run = next(_IDS)
    _LINES[run] = _Line()
  return np.full(shape, run, np.int32)


def _host_step(
  watch: Watch, final: bool, run, params, value, gnorm, steps, values, grads, nulls, status
):
  run, steps, status = np.asarray(run), np.asarray(steps), np.asarray(status)
  halt = False
  if watch.progress:
    line = _LINES.pop(int(run.ravel()[0]), None) if final else _LINES.get(int(run.ravel()[0]))
    if line is not None:
      line.draw(
        final,
        steps,
        np.asarray(grads),
        np.asarray(value),
        np.asarray(gnorm),
        np.asarray(nulls),
        status,
      )
  if final:
    return np.full(steps.shape, True)
  if watch.callback is not None:
    snapshot = Snapshot(
      params=jax.tree.map(np.asarray, params),
      value=np.asarray(value),
      grad_norm=np.asarray(gnorm),
      num_steps=steps,
      num_value_evals=np.asarray(values),
      num_grad_evals=np.asarray(grads),
      num_null_steps=np.asarray(nulls),
      status=status,
    )
    try:
      halt = bool(watch.callback(snapshot))
    except StopIteration:
      halt = True
  return np.full(steps.shape, halt)


def _call(watch: Watch, final: bool, w: WatchState, s, status) -> jax.Array:
  """The host's step call (``True``: stop); ``s`` is the loop's state after the step."""
  params = s.params if watch.callback is not None and not final else ()
  shape = jax.ShapeDtypeStruct(w.stop.shape, jnp.bool_)
  return jax.pure_callback(
    lambda *a: _host_step(watch, final, *a),
    shape,
    w.run,
    params,
    s.value,
    s.grad_norm,
    s.num_steps,
    s.num_value_evals,
    s.num_grad_evals,
    w.nulls,
    status,
    vmap_method="expand_dims",
  )


def _start(watch: Watch, s) -> WatchState:
  zero = jnp.zeros([], jnp.int32)
  if watch.progress:
    run = jax.pure_callback(
      lambda value: _host_start(np.shape(value)),
      jax.ShapeDtypeStruct([], jnp.int32),
      s.value,
      vmap_method="expand_dims",
    )
  else:
    run = zero
  return WatchState(
    stop=jnp.asarray(False), code=jnp.asarray(Status.STOPPED, jnp.int32), run=run, nulls=zero
  )


def _ftol_met(ftol, old, new) -> jax.Array:
  """SciPy L-BFGS-B's relative decrease test, on an update that decreased f.

  ``(f_k - f_{k+1}) <= ftol * max(|f_k|, |f_{k+1}|, 1)``, as L-BFGS-B tests it after each
  iteration (scipy/optimize/__lbfgsb.c, ``mainlb``: ``ddum = fmax(fmax(fabs(fold),
  fabs(*f)), 1.0); if ((fold - *f) <= tol*ddum)``, tol = factr * epsmch = ``ftol``). It is
  tested where f decreased: L-BFGS-B's line search ends only at a sufficient decrease, so
  its iterations always decrease f, while HDM's updates include null steps (a rejected
  trial, as a line search's, which keeps x) and accepted steps that leave f as it was or
  raise it within rounding (``curvature_checked``; from x = 17 on f(x) = x^2 one such step
  goes from 16 to -16): on those SciPy's test would stop a run far from a minimum.
  """
  dtype = new.value.dtype
  scale = jnp.maximum(jnp.maximum(jnp.abs(old.value), jnp.abs(new.value)), jnp.ones([], dtype))
  decrease = old.value - new.value
  small = decrease <= jnp.asarray(ftol, dtype) * scale
  return new.accepted & (decrease > 0) & small


def watched_loop(watch: Watch, run, body, carry, ftol, restored):
  """The loop of ``solve`` with the watch: ``(state, trace, status)`` at its end.

  Args:
    watch: the :class:`Watch`.
    run: the :class:`hdm_optax.loop` (``done``, ``status``).
    body: ``(state, trace) -> (state, trace)``, one step.
    carry: ``(state, trace)`` at the start.
    ftol: SciPy's ``ftol`` (used where ``watch.ftol``).
    restored: the loop's state with its gradient put back (``loops.restored``).

  Returns:
    The final ``(state, trace)`` and the status of the run.
  """

  def cond(c):
    (s, _), w = c
    return ~run.done(s) & ~w.stop

  def step(c):
    (old, trace), w = c
    new, trace = body((old, trace))
    w = w._replace(nulls=w.nulls + (~new.accepted).astype(jnp.int32))
    if watch.ftol:
      met = _ftol_met(ftol, old, new)
      w = w._replace(stop=w.stop | met, code=jnp.where(met, Status.CONVERGED_FTOL, w.code))
    if watch.callback is not None or watch.progress:
      halt = _call(watch, False, w, new, run.status(new)) & ~w.stop
      w = w._replace(stop=w.stop | halt, code=jnp.where(halt, Status.STOPPED, w.code))
    return (new, trace), w

  (s, trace), w = jax.lax.while_loop(cond, step, (carry, _start(watch, carry[0])))
  ruled = run.status(s)
  # The loop's own rule first (L-BFGS-B tests pgtol before ftol); the watch's stop over
  # MAX_STEPS reached at the same step.
  own = run.done(s) & (~w.stop | (ruled != Status.MAX_STEPS))
  status = jnp.where(own, ruled, w.code).astype(jnp.int32)
  if watch.progress:
    # The summary line's call returns True; feeding the result keeps it in the program.
    status = jnp.where(_call(watch, True, w, s, status), status, Status.STOPPED)
  return restored(s), trace, status
