"""What a run returns: :class:`Status`, :class:`Trace`, :class:`SolveResult`, :class:`SweepResult`."""

from __future__ import annotations

import builtins
import enum
import functools
import operator
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _info
from hdm_optax.driver import protocol

__all__ = (
  "SolveResult",
  "Status",
  "SweepResult",
  "Trace",
  "best_index",
  "converged",
)


class Status(enum.IntEnum):
  """How a run ended: :attr:`SolveResult.status` (an int32 array of these values).

  Attributes:
    CONVERGED: ``||grad f(params)||_inf <= tol``.
    MAX_STEPS: ``max_steps`` updates made, or ``max_grad_evals`` reached, before ``tol``.
    NON_FINITE: f or grad f is not finite at the current iterate.
    STOPPED: stopped before the stopping rule held (by
      ``sweep(stop_at_first_converged=True)`` when another point converged, by a
      ``callback`` that returned True or raised ``StopIteration``, or by Ctrl-C: the
      ``KeyboardInterrupt``'s ``.result``); :attr:`SolveResult.stopped_by` says which.
    STALLED: ``max_null_steps`` consecutive null steps (updates that left the iterate
      where it was).
    UNBOUNDED: ``f(params) < min_value``: the objective looks unbounded below.
    CONVERGED_IN_BOX: the optimizer holds a box (``lower=`` / ``upper=``) and the
      projected gradient ``||P(params - grad f) - params||_inf <= tol`` (L-BFGS-B's pgtol).
    CONVERGED_FTOL: the relative decrease of f along an update that moved the iterate,
      ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1)``, is at most ``ftol`` (L-BFGS-B's
      ``ftol``; :func:`hdm_optax.minimize`), and every trial since the previous accepted
      update had a finite f and grad f.
    FTOL_AT_NON_FINITE: that relative decrease is at most ``ftol``, but a trial since the
      previous accepted update met a non-finite f or grad f (an hdm_optax method reports
      it in ``info.nonfinite_run``): the step was cut short by the edge of the region where
      f is finite, so the run stopped there without converging (``converged`` False;
      ``grad_norm`` is the gradient's at the returned point). Where the minimum lies on
      that edge, state it as bounds.
  """

  CONVERGED = 0
  MAX_STEPS = 1
  NON_FINITE = 2
  STOPPED = 3
  STALLED = 4
  UNBOUNDED = 5
  CONVERGED_IN_BOX = 6
  CONVERGED_FTOL = 7
  FTOL_AT_NON_FINITE = 8

  @property
  def message(self) -> str:
    """What the status means, in one line."""
    return _MESSAGES[self]

  @property
  def converged(self) -> bool:
    """Whether a run that ends with this status converged (:func:`converged`)."""
    return bool(converged(self))


# The statuses of a run that converged.
_CONVERGED = (Status.CONVERGED, Status.CONVERGED_IN_BOX, Status.CONVERGED_FTOL)


def converged(status):
  """Whether ``status`` (a code, or a NumPy or JAX array of codes) says the run converged:
  ``CONVERGED``, ``CONVERGED_IN_BOX`` or ``CONVERGED_FTOL`` (:attr:`SolveResult.converged`)."""
  return functools.reduce(operator.or_, [status == code for code in _CONVERGED])


_MESSAGES = {
  Status.CONVERGED: "converged: ||grad f||_inf <= tol",
  Status.MAX_STEPS: "max_steps or max_grad_evals reached before ||grad f||_inf <= tol",
  Status.NON_FINITE: "f or grad f is not finite at the current iterate",
  Status.STOPPED: "stopped before the end: by the callback, by Ctrl-C (KeyboardInterrupt) or "
  "by sweep(stop_at_first_converged=True)",
  Status.STALLED: "stalled: max_null_steps consecutive null steps (the iterate did not move)",
  Status.UNBOUNDED: "unbounded: f < min_value (the objective looks unbounded below)",
  Status.CONVERGED_IN_BOX: "converged: ||P(x - grad f) - x||_inf <= tol (the box's projected "
  "gradient)",
  Status.CONVERGED_FTOL: "converged: (f_k - f_k+1) / max(|f_k|, |f_k+1|, 1) <= ftol (the "
  "relative decrease of f)",
  Status.FTOL_AT_NON_FINITE: "not converged: f decreased by at most ftol, but the trials "
  "before the last update met a non-finite f or grad f, so the run stopped at the edge of "
  "the region where f is finite, not at a minimum (if the minimum lies on that edge, give "
  "it as bounds)",
}


