"""Where a run starts: fresh, warm (from an optimizer state) or resumed (from a result).

The start is an argument of the run's program (:class:`Resume`), so a fresh run, a warm
start and a resumed run share one compiled program. A resumed run goes on from its
result: from ``result.params`` with ``result.state``, its counts going on from the
result's, and f and grad f at the params taken from the optimizer's cache where it keeps
one (docs/guide.md, "Resuming a run").
"""

from __future__ import annotations

import contextvars
import functools
import math
import weakref
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax.driver import compiled as compiled_lib
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import Status

__all__ = (
  "FRESH",
  "RESUME",
  "WARM",
  "Resume",
  "batch_start",
  "check_params",
  "kept_reading",
  "Reread",
  "resumable",
  "resumed_on",
  "result_of",
  "same_reading",
  "small",
  "start_of",
)

# Resume.mode: a fresh run, one from an optimizer state (a warm start), a resumed run.
FRESH, WARM, RESUME = 0, 1, 2


class Resume(NamedTuple):
  """Where a run starts, as an argument of its program.

  Attributes:
    opt_state: the optimizer state to start from: a placeholder of its shapes (zeros) where
      ``mode`` is :data:`FRESH` (the run takes ``optimizer.init``), the state given where it
      is :data:`WARM` or :data:`RESUME`; ``None``: a fresh run with no placeholder.
    num_steps: the steps made so far (0 unless resumed), and so on for each count:
    num_value_evals: objective evaluations so far.
    num_grad_evals: gradient evaluations so far.
    null_run: null steps in a row up to the last step.
    num_null_steps: null steps so far.
    mode: :data:`FRESH`, :data:`WARM` (an optimizer state: the counts start at 0, f and grad
      f are evaluated) or :data:`RESUME` (a result: the counts go on, and f and grad f at
      the params are the optimizer cache's, where it keeps one: no call).
    ftol_met: for a result that ended ``CONVERGED_FTOL``, the relative decrease of f along
      its last update (float32), read from its trace, or 0 where the trace does not hold
      that update (``trace=0``, a batch's default); a resumed run whose ``ftol`` is at
      least this has converged where it starts, as a gtol-converged one has, and makes no
      step. ``inf`` for any other start.
  """

  opt_state: Any
  num_steps: Any
  num_value_evals: Any
  num_grad_evals: Any
  null_run: Any
  num_null_steps: Any
  mode: Any
  ftol_met: Any = None

  @classmethod
  def of(cls, opt_state, mode=WARM, ftol_met=np.inf, **counts) -> "Resume":
    """A :class:`Resume` of ``opt_state`` (``None``: fresh), the counts 0 unless given."""
    fields = dict.fromkeys(cls._fields[1:-2], 0)
    fields.update(counts, mode=mode)
    fields = {k: v if programs.tracers(v) else np.int32(v) for k, v in fields.items()}
    met = ftol_met if programs.tracers(ftol_met) else np.float32(ftol_met)
    return cls(opt_state, **fields, ftol_met=met)


def _ftol_met(result) -> Any:
  """:attr:`Resume.ftol_met` of ``result`` (a row per member for a batched one): where it
  ended ``CONVERGED_FTOL``, the relative decrease ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|,
  1)`` of its last update if its trace holds f before and after that update, else 0 (the
  test held, at an ftol not known); ``inf`` for any other status. NumPy outside a trace."""
  fields = (result.status, result.num_steps, result.trace.value, result.trace.step)
  xp = jnp if programs.tracers(fields) else np
  status, steps, values, at = (xp.asarray(a) for a in fields)
  if result.trace.step is None or values.shape[-1] == 0:
    picked = None
  else:
    index = xp.arange(values.shape[-1])

    def f_at(step):  # f at the trace's entry of ``step`` (its last), and whether it has one
      entry = xp.max(xp.where(at == step[..., None], index, -1), axis=-1)
      f = xp.take_along_axis(values, xp.maximum(entry, 0)[..., None], axis=-1)[..., 0]
      return f, entry >= 0

    picked = (f_at(steps), f_at(steps - 1))
  if picked is None:
    known, ratio = False, xp.zeros(status.shape, xp.float32)
  else:
    (new, after), (old, before) = picked
    scale = xp.maximum(xp.maximum(xp.abs(old), xp.abs(new)), xp.ones((), values.dtype))
    known, ratio = after & before, ((old - new) / scale).astype(xp.float32)
  met = xp.where(known, ratio, xp.float32(0.0))
  return xp.where(status == Status.CONVERGED_FTOL, met, xp.float32(np.inf)).astype(xp.float32)


