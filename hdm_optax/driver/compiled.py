"""``solve`` (one compiled run of the loop) and ``sweep`` (one vmapped run per grid point)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common
from hdm_optax.driver import closure
from hdm_optax.driver import adjoint as adjoint_lib
from hdm_optax.driver import grid as grid_lib
from hdm_optax.driver import loops as loop_lib
from hdm_optax.driver import staging
from hdm_optax.driver import watch as watch_lib
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import Status
from hdm_optax.driver.results import SweepResult
from hdm_optax.driver.results import Trace
from hdm_optax.driver.results import best_index

__all__ = ("DEFAULT_MAX_NULL_STEPS", "DEFAULT_MAX_STEPS", "solve", "solve_batch", "sweep")


def _check_max_steps(max_steps) -> int:
  if not isinstance(max_steps, (int, np.integer)) or isinstance(max_steps, bool) or max_steps < 0:
    raise ValueError(f"max_steps must be a non-negative int, got {max_steps!r}")
  return int(max_steps)


def _trace_size(max_steps: int) -> int:
  """The trace's length in the compiled program: max_steps + 1 rounded up to a power of two.

  ``max_steps`` itself is a traced value, so budgets that round up alike share one
  program; the result's trace is cut to ``max_steps + 1`` outside it (:func:`_cut`).
  """
  return 1 << max_steps.bit_length()


def _cut_trace(trace: Trace, size: int) -> Trace:
  return jax.tree.map(lambda a: a[..., :size], trace)


# One dispatch for the four arrays (eager slices cost 0.15 ms each on a CPU).
_cut_trace_jit = jax.jit(_cut_trace, static_argnums=1)


def _cut(result: SolveResult, max_steps: int) -> SolveResult:
  """``result`` with its trace (last axis) cut to ``max_steps + 1`` entries."""
  trace = result.trace
  if trace.value.shape[-1] == max_steps + 1:
    return result
  cut = _cut_trace if _under_trace(trace) else _cut_trace_jit
  return result._replace(trace=cut(trace, max_steps + 1))


def _new_trace(s: loop_lib.LoopState, size: int) -> Trace:
  return Trace(
    value=jnp.full([size], s.value),
    grad_norm=jnp.full([size], s.grad_norm),
    accepted=jnp.ones([size], bool),
    grad_evals=jnp.ones([size], jnp.int32),
  )


def _record(trace: Trace, index, s: loop_lib.LoopState) -> Trace:
  return Trace(
    value=trace.value.at[index].set(s.value),
    grad_norm=trace.grad_norm.at[index].set(s.grad_norm),
    accepted=trace.accepted.at[index].set(s.accepted),
    grad_evals=trace.grad_evals.at[index].set(s.num_grad_evals),
  )


def _finish(
  run, s: loop_lib.LoopState, tr: Trace, fun, fun_args, has_aux, tol, status=None
) -> SolveResult:
  # Freeze the tail of the trace at the final values.
  tail = jnp.arange(tr.value.shape[0], dtype=s.num_steps.dtype) > s.num_steps
  trace = Trace(
    value=jnp.where(tail, s.value, tr.value),
    grad_norm=jnp.where(tail, s.grad_norm, tr.grad_norm),
    accepted=jnp.where(tail, False, tr.accepted),
    grad_evals=jnp.where(tail, s.num_grad_evals, tr.grad_evals),
  )
  converged = None
  if status is None:
    status = run.status(s)
  else:  # the watched loop's status: ftol's convergence too
    converged = status == Status.CONVERGED_FTOL
  converged_rule = status == loop_lib.converged_status(s.opt_state)
  converged = converged_rule if converged is None else converged_rule | converged
  num_value_evals, aux = s.num_value_evals, None
  if has_aux:  # one more evaluation of f (no gradient) gives aux at params
    aux = fun(s.params, *fun_args)[1]
    num_value_evals = num_value_evals + 1
  return SolveResult(
    params=s.params,
    state=s.opt_state,
    value=s.value,
    grad_norm=s.grad_norm,
    num_steps=s.num_steps,
    num_value_evals=num_value_evals,
    num_grad_evals=s.num_grad_evals,
    converged=converged,
    status=status,
    trace=trace,
    null_run=s.null_run,
    aux=aux,
    tol=tol,
  )


def _blocks(run, check_every, max_steps, body, carry):
  """Runs blocks of ``check_every`` steps until the stopping rule held inside one.

  The rule is evaluated after every step and tested by the ``while_loop`` once
  per block; the steps of a block run unmasked, and no block runs past
  ``max_steps``. Returns the carry at the start of the block in which the rule
  first held (the start carry if it holds there), else the carry after the last
  block: the per-step loop goes on from it and stops where a test at every step
  stops, so the steps, calls and trace are those of that run.
  """

  def block(c):
    current, _, _ = c

    def step(_, inner):
      carry, held = inner
      carry = body(carry)
      return carry, held | run.done(carry[0])

    end, held = jax.lax.fori_loop(0, check_every, step, (current, jnp.asarray(False)))
    return end, current, held

  def more(c):
    current, _, held = c
    return ~held & (current[0].num_steps <= max_steps - check_every)

  end, start, held = jax.lax.while_loop(more, block, (carry, carry, run.done(carry[0])))
  return jax.lax.cond(held, lambda: start, lambda: end)


def _check_every(check_every) -> int:
  if (
    not isinstance(check_every, (int, np.integer))
    or isinstance(check_every, bool)
    or check_every < 1
  ):
    raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
  return int(check_every)


def _check_rtol(rtol):
  return loop_lib.check_tolerance(
    "rtol",
    rtol,
    "the run stops once ||grad f||_inf <= rtol ||grad f(x0)||_inf",
    "pass e.g. rtol=1e-6, or rtol=0.0 for tol alone",
  )


def _start(optimizer, fun, fun_args, has_aux, limits, rtol, init_params, init_state=None):
  """The loop at its first point, its state there and its threshold.

  The threshold is max(tol, rtol ||grad f(x0)||_inf), known once x0 is evaluated;
  the loop's stopping rule is built with it.
  """
  run = loop_lib.build(optimizer, fun, fun_args, has_aux, limits)
  s = run.start(init_params, init_state)
  norm0 = s.grad_norm
  tol = jnp.maximum(jnp.asarray(limits.tol, norm0.dtype), jnp.asarray(rtol, norm0.dtype) * norm0)
  done, status = loop_lib.stopping_rule(limits._replace(tol=tol))
  return run._replace(done=done, status=status), s, tol


def _solve(
  optimizer,
  fun,
  trace_size,
  has_aux,
  check_every,
  init_params,
  fun_args,
  limits,
  init_state,
  rtol,
  watch=None,
):
  run, s, tol = _start(optimizer, fun, fun_args, has_aux, limits, rtol, init_params, init_state)

  def body(carry):
    s, trace = carry
    s = run.step(loop_lib.restored(s))
    return loop_lib.carried(s), _record(trace, s.num_steps, s)

  carry = (loop_lib.carried(s), _new_trace(s, trace_size))
  if watch is not None:  # the watched loop (callback, progress, ftol); check_every is 1
    s, trace, status = watch_lib.watched_loop(
      watch, run, body, carry, limits.ftol, loop_lib.restored
    )
    return _finish(run, s, trace, fun, fun_args, has_aux, tol, status)
  if check_every > 1:
    carry = _blocks(run, check_every, limits.max_steps, body, carry)
  s, trace = jax.lax.while_loop(lambda c: ~run.done(c[0]), body, carry)
  return _finish(run, loop_lib.restored(s), trace, fun, fun_args, has_aux, tol)


_solve_jit = jax.jit(_solve, static_argnums=(0, 1, 2, 3, 4, 10))

# The public handle on JAX's current trace (jax >= 0.4.36); older versions
# trace inline only when an argument is a tracer.
_trace_state = getattr(jax.extend.core, "get_opaque_trace_state", None)
_EVAL_TRACE = _trace_state(None) if _trace_state else None


def _under_trace(*args) -> bool:
  """Whether ``solve`` is called inside jit/vmap/grad (the optimizer may close over tracers).

  Then it traces inline: a compiled ``solve`` keyed on an optimizer holding
  tracers would keep them alive in the compilation cache.
  """
  if _trace_state is None:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
  return _trace_state(None) != _EVAL_TRACE


# None: HDM's null steps still adapt P, and in the Table 1 runs (10 LIBSVM
# datasets, both problems, every algorithm and grid point, 1000 gradient calls)
# a run moved again after as many as 888 consecutive null steps, so no bound
# below the budget leaves the paper's runs unchanged.
DEFAULT_MAX_NULL_STEPS = None

# The paper's budget (Table 1: 1000 gradient calls) and the benchmark's. A run stops at
# ``tol`` first; the budget bounds the runs that do not get there. The trace holds 1024
# entries (21 bytes each in float64), which a vmapped solve holds per problem; SciPy's
# L-BFGS-B allows 15000 iterations (16384 entries), optimistix 256 steps.
DEFAULT_MAX_STEPS = 1000


def solve(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., Any],
  init_params: Any,
  *,
  max_steps: int = DEFAULT_MAX_STEPS,
  tol: Any = 1e-4,
  rtol: Any = 0.0,
  init_state: Optional[Any] = None,
  fun_args: Sequence[Any] = (),
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = DEFAULT_MAX_NULL_STEPS,
  min_value: Optional[float] = -1e20,
  has_aux: bool = False,
  check_every: int = 1,
  callback: Optional[Callable[[watch_lib.Snapshot], Any]] = None,
  progress: bool = False,
  adjoint: Any = None,
) -> SolveResult:
  r"""Minimizes ``fun(params, *fun_args)`` with ``optimizer``, compiled end to end.

  The run is one ``lax.while_loop`` over ``jax.value_and_grad(fun)``. It stops
  (freezes) once :math:`\|\nabla f(x)\|_\infty \le \max(\text{tol},\
  \text{rtol}\,\|\nabla f(x_0)\|_\infty)`, after
  ``max_steps`` updates or ``max_grad_evals`` gradient evaluations, when f or
  its gradient is not finite, when f < ``min_value``, or after
  ``max_null_steps`` consecutive null steps; ``status`` says which
  (:class:`Status`). ``fun_args`` are arguments of the compiled program (data
  is not folded into it as constants). Works for any optax transformation;
  ``update`` receives ``value``, ``grad`` and ``value_fn``.

  The reported ``value`` and gradient are always at the reported params. If the
  caching transformation (every hdm_optax transformation, optax's linesearches
  and so ``optax.lbfgs``) is the last one, its cached f and grad f are at the
  new params and are reused: an HDM-Best or L-BFGS iteration costs no extra
  oracle call. If a later transformation can change its update (for example
  ``optax.chain(hdm_best(), optax.scale(0.5))``), the cache is at another point:
  ``solve`` then evaluates f at the new params at every step (counted, and a
  warning says to put the caching transformation last). See
  :func:`cache_at_params`.

  Each call solves ``fun`` as it is at the call: outside a trace, ``solve``
  traces ``fun`` first and the arrays it reads from outside its arguments
  (closure cells, module globals, a bound method's object, an equinox Module's
  fields) enter the program as arguments, as ``fun_args`` do
  (:mod:`~hdm_optax.driver.closure`). Arrays read only inside a custom
  derivative rule (``jax.custom_vjp``'s backward function) or inside a function
  that is itself ``jax.jit``-ed are fixed when the program is compiled: pass
  those in ``fun_args``. Called outside a trace, ``solve`` compiles once per
  configuration: the program is cached on (optimizer, ``fun``, the structure of
  its trace, ``has_aux``, ``check_every``, the trace's length) and the shapes
  and dtypes of ``init_params``, ``fun_args`` and ``init_state``, so new arrays
  of the same shapes reuse it and a changed Python number that ``fun`` reads
  compiles a new one. An equinox Module as ``fun`` is keyed on its structure.
  hdm_optax's factories return transformations equal to
  every other one built with equal arguments (they carry their
  ``configuration``: the factory and its arguments), so
  ``solve(trial_lbfgs(), fun, x0, ...)`` in a loop over datasets compiles once,
  while ``trial_lbfgs(memory_size=5)`` compiles its own program; other optax
  transformations (``optax.adam(1e-3)``, ``optax.chain(...)``) are compared by
  identity: build them once, outside the loop. The limits (``tol``, ``rtol``,
  ``max_steps``, ``max_grad_evals``, ``max_null_steps``, ``min_value``) are
  traced values: a new ``tol`` or budget reuses the program. The trace is the
  one array whose length follows ``max_steps``: the program holds
  ``max_steps + 1`` rounded up to a power of two entries (budgets of 513 to
  1023 steps share one program) and the result is cut to ``max_steps + 1``.
  Inside ``jax.jit``/``jax.vmap`` it traces inline, so
  ``jax.jit(jax.vmap(lambda lr: solve(hdm_best(precond_lr=lr), ...)))``
  compiles one program for a whole grid.

  Args:
    optimizer: an optax transformation.
    fun: the objective, ``fun(params, *fun_args) -> scalar`` of the params'
      dtype (``-> (scalar, aux)`` with ``has_aux``).
    init_params: x^1, any pytree of float arrays of one dtype.
    max_steps: the number of updates allowed (a Python int; traced, and it
      sets the trace's length as above). The default, 1000, is the paper's budget
      of gradient calls (:data:`DEFAULT_MAX_STEPS`; SciPy's L-BFGS-B allows 15000
      iterations, optimistix 256 steps): a run that needs more stops with status
      ``MAX_STEPS``.
    tol: stop when ||grad f||_inf <= tol (>= 0; 0 runs to the other limits).
    rtol: also stop when ||grad f||_inf <= rtol ||grad f(x0)||_inf (>= 0; 0,
      the default, leaves ``tol`` alone): a reduction by a factor from x0. The
      threshold follows ||grad f(x0)||_inf, which grows with the number of
      terms of f, so it may lie far above ``tol``. :attr:`SolveResult.tol` is
      the threshold a run used;
      docs/pitfalls.md says when ``rtol`` helps (a float32 run whose gradient
      cannot get below ``tol``).
    init_state: resume from this optimizer state instead of ``optimizer.init``.
    fun_args: extra arguments of ``fun`` (e.g. the data).
    max_grad_evals: also stop before an update once this many gradient
      evaluations have been made (an update that evaluates several times, such
      as a linesearch, may end above it). ``None``: no limit.
    max_null_steps: stop with status ``STALLED`` after this many consecutive
      updates that left the iterate where it was. ``None`` (the default):
      never, because HDM's null steps still adapt P and a run may move again
      after many of them; ``null_run`` and :attr:`SolveResult.message` still
      report a final run of null steps.
    min_value: stop with status ``UNBOUNDED`` once f < min_value (the objective
      looks unbounded below; ``None``: never).
    has_aux: ``fun`` returns ``(value, aux)``, as in ``jax.value_and_grad``;
      the optimizer sees the value only, and ``aux`` at the final params is
      returned in :attr:`SolveResult.aux` (one more evaluation of ``fun``,
      without gradient, counted in ``num_value_evals``).
    check_every: the ``while_loop`` tests the stopping rule once per
      ``check_every`` steps (static). The steps of a block run unmasked and
      the rule is evaluated after each; once it held inside a block, the run
      goes on step by step from that block's start, so the result, trace and
      counts are those of a test at every step (bit for bit on a CPU, where
      it is tested; on other backends the two are different compiled programs
      and agree as any two programs do, see ``tests/backends.py``). No block
      runs past ``max_steps``: a run that ends there makes the per-step run's
      calls. When the rule holds inside a block, that block's steps are
      computed twice: their oracle calls after the stop run and are
      discarded, uncounted (at most ``check_every - 1``), and a
      ``jax.debug.callback`` in ``fun`` sees them. The loop holds a second
      copy of its state (the block's start): 21 instead of 15 vectors of n in
      the compiled ``solve(hdm_auto())``. On a GPU the test of the loop's
      condition is a round trip to the host, but copying the block's start
      costs about as much, so the default is 1 on every backend.
    callback: ``callback(snapshot)``, called on the host after every step
      with a :class:`hdm_optax.driver.watch.Snapshot` (params, value,
      grad norm, steps, calls, null steps, status), from the compiled program
      (``jax.pure_callback``); it stops the run (status ``STOPPED``) by
      returning True or raising ``StopIteration``. Under ``jax.vmap`` it is
      called once per step of the batched loop with the whole batch (every
      field with the batch's axes). The program is cached on the callable:
      pass the same one to reuse it. Needs ``check_every=1``.
    progress: show a live line on stderr (steps, gradient calls, f,
      ||grad f||, null steps, seconds), redrawn at most 5 times a second, and
      leave a summary line at the end; under ``jax.vmap``, one line for the
      batch (how many converged). Off (the default) with no ``callback``, the
      compiled program is the one without these hooks; on, each step makes a
      call to the host (docs/guide.md gives its cost).
    adjoint: how ``jax.grad``/``jax.jvp`` see ``params`` and ``value`` as functions of
      ``fun_args`` (and of arrays ``fun`` closes over):
      :class:`hdm_optax.ImplicitAdjoint` (``None``, the default: the implicit function
      theorem at the returned point, ``x0`` gets zero) or
      :class:`hdm_optax.UnrolledAdjoint` (through the iterations of a ``lax.scan`` run
      of ``max_steps`` iterations). See :mod:`hdm_optax.driver.adjoint`.

  Returns:
    A :class:`SolveResult`.

  Raises:
    ValueError: for a ``tol`` or ``rtol`` that is not a number >= 0 (``nan``,
      negative), and
      for invalid ``max_steps``, ``max_grad_evals``, ``max_null_steps`` or
      ``min_value``.
    TypeError: if ``fun`` returns a value of another dtype than the params
      (e.g. float32 params with float64 data): cast one of them.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x, a: jnp.sum(a * x ** 2)
    >>> a = jnp.array([1.0, 10.0, 100.0])
    >>> res = hdm_optax.solve(hdm_optax.hdm_best(lipschitz=200.0), fun,
    ...                       jnp.ones(3), max_steps=500, fun_args=(a,))
    >>> bool(res.converged), int(res.num_grad_evals) <= 501, res.message
    (True, True, 'converged: ||grad f||_inf <= tol')
  """
  max_steps = _check_max_steps(max_steps)
  limits = loop_lib.check_limits(
    tol=tol, max_grad_evals=max_grad_evals, max_null_steps=max_null_steps, min_value=min_value
  )
  limits = limits._replace(max_steps=jnp.asarray(max_steps, jnp.int32))
  _check_rtol(rtol)
  fun_args = tuple(fun_args)
  _common.params_dtype(init_params)
  check_every = _check_every(check_every)
  watch = watch_lib.make_watch(callback, progress)
  if watch is not None and check_every != 1:
    raise ValueError(
      f"callback= and progress= watch every step; they need check_every=1, got {check_every}."
    )
  traced = _under_trace(init_params, fun_args, tol, rtol, init_state)
  if not traced:  # the arrays fun reads at this call enter the program as arguments
    fun, fun_args = closure.hoist(fun, init_params, fun_args)
  solve_fn = _solve if traced else _solve_jit

  def run(fun, init_params, fun_args, init_state):
    size, aux = _trace_size(max_steps), bool(has_aux)
    return solve_fn(
      optimizer, fun, size, aux, check_every, init_params, fun_args, limits, init_state, rtol, watch
    )

  # Differentiation (hdm_optax.driver.adjoint): implicit at the returned point, or unrolled.
  unrolled = adjoint_lib.unrolled_run(adjoint, optimizer, has_aux, max_steps, traced, limits, rtol)
  result = adjoint_lib.differentiable_run(
    adjoint, run, unrolled, traced, fun, has_aux, init_params, fun_args, init_state
  )
  return _cut(result, max_steps)


def _sweep(
  make_optimizer,
  fun,
  trace_size,
  has_aux,
  stop_at_first,
  sizes,
  in_order,
  layout,
  points,
  mapped,
  fixed,
  limits,
  rtol,
):
  def problem(point):
    columns, _, params, args = point
    return columns, layout.params(params, fixed[0]), layout.args(args, fixed[1])

  def run(point, tol):
    columns, _, args = problem(point)
    limited = limits._replace(tol=tol)
    return loop_lib.build(make_optimizer(**columns), fun, args, has_aux, limited)

  def start(point):
    columns, params, args = problem(point)
    _, s, tol = _start(make_optimizer(**columns), fun, args, has_aux, limits, rtol, params)
    return loop_lib.carried(s), tol

  def active(points, batch):
    tols, s, _ = batch
    return jax.vmap(lambda p, tol, s: ~run(p, tol).done(s))(points, tols, s)

  def advance(points, batch, t):
    # Points that are done stay frozen (as in a vmapped while_loop); the active
    # ones have made t - 1 steps, so their entry t is step k + 1.
    tols, s, trace = batch
    step = lambda p, tol, s: loop_lib.carried(run(p, tol).step(loop_lib.restored(s)))
    moved = jax.vmap(step)(points, tols, s)
    s = jax.vmap(optax.tree.where)(active(points, batch), moved, s)
    trace = jax.vmap(lambda tr, s: _record(tr, t, s))(trace, s)
    return tols, s, trace

  def stop(points, batch):
    if not stop_at_first:
      return jnp.asarray(False)
    tols, s, _ = batch
    converged = lambda p, tol, s: run(p, tol).status(s) == loop_lib.converged_status(s.opt_state)
    return jnp.any(jax.vmap(converged)(points, tols, s))

  def finish(point, tol, s, trace):
    _, _, args = problem(point)
    return _finish(run(point, tol), loop_lib.restored(s), trace, fun, args, has_aux, tol)

  columns, ids = points
  # Each point's problem data, gathered once (its own copy of the mapped leaves) unless
  # the points are the problems in order; the problem ids keep the batch non-empty when
  # nothing else is mapped.
  own = (lambda a: a) if in_order else (lambda a: a[ids])
  points = (columns, ids, [own(a) for a in mapped[0]], [own(a) for a in mapped[1]])
  s, tols = jax.vmap(start)(points)
  trace = jax.vmap(lambda s: _new_trace(s, trace_size))(s)
  batch = staging.run_in_stages(
    sizes, points, (tols, s, trace), active=active, advance=advance, stop=stop
  )
  return jax.vmap(finish)(points, *batch)


_sweep_jit = jax.jit(_sweep, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))


def _hoisted(fun, params, problems: grid_lib.Problems):
  """``fun`` and the problems with the arrays ``fun`` reads at this call as a fixed argument."""
  point = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, weak_type=a.weak_type)
  args = problems.layout.args([point(a) for a in problems.mapped[1]], problems.fixed[1])
  closed, (*args, consts) = closure.hoist(fun, params, args)
  layout = problems.layout._replace(
    args_def=jax.tree.structure((*args, consts)),
    args_mapped=problems.layout.args_mapped + (False,) * len(consts),
  )
  fixed = (problems.fixed[0], [*problems.fixed[1], *consts])
  return closed, problems._replace(layout=layout, fixed=fixed)


def sweep(
  make_optimizer: Callable[..., optax.GradientTransformation],
  grid: Union[Mapping[str, Sequence[Any]], Sequence[Mapping[str, Any]]],
  fun: Callable[..., Any],
  init_params: Any,
  *,
  max_steps: int = DEFAULT_MAX_STEPS,
  tol: Any = 1e-4,
  rtol: Any = 0.0,
  fun_args: Sequence[Any] = (),
  in_axes: Any = (None, None),
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = DEFAULT_MAX_NULL_STEPS,
  min_value: Optional[float] = -1e20,
  has_aux: bool = False,
  stop_at_first_converged: bool = False,
  compact: bool = False,
) -> SweepResult:
  """Solves once per grid point, all points in one vmapped, compiled call.

  Each point runs the loop of :func:`solve`. The points run in lockstep until
  every one has stopped, or, with ``stop_at_first_converged``, until the first
  point converges: the points that converge then have the fewest steps, so
  ``best`` is the same, and the others stop early with status ``STOPPED``.
  With ``compact``, finished points stop costing work: once at most a quarter
  of the batch is still active, those points continue as a batch of a quarter
  the size (B, B/4, B/16, ..., down to 1, or to 16 for more than 64 points;
  each stage is one more compiled loop, so compile time grows). Worth it when
  the objective's cost grows with the batch, or when a few points need many more
  steps than the others (:func:`solve_batch`). The
  results are those of the lockstep sweep up to rounding (another compiled
  program). As in :func:`solve`, the arrays ``fun`` reads from outside its
  arguments are read at each call and enter the program as arguments; those
  that ``make_optimizer`` closes over are constants of its program. The
  compiled program is cached on (``make_optimizer``, ``fun`` and the structure
  of its trace, the trace's length as in :func:`solve`) and the shapes and dtypes, so a
  module-level ``make_optimizer`` (a factory such as ``hdm_optax.hdm_best``)
  reused across problems of the same shapes compiles once, whatever the
  limits; pass problem constants (such as L) as grid columns or ``fun_args``
  rather than closing over them.

  Args:
    make_optimizer: ``make_optimizer(**point)`` builds the optimizer; grid
      values arrive as traced scalars: Python floats in the params' dtype,
      integers and booleans in their own dtype, arrays in theirs. A setting
      the optimizer cannot be built from as a traced value (a string, or an
      integer that sizes the state, as ``trial_lbfgs``'s ``memory_size``)
      arrives as its Python value, one compiled program per value; the
      results come back in the grid's order (``results.state`` is then a
      list of per-point states where their shapes differ).
    grid: keyword -> list of values (the grid is their Cartesian product, in
      row-major order), or an explicit list of points (dicts with the same keys).
    fun: the objective, as in :func:`solve`.
    init_params: the starting point (of every problem, unless ``in_axes`` maps it).
    max_steps: as in :func:`solve` (default 1000); every point holds a trace of
      ``max_steps + 1`` rounded up to a power of two entries.
    tol: as in :func:`solve`.
    rtol: as in :func:`solve`, from each point's own ||grad f(x0)||_inf.
    fun_args: as in :func:`solve`.
    in_axes: ``(params_axes, fun_args_axes)``, as ``jax.vmap``'s ``in_axes``
      for ``init_params`` and ``fun_args``: an int, ``None`` or a pytree prefix
      per argument. Mapped axes (of one size B) make B problems, and every grid
      point runs on every problem: ``len(points) == len(grid) * B``, grid-major,
      each point with its ``"problem"`` index. Each point gets its own copy of
      the mapped leaves. Default: one problem.
    max_grad_evals: as in :func:`solve`.
    max_null_steps: as in :func:`solve`.
    min_value: as in :func:`solve`.
    has_aux: as in :func:`solve`.
    stop_at_first_converged: stop all points once one has converged.
    compact: move the active points to smaller batches as points finish.

  Returns:
    A :class:`SweepResult`.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> out = hdm_optax.sweep(
    ...     lambda precond_lr, momentum_lr: hdm_optax.hdm_best(
    ...         lipschitz=20.0, precond_lr=precond_lr, momentum_lr=momentum_lr),
    ...     {"precond_lr": [0.05, 0.5], "momentum_lr": [1.0, 3.0]},
    ...     fun, jnp.ones(2), max_steps=300)
    >>> len(out.points), out.results.num_steps.shape
    (4, (4,))
  """
  problems = grid_lib.problems(init_params, tuple(fun_args), in_axes)
  if stop_at_first_converged and problems.count > 1:
    raise ValueError(
      "stop_at_first_converged stops every point once one converged, but with in_axes the "
      f"points solve {problems.count} different problems; sweep one problem at a time, or "
      "drop stop_at_first_converged."
    )
  limits = _Limits(max_steps, tol, rtol, max_grad_evals, max_null_steps, min_value)
  points, results = _run_sweep(
    make_optimizer, grid, fun, problems, limits, has_aux, stop_at_first_converged, compact
  )
  return SweepResult(points=points, results=results, best=best_index(results))


class _Limits(NamedTuple):
  """The limits :func:`sweep` and :func:`solve_batch` take as :func:`solve` does."""

  max_steps: Any
  tol: Any
  rtol: Any
  max_grad_evals: Any
  max_null_steps: Any
  min_value: Any


def _run_sweep(make_optimizer, grid, fun, problems, limits, has_aux, stop_at_first, compact):
  """:func:`sweep`'s points and results (``limits``: :class:`_Limits`)."""
  names, points = grid_lib.grid_points(grid)
  max_steps = _check_max_steps(limits.max_steps)
  rtol = limits.rtol
  _check_rtol(rtol)
  limits = loop_lib.check_limits(
    tol=limits.tol,
    max_grad_evals=limits.max_grad_evals,
    max_null_steps=limits.max_null_steps,
    min_value=limits.min_value,
  )._replace(max_steps=jnp.asarray(max_steps, jnp.int32))
  first = problems.layout.params([a[0] for a in problems.mapped[0]], problems.fixed[0])
  dtype = _common.params_dtype(first)
  fun, problems = _hoisted(fun, first, problems)
  static = grid_lib.static_names(make_optimizer, names, points, first, dtype)
  points, ids = grid_lib.expand(points, problems.count)
  common = (fun, _trace_size(max_steps), bool(has_aux), bool(stop_at_first))
  results = []
  for indices, make, columns in grid_lib.programs(make_optimizer, names, points, static, dtype):
    sizes = staging.stage_sizes(len(indices), bool(compact))
    in_order = problems.count > 1 and np.array_equal(ids[indices], np.arange(problems.count))
    batch = (columns, jnp.asarray(ids[indices]))
    data = (problems.layout, batch, problems.mapped, problems.fixed, limits, rtol)
    results.append((indices, _sweep_jit(make, *common, sizes, in_order, *data)))
  return points, _cut(grid_lib.combine(results, len(points)), max_steps)


class _Given(NamedTuple):
  """``make_optimizer`` for :func:`solve_batch`: the given transformation, hashed as it is
  (equal transformations, one compiled program)."""

  optimizer: Any

  def __call__(self):
    return self.optimizer


def solve_batch(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., Any],
  init_params: Any,
  *,
  fun_args: Sequence[Any] = (),
  in_axes: Any = (0, 0),
  compact: bool = True,
  max_steps: int = DEFAULT_MAX_STEPS,
  tol: Any = 1e-4,
  rtol: Any = 0.0,
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = DEFAULT_MAX_NULL_STEPS,
  min_value: Optional[float] = -1e20,
  has_aux: bool = False,
) -> SolveResult:
  """Solves a batch of problems in one compiled call, retiring the members that have stopped.

  ``jax.jit(jax.vmap(solve))`` runs every member in lockstep until the slowest one
  stops: a batch whose members need different numbers of steps pays for the slowest at
  every step. Here, once at most a quarter of the batch is still running, the running
  members move to a batch a quarter the size (B, B/4, ..., down to 1, or to 16 for more
  than 64 members; each stage is one more loop in the same program, so compiling takes
  longer than the lockstep program's). Each member runs the loop of :func:`solve`, so the
  results are those of ``jax.vmap(solve)`` up to rounding (another compiled program). It
  is :func:`sweep` over one grid point, and, as there, the program is cached on the
  optimizer, ``fun`` and the shapes: a second call with new data of the same shapes, or
  with an equal optimizer (hdm_optax's factories called with equal arguments), does not
  compile again.

  Args:
    optimizer: the optax transformation, as in :func:`solve`.
    fun: the objective, as in :func:`solve`.
    init_params: the starting points (or one, shared: ``in_axes=(None, ...)``).
    fun_args: as in :func:`solve`; the problems' data.
    in_axes: ``(params_axes, fun_args_axes)``, as ``jax.vmap``'s ``in_axes`` for
      ``init_params`` and ``fun_args``: an int, ``None`` or a pytree prefix per argument;
      the mapped axes (of one size B) are the batch. Default: both on axis 0.
    compact: retire stopped members (``False``: the lockstep loop of ``jax.vmap(solve)``).
    max_steps: as in :func:`solve`.
    tol: as in :func:`solve`.
    rtol: as in :func:`solve`, from each member's own ||grad f(x0)||_inf.
    max_grad_evals: as in :func:`solve`.
    max_null_steps: as in :func:`solve`.
    min_value: as in :func:`solve`.
    has_aux: as in :func:`solve`.

  Returns:
    A :class:`SolveResult` whose leaves have a leading axis of B, in the batch's order.

  Raises:
    ValueError: ``in_axes`` maps nothing, or axes of different sizes.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> scales = jnp.array([[1.0, 10.0], [1.0, 1e4], [1.0, 2.0]])
    >>> fun = lambda x, d: jnp.sum(d * (x - 1.0) ** 2)
    >>> out = hdm_optax.solve_batch(
    ...     hdm_optax.trial_lbfgs(), fun, jnp.zeros(2), fun_args=(scales,), in_axes=(None, 0))
    >>> out.converged.tolist(), out.params.shape
    ([True, True, True], (3, 2))
  """
  problems = grid_lib.problems(init_params, tuple(fun_args), in_axes)
  if not (problems.mapped[0] or problems.mapped[1]):
    raise ValueError(
      f"in_axes={in_axes!r} maps no axis of init_params or fun_args, so there is no batch; "
      "name the batch axes (e.g. in_axes=(0, 0)), or call hdm_optax.solve for one problem."
    )
  limits = _Limits(max_steps, tol, rtol, max_grad_evals, max_null_steps, min_value)
  _, results = _run_sweep(_Given(optimizer), [{}], fun, problems, limits, has_aux, False, compact)
  return results
