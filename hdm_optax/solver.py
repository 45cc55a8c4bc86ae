"""A compiled full-batch solver for any optax transformation, and vmapped sweeps."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common

# SolveResult.status codes.
CONVERGED = 0
MAX_STEPS = 1
NON_FINITE = 2
STOPPED = 3
STATUS_MESSAGES = {
  CONVERGED: "converged: ||grad f||_inf <= tol",
  STOPPED: "stopped by sweep(stop_at_first_converged=True) before the end",
  MAX_STEPS: "max_steps or max_grad_evals reached before ||grad f||_inf <= tol",
  NON_FINITE: "f or grad f is not finite at the current iterate",
}


class Trace(NamedTuple):
  """Per-step record; entry 0 is the initial point, entry k follows step k.

  Entries after the last step repeat the final values.

  Attributes:
    value: f(x^k).
    grad_norm: ||grad f(x^k)||_inf.
    accepted: whether step k moved the iterate (True for entry 0).
    grad_evals: cumulative gradient evaluations after step k.
  """

  value: jax.Array
  grad_norm: jax.Array
  accepted: jax.Array
  grad_evals: jax.Array


class SolveResult(NamedTuple):
  """Result of :func:`solve`.

  Attributes:
    params: the last iterate.
    state: the optimizer state after the last step.
    value: f(params).
    grad_norm: ||grad f(params)||_inf.
    num_steps: number of ``update`` calls made.
    num_value_evals: objective evaluations, the initial one included.
    num_grad_evals: gradient evaluations, the initial one included.
    converged: whether ||grad f||_inf <= tol.
    status: ``CONVERGED``, ``MAX_STEPS`` or ``NON_FINITE``
      (see ``STATUS_MESSAGES``).
    trace: :class:`Trace`, arrays of length ``max_steps + 1``.
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


def _inf_norm(tree):
  return jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(tree)]))


def _calls_in_update(old_state, new_state):
  """(value, grad) evaluations that ``update`` made between the two states.

  hdm_optax states count them in ``info``; optax's zoom linesearch (used by
  ``optax.lbfgs``) makes one value-and-gradient call per linesearch step;
  other transformations do not call the oracle.
  """
  vals = optax.tree.get(new_state, "num_value_evals")
  if vals is not None:
    grads = optax.tree.get(new_state, "num_grad_evals")
    return (
      vals - optax.tree.get(old_state, "num_value_evals"),
      grads - optax.tree.get(old_state, "num_grad_evals"),
    )
  steps = optax.tree.get(new_state, "num_linesearch_steps")
  if steps is not None:
    return steps, steps
  return 0, 0


def _has_cache(state) -> bool:
  try:
    return optax.tree.get(state, "value") is not None and optax.tree.get(state, "grad") is not None
  except KeyError:  # several 'value' fields: no usable cache
    return False


class _Run(NamedTuple):
  """The pieces of a run, so that ``solve`` and ``sweep`` share one loop body.

  The carry (a dict) holds the iterate, the optimizer state and the counters;
  the :class:`Trace` is kept beside it so that ``sweep`` can write one column
  per lockstep iteration (a cheap dynamic slice, not a batched scatter) and
  keep it out of the per-point select that freezes finished points.
  """

  start: Callable[[Any, Any], dict]
  active: Callable[[dict], jax.Array]
  step: Callable[[dict], dict]
  new_trace: Callable[[dict], Trace]
  record: Callable[[Trace, jax.Array, dict], Trace]
  finish: Callable[[dict, Trace], SolveResult]


