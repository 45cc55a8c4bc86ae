"""``solve_batch`` and ``sweep``: many problems, or a grid of settings, as one program.

Both run the engine's batched loop (:class:`hdm_optax.driver.runs.Staged`): every
member runs the loop of :func:`hdm_optax.solve`, and once three quarters of a stage have
stopped, the members still running go on as a batch a quarter the size. With ``devices=``
the members are spread over the devices (``jax.shard_map``), each device retiring its own
finished members.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _numerics
from hdm_optax.driver import adjoint as adjoint_lib
from hdm_optax.driver import engine
from hdm_optax.driver import runs
from hdm_optax.driver import hooks
from hdm_optax.driver import members as members_lib
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver import resuming
from hdm_optax.driver.limits import Limits
from hdm_optax.driver.limits import takes_limits
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import SweepResult
from hdm_optax.driver.results import best_index

__all__ = ("solve_batch", "sweep")

_AXIS = "members"


class _Plan(NamedTuple):
  """The static shape of a batch program.

  Attributes:
    primitive: the batch's loop, as the adjoint picked it (:mod:`hdm_optax.driver.runs`).
    mapped: per leaf of ``(init_params, theta)``: on the batch axis (``theta``: the dynamic
      arguments of the objective, its closed-over arrays last).
    theta_def: the structure of ``theta``.
    in_order: the members are the problems in order (no gather).
    devices: the devices the members are spread over, or ``None``.
  """

  primitive: Any
  mapped: tuple
  theta_def: Any
  in_order: bool
  devices: Optional[tuple]


def _batch_entry(
  maker, closed, program, plan, adjoint, handle, arrays, columns, pid, data, state, limits
):
  """One batch program; members are (columns, problem ``pid``) and ``data`` the problems."""
  count, params = pid.shape[0], len(jax.tree.leaves(data[0]))
  leaves, treedef = jax.tree.flatten(data)
  for i, (a, m) in enumerate(zip(leaves, plan.mapped)):
    if m:  # a problem's data, gathered for its members
      leaves[i] = a if plan.in_order else a[pid]
    elif i < params:  # a shared start: one row per member
      leaves[i] = jnp.broadcast_to(a, (count,) + jnp.shape(a))
  x0, theta = jax.tree.unflatten(treedef, leaves)
  theta_mapped = plan.mapped[params:]

  def run(theta, rest):  # every traced value enters as an argument (none is closed over)
    x0, state, arrays, columns, limits, handle = rest
    flat = jax.tree.leaves(theta)
    member_rows = [x for x, m in zip(flat, theta_mapped) if m]

    def make(member):
      settings, mine = member
      given = iter(mine)
      mixed = [next(given) if m else x for x, m in zip(flat, theta_mapped)]
      fun = lambda p: closed(p, *jax.tree.unflatten(plan.theta_def, mixed))
      return engine.make_loop(maker.build(arrays, settings), fun, limits, program.has_aux), fun

    return _run_members(make, program, plan, (columns, member_rows), x0, state, handle)

  def bounds(rest):  # each member's box, that of its fresh state (a resumed one keeps it)
    x0, _, arrays, columns = rest[:4]
    box = lambda settings, x: protocol.box_of(maker.build(arrays, settings).init(x))
    return jax.vmap(box)(columns, x0)

  rest = (x0, state, arrays, columns, limits, handle)
  axes = jax.tree.unflatten(plan.theta_def, [0 if m else None for m in theta_mapped])
  objective = closed.objective(program.has_aux)
  return adjoint.apply(run, objective, theta, rest, axes, bounds=bounds)


_batch_entry.num_statics = 5


def _run_members(make, program, plan, members, params, opt_state, handle):
  """The batch's run, on one device or spread over ``plan.devices``."""
  run = functools.partial(runs.run, make, program, primitive=plan.primitive, handle=handle)
  if plan.devices is None:
    return run(members, params, opt_state)
  spec = jax.sharding.PartitionSpec(_AXIS)

  def local(members, params, opt_state):
    offset = jax.lax.axis_index(_AXIS) * len(jax.tree.leaves(params)[0])
    return run(members, params, opt_state, first_member=offset)

  return jax.shard_map(
    local,
    mesh=jax.sharding.Mesh(np.asarray(plan.devices), (_AXIS,)),
    in_specs=(spec, spec, None if opt_state is None else spec),
    out_specs=spec,
    check_vma=False,
  )(members, params, opt_state)


