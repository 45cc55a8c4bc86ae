"""Running the engine's loop to its end: the primitives, the trace ring, the hook.

:func:`run` runs a :class:`~hdm_optax.driver.engine.Loop` from its first point to the
stop rule's verdict with a *primitive*, the loop that drives its :class:`Steps`:
:class:`While` (the plain ``while_loop``), :class:`Blocks` (several steps per test of the
loop's condition), :class:`Scan` (a checkpointed ``scan`` that reverse mode enters, for
``UnrolledAdjoint``), and for a batch of problems, each member its own loop,
:class:`Staged` (stages that retire the finished members) or :class:`Lockstep` (every
member runs a primitive under ``jax.vmap``). The adjoint picks the primitive
(:mod:`hdm_optax.driver.adjoint`). Each step is recorded in the trace ring and watched by
the hook (:mod:`hdm_optax.driver.hooks`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import jax
import jax.extend
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np

from hdm_optax import _gating
from hdm_optax.driver import hooks as hooks_lib
from hdm_optax.driver import interrupts
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver import results
from hdm_optax.driver.engine import RUNNING
from hdm_optax.driver.engine import Loop
from hdm_optax.driver.engine import LoopState
from hdm_optax.driver.limits import check_count
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import Trace
from hdm_optax.driver.results import converged

__all__ = (
  "Blocks",
  "Lockstep",
  "Program",
  "Scan",
  "Staged",
  "Steps",
  "While",
  "cut_trace",
  "run",
  "stage_sizes",
  "trace_size",
)


class _Carry(NamedTuple):
  """What a run carries: the loop state (its gradient left out where the optimizer's cache
  holds it), the trace ring and the hook's state."""

  state: LoopState
  trace: Trace
  hook: Any


def _without_cached_grad(s: LoopState) -> LoopState:
  # The cache's gradient and s.grad are one array; carried twice, XLA copies it every step.
  return s if protocol.cache_at_params(s.opt_state) is None else s._replace(grad=None)


def _with_cached_grad(s: LoopState) -> LoopState:
  return s if s.grad is not None else s._replace(grad=protocol.cache_at_params(s.opt_state).grad)


def _trace_entry(s: LoopState) -> Trace:
  return Trace(s.value, s.grad_norm, s.accepted, s.num_grad_evals, s.num_steps)


def _record(trace: Trace, s: LoopState) -> Trace:
  size = trace.value.shape[0]
  if size == 0:
    return trace
  index = s.num_steps % size
  return jax.tree.map(lambda a, v: a.at[index].set(v), trace, _trace_entry(s))


def _ordered(trace: Trace, s: LoopState) -> Trace:
  """The ring in step order: the last ``size`` entries, then the final one repeated."""
  size = trace.value.shape[0]
  begun = jnp.min(trace.step) if size else 0  # the step the run began at (resumed: not 0)
  first = jnp.maximum(begun, s.num_steps - size + 1)
  steps = jnp.minimum(first + jnp.arange(size, dtype=s.num_steps.dtype), s.num_steps)
  ordered = jax.tree.map(lambda a: a[steps % max(size, 1)], trace)
  after = first + jnp.arange(size, dtype=s.num_steps.dtype) > s.num_steps
  return ordered._replace(accepted=ordered.accepted & ~after, step=steps)


class Program(NamedTuple):
  """What :func:`run` needs of a front door besides the data (static).

  Attributes:
    trace_size: the number of trace entries kept (the last ones).
    hook: the :class:`~hdm_optax.driver.hooks.Hook` (callback, progress), or ``None``.
    has_aux: ``fun`` returns ``(value, aux)``; aux is evaluated once at the end.
    watch: the run asks the host about Ctrl-C between chunks of steps
      (:func:`hdm_optax.driver.interrupts.chunked`; the handle's ``watch``).
  """

  trace_size: int = 0
  hook: Optional[hooks_lib.Hook] = None
  has_aux: bool = False
  watch: bool = False