def _run(optimizer, fun, max_steps, fun_args, tol, max_grad_evals) -> _Run:
  """Builds the pieces of one run of ``optimizer`` on ``fun``."""

  def value_fn(p):
    return fun(p, *fun_args)

  value_and_grad = lambda p: _common.value_and_grad(value_fn, p)

  def start(init_params, init_state):
    state = optimizer.init(init_params) if init_state is None else init_state
    value, grad = value_and_grad(init_params)
    if _has_cache(state):
      state = optax.tree.set(state, value=value, grad=grad)
    one = jnp.ones([], jnp.int32)
    return dict(
      params=init_params,
      state=state,
      value=value,
      grad=grad,
      gnorm=_inf_norm(grad),
      k=jnp.zeros([], jnp.int32),
      nv=one,
      ng=one,
      accepted=jnp.asarray(True),
    )

  def new_trace(c):
    size = [max_steps + 1]
    return Trace(
      value=jnp.full(size, c["value"]),
      grad_norm=jnp.full(size, c["gnorm"]),
      accepted=jnp.ones(size, bool),
      grad_evals=jnp.ones(size, jnp.int32),
    )

  def record(trace, index, c):
    return Trace(
      value=trace.value.at[index].set(c["value"]),
      grad_norm=trace.grad_norm.at[index].set(c["gnorm"]),
      accepted=trace.accepted.at[index].set(c["accepted"]),
      grad_evals=trace.grad_evals.at[index].set(c["ng"]),
    )

  def finite(c):
    return jnp.isfinite(c["value"]) & jnp.isfinite(c["gnorm"])

  def converged(c):
    return (c["gnorm"] <= jnp.asarray(tol, c["gnorm"].dtype)) & finite(c)

  def active(c):
    return (c["k"] < max_steps) & ~converged(c) & finite(c) & (c["ng"] < max_grad_evals)

  def step(c):
    updates, new_state = optimizer.update(
      c["grad"], c["state"], c["params"], value=c["value"], grad=c["grad"], value_fn=value_fn
    )
    params = optax.apply_updates(c["params"], updates)
    dv, dg = _calls_in_update(c["state"], new_state)
    nv = c["nv"] + jnp.asarray(dv, jnp.int32)
    ng = c["ng"] + jnp.asarray(dg, jnp.int32)
    if _has_cache(new_state):
      value = optax.tree.get(new_state, "value")
      grad = optax.tree.get(new_state, "grad")
    else:
      value, grad = value_and_grad(params)
      nv, ng = nv + 1, ng + 1
    accepted = optax.tree.get(new_state, "accepted")
    accepted = jnp.asarray(True) if accepted is None else jnp.asarray(accepted)
    return dict(
      params=params,
      state=new_state,
      value=jnp.asarray(value, c["value"].dtype),
      grad=grad,
      gnorm=_inf_norm(grad),
      k=c["k"] + 1,
      nv=nv,
      ng=ng,
      accepted=accepted,
    )

  def finish(c, tr):
    # Freeze the tail of the trace at the final values.
    tail = jnp.arange(max_steps + 1) > c["k"]
    trace = Trace(
      value=jnp.where(tail, c["value"], tr.value),
      grad_norm=jnp.where(tail, c["gnorm"], tr.grad_norm),
      accepted=jnp.where(tail, False, tr.accepted),
      grad_evals=jnp.where(tail, c["ng"], tr.grad_evals),
    )
    status = jnp.select(
      [converged(c), ~finite(c), active(c)], [CONVERGED, NON_FINITE, STOPPED], MAX_STEPS
    )
    return SolveResult(
      params=c["params"],
      state=c["state"],
      value=c["value"],
      grad_norm=c["gnorm"],
      num_steps=c["k"],
      num_value_evals=c["nv"],
      num_grad_evals=c["ng"],
      converged=converged(c),
      status=status.astype(jnp.int32),
      trace=trace,
    )

  return _Run(start, active, step, new_trace, record, finish)


def _solve(optimizer, fun, max_steps, init_params, fun_args, tol, init_state, max_grad_evals):
  run = _run(optimizer, fun, max_steps, fun_args, tol, max_grad_evals)

  def body(carry):
    c, trace = carry
    c = run.step(c)
    return c, run.record(trace, c["k"], c)

  c = run.start(init_params, init_state)
  c, trace = jax.lax.while_loop(lambda carry: run.active(carry[0]), body, (c, run.new_trace(c)))
  return run.finish(c, trace)


_solve_jit = jax.jit(_solve, static_argnums=(0, 1, 2))