def _check(batched_call, batch):
  """A combination a batch does not offer: a ValueError that names it (the adjoint refuses
  what its loop cannot run)."""
  if batched_call:
    raise ValueError(
      "sweep and solve_batch under jax.vmap are not offered (they batch "
      "already): put the vmapped axis into in_axes, or call hdm_optax.solve under jax.vmap."
    )
  if batch.devices is not None and batch.stop_at_first_converged:
    raise ValueError(
      "stop_at_first_converged with devices= is not "
      "offered: each device runs its members on its own. Drop one of them."
    )
  if batch.devices is not None and (batch.callback is not None or batch.progress):
    raise ValueError(
      "callback= and progress= "
      "with devices= are not offered: each device would call the host on its own, step by "
      "step. Drop devices= to watch the run, or the watch."
    )


def _devices(devices) -> Optional[tuple]:
  if devices is None:
    return None
  if isinstance(devices, jax.sharding.Mesh):
    devices = devices.devices.ravel().tolist()
  devices = tuple(devices)
  if not devices or not all(isinstance(d, jax.Device) for d in devices):
    raise ValueError(
      f"devices must be None, a jax.sharding.Mesh or a sequence of jax.Device, got {devices!r}"
      "; e.g. devices=jax.devices()."
    )
  if len(set(devices)) != len(devices):
    twice = sorted({str(d) for d in devices if devices.count(d) > 1})
    raise ValueError(
      f"devices names {', '.join(twice)} more than once ({len(devices)} entries, "
      f"{len(set(devices))} devices): each device runs its own share of the members once; "
      "pass each device once, e.g. devices=jax.devices()."
    )
  return devices


def _combine(parts: list) -> SolveResult:
  """The results of several programs in member order (states of other shapes as a list)."""
  if len(parts) == 1:
    return parts[0][1]
  order = np.argsort(np.concatenate([i for i, _ in parts]), kind="stable")
  results = [r for _, r in parts]

  def stacked(trees):
    shapes = [(jax.tree.structure(t), [np.shape(x)[1:] for x in jax.tree.leaves(t)]) for t in trees]
    if any(s != shapes[0] for s in shapes):
      return None
    return jax.tree.map(lambda *xs: jnp.concatenate(xs)[order], *trees)

  fields = {f: stacked([getattr(r, f) for r in results]) for f in SolveResult._fields}
  if fields["state"] is None:
    each = [
      jax.tree.map(lambda x, k=k: x[k], r.state) for r in results for k in range(len(r.value))
    ]
    fields["state"] = [each[i] for i in order]
  return SolveResult(**fields)


class _Batch(NamedTuple):
  """A batch call: its members and options, checked (:func:`_batch`)."""

  problems: members_lib.Problems
  limits: Limits
  has_aux: bool
  compact: bool
  stop_at_first_converged: bool
  callback: Any
  progress: bool
  init_state: Any
  adjoint: Any
  trace: Optional[int]
  devices: Optional[tuple]


def _batch(arguments: dict, **given) -> _Batch:
  """A front door's arguments as a :class:`_Batch`: the options checked, the refusals."""
  options = {name: arguments.get(name) for name in _Batch._fields} | given
  adjoint = adjoint_lib.check_adjoint(options["adjoint"])
  compact = _compact(options["compact"], options["problems"], adjoint)
  devices = _devices(options["devices"])
  batch = _Batch(**{**options, "adjoint": adjoint, "devices": devices, "compact": compact})
  traced = programs.tracers((batch.problems.tree, batch.limits))
  _check(any(map(programs.is_batched, traced)), batch)
  adjoint.batch_primitive(1, batch.compact, batch.stop_at_first_converged, 1)  # its refusals
  resumed = resuming.result_of(batch.init_state)
  if resumed is not None:  # a resumed batch: from its params
    resuming.check_params(batch.problems.tree[0], resumed.params)
  return batch