def result_of(init_state) -> Optional[Any]:
  """``init_state`` where it is a result (a :class:`SolveResult`, or a result with its fields
  such as ``minimize``'s, or a sweep's ``results``), else ``None``."""
  init_state = getattr(init_state, "results", init_state)
  fields = getattr(type(init_state), "_fields", ())
  return init_state if set(SolveResult._fields) <= set(fields) else None


def _counts(result) -> dict:
  """A result's counts, which a resumed run goes on from."""
  return dict(
    num_steps=result.num_steps,
    num_value_evals=result.num_value_evals,
    num_grad_evals=result.num_grad_evals,
    null_run=result.null_run,
    num_null_steps=protocol.null_steps(result.state),
  )


# id of a result's first state leaf -> what its run read (see _ran_on), while it lives.
_RAN_ON: dict = {}

# A NumPy constant of the objective's trace of at most this many entries is kept by its
# content: fun may make it anew at each trace (``np.linspace`` in its body).
_BY_CONTENT = 1024


class _Content(tuple):
  """A small NumPy constant of the objective's trace, kept by its content
  (:func:`hdm_optax.driver.programs.content`)."""

  __slots__ = ()


class _Reading:
  """What one call of a front door reads (:func:`resumable`): ``fun_args``, and, once the
  door holds them (:func:`resumed_on`), the objective it runs and the arrays that objective
  reads from outside its arguments."""

  __slots__ = ("fun_args", "objective", "consts")

  def __init__(self, fun_args):
    self.fun_args, self.objective, self.consts = fun_args, None, None

  def leaves(self) -> list:
    """The leaves of ``fun_args``, then those of the objective's arrays."""
    return jax.tree.leaves((self.fun_args, self.consts))


_READING: contextvars.ContextVar = contextvars.ContextVar("hdm_optax_reading", default=None)


def _kept(leaf, constant: bool):
  """``leaf`` as :func:`_ran_on` keeps it: an array by identity (weakly), a number and other
  values by value, a small NumPy ``constant`` of the objective's trace by content."""
  if constant and isinstance(leaf, np.ndarray) and leaf.size <= _BY_CONTENT:
    return _Content(programs.content(leaf))
  try:
    return weakref.ref(leaf)
  except TypeError:  # a number, a string
    return leaf


def _same(kept, leaf) -> bool:
  """Whether ``leaf`` is the value :func:`_kept` kept as ``kept``."""
  if isinstance(kept, weakref.ref):
    return kept() is leaf
  if isinstance(kept, _Content):
    return isinstance(leaf, np.ndarray) and kept == programs.content(leaf)
  return type(kept) is type(leaf) and bool(kept == leaf)


def kept_reading(args) -> tuple:
  """The data of :func:`~hdm_optax.driver.programs.hoist`'s ``args``, kept as
  :func:`_ran_on` keeps a run's: the arrays by identity (weakly), numbers by value, the
  objective's small NumPy constants by content."""
  data = [_kept(leaf, False) for leaf in jax.tree.leaves(args[:-1])]
  return tuple(data + [_kept(leaf, True) for leaf in jax.tree.leaves(args[-1])])


def same_reading(kept: tuple, args) -> bool:
  """Whether ``args`` hold the data :func:`kept_reading` kept."""
  given = jax.tree.leaves(args)
  return len(kept) == len(given) and all(_same(k, x) for k, x in zip(kept, given))