def _under_trace(*trees) -> bool:
  """Whether ``solve`` runs inside an outer jit/vmap/grad trace."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees)):
    return True
  try:  # private, but the only way to see tracers closed over by the optimizer
    from jax._src import core  # pylint: disable=g-import-not-at-top

    return not core.trace_state_clean()
  except (ImportError, AttributeError):
    return False


def solve(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., jax.Array],
  init_params: Any,
  *,
  max_steps: int,
  tol: float = 1e-4,
  init_state: Optional[Any] = None,
  fun_args: Sequence[Any] = (),
  max_grad_evals: Optional[int] = None,
) -> SolveResult:
  r"""Minimizes ``fun(params, *fun_args)`` with ``optimizer``, compiled end to end.

  The run is one ``lax.while_loop`` over ``jax.value_and_grad(fun)``: it stops
  (freezes) once :math:`\|\nabla f(x)\|_\infty \le` ``tol``, after
  ``max_steps`` updates, or when f or its gradient is not finite. If the state
  caches ``value`` and ``grad`` (every hdm_optax transformation, optax's
  linesearches) they are reused, so an HDM iteration costs one oracle call;
  otherwise the gradient is computed once per step. ``fun_args`` are
  arguments of the compiled program (data is not folded into it as
  constants). Works for any optax transformation; ``update`` receives
  ``value``, ``grad`` and ``value_fn``.

  ``solve`` is traceable: inside ``jax.jit``/``jax.vmap`` it traces inline,
  so ``jax.jit(jax.vmap(lambda lr: solve(hdm_best(precond_lr=lr), ...)))``
  compiles one program for a whole grid. Called outside a trace it compiles
  once per (optimizer object, fun, max_steps) and input shapes.

  Args:
    optimizer: an optax transformation.
    fun: the objective, ``fun(params, *fun_args) -> scalar``.
    init_params: x^1, any pytree of float arrays.
    max_steps: the number of updates allowed (static).
    tol: stop when ||grad f||_inf <= tol.
    init_state: resume from this optimizer state instead of ``optimizer.init``.
    fun_args: extra arguments of ``fun`` (e.g. the data).
    max_grad_evals: also stop before an update once this many gradient
      evaluations have been made (an update that evaluates several times, such
      as a linesearch, may end above it). ``None``: no limit.

  Returns:
    A :class:`SolveResult`.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x, a: jnp.sum(a * x ** 2)
    >>> a = jnp.array([1.0, 10.0, 100.0])
    >>> res = hdm_optax.solve(hdm_optax.hdm_best(lipschitz=200.0), fun,
    ...                       jnp.ones(3), max_steps=500, fun_args=(a,))
    >>> bool(res.converged), int(res.num_grad_evals) <= 501
    (True, True)
  """
  if not isinstance(max_steps, (int, np.integer)) or max_steps < 0:
    raise ValueError(f"max_steps must be a non-negative int, got {max_steps!r}")
  fun_args = tuple(fun_args)
  _common.params_dtype(init_params)
  if max_grad_evals is None:
    max_grad_evals = np.iinfo(np.int32).max
  if _under_trace(init_params, fun_args, tol, init_state):
    return _solve(
      optimizer, fun, int(max_steps), init_params, fun_args, tol, init_state, max_grad_evals
    )
  return _solve_jit(
    optimizer, fun, int(max_steps), init_params, fun_args, tol, init_state, max_grad_evals
  )


class SweepResult(NamedTuple):
  """Result of :func:`sweep`.

  Attributes:
    points: the grid, a list of dicts (keyword -> value), in row-major order.
    results: a :class:`SolveResult` whose leaves have a leading axis of
      length ``len(points)``.
    best: index of the best point: fewest steps among the converged points,
      then lowest final value (among all points when none converged).
  """

  points: list
  results: SolveResult
  best: int


def _stages(size: int, compact: bool) -> tuple[int, ...]:
  """Batch sizes of the sweep's stages: (B,), or (B, ceil(B/4), ..., 1) to compact."""
  sizes = [size]
  while compact and sizes[-1] > 1:
    sizes.append(-(-sizes[-1] // 4))
  return tuple(sizes)


def _sweep(
  make_optimizer,
  fun,
  max_steps,
  stop_at_first,
  stages,
  columns,
  init_params,
  fun_args,
  tol,
  max_grad_evals,
):
  def run(point):
    return _run(make_optimizer(**point), fun, max_steps, fun_args, tol, max_grad_evals)

  def batched(cols, method, *args):
    return jax.vmap(lambda point, *a: getattr(run(point), method)(*a))(cols, *args)

  def any_converged(c):
    return jnp.any((c["gnorm"] <= tol) & jnp.isfinite(c["value"]))

  def run_stage(cols, c, trace, t, later, stopped):
    """Runs the batch while more than ``later`` points are active."""

    def go(carry):
      c, _, _ = carry
      busy = jnp.sum(batched(cols, "active", c)) > later
      if stop_at_first:
        busy &= ~any_converged(c) & ~stopped
      return busy

    def body(carry):
      c, trace, t = carry
      # Points that are done stay frozen (as in a vmapped while_loop); the
      # active ones have made t steps, so their entry t + 1 is step k + 1.
      keep = batched(cols, "active", c)
      c = jax.vmap(optax.tree.where)(keep, batched(cols, "step", c), c)
      t = t + 1
      record = lambda point, tr, cc: run(point).record(tr, t, cc)
      return c, jax.vmap(record)(cols, trace, c), t

    return jax.lax.while_loop(go, body, (c, trace, t))

  c = jax.vmap(lambda point: run(point).start(init_params, None))(columns)
  trace = batched(columns, "new_trace", c)
  t = jnp.zeros([], jnp.int32)
  for i, (size, later) in enumerate(zip(stages, stages[1:] + (0,))):
    if i == 0:
      c, trace, t = run_stage(columns, c, trace, t, later, jnp.asarray(False))
      continue
    # Continue with the (at most ``size``) active points in a smaller batch.
    stopped = any_converged(c) if stop_at_first else jnp.asarray(False)
    ids = jnp.argsort(~batched(columns, "active", c), stable=True)[:size]
    take = lambda tree: jax.tree.map(lambda x: x[ids], tree)
    c_s, trace_s, t = run_stage(take(columns), take(c), take(trace), t, later, stopped)
    put = lambda full, part: jax.tree.map(lambda f, x: f.at[ids].set(x), full, part)
    c, trace = put(c, c_s), put(trace, trace_s)
  return batched(columns, "finish", c, trace)


_sweep_jit = jax.jit(_sweep, static_argnums=(0, 1, 2, 3, 4))


def sweep(
  make_optimizer: Callable[..., optax.GradientTransformation],
  grid: Union[Mapping[str, Sequence[Any]], Sequence[Mapping[str, Any]]],
  fun: Callable[..., jax.Array],
  init_params: Any,
  *,
  max_steps: int,
  tol: float = 1e-4,
  fun_args: Sequence[Any] = (),
  max_grad_evals: Optional[int] = None,
  stop_at_first_converged: bool = False,
  compact: bool = False,
) -> SweepResult:
  """Solves once per grid point, all points in one vmapped, compiled call.

  The points run in lockstep until every one has converged or run out of
  budget, or, with ``stop_at_first_converged``, until the first point
  converges: the points that converge then have the fewest steps, so ``best``
  is the same, and the others stop early with status ``STOPPED``. With
  ``compact``, finished points stop costing work: once at most a quarter of
  the batch is still active, those points continue as a batch of a quarter
  the size (B, B/4, B/16, ..., 1; each stage is one more compiled loop, so
  compile time grows). Worth it when the objective's cost grows with the
  batch (large data); on small problems per-step overhead dominates. The
  results are those of the lockstep sweep up to rounding (another compiled
  program). The compiled program is cached on (``make_optimizer``, ``fun``,
  ``max_steps``) and the shapes, so a module-level ``make_optimizer`` reused
  across problems of the same shapes compiles once; pass problem constants
  (such as L) as grid columns rather than closing over them.

  Args:
    make_optimizer: ``make_optimizer(**point)`` builds the optimizer; grid
      values arrive as traced scalars of the params dtype.
    grid: keyword -> list of values (the grid is their Cartesian product, in
      row-major order), or an explicit list of points (dicts with the same keys).
    fun: the objective, as in :func:`solve`.
    init_params: the common starting point.
    max_steps: as in :func:`solve`.
    tol: as in :func:`solve`.
    fun_args: as in :func:`solve`.
    max_grad_evals: as in :func:`solve`.
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
  if not isinstance(max_steps, (int, np.integer)) or max_steps < 0:
    raise ValueError(f"max_steps must be a non-negative int, got {max_steps!r}")
  dtype = _common.params_dtype(init_params)
  columns = {n: jnp.asarray([p[n] for p in points], dtype) for n in names}
  if max_grad_evals is None:
    max_grad_evals = np.iinfo(np.int32).max
  stages = _stages(len(points), bool(compact))
  results = _sweep_jit(
    make_optimizer,
    fun,
    int(max_steps),
    bool(stop_at_first_converged),
    stages,
    columns,
    init_params,
    tuple(fun_args),
    tol,
    max_grad_evals,
  )
  return SweepResult(points=points, results=results, best=best_index(results))


def best_index(results: SolveResult) -> int:
  """Fewest steps among converged points, then lowest final value."""
  steps = np.asarray(results.num_steps)
  conv = np.asarray(results.converged)
  value = np.asarray(results.value)
  value = np.where(np.isfinite(value), value, np.inf)
  if conv.any():
    order = np.lexsort((value, np.where(conv, steps.astype(np.float64), np.inf)))
  else:
    order = np.lexsort((value,))
  return int(order[0])
