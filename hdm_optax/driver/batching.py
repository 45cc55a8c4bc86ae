"""``solve_batch`` and ``sweep``: many problems, or a grid of settings, as one program.

Both run the engine's batched loop (:func:`hdm_optax.driver.engine.run_batch`): every
member runs the loop of :func:`hdm_optax.solve`, and once three quarters of a stage have
stopped, the members still running go on as a batch a quarter the size. With ``devices=``
the members are spread over a mesh of devices (``jax.shard_map``), each device retiring its
own finished members.
"""

from __future__ import annotations

import functools
import itertools
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common
from hdm_optax.driver import adjoint as adjoint_lib
from hdm_optax.driver import engine
from hdm_optax.driver import hooks
from hdm_optax.driver import programs
from hdm_optax.driver import solving
from hdm_optax.driver.limits import DEFAULT_MAX_STEPS
from hdm_optax.driver.limits import check_limits
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import SweepResult
from hdm_optax.driver.results import best_index

__all__ = ("solve_batch", "sweep")

_AXIS = "members"


class _Axis(NamedTuple):
  axis: Any


def _leaf_axes(axes, tree, what: str) -> list:
  """The axis (an int or None) of each leaf of ``tree``, from ``jax.vmap``-style ``axes``."""
  count = len(jax.tree.leaves(tree))
  if axes is None or isinstance(axes, int):
    return [axes] * count
  try:
    nested = jax.tree.map(
      lambda ax, sub: [_Axis(ax)] * len(jax.tree.leaves(sub)),
      axes,
      tree,
      is_leaf=lambda x: x is None,
    )
  except ValueError:
    raise ValueError(
      f"in_axes for {what} must be an int, None or a pytree prefix of {what} (as jax.vmap's "
      f"in_axes), got {axes!r} for {what} of structure {jax.tree.structure(tree)}"
    ) from None
  found = [a.axis for a in jax.tree.leaves(nested, is_leaf=lambda x: isinstance(x, _Axis))]
  if any(a is not None and not isinstance(a, int) for a in found):
    raise ValueError(f"in_axes for {what} must hold ints or None, got {axes!r}")
  return found


class _Batch(NamedTuple):
  """The problems: leaves with their batch axis moved to 0 (``mapped``), or shared."""

  tree: Any  # the pytree, each leaf an array (mapped on axis 0) or as given
  mapped: tuple  # per leaf: on the batch axis
  count: int  # the number of problems (1 when nothing is mapped)


def _batch(init_params, fun_args: tuple, in_axes) -> _Batch:
  if not (isinstance(in_axes, (tuple, list)) and len(in_axes) == 2):
    raise ValueError(
      "in_axes must be a pair (axes of init_params, axes of fun_args), each an int, None "
      f"or a pytree prefix as in jax.vmap, got {in_axes!r}; e.g. in_axes=(None, (None, 0))"
    )
  tree = (init_params, fun_args)
  axes = _leaf_axes(in_axes[0], init_params, "init_params")
  axes += _leaf_axes(in_axes[1], fun_args, "fun_args")
  leaves, treedef = jax.tree.flatten(tree)
  out, sizes = [], set()
  for leaf, axis in zip(leaves, axes):
    if axis is None:
      out.append(leaf)
      continue
    leaf = jnp.asarray(leaf)
    if not -leaf.ndim <= axis < leaf.ndim:
      raise ValueError(f"in_axes: axis {axis} of a leaf of shape {leaf.shape}")
    sizes.add(leaf.shape[axis])
    out.append(leaf if axis % leaf.ndim == 0 else jnp.moveaxis(leaf, axis, 0))
  if len(sizes) > 1:
    raise ValueError(
      f"in_axes: the mapped axes of init_params and fun_args must have one size (the number "
      f"of problems), got sizes {sorted(sizes)}"
    )
  mapped = tuple(a is not None for a in axes)
  return _Batch(jax.tree.unflatten(treedef, out), mapped, sizes.pop() if sizes else 1)


# --- the grid of settings ----------------------------------------------------------------


def _grid_points(grid):
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
  return names, points


def _column(name, values, float_dtype) -> jax.Array:
  """A grid column: floats in the params' dtype, ints and bools in their own, arrays as given."""
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


def _is_number(value) -> bool:
  return isinstance(value, (numbers.Number, np.generic, np.ndarray, jax.Array))