def _ran_on(result, reading: _Reading) -> None:
  """Records what ``result``'s run read (``reading``), so that a run resuming it on other
  data or another objective evaluates f and grad f instead of taking the optimizer's cache
  of them (:func:`_checked`). Kept while the result's state lives; nothing inside a trace,
  nor where the door ended before it held its objective."""
  leaves = jax.tree.leaves(getattr(result, "state", None))
  if reading.consts is None or not leaves or programs.tracers(leaves[0]):
    return
  key = id(leaves[0])
  try:
    weakref.finalize(leaves[0], _RAN_ON.pop, key, None)
  except TypeError:  # a leaf without weak references
    return
  data = [_kept(leaf, False) for leaf in jax.tree.leaves(reading.fun_args)]
  data += [_kept(leaf, True) for leaf in jax.tree.leaves(reading.consts)]
  _RAN_ON[key] = (reading.objective, tuple(data))


class Reread(SolveResult):
  """A result to resume whose run read other data, or ran another objective: f and grad f
  at its params are evaluated (one counted call) instead of taken from the optimizer's
  cache."""

  __slots__ = ()


def _checked(init_state, reading: _Reading):
  """``init_state``, as a :class:`Reread` where it is a result whose run read other data
  than ``reading`` (other arrays, or other numbers, in ``fun_args`` or among the arrays the
  objective reads from outside its arguments) or ran another objective: its cache of f and
  grad f belongs to those. Where nothing is known of its run (a result loaded from a file,
  or made in a trace) it is taken as it is (docs/guide.md, "Resuming a run")."""
  result = result_of(init_state)
  leaves = jax.tree.leaves(None if result is None else result.state)
  ran_on = _RAN_ON.get(id(leaves[0])) if leaves else None
  if ran_on is None:
    return init_state
  objective, kept = ran_on
  given = reading.leaves()
  same = len(kept) == len(given) and all(_same(k, x) for k, x in zip(kept, given))
  if same and (objective is reading.objective or objective == reading.objective):
    return init_state
  return Reread(*(result[: len(SolveResult._fields)]))


def resumed_on(init_state, objective, args) -> Any:
  """``init_state`` as a front door (:func:`resumable`) runs it, once the door holds its
  objective: a result whose run read other data or ran another objective becomes a
  :class:`Reread`.

  Args:
    init_state: the door's ``init_state``.
    objective: what the door runs: :func:`~hdm_optax.driver.programs.hoist`'s ``Closed``
      (compared by its key, as the program cache compares it), or ``fun`` itself where the
      host calls it.
    args: ``hoist``'s args, whose last entry holds the arrays ``objective`` reads from
      outside its arguments, compared as ``fun_args`` are (``()`` where the host calls
      ``fun``).
  """
  reading = _READING.get()
  reading.objective, reading.consts = objective, (args[-1] if args else [])
  return _checked(init_state, reading)


def resumable(door):
  """``door`` (a front door with ``init_state`` and ``fun_args`` keywords, which calls
  :func:`resumed_on` once it holds its objective), resuming a result on other data, or with
  another objective, from f and grad f evaluated anew: it records what each result's run
  read, and the door runs a :class:`Reread` where ``init_state`` is a result of another.
  """

  @functools.wraps(door)
  def front_door(*args, init_state=None, fun_args=(), **kwargs):
    reading = _Reading(fun_args)
    token = _READING.set(reading)
    try:
      result = door(*args, init_state=init_state, fun_args=fun_args, **kwargs)
    except BaseException as error:  # a partial result (Ctrl-C, a callback's error) resumes too
      part = getattr(error, "result", None)
      _ran_on(getattr(part, "results", part), reading)
      raise
    finally:
      _READING.reset(token)
    _ran_on(getattr(result, "results", result), reading)
    return result

  return front_door


def start_of(init_state, init_params, shape, kept: bool = False) -> Resume:
  """The start of one run: fresh (a placeholder of the state's ``shape``, ``jax.eval_shape``
  of ``optimizer.init``), a warm start from a state, or a resumed result. ``kept``: a
  small fresh start is kept on the device (:func:`hdm_optax.driver.programs.on_device`; for
  a run outside any trace on one device). A resumed result's f and grad f are the
  optimizer cache's, unless it is :class:`Reread` (evaluated, the counts going on)."""
  if init_state is None and kept and small(shape):
    key = ("fresh", compiled_lib.abstract(shape))
    return programs.on_device(key, lambda: Resume.of(_placeholder(shape), FRESH))
  if init_state is None:
    return Resume.of(_placeholder(shape), FRESH)
  result = result_of(init_state)
  if result is None:
    return Resume.of(_like(init_state, shape), WARM)
  check_params(init_params, result.params)
  counts = _counts(result)
  counts = {k: v if programs.tracers(v) else np.int32(np.asarray(v)) for k, v in counts.items()}
  mode = WARM if isinstance(result, Reread) else RESUME
  met = np.float32(np.inf) if mode == WARM else _ftol_met(result)
  return Resume.of(_like(result.state, shape), mode, ftol_met=met, **counts)