# The trace a run keeps by default (one run, outside jax.vmap): its last 1024 entries at most.
DEFAULT_TRACE = 1024


def trace_size(trace: Optional[int], max_steps, *, batch: bool) -> tuple[int, int]:
  """``(program, result)``: the trace entries a program keeps and those a result shows.

  ``trace``, or by default the whole run up to :data:`DEFAULT_TRACE` entries, and none for
  a ``batch`` (``solve_batch``, ``sweep``, ``solve`` under ``jax.vmap``). The program keeps
  a power of two, so that budgets that round up alike share one program; the result is cut
  to ``max_steps + 1``.
  """
  size = 0 if batch else DEFAULT_TRACE
  if trace is not None:
    size = int(check_count("trace", trace, 0, "the number of last entries to keep"))
  if isinstance(max_steps, jax.core.Tracer) or size == 0:
    return size, size
  shown = min(size, int(np.minimum(max_steps, size)) + 1)
  return min(size, 1 << (shown - 1).bit_length()), shown


def cut_trace(result, size: int):
  """``result`` with its trace cut to ``size`` entries (the last axis)."""
  if result.trace.value.shape[-1] == size:
    return result
  cut = _cut if programs.tracers(result.trace) else _cut_compiled
  return result._replace(trace=cut(result.trace, size))


def _cut(trace, size):
  return jax.tree.map(lambda a: a[..., :size], trace)


_cut_compiled = jax.jit(_cut, static_argnums=1)  # one dispatch for the five arrays


def _begin(make, program: Program, handle, member, params, opt_state, index) -> _Carry:
  s = make(member)[0].start(params, opt_state)
  trace = jax.tree.map(lambda v: jnp.full((program.trace_size,), v), _trace_entry(s))
  return _Carry(_without_cached_grad(s), trace, hooks_lib.begin(program.hook, handle.hook, index))


def _advance(make, program: Program, member, carry: _Carry, active=None) -> _Carry:
  """One step, recorded and watched; ``active`` False leaves the member as it was."""
  loop_ = make(member)[0]
  old = _with_cached_grad(carry.state)
  if active is None:
    s = loop_.step(old)
  else:
    with _gating.gate(active, old) as gate:
      s = loop_.step(old)
    s = gate.where(s, old)
  cause = hooks_lib.host_call(program.hook, carry.hook, s, loop_.status(s))
  if cause is not None:  # a finished member is not running: the stop leaves it as it is
    s = loop_.stop(s, cause)
  return _Carry(_without_cached_grad(s), _record(carry.trace, s), carry.hook)


def _end(make, program: Program, member, carry: _Carry) -> SolveResult:
  loop_, fun = make(member)
  s = _with_cached_grad(carry.state)
  cause = hooks_lib.host_call(program.hook, carry.hook, s, loop_.status(s), final=True)
  s = s if cause is None else loop_.stop(s, cause)
  status = loop_.status(s)
  num_value_evals, aux = s.num_value_evals, None
  if program.has_aux:  # one more evaluation of f (no gradient) gives aux at params
    aux = fun(s.params)[1]
    num_value_evals = num_value_evals + 1
  return SolveResult(
    params=s.params,
    state=s.opt_state,
    value=s.value,
    grad_norm=s.grad_norm,
    num_steps=s.num_steps,
    num_value_evals=num_value_evals,
    num_grad_evals=s.num_grad_evals,
    converged=converged(status),
    status=status,
    trace=_ordered(carry.trace, s),
    null_run=s.null_run,
    aux=aux,
    tol=s.tol,
    stopped_by=s.stopped_by,
  )