def _static_names(make_optimizer, names, points, params, float_dtype) -> tuple:
  """The settings held static: non-numbers, and integers a trace cannot build (a memory size)."""

  def builds(traced):
    try:
      jax.eval_shape(lambda v: make_optimizer(**{**points[0], **v}).init(params), traced)
    except Exception:  # pylint: disable=broad-except  # any failure: held static
      return False
    return True

  held = [n for n in names if not all(_is_number(p[n]) for p in points)]
  traced = {n: _column(n, [p[n] for p in points], float_dtype)[0] for n in names if n not in held}
  for name in [n for n in traced if all(isinstance(p[n], numbers.Integral) for p in points)]:
    if builds(traced):
      break
    rest = {n: v for n, v in traced.items() if n != name}
    if builds(rest):
      traced, held = rest, held + [name]
  return tuple(held)


def _plain(value):
  return value.item() if isinstance(value, np.generic) else value


class _Maker:
  """How a member's optimizer is built inside the program (static).

  ``make_optimizer(**settings, **columns)`` for a sweep (keyed on what ``make_optimizer``
  computes), or a given optimizer's :class:`~hdm_optax.driver.programs.OptimizerKey`.
  """

  def __init__(self, make_optimizer=None, settings=(), key=None):
    self.make_optimizer, self.settings, self.optimizer_key = make_optimizer, settings, key
    self._key = (key, programs.fingerprint((make_optimizer, settings)))

  def build(self, arrays, columns):
    if self.optimizer_key is not None:
      return self.optimizer_key.build(arrays)
    return self.make_optimizer(**dict(self.settings), **columns)

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _Maker) and other._key == self._key


class _Plan(NamedTuple):
  """The static shape of a batch program.

  Attributes:
    sizes: the stage sizes (of the members on one device).
    params_mapped: per leaf of init_params: on the batch axis.
    theta_mapped: per dynamic argument of fun (the leaves of fun_args, then the arrays it
      closes over): on the batch axis.
    in_order: the members are the problems in order (no gather).
    stop_at_first_converged: end every member once one converged.
    devices: the devices the members are spread over, or ``None``.
    unrolled_steps: the scan's length under :class:`UnrolledAdjoint`.
  """

  sizes: tuple
  params_mapped: tuple
  theta_mapped: tuple
  in_order: bool
  stop_at_first_converged: bool
  devices: Optional[tuple]
  unrolled_steps: int


def _rows(tree, mapped, rows, count, broadcast):
  """Each mapped leaf at ``rows`` (as it is when ``rows`` is None); fixed leaves broadcast to
  ``count`` rows where ``broadcast``, else as they are."""
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for leaf, m in zip(leaves, mapped):
    if m:
      out.append(leaf if rows is None else leaf[rows])
    elif broadcast:
      out.append(jnp.broadcast_to(leaf, (count,) + jnp.shape(leaf)))
    else:
      out.append(leaf)
  return jax.tree.unflatten(treedef, out)


def _split(theta, mapped):
  leaves, treedef = jax.tree.flatten(list(theta))
  return [x for x, m in zip(leaves, mapped) if m], (treedef, leaves, mapped)


def _merge(rows, fixed):
  treedef, leaves, mapped = fixed
  given = iter(rows)
  return jax.tree.unflatten(treedef, [next(given) if m else x for x, m in zip(leaves, mapped)])


def _batch_entry(
  maker, closed, program, plan, adjoint, handle, arrays, columns, pid, x0, theta, state, limits
):
  count = pid.shape[0]
  rows = None if plan.in_order else pid
  x0 = _rows(x0, plan.params_mapped, rows, count, True)
  theta = _rows(list(theta), plan.theta_mapped, rows, count, False)

  def run(theta, rest):  # every traced value enters as an argument (none is closed over)
    x0, state, arrays, columns, limits, handle = rest
    mapped_rows, fixed = _split(theta, plan.theta_mapped)

    def make(member):
      settings, member_rows = member
      fun = lambda p: closed(p, *_merge(member_rows, fixed))
      loop_ = engine.make_loop(
        maker.build(arrays, settings), fun, limits, program.has_aux, program.ftol
      )
      return loop_, fun

    members = (columns, mapped_rows)
    if not isinstance(adjoint, adjoint_lib.UnrolledAdjoint):
      return _run_members(make, program, plan, members, x0, state, handle)
    primitive = engine.scan_primitive(plan.unrolled_steps, adjoint.checkpoint)

    def one(member, x, s):
      loop_, fun = make(member)
      return engine.run(loop_, program, fun, x, s, primitive=primitive, handle=handle)

    return jax.vmap(one, in_axes=(0, 0, None if state is None else 0))(members, x0, state)

  rest = (x0, state, arrays, columns, limits, handle)
  if isinstance(adjoint, adjoint_lib.UnrolledAdjoint):
    return run(theta, rest)
  objective = lambda x, th: _value(closed(x, *th), program.has_aux)
  axes = [0 if m else None for m in plan.theta_mapped]
  axes = jax.tree.unflatten(jax.tree.structure(list(theta)), axes)
  return adjoint_lib.implicit_solution(adjoint, run, objective, theta, rest, axes)