# What stopped a run that ended STOPPED (SolveResult.stopped_by, int32): 0 where nothing
# did (or it is not known), one of these, or an exception a callback raised (raised_code).
BY_CALLBACK = 1
BY_CTRL_C = 2
BY_OTHER_POINT = 3
_CAUSES = {
  BY_CALLBACK: "the callback, which returned True",
  BY_CTRL_C: "Ctrl-C (KeyboardInterrupt)",
  BY_OTHER_POINT: "sweep(stop_at_first_converged=True): another point converged first",
}
# A callback's exception: 2 codes per builtin exception type, from this one on (the type
# itself, or one of the user's derived from it).
_RAISED = 16
_BUILTIN_ERRORS = tuple(
  sorted(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
  )
)


def raised_code(error: BaseException) -> int:
  """The :attr:`SolveResult.stopped_by` code of a callback that raised ``error``: its type
  where it is a builtin one, else the nearest builtin type it derives from."""
  kind = type(error)
  builtin = next(c for c in kind.__mro__ if getattr(builtins, c.__name__, None) is c)
  return _RAISED + 2 * _BUILTIN_ERRORS.index(builtin.__name__) + int(builtin is not kind)


def stop_cause(code) -> Optional[str]:
  """What stopped a run whose :attr:`SolveResult.stopped_by` is ``code``, in words said after
  "stopped before the end: by" (``None`` where nothing is known)."""
  index, derived = divmod(int(code) - _RAISED, 2)
  if 0 <= index < len(_BUILTIN_ERRORS):
    raised = (
      f"an exception derived from {_BUILTIN_ERRORS[index]}" if derived else _BUILTIN_ERRORS[index]
    )
    return f"the callback, which raised {raised}"
  return _CAUSES.get(int(code))


# Recent steps: the window, and the share of null steps that names a stall.
_RECENT_STEPS = 100
_RECENT_NULL_SHARE = 0.5
# An entry of P at or below this has collapsed: its step is below the rounding of the
# params of any reasonably scaled problem (hdm_auto's floor is 1e-30).
_COLLAPSED_PRECOND = 1e-20


# f's rounding, as the acceptance tests take it (hdm_optax.pieces.acceptance): 64 eps |f|.
_ROUNDING_EPS = 64


def _rounding_floor_note(values) -> list:
  """A run whose last updates moved f only within its rounding, back and forth.

  Where ``||grad f||`` cannot go below ``tol`` in f's dtype (float32's floor on a sum of many
  terms, docs/pitfalls.md), the methods accept steps that leave f equal within its rounding
  and can cycle among a few points until ``max_steps``; neither the gradient test nor
  ``ftol`` (a decrease of f) holds there. Say so, with the dtype and the fix.
  """
  if not np.all(np.isfinite(values)) or np.all(values == values[0]):
    return []
  dtype = values.dtype
  span, size = float(np.max(values) - np.min(values)), float(np.max(np.abs(values)))
  if span > _ROUNDING_EPS * float(np.finfo(dtype).eps) * size:
    return []
  wider = "" if dtype.itemsize >= 8 else ", or compute in float64 (jax_enable_x64)"
  return [
    f"f moved only within its {dtype.name} rounding over the last {values.size} steps "
    f"({np.min(values):.7g} to {np.max(values):.7g}): ||grad f|| is at its rounding floor "
    "above tol; ask for a reduction with rtol= (1e-6 to 1e-5) or a larger tol (minimize: "
    f"gtol){wider} (docs/pitfalls.md, float32)"
  ]