def batch_start(init_state):
  """A batch's start: ``None``, the members' optimizer states (a warm start), or a batched
  result whose runs each member resumes (a :class:`Resume` with a row per member; as in
  :func:`start_of` for a :class:`Reread` result)."""
  result = result_of(init_state)
  if result is None:
    return init_state
  rows = np.shape(result.num_steps)[0]
  counts = dict(_counts(result), mode=np.full(rows, WARM if isinstance(result, Reread) else RESUME))
  counts = {k: jnp.broadcast_to(jnp.asarray(v, jnp.int32), (rows,)) for k, v in counts.items()}
  met = np.full(rows, np.inf, np.float32) if isinstance(result, Reread) else _ftol_met(result)
  return Resume(opt_state=result.state, **counts, ftol_met=jnp.asarray(met, jnp.float32))


def _avals(shape) -> tuple:
  return tuple((leaf.shape, jnp.dtype(leaf.dtype)) for leaf in jax.tree.leaves(shape))


def small(shape) -> bool:
  """Whether a state of ``shape`` (``jax.eval_shape`` of ``init``) is small enough to keep
  on the device between calls (its abstract value is remembered where ``shape`` is kept)."""
  leaves = compiled_lib.abstract_of(shape)[1]
  return sum(math.prod(leaf[0]) for leaf in leaves) <= programs.SMALL_PROGRAM


def _placeholder(shape):
  """Zeros of the state's shapes: NumPy's for a small state (no program to compile in a new
  process), else made on the device (no transfer)."""
  avals = _avals(shape)
  if small(shape):
    return jax.tree.unflatten(jax.tree.structure(shape), [np.zeros(s, d) for s, d in avals])
  return _zeros(jax.tree.structure(shape), avals)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _zeros(treedef, avals):
  """A placeholder state: zeros of these shapes (one dispatch, no transfer)."""
  return jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype) for shape, dtype in avals])


def _like(state, shape):
  """``state`` with weakly typed leaves made strong (a weakly typed scalar of the right dtype
  would make another program); a leaf of another dtype or shape stays as it is, and the
  program's check names it (:func:`hdm_optax.driver.protocol.with_box_of`)."""
  if jax.tree.structure(state) != jax.tree.structure(shape):
    return state
  weak = lambda a, s: getattr(a, "weak_type", False) and jnp.result_type(a) == s.dtype
  return jax.tree.map(lambda a, s: jnp.asarray(a, s.dtype) if weak(a, s) else a, state, shape)


def check_params(params, resumed) -> None:
  """A resumed run starts where its result ended: ``init_params`` must be its params.

  Raises:
    ValueError: ``params`` of another structure, or other values, than ``resumed``.
  """
  leaves, given = jax.tree.leaves(resumed), jax.tree.leaves(params)
  if jax.tree.structure(resumed) != jax.tree.structure(params):
    raise ValueError(
      "init_state is a result, which resumes its run from its params, but init_params has "
      f"another structure ({jax.tree.structure(params)} against "
      f"{jax.tree.structure(resumed)}); pass init_params=result.params, or "
      "init_state=result.state for a warm start from other params."
    )
  for a, b in zip(given, leaves):
    if a is b or programs.tracers((a, b)):
      continue
    if np.shape(a) != np.shape(b) or not np.array_equal(np.asarray(a), np.asarray(b)):
      raise ValueError(
        "init_state is a result, which resumes its run from its params (f and grad f there "
        "are the result's), but init_params differ from result.params; pass "
        "init_params=result.params to resume, or init_state=result.state for a warm start "
        "from these params (f is evaluated there, the counts start at 0)."
      )