_batch_entry.num_statics = 5


def _value(out, has_aux):
  return out[0] if has_aux else out


def _run_members(make, program, plan, members, params, opt_state, handle):
  """The staged batch, on one device or spread over ``plan.devices``."""
  first = functools.partial(
    engine.run_batch,
    make,
    program,
    handle=handle,
    sizes=plan.sizes,
    stop_at_first_converged=plan.stop_at_first_converged,
  )
  if plan.devices is None:
    return first(members, params, opt_state)
  mesh = jax.sharding.Mesh(np.asarray(plan.devices), (_AXIS,))
  spec = jax.sharding.PartitionSpec(_AXIS)
  state_spec = None if opt_state is None else spec

  def local(members, params, opt_state):
    offset = jax.lax.axis_index(_AXIS) * plan.sizes[0]
    return first(members, params, opt_state, first_member=offset)

  shard = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, state_spec), out_specs=spec)
  return shard(members, params, opt_state)


class _Options(NamedTuple):
  """A batch front door's settings besides the problems and the grid."""

  limits: Any
  max_steps: Any
  has_aux: bool
  compact: bool
  stop_at_first_converged: bool
  callback: Any
  progress: bool
  init_state: Any
  adjoint: Any
  trace: Optional[int]
  devices: Optional[tuple]


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
  return devices


def _check_options(options: _Options, batched_call: bool) -> None:
  if batched_call:
    raise ValueError(
      "sweep and solve_batch under jax.vmap are not offered (they batch already): put the "
      "vmapped axis into in_axes, or call hdm_optax.solve under jax.vmap."
    )
  if isinstance(options.adjoint, adjoint_lib.UnrolledAdjoint) and options.compact:
    raise ValueError(
      "UnrolledAdjoint with compact=True is not offered: retiring members needs while loops, "
      "which reverse mode cannot enter. Pass compact=False (a lockstep scan) or the default "
      "ImplicitAdjoint."
    )
  if options.devices is not None and options.stop_at_first_converged:
    raise ValueError(
      "stop_at_first_converged with devices= is not offered: each device runs its members "
      "on its own. Drop one of them."
    )


def _first(batch: _Batch):
  leaves, treedef = jax.tree.flatten(batch.tree)
  return jax.tree.unflatten(treedef, [a[0] if m else a for a, m in zip(leaves, batch.mapped)])


def _combine(parts: list, count: int) -> SolveResult:
  """The results of several programs, put back in member order (states of other shapes as a
  list, one per member)."""
  if len(parts) == 1:
    return parts[0][1]
  order = np.argsort(np.concatenate([i for i, _ in parts]), kind="stable")
  results = [r for _, r in parts]

  def stacked(trees):
    shapes = {
      (jax.tree.structure(t), tuple(np.shape(x)[1:] for x in jax.tree.leaves(t))) for t in trees
    }
    if len(shapes) > 1:
      return None
    return jax.tree.map(lambda *xs: jnp.concatenate(xs)[order], *trees)

  fields = {f: stacked([getattr(r, f) for r in results]) for f in SolveResult._fields}
  if fields["state"] is None:
    each = [
      jax.tree.map(lambda x, k=k: x[k], r.state) for r in results for k in range(len(r.value))
    ]
    fields["state"] = [each[i] for i in order]
  return SolveResult(**fields)