def _stall_notes(
  status: Status, null_run: int, recent, precond, values=None, nonfinite: int = 0, uphill: int = 0
) -> list:
  """What a run that did not converge says about stalling (``recent``: the last updates'
  accepted flags; ``values``: f after them; ``nonfinite``: the trials since the last
  accepted update that met a non-finite f or grad f; ``uphill``: the run's trials that went
  down the method's incoming updates but not down f)."""
  if status not in (Status.MAX_STEPS, Status.STALLED):
    return []
  notes = []
  if null_run and 2 * nonfinite > null_run:  # the stall's cause; a rounding note would mislead
    notes.append(
      f"{min(nonfinite, null_run)} of the {null_run} trials since the last accepted update "
      "met a non-finite f or grad f (NaN or inf): f is finite at the reported point but not "
      "where the steps tried went; check what fun (or its gradient) returns near x, or bound "
      "x away from where it is not finite"
    )
  elif (
    values is not None
    and values.size >= _RECENT_STEPS
    and np.all(values == values[0])
    and not (null_run and 2 * uphill > null_run)  # rejected uphill trials held x, not rounding
  ):
    notes.append(
      f"f has not changed over the last {values.size} steps: the steps are below the "
      "rounding of x (scale f or the variables, or raise the method's step size)"
    )
  elif values is not None and values.size >= _RECENT_STEPS:
    notes += _rounding_floor_note(values)
  if status == Status.MAX_STEPS and null_run > 0:
    notes.append(
      f"the last {null_run} updates were null steps (the iterate did not move; "
      "max_null_steps= stops such a run early)"
    )
  nulls = int(np.sum(~recent))
  if recent.size and nulls > _RECENT_NULL_SHARE * recent.size and nulls > null_run:
    notes.append(f"stalling: {nulls} of the last {recent.size} updates were null steps")
  if precond is not None and precond.size:
    share = float(np.mean(np.abs(precond) <= _COLLAPSED_PRECOND))
    if share > 0.5:
      notes.append(
        f"P has collapsed: {share:.0%} of its entries are <= {_COLLAPSED_PRECOND:g} "
        "(null steps shrank it; in float32 see docs/pitfalls.md)"
      )
  return notes


def _precond_rows(state, count: int):
  """The ``precond`` entries of ``count`` runs' state, all leaves in one row per run
  (``count`` Nones without a precond)."""
  found = optax.tree.get_all_with_path(state, "precond")
  leaves = [np.asarray(leaf).reshape(count, -1) for _, p in found for leaf in jax.tree.leaves(p)]
  return np.concatenate(leaves, axis=1) if leaves else [None] * count


def _non_finite_note(value, steps: int) -> str:
  where = "at x0 (init_params, x0: check it for NaN or inf)" if steps == 0 else f"at step {steps}"
  if not np.isfinite(value):
    return f"f is not finite {where}"
  return f"grad f is not finite {where}, where f is: check fun's derivative (sqrt or log at 0?)"


def _huge_gradient_note(grad_norm, dtype) -> list:
  """Gradients whose squares overflow: the methods' step sizes cannot be formed."""
  big = np.sqrt(np.finfo(dtype).max) / 16
  if not np.isfinite(grad_norm) or grad_norm < big:
    return []
  return [
    f"||grad f|| is {grad_norm:.1e}, whose square overflows {np.dtype(dtype).name}: the step "
    "sizes, which divide by it, cannot be formed; scale f down (divide it by a constant)"
  ]


class Trace(NamedTuple):
  """The last entries of a run, in step order (``trace=`` says how many are kept).

  Entry i follows step ``step[i]`` (0: the initial point). A run shorter than the trace
  fills it with its final values after its last step (``accepted`` False there).

  Attributes:
    value: f(x^k).
    grad_norm: ||grad f(x^k)||_inf (the projected gradient's with a box).
    accepted: the step rule accepted step k (True for entry 0).
    grad_evals: cumulative gradient evaluations after step k.
    step: k, the step of each entry.
  """

  value: jax.Array
  grad_norm: jax.Array
  accepted: jax.Array
  grad_evals: jax.Array
  step: Any = None