class Steps(NamedTuple):
  """What a primitive drives (:func:`run`): the tests and the step of a member's run, pure
  functions of its carry (``member``: what the run is of, a row of a batch's data).

  Attributes:
    running: ``running(carry) -> bool``: the stop rule has not held.
    body: ``body(member, carry, active=None) -> carry``: one step, recorded and watched
      (``active`` False, under ``jax.vmap``: the member stays as it was).
    room: ``room(member, carry, steps) -> bool``: the budget leaves ``steps`` more updates
      (the stop rule's ``max_steps``).
    stop: ``stop(member, carry, cause) -> carry``: a run still going on ends ``STOPPED``
      where ``cause``, an int32 code of what stopped it (``SolveResult.stopped_by``), is
      not 0 (the stop rule's halt).
    chunked: ``chunked(primitive, steps_of) -> primitive``: ``primitive`` in chunks with a
      Ctrl-C check between them (:func:`hdm_optax.driver.interrupts.chunked`), or ``None``
      where the run is not checked.
  """

  running: Callable[[_Carry], jax.Array]
  body: Callable[..., _Carry]
  room: Callable[[Any, _Carry, int], jax.Array]
  stop: Callable[[Any, _Carry, Any], _Carry]
  chunked: Optional[Callable[..., Any]] = None


@dataclasses.dataclass(frozen=True)
class While:
  """The plain loop: ``lax.while_loop`` until the stop rule holds."""

  batch: ClassVar[bool] = False

  def __call__(self, steps: Steps, member, carry):
    return jax.lax.while_loop(steps.running, functools.partial(steps.body, member), carry)


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Blocks of ``check_every`` steps per test of the ``while_loop`` condition.

  The steps of a block run unmasked and the rule is evaluated after each; once it held
  before a block's last step, the run goes on step by step from that block's start, so the
  result, counts and trace are those of a test at every step (the block's steps after the
  stop are computed and discarded). No block runs past ``max_steps``: where the budget leaves
  less than a block, the last steps are tested one by one.
  """

  check_every: int
  batch: ClassVar[bool] = False

  def __call__(self, steps: Steps, member, carry):
    running, body = steps.running, functools.partial(steps.body, member)

    def block(c):
      current, _, _ = c

      def one(i, inner):
        carry, held = inner
        carry = body(carry)
        # A stop at the block's last step needs no replay: the block's end is that step.
        return carry, held | (~running(carry) & (i < self.check_every - 1))

      end, held = jax.lax.fori_loop(0, self.check_every, one, (current, jnp.asarray(False)))
      return end, current, held

    def more(c):
      current, _, held = c
      return ~held & running(current) & steps.room(member, current, self.check_every)

    end, start, held = jax.lax.while_loop(more, block, (carry, carry, ~running(carry)))
    carry = jax.lax.cond(held, lambda: start, lambda: end)
    return jax.lax.while_loop(running, body, carry)


@dataclasses.dataclass(frozen=True)
class Scan:
  """``length`` iterations of a ``lax.scan`` (reverse mode enters it); an iteration after
  the stop rule held leaves the carry as it is (a ``lax.cond``). ``checkpoint``: each
  iteration under ``jax.checkpoint``."""

  length: int
  checkpoint: bool = True
  batch: ClassVar[bool] = False

  def __call__(self, steps: Steps, member, carry):
    body = functools.partial(steps.body, member)

    def one(carry, _):
      return jax.lax.cond(steps.running(carry), body, lambda c: c, carry), None

    one = jax.checkpoint(one) if self.checkpoint else one
    # Traced once, as a jaxpr (fun is not traced twice), to look for inner loops in it.
    scan = lambda c: jax.lax.scan(one, c, length=self.length)[0]
    closed, shape = jax.make_jaxpr(scan, return_shape=True)(carry)
    out = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(carry))
    out = jax.tree.unflatten(jax.tree.structure(shape), out)
    if _loops_on_floats(closed.jaxpr):
      out = jax.tree.map(_refuse_reverse_mode, out)
    return out


_INNER_LOOP = (
  "UnrolledAdjoint cannot take this derivative: each step of the run enters a "
  "lax.while_loop (an inner loop of the optimizer's update, such as osgm_best's probes or "
  "optax.lbfgs's zoom line search, or one in fun), and reverse mode (jax.grad, jax.vjp, "
  "jax.jacrev) cannot differentiate a loop of dynamic length. Pass "
  "adjoint=hdm_optax.ImplicitAdjoint() (the default: the derivative of the solution), "
  "unroll an optimizer without inner loops (hdm_best, trial_lbfgs, optax.sgd), or take "
  "forward-mode derivatives (jax.jvp, jax.jacfwd), which go through the inner loops' "
  "iterations as they ran."
)


def _loops_on_floats(jaxpr) -> bool:
  """Whether ``jaxpr`` (or one inside it) has a ``while`` that carries floating values,
  which reverse mode cannot transpose."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while" and any(
      jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars
    ):
      return True
    for param in jax.tree.leaves(eqn.params, is_leaf=_is_jaxpr):
      inner = getattr(param, "jaxpr", param)
      if _is_jaxpr(param) and _loops_on_floats(inner):
        return True
  return False