def _run_grid(make_optimizer, optimizer, names, points, fun, batch: _Batch, options: _Options):
  """The members (every point on every problem), run one program per static setting."""
  params_one, args_one = _first(batch)
  dtype = _common.params_dtype(params_one)
  static = (
    () if optimizer is not None else _static_names(make_optimizer, names, points, params_one, dtype)
  )
  if batch.count > 1:
    if "problem" in points[0]:
      raise ValueError('with in_axes every point gets the key "problem": rename that setting')
    points = [dict(p, problem=b) for p in points for b in range(batch.count)]
  pid = np.tile(np.arange(batch.count, dtype=np.int32), len(points) // batch.count)
  closed, hoisted = programs.hoist(fun, params_one, args_one)
  params_leaves = len(jax.tree.leaves(batch.tree[0]))
  args_mapped = batch.mapped[params_leaves:]
  args_leaves = jax.tree.leaves(batch.tree[1])
  dynamic = [x for x in args_leaves if programs.is_dynamic(x)]
  theta_mapped = [m for x, m in zip(args_leaves, args_mapped) if programs.is_dynamic(x)]
  if any(m and not programs.is_dynamic(x) for x, m in zip(args_leaves, args_mapped)):
    raise ValueError("in_axes maps a leaf of fun_args that is not an array; map arrays only.")
  theta = (*dynamic, hoisted[-1])
  theta_mapped = tuple(theta_mapped) + (False,) * len(hoisted[-1])
  hook = hooks.check_hook(options.callback, options.progress, len(points))
  ftol = solving.ftol_on(options.limits.ftol)
  program = engine.Program(options.trace or 0, hook, options.has_aux, ftol)
  traced = bool(solving.tracers((batch.tree, options.limits)))
  groups: dict = {}
  for i, point in enumerate(points):
    groups.setdefault(tuple((n, _plain(point[n])) for n in static), []).append(i)
  parts = []
  for settings, indices in groups.items():
    indices = np.asarray(indices)
    if optimizer is not None:
      key, arrays = programs.split_optimizer(optimizer)
      maker = _Maker(key=key)
    else:
      maker, arrays = _Maker(make_optimizer, settings), []
    columns = {
      n: _column(n, [points[i][n] for i in indices], dtype) for n in names if n not in static
    }
    part = _run_part(
      maker,
      arrays,
      columns,
      indices,
      pid[indices],
      closed,
      program,
      batch,
      theta,
      theta_mapped,
      options,
      traced,
    )
    parts.append((indices, part))
  return points, _combine(parts, len(points))


def _run_part(
  maker, arrays, columns, indices, pid, closed, program, batch, theta, theta_mapped, options, traced
):
  """One program of a grid: the members ``indices`` (problems ``pid``) with these settings."""
  count, devices = len(pid), options.devices
  padded = count if devices is None else -(-count // len(devices)) * len(devices)

  def pad(a):
    a = jnp.asarray(a)
    return jnp.concatenate([a, jnp.repeat(a[-1:], padded - count, axis=0)]) if padded > count else a

  state = options.init_state
  if state is not None:
    state = jax.tree.map(lambda a: pad(jnp.asarray(a)[indices]), state)
  plan = _Plan(
    sizes=engine.stage_sizes(padded // (1 if devices is None else len(devices)), options.compact),
    params_mapped=batch.mapped[: len(jax.tree.leaves(batch.tree[0]))],
    theta_mapped=theta_mapped,
    in_order=devices is None and batch.count > 1 and np.array_equal(pid, np.arange(batch.count)),
    stop_at_first_converged=options.stop_at_first_converged,
    devices=devices,
    unrolled_steps=int(options.max_steps),
  )
  statics = (maker, closed, program, plan, options.adjoint)
  dynamic = (arrays, jax.tree.map(pad, columns), pad(pid), batch.tree[0], theta, state)
  result = solving.call(
    _batch_entry,
    statics,
    dynamic + (options.limits,),
    callback=options.callback,
    progress=options.progress,
    traced=traced,
  )
  return result if padded == count else jax.tree.map(lambda a: a[:count], result)


def _options(max_steps, tol, rtol, ftol, max_grad_evals, max_null_steps, min_value, **rest):
  limits = check_limits(
    tol=tol,
    rtol=rtol,
    ftol=ftol,
    max_steps=max_steps,
    max_grad_evals=max_grad_evals,
    max_null_steps=max_null_steps,
    min_value=min_value,
  )
  options = _Options(
    limits=limits,
    max_steps=max_steps,
    adjoint=adjoint_lib.check_adjoint(rest.pop("adjoint")),
    devices=_devices(rest.pop("devices")),
    has_aux=bool(rest.pop("has_aux")),
    **rest,
  )
  return options


def sweep(
  make_optimizer: Callable[..., optax.GradientTransformation],
  grid: Union[Mapping[str, Sequence[Any]], Sequence[Mapping[str, Any]]],
  fun: Callable[..., Any],
  init_params: Any,
  *,
  max_steps: int = DEFAULT_MAX_STEPS,
  tol: Any = 1e-4,
  rtol: Any = 0.0,
  ftol: Any = 0.0,
  fun_args: Sequence[Any] = (),
  in_axes: Any = (None, None),
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = None,
  min_value: Optional[float] = -1e20,
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
      arrive as traced scalars (Python floats in the params' dtype).
    grid: keyword -> list of values (their Cartesian product, row-major), or a list of
      points (dicts with the same keys).
    fun: the objective, as in :func:`hdm_optax.solve`.
    init_params: the starting point (of every problem, unless ``in_axes`` maps it).
    max_steps, tol, rtol, ftol, max_grad_evals, max_null_steps, min_value, has_aux: as in
      :func:`hdm_optax.solve`, for every point.
    fun_args: as in :func:`hdm_optax.solve`.
    in_axes: ``(params_axes, fun_args_axes)``, as ``jax.vmap``'s: mapped axes (of one size B)
      make B problems, and every point runs on every problem (``len(points) == len(grid) *
      B``, grid-major, each point with its ``"problem"`` index).
    stop_at_first_converged: stop every point once one has converged.
    compact: retire stopped members (stages of a quarter the size).
    callback: as in :func:`hdm_optax.solve`, called with the whole batch after every step.
    progress: one line for the batch on stderr.
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
  batch = _batch(init_params, tuple(fun_args), in_axes)
  if stop_at_first_converged and batch.count > 1:
    raise ValueError(
      "stop_at_first_converged stops every point once one converged, but with in_axes the "
      f"points solve {batch.count} different problems; sweep one problem at a time, or drop "
      "stop_at_first_converged."
    )
  options = _options(
    max_steps,
    tol,
    rtol,
    ftol,
    max_grad_evals,
    max_null_steps,
    min_value,
    has_aux=has_aux,
    compact=compact,
    stop_at_first_converged=stop_at_first_converged,
    callback=callback,
    progress=progress,
    init_state=init_state,
    adjoint=adjoint,
    trace=trace,
    devices=devices,
  )
  _check_options(options, _called_batched(batch.tree, options.limits))
  names, points = _grid_points(grid)
  points, results = _run_grid(make_optimizer, None, names, points, fun, batch, options)
  return SweepResult(points=points, results=results, best=best_index(results))


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
  ftol: Any = 0.0,
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = None,
  min_value: Optional[float] = -1e20,
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
  Here, once at most a quarter of the batch is still running, the running members move to a
  batch a quarter the size (B, B/4, ..., down to 1, or to 16 for more than 64 members; each
  stage is one more loop in the program, so it compiles longer than the lockstep one). Each
  member runs the loop of :func:`hdm_optax.solve`. With ``devices`` the members are spread
  over the devices (``jax.shard_map``), each retiring its own.

  Args:
    optimizer: the optax transformation, as in :func:`hdm_optax.solve`.
    fun: the objective, as in :func:`hdm_optax.solve`.
    init_params: the starting points (or one, shared: ``in_axes=(None, ...)``).
    fun_args: as in :func:`hdm_optax.solve`; the problems' data.
    in_axes: ``(params_axes, fun_args_axes)``, as ``jax.vmap``'s; the mapped axes (of one
      size B) are the batch. Default: both on axis 0.
    compact: retire stopped members (``False``: the lockstep loop of ``jax.vmap(solve)``).
    max_steps, tol, rtol, ftol, max_grad_evals, max_null_steps, min_value, has_aux: as in
      :func:`hdm_optax.solve`, for every member.
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
  batch = _batch(init_params, tuple(fun_args), in_axes)
  if not any(batch.mapped):
    raise ValueError(
      f"in_axes={in_axes!r} maps no axis of init_params or fun_args, so there is no batch; "
      "name the batch axes (e.g. in_axes=(0, 0)), or call hdm_optax.solve for one problem."
    )
  options = _options(
    max_steps,
    tol,
    rtol,
    ftol,
    max_grad_evals,
    max_null_steps,
    min_value,
    has_aux=has_aux,
    compact=compact,
    stop_at_first_converged=False,
    callback=callback,
    progress=progress,
    init_state=init_state,
    adjoint=adjoint,
    trace=trace,
    devices=devices,
  )
  _check_options(options, _called_batched(batch.tree, options.limits))
  return _run_grid(None, optimizer, [], [{}], fun, batch, options)[1]


def _called_batched(*inputs) -> bool:
  return any(map(solving.is_batched, solving.tracers(inputs)))