class SolveResult(NamedTuple):
  """Result of :func:`hdm_optax.solve`.

  Attributes:
    params: the last iterate.
    state: the optimizer state after the last step.
    value: f(params), always evaluated at ``params``.
    grad_norm: ||grad f(params)||_inf; with a box, ``||P(params - grad f) - params||_inf``.
    num_steps: number of ``update`` calls made.
    num_value_evals: objective evaluations, the initial one included.
    num_grad_evals: gradient evaluations, the initial one included.
    converged: whether the status is one of convergence (:func:`converged`):
      ||grad f(params)||_inf <= max(tol, rtol ||grad f(x0)||_inf) (the projected
      gradient's with a box; and f(params) finite and >= ``min_value``), or ``ftol``.
    status: a :class:`Status` code; :attr:`message` says what it means.
    trace: :class:`Trace`, arrays of length ``max_steps + 1``.
    null_run: the number of null steps at the end of the run (consecutive
      updates that left the iterate where it was).
    aux: with ``has_aux=True``, the auxiliary output of ``fun`` at ``params``;
      ``None`` otherwise.
    tol: the threshold the run stopped at, max(tol, rtol ||grad f(x0)||_inf):
      with ``rtol`` it is known only once x0 is evaluated (docs/pitfalls.md).
    stopped_by: what stopped a run that ended ``STOPPED`` (a callback, Ctrl-C, another
      point of a sweep), an int32 code that :attr:`message` says in words; 0 where the run
      did not end ``STOPPED``.
  """

  params: Any
  state: Any
  value: jax.Array
  grad_norm: jax.Array
  num_steps: jax.Array
  num_value_evals: jax.Array
  num_grad_evals: jax.Array
  converged: jax.Array
  status: jax.Array
  trace: Trace
  null_run: jax.Array
  aux: Any = None
  tol: Any = None
  stopped_by: Any = 0

  @property
  def message(self) -> Union[str, list]:
    """What ``status`` means (:attr:`Status.message`), and whether the run stalled.

    A run that did not converge also says: the final run of null steps, if
    any; that it was stalling, when most of its last 100 updates were null
    steps (not only a trailing run); and that P has collapsed, when most of
    the state's ``precond`` entries are at or below 1e-20. Outside ``jit``; a
    list for the batched results of :func:`hdm_optax.sweep`.
    """
    codes = np.asarray(self.status)
    count = codes.size
    each = lambda a: np.broadcast_to(np.asarray(a), codes.shape).ravel()
    rows = lambda a: np.asarray(a).reshape(count, -1)  # one row per run
    nulls, steps, value, gnorm, causes = map(
      each, (self.null_run, self.num_steps, self.value, self.grad_norm, self.stopped_by)
    )
    trace = self.trace
    accepted, trace_steps, trace_values = rows(trace.accepted), rows(trace.step), rows(trace.value)
    if isinstance(self.state, list):  # a sweep's states of other shapes, one per point
      state_of = self.state.__getitem__
      precond = [_precond_rows(state, 1)[0] for state in self.state]
    else:
      state_of = lambda i: jax.tree.map(lambda a: rows(a)[i], self.state)
      precond = _precond_rows(self.state, count)
    messages = []
    for i, code in enumerate(codes.ravel()):
      status, notes = Status(int(code)), []
      window = (trace_steps[i] > max(0, steps[i] - _RECENT_STEPS)) & (trace_steps[i] >= 1)
      window &= np.r_[True, trace_steps[i][1:] != trace_steps[i][:-1]]  # each step once
      nonfinite = int(np.sum(protocol.nonfinite_trials(state_of(i))))
      uphill = _info.uphill_trials(state_of(i))
      notes += _stall_notes(
        status,
        int(nulls[i]),
        accepted[i][window],
        precond[i],
        trace_values[i][window],
        nonfinite,
        uphill,
      )
      head = status.message
      cause = stop_cause(causes[i]) if status == Status.STOPPED else None
      if cause is not None:
        head = f"stopped before the end: by {cause}"
      if status == Status.NON_FINITE:
        head = "non-finite: " + _non_finite_note(value[i], int(steps[i]))
      if status in (Status.MAX_STEPS, Status.STALLED):
        notes += _huge_gradient_note(gnorm[i], value.dtype)
        advice = _info.uphill_advice(state_of(i))
        notes += [advice] if advice else []
      messages.append(head + "".join(f"; {n}" for n in notes))
    return messages[0] if codes.ndim == 0 else messages


class SweepResult(NamedTuple):
  """Result of :func:`hdm_optax.sweep`.

  Attributes:
    points: the grid, a list of dicts (keyword -> value), in row-major order;
      with ``in_axes``, every grid point once per problem, each with its
      ``"problem"`` index.
    results: a :class:`SolveResult` whose leaves have a leading axis of
      length ``len(points)`` (its ``state`` a list of per-point states when a
      setting, such as ``memory_size``, gives the points states of other shapes).
    best: index of the best point: fewest steps among the converged points,
      then lowest final value (among all points when none converged).
  """

  points: list
  results: SolveResult
  best: int


def best_index(results: SolveResult) -> Any:
  """Fewest steps among converged points, then lowest final value (an int; an array under
  ``jax.jit``)."""
  value = jnp.where(jnp.isfinite(results.value), results.value, jnp.inf)
  steps = jnp.where(results.converged, results.num_steps, jnp.iinfo(jnp.int32).max)
  best = jnp.lexsort((value, steps))[0]
  return best if isinstance(best, jax.core.Tracer) else int(best)
