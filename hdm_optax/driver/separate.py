"""The separate path: the method's program, compiled once per shapes and settings, and the
objective compiled on its own.

:func:`run` runs the engine's loop (:func:`hdm_optax.driver.runs.run`) in a program that
holds the optimizer and the limits but not the objective: its objective is
:func:`hdm_optax.driver.oracle.function`, which reaches the user's objective on the host
through a handle. The program is keyed on what the library owns (the optimizer's
configuration, the shapes and dtypes of the params, the run's static choices), so every
objective of those shapes reuses it; the objective costs its own compile (a JAX ``fun``) or
none (a NumPy ``fun``).

An hdm_optax transformation runs on the params packed into a few flat blocks
(:mod:`hdm_optax._blocks`): its program does not grow with the leaves of the params, which
appear only in the objective's program. The result comes back in the params' layout.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax import _blocks
from hdm_optax.driver import compiled as compiled_lib
from hdm_optax.driver import engine
from hdm_optax.driver import hooks
from hdm_optax.driver import host
from hdm_optax.driver import oracle as oracle_lib
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver import resuming
from hdm_optax.driver import runs
from hdm_optax.driver import store
from hdm_optax.pieces import box as box_lib

__all__ = (
  "SEPARATE_RUNS",
  "Layout",
  "chosen",
  "host_maker",
  "jax_maker",
  "method_optimizer",
  "open_to",
  "run",
  "spread",
)


def _is_box(node) -> bool:
  return isinstance(node, box_lib.Box)


class Layout:
  """The user's params and the method's view of them: packed blocks, or the params as they
  are (``Layout(None)``; also for params of one leaf)."""

  def __init__(self, params):
    self.packing = _blocks.Packing(params)
    self.on = self.packing.on
    self.blocks = _blocks.pack(params) if self.on else None

  @functools.cached_property
  def _blocks_layout(self) -> tuple:
    return _blocks.layout(self.blocks)

  def _like_blocks(self, node) -> bool:
    return _blocks.shaped_like(node, self._blocks_layout)

  def to_method(self, tree):
    """``tree`` with its subtrees shaped like the params packed (a box left as it is)."""
    if not self.on:
      return tree
    is_leaf = lambda n: _is_box(n) or self.packing.like_params(n)
    pack = lambda n: n if _is_box(n) or not self.packing.like_params(n) else _blocks.pack(n)
    return jax.tree.map(pack, tree, is_leaf=is_leaf)

  def to_user(self, tree, box=None):
    """``tree`` with its subtrees shaped like the blocks unpacked, and its box ``box``."""
    if not self.on:
      return tree
    is_leaf = lambda n: _is_box(n) or self._like_blocks(n)

    def back(node):
      if _is_box(node):
        return box
      return self.packing.unpack(node) if self._like_blocks(node) else node

    return jax.tree.map(back, tree, is_leaf=is_leaf)


def _numeric(value) -> bool:
  return isinstance(value, (jax.Array, np.ndarray, np.generic, int, float)) and not isinstance(
    value, bool
  )


def method_optimizer(optimizer, params) -> tuple[Any, Layout]:
  """``(optimizer on the method's params, layout)``.

  An hdm_optax transformation whose array arguments are numbers or shaped like the params
  (a box's sides) is rebuilt from its factory with those arguments packed, and runs on the
  packed params; any other optimizer runs on the params as they are.
  """
  configuration = programs.configuration_of(optimizer)
  layout = Layout(params)
  if not layout.on:
    return optimizer, layout
  if configuration is None:
    return optimizer, Layout(None)
  # None leaves counted as leaves: a box's side may hold None (open) where params hold arrays.
  is_none = lambda x: x is None
  arguments, structure = {}, jax.tree.structure(params, is_leaf=is_none)
  for name, value in configuration.arguments.items():
    numbers = [x for x in jax.tree.leaves(value) if _numeric(x)]
    per_leaf = value is not None and jax.tree.structure(value, is_leaf=is_none) == structure
    if layout.packing.like_params(value):
      arguments[name] = _blocks.pack(value)
    elif all(np.ndim(x) == 0 for x in numbers) and not per_leaf:
      arguments[name] = value
    else:  # a pytree of per-leaf values (a box's sides): no packed counterpart
      return optimizer, Layout(None)
  return configuration.factory(**arguments), layout


def _entry(key, program, primitive, layout, *blocks):
  """The method's program: the engine's run with the host oracle (``site``'s) as its
  objective; ``blocks``, its arguments of layout ``layout`` (:class:`_Arguments`): the
  call's :class:`~hdm_optax.driver.hooks.Handle`, the site, the optimizer's arrays, x, the
  start and the limits."""
  (handle, site, arrays, x0), (start, limits) = _blocks.unpack(blocks, _like(layout))
  fun = oracle_lib.function(site, x0)
  loop_ = engine.make_loop(key.build(arrays), fun, limits)
  make = lambda member: (loop_, fun)
  with host.buffered():  # a CPU program: its host calls hand over buffers
    return runs.run(make, program, None, x0, start, primitive=primitive, handle=handle)


_JIT = jax.jit(_entry, static_argnums=(0, 1, 2, 3))


# Programs compiled here and not yet written to the store (written from the caller's thread
# once no build is under way: serializing an executable while another compiles can crash).
_UNSAVED: list = []


def program(statics: tuple, blocks: tuple, options: dict, meanwhile: Callable[[], Any]):
  """``(compiled, meanwhile())``: the method's compiled program for ``statics`` (its
  arguments' layout among them) and the abstract ``blocks``, from the cache, the disk
  (:mod:`hdm_optax.driver.store`, read in the caller's thread) or compiled (and stored later,
  :func:`_save_unsaved`), and what ``meanwhile`` (the objective's compile) returns, run
  while a compile of the method's program is under way in a thread."""
  key = ("method", statics, tuple(sorted(options.items())))
  stored = _description(key)

  def compile_():
    program = programs.compile_lowered(_JIT.lower(*statics, *blocks), options)
    if stored is not None:
      del _UNSAVED[: max(len(_UNSAVED) - 3, 0)]  # at most 4 wait (not storing one is harmless)
      _UNSAVED.append((stored, program))
    return program

  if compiled_lib.peek(key) is None and not store.holds(stored):
    compiled_lib.prepare(key, compile_)
  made = meanwhile()
  return compiled_lib.lookup(key, lambda: store.load(stored) or compile_()), made


@functools.lru_cache(maxsize=256)
def _description(key) -> Optional[str]:
  """The store's key of the method's program ``key`` (:func:`store.describe`), kept: a
  front door's call asks for it twice, and the same shapes at every call."""
  return store.describe(key)


def _save_unsaved() -> None:
  """Writes the programs compiled since the last call to the store, where no build is under
  way."""
  while _UNSAVED and not compiled_lib.building():
    store.save(*_UNSAVED.pop())


compiled_lib.releases(_description.cache_clear)
compiled_lib.releases(_save_unsaved)


def _box_of(optimizer, params) -> Optional[box_lib.Box]:
  configuration = getattr(optimizer, "configuration", None)
  arguments = {} if configuration is None else configuration.arguments
  if arguments.get("lower") is None and arguments.get("upper") is None:
    return None
  return box_lib.make_box(params, arguments.get("lower"), arguments.get("upper"))


def run(
  optimizer,
  make_oracle,
  x0,
  *,
  limits,
  program_: runs.Program,
  primitive,
  init_state=None,
  callback=None,
  progress: bool = False,
  key=None,
):
  """Minimizes an objective from ``x0`` with ``optimizer`` on the separate path.

  ``make_oracle(packed)`` returns the :class:`~hdm_optax.driver.oracle.Oracle` of the
  objective on the method's params (``packed``: the params packed into blocks); ``key``,
  the optimizer's :class:`~hdm_optax.driver.programs.OptimizerKey` at ``x0`` where the
  front door has it (it is made again for packed params).

  Returns:
    The :class:`~hdm_optax.driver.results.SolveResult` in the params' layout.

  Raises:
    The exception the objective raised, if any; the callback's, with the partial result
    as its ``.result``.
  """
  method, layout = method_optimizer(optimizer, x0)
  x = _blocks.pack(x0) if layout.on else x0
  if key is None or layout.on:
    key = programs.OptimizerKey(method, x)
  placeholder = hooks.Handle.like(program_.hook is not None, program_.watch)
  arrays = programs.arrays_of(method)
  fresh = lambda handle, site: (handle, site, arrays, x)
  arguments = _arguments(fresh(placeholder, np.int32(0)), init_state, layout, method, limits, x0)
  statics, options = (
    (key, program_, primitive, arguments.layout),
    programs.compiler_options((x0, init_state), host_loop=True),
  )
  compiled, oracle = program(statics, arguments.abstract, options, lambda: make_oracle(layout.on))
  view = (lambda blocks: _blocks.unpack(blocks, x0)) if layout.on else None
  call = compiled_lib.dispatched(compiled)

  def run_(handle):
    with oracle_lib.serving(oracle) as (site, entry):
      try:
        result = call(*arguments.blocks(fresh(handle, site)))
        result.value.block_until_ready()  # one execution's outputs: all ready, or its error
      except Exception:  # XLA's error, whose type differs by JAX's dispatch path
        if entry.error is not None:
          raise entry.error from None
        raise
    return _to_user(result, layout, optimizer, x0)

  # No key for the Ctrl-C checks' learned chunk: this program serves every objective of its
  # shapes, and a cheaper one's chunk would leave a dearer one's Ctrl-C unseen for seconds.
  result = hooks.watched(
    run_, callback, progress, watch=program_.watch, key=None, view=view, ready=True
  )
  _save_unsaved()
  return result


def _arguments(fresh, init_state, layout: Layout, method, limits, x0) -> "_Arguments":
  """The run's :class:`_Arguments`: the call's own (``fresh``, shaped as at the call), the
  start (:func:`hdm_optax.driver.resuming.start_of`; a given state or result with its
  params-shaped nodes packed) and the limits; kept for the next call where the start is
  fresh and small."""
  x = fresh[-1]
  shape = programs.init_shape(method, x)
  if init_state is None and resuming.small(shape):
    numbers = limits.typed or programs.numbers(limits)
    key = ("arguments", compiled_lib.abstract(fresh), compiled_lib.abstract_of(shape), numbers)
    make = lambda: _Arguments(fresh, (resuming.start_of(None, x, shape), limits))
    return compiled_lib.kept(key, make)
  result = resuming.result_of(init_state)
  if layout.on and result is not None:
    resuming.check_params(x0, result.params)  # named in the user's layout
    init_state = result._replace(params=x, state=layout.to_method(result.state))
  elif layout.on:
    init_state = layout.to_method(init_state)
  return _Arguments(fresh, (resuming.start_of(init_state, x, shape), limits))


def _like(layout: tuple):
  """The arguments of ``layout`` (:attr:`_Arguments.layout`) as abstract values."""
  treedef, specs, _ = layout
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(*spec) for spec in specs])


class _Arguments:
  """A run's arguments as the method's program takes them: a block per dtype.

  A program that calls the host takes its arguments on JAX's Python path, where each one
  costs at every call (docs/speed.md), and a run has dozens (the state's leaves). Here the
  leaves of one dtype are one block (:func:`hdm_optax._blocks.groups`: a large leaf is a
  block of its own): first the call's own leaves (the handle, the site, the optimizer's
  arrays, x), then the kept ones (the start, the limits), whose part of each block is made
  once. The program takes the blocks apart (:func:`hdm_optax._blocks.unpack`); the limits'
  numbers arrive in a block's dtype, which the engine casts to its own.

  Attributes:
    layout: the tree of ``(fresh, kept)``, each leaf's shape and dtype, and how many leaves
      are the call's (a program's static argument).
    abstract: the blocks' abstract values.
  """

  def __init__(self, fresh, kept):
    leaves = jax.tree.leaves(fresh)
    kept_leaves = jax.tree.leaves(kept)
    specs = tuple((np.shape(x), jnp.result_type(x)) for x in leaves + kept_leaves)
    self.layout = (jax.tree.structure((fresh, kept)), specs, len(leaves))
    n, self._parts, abstract = len(leaves), [], []
    for group in _blocks.groups(jax.tree.leaves(_like(self.layout))):
      shape, dtype = specs[group[0]]
      ours, theirs = [i for i in group if i < n], [kept_leaves[i - n] for i in group if i >= n]
      if len(group) == 1:
        part = theirs[0] if theirs else None
      else:
        shape = (sum(math.prod(specs[i][0]) for i in group),)
        part = np.concatenate([np.ravel(np.asarray(leaf)) for leaf in theirs] or [[]], dtype=dtype)
      self._parts.append((ours, dtype, part if ours else jax.device_put(part)))
      abstract.append(jax.ShapeDtypeStruct(shape, dtype))
    self.abstract = tuple(abstract)

  def blocks(self, fresh) -> list:
    """The blocks of a call whose own leaves are ``fresh``'s (shaped as at construction)."""
    leaves = jax.tree.leaves(fresh)
    out = []
    for ours, dtype, part in self._parts:
      if not ours:
        out.append(part)
      elif part is None:
        out.append(leaves[ours[0]])
      else:
        out.append(np.concatenate([*(np.ravel(leaves[i]) for i in ours), part], dtype=dtype))
    return out


def _to_user(result, layout: Layout, optimizer, x0):
  if not layout.on:
    return result
  box = _box_of(optimizer, x0) if protocol.box_of(result.state) is not None else None
  return result._replace(
    params=layout.packing.unpack(result.params), state=layout.to_user(result.state, box)
  )


# Runs of one objective on the separate path before the fused program serves it (the second
# compiles the fused program in the background).
SEPARATE_RUNS = 2

# Params of more leaves stay on the separate path. The fused program runs the method on every
# leaf, so its compile grows with them (a process that ends meanwhile waits for it); the
# separate path's method program packs the leaves (docs/research/speed.md).
FUSED_MAX_LEAVES = 16


class _Sightings:
  """How many times each fused program's key was asked for (the most recent ones)."""

  def __init__(self, size: int = 1024):
    self.size, self.counts = size, collections.OrderedDict()

  def see(self, key) -> int:
    count = self.counts.pop(key, 0) + 1
    self.counts[key] = count
    while len(self.counts) > self.size:
      self.counts.popitem(last=False)
    return count


_SIGHTINGS = _Sightings()
compiled_lib.releases(_SIGHTINGS.counts.clear)


def open_to(has_aux: bool, dynamic) -> bool:
  """Whether a run of ``dynamic`` (a front door's traced values) may take the separate path:
  on the CPU, outside a caller's trace, without ``has_aux``, on one device and process."""
  if has_aux or engine.backend() != "cpu" or programs.staged():
    return False
  return not programs.tracers(dynamic) and not spread(dynamic)


def chosen(entry, statics: tuple, dynamic: tuple, *, key, program_: runs.Program, params) -> bool:
  """Whether a front door's call of a JAX objective runs on the separate path rather than
  ``entry``'s fused program (``entry(*statics, *dynamic)``, ``dynamic`` led by the call's
  handle (one :meth:`~hdm_optax.driver.hooks.Handle.like` it will be); ``key``, its
  :func:`~hdm_optax.driver.programs.program_key`; ``params``, the run's params).

  The rule: where the path is open (:func:`open_to`), a NumPy ``fun`` (:func:`host_maker`,
  decided before this) and params of more than :data:`FUSED_MAX_LEAVES` leaves always take
  it, and a JAX objective does for its first :data:`SEPARATE_RUNS` runs (counted by the
  fused program's key: the objective's trace, the optimizer, the shapes); the last of them
  compiles the fused program in the background, which serves the later runs.
  """
  if key is None or not open_to(program_.has_aux, dynamic):
    return False
  if len(jax.tree.leaves(params)) > FUSED_MAX_LEAVES:
    return True
  if compiled_lib.peek(key) is not None:
    return False
  runs_so_far = _SIGHTINGS.see(key)
  if runs_so_far == SEPARATE_RUNS:
    options, abstract = programs.compiler_options(dynamic), jax.tree.map(_abstract_value, dynamic)
    build = lambda: programs.jitted(entry).lower(*statics, *abstract).compile(options or None)
    compiled_lib.prepare(key, build)
  return runs_so_far <= SEPARATE_RUNS


def spread(tree) -> bool:
  """Whether the run spans several devices or processes (the fused program shards it)."""
  if jax.process_count() > 1:
    return True
  arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  return any(len(x.sharding.device_set) > 1 for x in arrays)


def _abstract_value(x):
  weak = isinstance(x, (float, int, complex)) or bool(getattr(x, "weak_type", False))
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), weak_type=weak)


def host_maker(fun, fun_args, like, open_: tuple):
  """``make_oracle(packed)`` of a NumPy ``fun`` (:func:`hdm_optax.minimize`) where the
  separate path is open to the call (``open_``: :func:`open_to`'s arguments): the host's own
  oracle; ``None`` for a JAX objective, or where the path is closed."""
  if not getattr(fun, "on_host", False) or not open_to(*open_):
    return None
  return lambda packed: fun.host_oracle(fun_args, like, packed)


def jax_maker(closed, args, like):
  """``make_oracle(packed)`` of a JAX objective (:func:`~hdm_optax.driver.programs.hoist`'s
  ``closed`` and ``args``): the objective compiled on its own."""
  options = programs.compiler_options((like, args))
  return lambda packed: oracle_lib.JaxOracle(closed, args, like, packed, options=options)
