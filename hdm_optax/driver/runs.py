"""Running the engine's loop to its end: the primitives, the trace ring, the staged batch.

:func:`run` runs a :class:`~hdm_optax.driver.engine.Loop` from its first point to the
stop rule's verdict with a *primitive*: :func:`while_primitive` (the plain ``while_loop``),
:func:`blocks_primitive` (several steps per test of the loop's condition) or
:func:`scan_primitive` (a checkpointed ``scan`` that reverse mode enters, for
``UnrolledAdjoint``). Each step is recorded in the trace ring and watched by the hook
(:mod:`hdm_optax.driver.hooks`). :func:`run_batch` runs a batch of problems, each member its
own loop, in stages that retire the finished members.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from hdm_optax import _gating
from hdm_optax.driver import cache as cache_lib
from hdm_optax.driver import hooks as hooks_lib
from hdm_optax.driver.engine import RUNNING
from hdm_optax.driver.engine import Loop
from hdm_optax.driver.engine import LoopState
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import Trace
from hdm_optax.driver.results import converged

__all__ = (
  "Program",
  "Steps",
  "blocks_primitive",
  "run",
  "run_batch",
  "scan_primitive",
  "stage_sizes",
  "while_primitive",
)


class _Carry(NamedTuple):
  """What a run carries: the loop state (its gradient left out where the optimizer's cache
  holds it), the trace ring and the hook's state."""

  state: LoopState
  trace: Trace
  hook: Any


def _without_cached_grad(s: LoopState) -> LoopState:
  # The cache's gradient and s.grad are one array; carried twice, XLA copies it every step.
  return s if cache_lib.cache_at_params(s.opt_state) is None else s._replace(grad=None)