def _compact(compact: Optional[bool], problems, adjoint) -> bool:
  """``compact``, or where it is ``None`` the rule: retire stopped members where the batch's
  inputs hold more than :data:`~hdm_optax.driver.programs.SMALL_PROGRAM` entries in all (the
  run outweighs the compile of the extra stages) and the adjoint can; else lockstep, whose
  program compiles as fast as ``jax.jit(jax.vmap(solve))``'s."""
  if compact is not None:
    return bool(compact)
  entries = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(problems.tree))
  return entries > programs.SMALL_PROGRAM and adjoint.retires()


def _layout(batch: _Batch, fun):
  """``(closed, theta, mapped, params_one)``: ``fun`` hoisted at the first problem, the
  dynamic arguments of the objective (its closed-over arrays last), per leaf of
  ``(init_params, theta)`` whether it is on the batch axis, and the first problem's params."""
  problems = batch.problems
  leaves, treedef = jax.tree.flatten(problems.tree)
  params_one, args_one = jax.tree.unflatten(
    treedef, [a[0] if m else a for a, m in zip(leaves, problems.mapped)]
  )
  closed, theta = programs.hoist(fun, params_one, args_one)
  params_mapped = problems.mapped[: len(jax.tree.leaves(params_one))]
  args = jax.tree.leaves(problems.tree[1])
  args_mapped = problems.mapped[len(params_mapped) :]
  if any(m and not programs.is_dynamic(x) for x, m in zip(args, args_mapped)):
    raise ValueError("in_axes maps a leaf of fun_args that is not an array; map arrays only.")
  theta_mapped = [m for x, m in zip(args, args_mapped) if programs.is_dynamic(x)]
  theta = (*[x for x in args if programs.is_dynamic(x)], theta[-1])
  return closed, theta, (*params_mapped, *theta_mapped) + (False,) * len(theta[-1]), params_one