def _is_jaxpr(x) -> bool:
  return isinstance(x, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))


def _refuse_transpose(cotangent, leaf):
  del cotangent, leaf
  raise ValueError(_INNER_LOOP)


# The identity, linear, whose transpose (reverse mode) raises _INNER_LOOP before JAX meets
# the while loop and raises its own error; forward mode and jax.vmap go through it.
_refuse_reverse_mode_p = jax.extend.core.Primitive("hdm_refuse_reverse_mode")
_refuse_reverse_mode_p.def_impl(lambda leaf: leaf)
_refuse_reverse_mode_p.def_abstract_eval(lambda leaf: leaf)
ad.deflinear2(_refuse_reverse_mode_p, _refuse_transpose)
batching.primitive_batchers[_refuse_reverse_mode_p] = lambda args, dims: (
  _refuse_reverse_mode_p.bind(*args),
  dims[0],
)
mlir.register_lowering(_refuse_reverse_mode_p, mlir.lower_fun(lambda leaf: leaf, False))


def _refuse_reverse_mode(leaf):
  """``leaf``; reverse mode through it raises :data:`_INNER_LOOP` (floating leaves)."""
  if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
    return leaf
  return _refuse_reverse_mode_p.bind(leaf)


@dataclasses.dataclass(frozen=True)
class Lockstep:
  """A batch whose members each run ``primitive``, in lockstep (``jax.vmap``)."""

  primitive: Any
  batch: ClassVar[bool] = True

  def __call__(self, steps: Steps, members, carry):
    return jax.vmap(functools.partial(self.primitive, steps))(members, carry)


# Below this many members a stage costs about as much per step as a smaller one would, and
# every stage is one more loop to compile.
_SMALLEST_STAGE = 16


