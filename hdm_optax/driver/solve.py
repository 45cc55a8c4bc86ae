"""``solve`` (one compiled run of the loop) and ``sweep`` (one vmapped run per grid point)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import numbers
import optax

from hdm_optax import _common
from hdm_optax.driver import loop as loop_lib
from hdm_optax.driver import staging
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import SweepResult
from hdm_optax.driver.results import Trace
from hdm_optax.driver.results import best_index

__all__ = ("DEFAULT_MAX_NULL_STEPS", "solve", "sweep")


def _check_max_steps(max_steps) -> int:
  if not isinstance(max_steps, (int, np.integer)) or isinstance(max_steps, bool) or max_steps < 0:
    raise ValueError(f"max_steps must be a non-negative int, got {max_steps!r}")
  return int(max_steps)


def _new_trace(s: loop_lib.LoopState, max_steps: int) -> Trace:
  size = [max_steps + 1]
  return Trace(
    value=jnp.full(size, s.value),
    grad_norm=jnp.full(size, s.grad_norm),
    accepted=jnp.ones(size, bool),
    grad_evals=jnp.ones(size, jnp.int32),
  )


def _record(trace: Trace, index, s: loop_lib.LoopState) -> Trace:
  return Trace(
    value=trace.value.at[index].set(s.value),
    grad_norm=trace.grad_norm.at[index].set(s.grad_norm),
    accepted=trace.accepted.at[index].set(s.accepted),
    grad_evals=trace.grad_evals.at[index].set(s.num_grad_evals),
  )


def _finish(run, s: loop_lib.LoopState, tr: Trace, fun, fun_args, has_aux) -> SolveResult:
  # Freeze the tail of the trace at the final values.
  tail = jnp.arange(tr.value.shape[0], dtype=s.num_steps.dtype) > s.num_steps
  trace = Trace(
    value=jnp.where(tail, s.value, tr.value),
    grad_norm=jnp.where(tail, s.grad_norm, tr.grad_norm),
    accepted=jnp.where(tail, False, tr.accepted),
    grad_evals=jnp.where(tail, s.num_grad_evals, tr.grad_evals),
  )
  status = run.status(s)
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
    converged=status == loop_lib.converged_status(s.opt_state),
    status=status,
    trace=trace,
    null_run=s.null_run,
    aux=aux,
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


def _loop(optimizer, fun, max_steps, has_aux, fun_args, limits):
  limits = limits._replace(max_steps=max_steps)
  return loop_lib.loop(optimizer, fun, fun_args=fun_args, has_aux=has_aux, **limits._asdict())


def _check_every(check_every) -> int:
  if (
    not isinstance(check_every, (int, np.integer))
    or isinstance(check_every, bool)
    or check_every < 1
  ):
    raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
  return int(check_every)


def _solve(
  optimizer, fun, max_steps, has_aux, check_every, init_params, fun_args, limits, init_state, rtol
):
  s = _loop(optimizer, fun, max_steps, has_aux, fun_args, limits).start(init_params, init_state)
  # The stopping threshold max(tol, rtol ||grad f(x0)||_inf), known once x0 is evaluated.
  norm0 = s.grad_norm
  tol = jnp.maximum(jnp.asarray(limits.tol, norm0.dtype), jnp.asarray(rtol, norm0.dtype) * norm0)
  run = _loop(optimizer, fun, max_steps, has_aux, fun_args, limits._replace(tol=tol))

  def body(carry):
    s, trace = carry
    s = run.step(s)
    return s, _record(trace, s.num_steps, s)

  carry = (s, _new_trace(s, max_steps))
  if check_every > 1:
    carry = _blocks(run, check_every, max_steps, body, carry)
  carry = jax.lax.while_loop(lambda c: ~run.done(c[0]), body, carry)
  return _finish(run, *carry, fun, fun_args, has_aux)


_solve_jit = jax.jit(_solve, static_argnums=(0, 1, 2, 3, 4))

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


def solve(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., Any],
  init_params: Any,
  *,
  max_steps: int,
  tol: Any = 1e-4,
  rtol: Any = 0.0,
  init_state: Optional[Any] = None,
  fun_args: Sequence[Any] = (),
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = DEFAULT_MAX_NULL_STEPS,
  min_value: Optional[float] = -1e20,
  has_aux: bool = False,
  check_every: int = 1,
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

  ``solve`` is traceable: inside ``jax.jit``/``jax.vmap`` it traces inline,
  so ``jax.jit(jax.vmap(lambda lr: solve(hdm_best(precond_lr=lr), ...)))``
  compiles one program for a whole grid. Called outside a trace it compiles
  once per (optimizer object, fun, max_steps, has_aux) and input shapes.

  Args:
    optimizer: an optax transformation.
    fun: the objective, ``fun(params, *fun_args) -> scalar`` of the params'
      dtype (``-> (scalar, aux)`` with ``has_aux``).
    init_params: x^1, any pytree of float arrays of one dtype.
    max_steps: the number of updates allowed (static).
    tol: stop when ||grad f||_inf <= tol (>= 0; 0 runs to the other limits).
    rtol: also stop when ||grad f||_inf <= rtol ||grad f(x0)||_inf (>= 0; 0,
      the default, leaves ``tol`` alone). In float32 the gradient of a sum of
      many terms is itself rounded to about 1e-7 of its terms, so an absolute
      ``tol`` can be out of reach; ``rtol=1e-5`` (about 100 eps of float32)
      is what the benchmark's float32 suites add (docs/pitfalls.md).
    init_state: resume from this optimizer state instead of ``optimizer.init``.
    fun_args: extra arguments of ``fun`` (e.g. the data).
    max_grad_evals: also stop before an update once this many gradient
      evaluations have been made (an update that evaluates several times, such
      as a linesearch, may end above it). ``None``: no limit.
    max_null_steps: stop with status ``STALLED`` after this many consecutive
      updates that left the iterate where it was. ``None`` (the default):
      never, because HDM's null steps still adapt P and a run may move again
      after many of them (after as many as 888 in the paper's Table 1 runs);
      ``null_run`` and :attr:`SolveResult.message` still report a final run
      of null steps.
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
      costs about as much: on an H200, ``check_every=8`` took 1.06 (n = 1e6)
      and 1.01 (n = 1e7) times the time of ``check_every=1``
      (``docs/accelerators.md``), so the default is 1 on every backend.

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
  try:
    loop_lib.check_limits(tol=rtol)
  except (TypeError, ValueError):
    error = TypeError if isinstance(rtol, (str, bytes, bool)) or rtol is None else ValueError
    raise error(
      f"rtol must be a scalar >= 0 (the run stops once ||grad f||_inf <= rtol "
      f"||grad f(x0)||_inf), got {rtol!r}; pass e.g. rtol=1e-5, or rtol=0.0 for tol alone."
    ) from None
  fun_args = tuple(fun_args)
  _common.params_dtype(init_params)
  check_every = _check_every(check_every)
  traced = _under_trace(init_params, fun_args, tol, rtol, init_state)
  solve_fn = _solve if traced else _solve_jit
  return solve_fn(
    optimizer,
    fun,
    max_steps,
    bool(has_aux),
    check_every,
    init_params,
    fun_args,
    limits,
    init_state,
    rtol,
  )


def _sweep(
  make_optimizer,
  fun,
  max_steps,
  has_aux,
  stop_at_first,
  sizes,
  columns,
  init_params,
  fun_args,
  limits,
):
  def run(point):
    return _loop(make_optimizer(**point), fun, max_steps, has_aux, fun_args, limits)

  def active(batch):
    columns, s, _ = batch
    return jax.vmap(lambda point, s: ~run(point).done(s))(columns, s)

  def advance(batch, t):
    # Points that are done stay frozen (as in a vmapped while_loop); the active
    # ones have made t - 1 steps, so their entry t is step k + 1.
    columns, s, trace = batch
    keep = active(batch)
    s = jax.vmap(optax.tree.where)(keep, jax.vmap(lambda p, s: run(p).step(s))(columns, s), s)
    trace = jax.vmap(lambda tr, s: _record(tr, t, s))(trace, s)
    return columns, s, trace

  def stop(batch):
    if not stop_at_first:
      return jnp.asarray(False)
    columns, s, _ = batch
    done = lambda p, s: run(p).status(s) == loop_lib.converged_status(s.opt_state)
    return jnp.any(jax.vmap(done)(columns, s))

  s = jax.vmap(lambda point: run(point).start(init_params))(columns)
  trace = jax.vmap(lambda s: _new_trace(s, max_steps))(s)
  batch = staging.run_in_stages(
    sizes, (columns, s, trace), active=active, advance=advance, stop=stop
  )
  _, s, trace = batch
  return jax.vmap(lambda p, s, tr: _finish(run(p), s, tr, fun, fun_args, has_aux))(
    columns, s, trace
  )


_sweep_jit = jax.jit(_sweep, static_argnums=(0, 1, 2, 3, 4, 5))


def _grid_column(name, values, float_dtype):
  """One grid column as an array: numbers of a float grid in the params' dtype.

  Booleans and integers keep their dtype (so they can be swept, e.g. a number
  of steps or an on/off switch); Python floats take the params' dtype (no
  silent promotion of float32 runs); arrays with a dtype keep it.
  """
  if all(isinstance(v, (bool, np.bool_)) for v in values):
    return jnp.asarray(values, bool)
  if all(isinstance(v, (numbers.Integral, np.integer)) for v in values):
    return jnp.asarray(values)
  if all(isinstance(v, numbers.Real) and not hasattr(v, "dtype") for v in values):
    return jnp.asarray(values, float_dtype)
  column = jnp.asarray(values)
  if column.ndim != 1:
    raise ValueError(f"grid values of {name!r} must be scalars, got shape {column.shape[1:]}")
  return column


def sweep(
  make_optimizer: Callable[..., optax.GradientTransformation],
  grid: Union[Mapping[str, Sequence[Any]], Sequence[Mapping[str, Any]]],
  fun: Callable[..., Any],
  init_params: Any,
  *,
  max_steps: int,
  tol: Any = 1e-4,
  fun_args: Sequence[Any] = (),
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
  the size (B, B/4, B/16, ..., 1; each stage is one more compiled loop, so
  compile time grows). Worth it when the objective's cost grows with the
  batch (large data); on small problems per-step overhead dominates. The
  results are those of the lockstep sweep up to rounding (another compiled
  program). The compiled program is cached on (``make_optimizer``, ``fun``,
  ``max_steps``) and the shapes and dtypes, so a module-level
  ``make_optimizer`` reused across problems of the same shapes compiles once;
  pass problem constants (such as L) as grid columns rather than closing over
  them.

  Args:
    make_optimizer: ``make_optimizer(**point)`` builds the optimizer; grid
      values arrive as traced scalars: Python floats in the params' dtype,
      integers and booleans in their own dtype, arrays in theirs.
    grid: keyword -> list of values (the grid is their Cartesian product, in
      row-major order), or an explicit list of points (dicts with the same keys).
    fun: the objective, as in :func:`solve`.
    init_params: the common starting point.
    max_steps: as in :func:`solve`.
    tol: as in :func:`solve`.
    fun_args: as in :func:`solve`.
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
  if isinstance(grid, Mapping):
    names = list(grid)
    points = [dict(zip(names, vals)) for vals in itertools.product(*grid.values())]
  else:
    points = [dict(p) for p in grid]
    names = list(points[0]) if points else []
    if any(set(p) != set(names) for p in points):
      raise ValueError("every grid point must have the same keys")
  if not points:
    raise ValueError("grid is empty")
  max_steps = _check_max_steps(max_steps)
  limits = loop_lib.check_limits(
    tol=tol, max_grad_evals=max_grad_evals, max_null_steps=max_null_steps, min_value=min_value
  )
  dtype = _common.params_dtype(init_params)
  columns = {n: _grid_column(n, [p[n] for p in points], dtype) for n in names}
  results = _sweep_jit(
    make_optimizer,
    fun,
    max_steps,
    bool(has_aux),
    bool(stop_at_first_converged),
    staging.stage_sizes(len(points), bool(compact)),
    columns,
    init_params,
    tuple(fun_args),
    limits,
  )
  return SweepResult(points=points, results=results, best=best_index(results))