def _run(batch: _Batch, fun, grid, make_optimizer=None, optimizer=None):
  """The members, every point of ``grid`` on every problem, run one program per setting held
  static (``optimizer``: the one given to ``solve_batch``)."""
  names, points = members_lib.grid_points(grid)
  closed, theta, mapped, params_one = _layout(batch, fun)
  batch = batch._replace(init_state=resuming.resumed_on(batch.init_state, closed, theta))
  count = batch.problems.count
  dtype = _numerics.params_dtype(params_one)
  static = (
    () if optimizer else members_lib.static_names(make_optimizer, names, points, params_one, dtype)
  )
  if not optimizer:  # the factory's checks, with each point's own values (traced, they pass)
    _blame_point(make_optimizer, points, static, dtype)
  if count > 1:
    if "problem" in names:
      raise ValueError('with in_axes every point gets the key "problem": rename that setting')
    points = [dict(p, problem=b) for p in points for b in range(count)]
  pid = np.tile(np.arange(count, dtype=np.int32), len(points) // count)
  groups: dict = {}  # one program per value of the settings held static
  for i, point in enumerate(points):
    groups.setdefault(tuple((n, members_lib.plain(point[n])) for n in static), []).append(i)
  key = programs.OptimizerKey(optimizer, params_one) if optimizer else None
  arrays = [] if key is None else programs.arrays_of(optimizer)
  parts = []
  for settings, indices in groups.items():
    indices = np.asarray(indices)
    columns = {
      n: members_lib.column(n, [points[i][n] for i in indices], dtype)
      for n in names
      if n not in static
    }
    maker = members_lib.Maker(make_optimizer, settings, key, columns, params_one)
    try:
      part = _run_part(batch, maker, arrays, columns, indices, pid[indices], closed, theta, mapped)
    except BaseException as error:  # a callback's error or Ctrl-C: the members run so far
      if isinstance(getattr(error, "result", None), SolveResult):
        done = parts + [(indices, error.result)]
        error.result = _combine(done)
        error.points = [points[i] for i in np.sort(np.concatenate([i for i, _ in done]))]
      raise
    parts.append((indices, part))
  return points, _combine(parts)


def _run_part(batch: _Batch, maker, arrays, columns, indices, pid, closed, theta, mapped):
  """One program: the members ``indices`` (problems ``pid``), padded to the devices."""
  count, devices, problems = len(pid), batch.devices, batch.problems
  padded = count if devices is None else -(-count // len(devices)) * len(devices)

  def pad(a):
    a = jnp.asarray(a)
    return jnp.concatenate([a, jnp.repeat(a[-1:], padded - count, axis=0)]) if padded > count else a

  state = resuming.batch_start(batch.init_state)
  state = None if state is None else jax.tree.map(lambda a: pad(jnp.asarray(a)[indices]), state)
  size = padded // (1 if devices is None else len(devices))
  limits = batch.limits
  plan = _Plan(
    primitive=batch.adjoint.batch_primitive(
      size, batch.compact, batch.stop_at_first_converged, limits.max_steps
    ),
    mapped=mapped,
    theta_def=jax.tree.structure(theta),
    in_order=devices is None
    and problems.count > 1
    and np.array_equal(pid, np.arange(problems.count)),
    devices=devices,
  )
  kept, shown = runs.trace_size(batch.trace, limits.max_steps, batch=True)
  hook = hooks.check_hook(batch.callback, batch.progress, count)  # its own table
  dynamic = (arrays, jax.tree.map(pad, columns), pad(pid), (problems.tree[0], theta), state, limits)
  watch = hook is None and devices is None and isinstance(plan.primitive, runs.Staged)
  program = runs.Program(kept, hook, batch.has_aux, watch and hooks.watchable(dynamic))
  statics = (maker, closed, program, plan, batch.adjoint)
  traced = bool(programs.tracers((problems.tree, limits)))

  def run(handle):
    return programs.call(_batch_entry, statics, dynamic, handle=handle, traced=traced)

  def finished(result):
    result = result if padded == count else jax.tree.map(lambda a: a[:count], result)
    return runs.cut_trace(result, shown)

  named = programs.program_key(_batch_entry, statics, dynamic) if program.watch else None
  try:
    result = hooks.watched(run, batch.callback, batch.progress, watch=program.watch, key=named)
  except BaseException as error:  # the partial result, as a finished one is returned
    if isinstance(getattr(error, "result", None), SolveResult):
      error.result = finished(error.result)
    raise
  return finished(result)


@takes_limits
@resuming.resumable
def sweep(
  make_optimizer: Callable[..., optax.GradientTransformation],
  grid: Union[Mapping[str, Sequence[Any]], Sequence[Mapping[str, Any]]],
  fun: Callable[..., Any],
  init_params: Any,
  *,
  limits: Limits,
  fun_args: Sequence[Any] = (),
  in_axes: Any = (None, None),
  has_aux: bool = False,
  stop_at_first_converged: bool = False,
  compact: bool = False,
  callback: Optional[Callable[[hooks.Snapshot], Any]] = None,
  progress: bool = False,
  init_state: Any = None,
  adjoint: Any = None,
  trace: Optional[int] = None,
  devices: Any = None,
) -> SweepResult:
  """Solves once per grid point (and per problem of a batch), all in one compiled program.

  Each point runs the loop of :func:`hdm_optax.solve` with ``make_optimizer(**point)``. The
  points run in lockstep until every one has stopped, or, with ``stop_at_first_converged``,
  until the first one converges (the others stop with status ``STOPPED``). With ``compact``
  the members still running move to a batch a quarter the size once three quarters of a
  stage have stopped (:func:`solve_batch`). A setting that cannot be traced (a string, or an
  integer that sizes the state, such as ``trial_lbfgs``'s ``memory_size``) gets a program of
  its own per value; the results come back in the grid's order. The cache policy is
  :func:`hdm_optax.solve`'s (``make_optimizer`` is compared by what it computes).

  Args:
    make_optimizer: ``make_optimizer(**point)`` builds the optimizer; numeric settings
      arrive as traced scalars (Python floats in the params' dtype); each point is first
      built once with its own values, so that the factory's checks of its arguments see
      them (a point it refuses raises its error, naming the point). With ``grid={}``, an
      optimizer itself: the points are then the problems of ``in_axes`` alone.
    grid: keyword -> list of values (their Cartesian product, row-major), or a list of
      points (dicts with the same keys).
    fun: the objective, as in :func:`hdm_optax.solve`.
    init_params: the starting point (of every problem, unless ``in_axes`` maps it).
    limits: as in :func:`hdm_optax.solve`, for every point.
    has_aux: as in :func:`hdm_optax.solve`.
    fun_args: as in :func:`hdm_optax.solve`.
    in_axes: ``(params_axes, fun_args_axes)``, as ``jax.vmap``'s: mapped axes (of one size B)
      make B problems, and every point runs on every problem (``len(points) == len(grid) *
      B``, grid-major, each point with its ``"problem"`` index).
    stop_at_first_converged: stop every point once one has converged.
    compact: retire stopped members (stages of a quarter the size).
    callback: as in :func:`hdm_optax.solve`, called with the whole batch after every step
      (each program of a setting held static with its own points).
    progress: one line for the batch on stderr (one per program).
    init_state: the points' optimizer states to resume (a leading axis of ``len(points)``).
    adjoint: as in :func:`hdm_optax.solve` (:class:`UnrolledAdjoint` needs ``compact=False``).
    trace: keep the last ``trace`` entries of each run (default: none).
    devices: spread the points over these devices (a sequence of ``jax.Device`` or a
      ``jax.sharding.Mesh``); each device retires its own finished points.

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
  problems = members_lib.problems(init_params, tuple(fun_args), in_axes)
  if stop_at_first_converged and problems.count > 1:
    raise ValueError(
      "stop_at_first_converged stops every point once one converged, but with in_axes the "
      f"points solve {problems.count} different problems; sweep one problem at a time, or "
      "drop stop_at_first_converged."
    )
  instance = protocol.is_optimizer(make_optimizer)
  _check_factory(make_optimizer, grid, instance)
  if instance:
    make_optimizer = protocol.check_optimizer("sweep", make_optimizer)
  factory = {"optimizer" if instance else "make_optimizer": make_optimizer}
  try:
    points, results = _run(_batch(locals()), fun, grid, **factory)
  except BaseException as error:  # pylint: disable=broad-except
    if isinstance(getattr(error, "result", None), SolveResult):  # stopped: the points run
      part = error.result
      error.result = SweepResult(points=error.points, results=part, best=best_index(part))
    raise
  return SweepResult(points=points, results=results, best=best_index(results))


def _check_factory(make_optimizer, grid, instance: bool) -> None:
  """sweep's ``make_optimizer``: a factory, or an optimizer with an empty grid."""
  if instance and members_lib.grid_points(grid)[1] != [{}]:
    raise ValueError(
      f"sweep: make_optimizer is an optimizer ({type(make_optimizer).__name__}), which has no "
      f"settings for the grid {grid!r} to vary; pass a factory, e.g. "
      "make_optimizer=lambda memory_size: hdm_optax.trial_lbfgs(memory_size), or grid={} to "
      "sweep problem data only (in_axes)."
    )
  if not instance and not callable(make_optimizer):
    raise TypeError(
      f"sweep: make_optimizer must be a factory make_optimizer(**point) -> optimizer (or an "
      f"optimizer, with grid={{}}), got {make_optimizer!r}."
    )


def _blame_point(make_optimizer, points, static, dtype) -> None:
  """Raises the error of the first grid point that builds no optimizer, naming the point.

  ``make_optimizer(**point)`` is called once per point before the run, with the point's own
  values: in the program they arrive traced, where the factory's checks of its arguments
  cannot see them (a point of ``precond_lr=-1.0`` would run its whole budget stuck at x0).
  Where the plain values fail, the point is built as the program builds it, the settings
  not held static as concrete scalars of their column's dtype
  (:func:`~hdm_optax.driver.members.column`; a factory may read ``.dtype``); a point that
  fails both ways is refused. The optimizers built here are dropped; the run builds its own.
  """
  names, columns = list(points[0]), None
  for i, point in enumerate(points):
    try:
      make_optimizer(**point)
      continue
    except Exception as error:  # pylint: disable=broad-except
      plain = error
    if columns is None:
      columns = {n: _scalars(n, [p[n] for p in points], dtype) for n in names if n not in static}
    try:
      make_optimizer(**{n: columns[n][i] if n in columns else point[n] for n in names})
      continue
    except Exception as error:  # pylint: disable=broad-except
      bad = plain if type(plain) in (ValueError, TypeError) else error
    kind = type(bad) if type(bad) in (ValueError, TypeError) else ValueError
    raise kind(f"sweep: grid point {point!r}: make_optimizer(**point) raised: {bad}") from bad


def _scalars(name, values, dtype) -> list:
  """A grid column's values one by one in the column's dtype
  (:func:`~hdm_optax.driver.members.column`): NumPy scalars, and a value traced by a caller's
  ``jax.jit`` as a traced scalar. Inside that jit the column itself is traced, whatever its
  values: its dtype alone is read."""
  kind = members_lib.column(name, values, dtype).dtype
  return [
    v.astype(kind) if isinstance(v, jax.core.Tracer) else np.asarray(v, kind)[()] for v in values
  ]


@takes_limits
@resuming.resumable
def solve_batch(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., Any],
  init_params: Any,
  *,
  limits: Limits,
  fun_args: Sequence[Any] = (),
  in_axes: Any = (0, 0),
  compact: Optional[bool] = None,
  has_aux: bool = False,
  callback: Optional[Callable[[hooks.Snapshot], Any]] = None,
  progress: bool = False,
  init_state: Any = None,
  adjoint: Any = None,
  trace: Optional[int] = None,
  devices: Any = None,
) -> SolveResult:
  """Solves a batch of problems in one compiled call, retiring the members that have stopped.

  ``jax.jit(jax.vmap(solve))`` runs every member in lockstep until the slowest one stops.
  Here (``compact``, the default for batches of more than 65,536 entries), once at most a
  quarter of the batch is still running, the running members move to a batch a quarter the
  size (B, B/4, ..., down to 1, or to 16 for more than 64 members; each stage is one more
  loop in the program, so it compiles longer than the lockstep one). Each
  member runs the loop of :func:`hdm_optax.solve`. With ``devices`` the members are spread
  over the devices (``jax.shard_map``), each retiring its own.

  Args:
    optimizer: the optax transformation, as in :func:`hdm_optax.solve`.
    fun: the objective, as in :func:`hdm_optax.solve`.
    init_params: the starting points (or one, shared: ``in_axes=(None, ...)``).
    fun_args: as in :func:`hdm_optax.solve`; the problems' data.
    in_axes: ``(params_axes, fun_args_axes)``, as ``jax.vmap``'s; the mapped axes (of one
      size B) are the batch. Default: both on axis 0.
    compact: retire stopped members (``False``: the lockstep loop of ``jax.vmap(solve)``);
      ``None``: where the problems' inputs (params and ``fun_args`` of every member) hold
      more than 65,536 entries in all, where the run outweighs the compile of the extra
      stages; smaller batches run in lockstep and compile as fast as
      ``jax.jit(jax.vmap(solve))``.
    limits: as in :func:`hdm_optax.solve`, for every member.
    has_aux: as in :func:`hdm_optax.solve`.
    callback: as in :func:`hdm_optax.solve`, called with the whole batch after every step.
    progress: one line for the batch on stderr.
    init_state: the members' optimizer states to resume (leading axis B).
    adjoint: as in :func:`hdm_optax.solve` (:class:`UnrolledAdjoint` needs ``compact=False``).
    trace: keep the last ``trace`` entries of each run (default: none).
    devices: spread the members over these devices (a sequence of ``jax.Device`` or a
      ``jax.sharding.Mesh``).

  Returns:
    A :class:`SolveResult` whose leaves have a leading axis of B, in the batch's order.

  Raises:
    ValueError: ``in_axes`` maps nothing or axes of different sizes; a combination not
      offered (named in the message).

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> scales = jnp.array([[1.0, 10.0], [1.0, 1e4], [1.0, 2.0]])
    >>> fun = lambda x, d: jnp.sum(d * (x - 1.0) ** 2)
    >>> out = hdm_optax.solve_batch(
    ...     hdm_optax.trial_lbfgs(), fun, jnp.zeros(2), fun_args=(scales,), in_axes=(None, 0))
    >>> out.converged.tolist(), out.params.shape
    ([True, True, True], (3, 2))
  """
  optimizer = protocol.check_optimizer("solve_batch", optimizer)
  problems = members_lib.problems(init_params, tuple(fun_args), in_axes)
  if not any(problems.mapped):
    raise ValueError(
      f"in_axes={in_axes!r} maps no axis of init_params or fun_args, so there is no batch; "
      "name the batch axes (e.g. in_axes=(0, 0)), or call hdm_optax.solve for one problem."
    )
  batch = _batch(locals(), stop_at_first_converged=False)
  return _run(batch, fun, [{}], optimizer=optimizer)[1]