def stage_sizes(size: int, compact: bool) -> tuple[int, ...]:
  """Batch sizes of the stages: ``(size,)``, or to retire members ``(size, ceil(size/4),
  ...)`` down to 1, or, for a batch of more than 64 members, down to 16."""
  smallest = 1 if size <= 4 * _SMALLEST_STAGE else _SMALLEST_STAGE
  sizes = [size]
  while compact and sizes[-1] > smallest:
    sizes.append(-(-sizes[-1] // 4))
  return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class Staged:
  """A batch run a stage at a time, retiring its finished members.

  ``sizes`` are the stage sizes (:func:`stage_sizes`; ``sizes[0]`` is the number of
  members): once at most ``sizes[i + 1]`` members are still running, those go on as a batch
  of that size (gathered with their data), and the others cost nothing more. With
  ``stop_at_first_converged`` every member ends once one has converged (the others end
  ``STOPPED``: the stop rule's halt).
  """

  sizes: tuple
  stop_at_first_converged: bool = False
  batch: ClassVar[bool] = True

  def __call__(self, steps: Steps, members, batch):
    stop = jax.vmap(steps.stop, in_axes=(0, 0, None))

    def advance(member, carry):
      return steps.body(member, carry, steps.running(carry))

    def first(part):  # a member converged: judged on the whole batch, where it is
      if not self.stop_at_first_converged:
        return jnp.asarray(False)
      return jnp.any(converged(part.state.status))

    def stage(rows, part, later, stopped):
      def go(counted):
        part = counted[0]
        return (jnp.sum(jax.vmap(steps.running)(part)) > later) & ~stopped & ~first(part)

      def step(rows, counted):
        return jax.vmap(advance)(rows, counted[0]), counted[1] + 1

      def halted(rows, counted, cause):  # Ctrl-C: every member still running ends STOPPED
        return stop(rows, counted[0], cause), counted[1]

      loop = While()
      if steps.chunked is not None:  # the stage's iterations count the chunks
        loop = steps.chunked(loop, lambda counted: counted[1])
      whole = Steps(go, step, lambda *_: jnp.asarray(True), halted)
      return loop(whole, rows, (part, jnp.zeros([], jnp.int32)))[0]

    later_sizes = self.sizes[1:] + (0,)
    batch = stage(members, batch, later_sizes[0], jnp.asarray(False))
    for size, later in zip(self.sizes[1:], later_sizes[1:]):
      stopped = first(batch)
      chosen = jnp.argsort(~jax.vmap(steps.running)(batch), stable=True)[:size]
      take = lambda tree: jax.tree.map(lambda x: x[chosen], tree)
      part = stage(take(members), take(batch), later, stopped)
      batch = jax.tree.map(lambda full, x: full.at[chosen].set(x), batch, part)
    if self.stop_at_first_converged:  # the members still running end STOPPED
      cause = jnp.where(first(batch), jnp.int32(results.BY_OTHER_POINT), jnp.int32(0))
      batch = stop(members, batch, cause)
    return batch


def run(
  make: Callable[[Any], tuple[Loop, Callable]],
  program: Program,
  member,
  params,
  opt_state=None,
  *,
  primitive,
  handle,
  first_member=0,
) -> SolveResult:
  """Runs a member's loop from ``params`` to its end with ``primitive``.

  A primitive is ``primitive(steps, member, carry) -> carry``: it runs the :class:`Steps`
  from the carry of the first point until ``steps.running`` is False (or, a scan, for its
  length). A batch primitive (``primitive.batch``: :class:`Staged`, :class:`Lockstep`)
  runs a batch of members: ``member``, ``params`` and ``opt_state`` have one row per member.

  Args:
    make: ``make(member) -> (loop, fun)``: the :class:`~hdm_optax.driver.engine.Loop` of a
      member and its objective.
    program: the static :class:`Program`.
    member: what the run is of (a pytree; rows of a batch's data and settings).
    params: the starting point (a batch's: one row per member).
    opt_state: the optimizer state to resume, or ``None``.
    primitive: the loop (as the adjoint picked it: :class:`While`, :class:`Blocks`, ...).
    handle: the call's :class:`~hdm_optax.driver.hooks.Handle` (the hook's session, the
      Ctrl-C check; each ``None`` where the call has none).
    first_member: the index of the batch's first member in the whole batch (for the hook).

  Returns:
    The :class:`SolveResult` (a batch's: one row per member).
  """
  steps = Steps(
    lambda carry: carry.state.status == RUNNING,
    functools.partial(_advance, make, program),
    lambda member, carry, n: make(member)[0].room(carry.state, n),
    lambda member, carry, cause: carry._replace(state=make(member)[0].stop(carry.state, cause)),
  )
  if program.watch:  # Ctrl-C checks between chunks of steps
    steps = steps._replace(
      chunked=functools.partial(interrupts.chunked, watch=handle.watch, cause=results.BY_CTRL_C)
    )
    if not primitive.batch:
      primitive = steps.chunked(primitive, lambda carry: carry.state.num_steps)
  begin = functools.partial(_begin, make, program, handle)
  end = functools.partial(_end, make, program)
  index = None
  if primitive.batch:
    index = first_member + jnp.arange(len(jax.tree.leaves(params)[0]), dtype=jnp.int32)
    begin = jax.vmap(begin, in_axes=(0, 0, None if opt_state is None else 0, 0))
    end = jax.vmap(end)
  carry = begin(member, params, opt_state, index)
  return end(member, primitive(steps, member, carry))