def _with_cached_grad(s: LoopState) -> LoopState:
  return s if s.grad is not None else s._replace(grad=cache_lib.cache_at_params(s.opt_state).grad)


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
  first = jnp.maximum(0, s.num_steps - size + 1)
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
  """

  trace_size: int = 0
  hook: Optional[hooks_lib.Hook] = None
  has_aux: bool = False


def _begin(loop_: Loop, program: Program, params, opt_state, handle, member) -> _Carry:
  s = loop_.start(params, opt_state)
  trace = jax.tree.map(lambda v: jnp.full((program.trace_size,), v), _trace_entry(s))
  return _Carry(_without_cached_grad(s), trace, hooks_lib.begin(program.hook, handle, member))


def _advance(loop_: Loop, program: Program, carry: _Carry, active=None) -> _Carry:
  """One step, recorded and watched; ``active`` False leaves the member as it was."""
  old = _with_cached_grad(carry.state)
  if active is None:
    s = loop_.step(old)
  else:
    with _gating.gate(active, old) as gate:
      s = loop_.step(old)
    s = gate.where(s, old)
  halt = hooks_lib.after_step(program.hook, carry.hook, s, loop_.status(s))
  if halt is not None:  # a finished member is not running: the halt leaves it as it is
    s = loop_.stop(s, halt)
  return _Carry(_without_cached_grad(s), _record(carry.trace, s), carry.hook)


def _running(carry: _Carry) -> jax.Array:
  return carry.state.status == RUNNING


def _end(loop_: Loop, program: Program, fun, carry: _Carry) -> SolveResult:
  s = _with_cached_grad(carry.state)
  halt = hooks_lib.at_end(program.hook, carry.hook, s, loop_.status(s))
  status = loop_.status(s if halt is None else loop_.stop(s, halt))
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
  )


class Steps(NamedTuple):
  """What a primitive drives (:func:`run`): a run's tests and its step, pure functions of
  its carry.

  Attributes:
    running: ``running(carry) -> bool``: the stop rule has not held.
    body: ``body(carry) -> carry``: one step, recorded and watched.
    room: ``room(carry, steps) -> bool``: the budget leaves ``steps`` more updates (the
      stop rule's ``max_steps``).
  """

  running: Callable[[_Carry], jax.Array]
  body: Callable[[_Carry], _Carry]
  room: Callable[[_Carry, int], jax.Array]


def while_primitive(steps: Steps, carry):
  """The plain loop: ``lax.while_loop`` until the stop rule holds."""
  return jax.lax.while_loop(steps.running, steps.body, carry)


def blocks_primitive(check_every: int):
  """Blocks of ``check_every`` steps per test of the ``while_loop`` condition.

  The steps of a block run unmasked and the rule is evaluated after each; once it held
  inside a block, the run goes on step by step from that block's start, so the result,
  counts and trace are those of a test at every step (the block's steps after the stop
  are computed and discarded). No block runs past ``max_steps``: where the budget leaves
  less than a block, the last steps are tested one by one.
  """

  def primitive(steps: Steps, carry):
    running, body = steps.running, steps.body

    def block(c):
      current, _, _ = c

      def one(_, inner):
        carry, held = inner
        carry = body(carry)
        return carry, held | ~running(carry)

      end, held = jax.lax.fori_loop(0, check_every, one, (current, jnp.asarray(False)))
      return end, current, held

    def more(c):
      current, _, held = c
      return ~held & steps.room(current, check_every)

    end, start, held = jax.lax.while_loop(more, block, (carry, carry, ~running(carry)))
    carry = jax.lax.cond(held, lambda: start, lambda: end)
    return jax.lax.while_loop(running, body, carry)

  return primitive


def scan_primitive(length: int, checkpoint: bool = True):
  """``length`` iterations of a ``lax.scan`` (reverse mode enters it); an iteration after
  the stop rule held leaves the carry as it is (a ``lax.cond``)."""

  def primitive(steps: Steps, carry):
    def one(carry, _):
      return jax.lax.cond(steps.running(carry), steps.body, lambda c: c, carry), None

    one = jax.checkpoint(one) if checkpoint else one
    return jax.lax.scan(one, carry, length=length)[0]

  return primitive


def run(
  loop_: Loop, program: Program, fun, params, opt_state=None, *, primitive=None, handle=None
) -> SolveResult:
  """Runs ``loop_`` from ``params`` to its end with ``primitive`` (default: the while loop).

  A primitive is ``primitive(steps, carry) -> carry``: it runs the :class:`Steps` from the
  carry of the first point until ``steps.running`` is False (or, a scan, for its length).
  """
  primitive = primitive or while_primitive
  carry = _begin(loop_, program, params, opt_state, handle, None)
  steps = Steps(_running, functools.partial(_advance, loop_, program), _room(loop_))
  carry = primitive(steps, carry)
  return _end(loop_, program, fun, carry)


def _room(loop_: Loop):
  return lambda carry, steps: loop_.room(carry.state, steps)


# --- a batch of problems that retires its finished members --------------------------------

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


def run_batch(
  make: Callable[[Any], tuple[Loop, Callable]],
  program: Program,
  members: Any,
  params,
  opt_state,
  *,
  sizes: tuple[int, ...],
  handle=None,
  stop_at_first_converged: bool = False,
  first_member=0,
) -> SolveResult:
  """Runs a batch of problems, a stage at a time, each member its own loop.

  Args:
    make: ``make(member) -> (loop, fun)``: the loop of a member and its objective.
    program: the static :class:`Program`.
    members: a pytree whose leaves have one row per member (its data and settings).
    params: the members' starting points (one row per member).
    opt_state: the members' optimizer states to resume (one row per member), or ``None``.
    sizes: the stage sizes (:func:`stage_sizes`); ``sizes[0]`` is the number of members.
    handle: the hook's handle (:mod:`hdm_optax.driver.hooks`).
    stop_at_first_converged: end every member once one has converged (the others end
      ``STOPPED``: :func:`~hdm_optax.driver.engine.judge`'s halt).
    first_member: the index of the first member in the whole batch (for the hook).

  Returns:
    The batched :class:`SolveResult`. Once at most ``sizes[i + 1]`` members are still
    running, those go on as a batch of that size (gathered with their data), and the others
    cost nothing more.
  """

  def begin(member, x, state, index):
    return _begin(make(member)[0], program, x, state, handle, index)

  def advance(member, carry):
    return _advance(make(member)[0], program, carry, active=_running(carry))

  def stop(part):
    if not stop_at_first_converged:
      return jnp.asarray(False)
    return jnp.any(converged(part.state.status))

  def stage(rows, part, later, stopped):
    def go(part):
      return (jnp.sum(jax.vmap(_running)(part)) > later) & ~stopped & ~stop(part)

    return jax.lax.while_loop(go, lambda part: jax.vmap(advance)(rows, part), part)

  ids = first_member + jnp.arange(sizes[0], dtype=jnp.int32)
  axes = (0, 0, None if opt_state is None else 0, 0)
  batch = jax.vmap(begin, in_axes=axes)(members, params, opt_state, ids)
  later_sizes = sizes[1:] + (0,)
  batch = stage(members, batch, later_sizes[0], jnp.asarray(False))
  for size, later in zip(sizes[1:], later_sizes[1:]):
    stopped = stop(batch)  # judged on the whole batch, where the member that met it is
    chosen = jnp.argsort(~jax.vmap(_running)(batch), stable=True)[:size]
    take = lambda tree: jax.tree.map(lambda x: x[chosen], tree)
    part = stage(take(members), take(batch), later, stopped)
    batch = jax.tree.map(lambda full, x: full.at[chosen].set(x), batch, part)
  if stop_at_first_converged:  # the members still running end STOPPED

    def halt(member, carry, first):
      return carry._replace(state=make(member)[0].stop(carry.state, first))

    batch = jax.vmap(halt, in_axes=(0, 0, None))(members, batch, stop(batch))

  def end(member, carry):
    loop_, fun = make(member)
    return _end(loop_, program, fun, carry)

  return jax.vmap(end)(members, batch)
