"""``solve``: one problem, one compiled run of the engine; and what every front door shares."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common
from hdm_optax.driver import adjoint as adjoint_lib
from hdm_optax.driver import engine
from hdm_optax.driver import runs
from hdm_optax.driver import hooks
from hdm_optax.driver import programs
from hdm_optax.driver.limits import Limits
from hdm_optax.driver.limits import check_count
from hdm_optax.driver.limits import takes_limits
from hdm_optax.driver.results import SolveResult

__all__ = (
  "DEFAULT_TRACE",
  "call",
  "check_params",
  "compiled_count",
  "cut_trace",
  "solve",
  "trace_size",
)

# The trace a run keeps by default outside jax.vmap: its last 1024 entries at most.
DEFAULT_TRACE = 1024


def tracers(tree):
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.core.Tracer)]


def is_batched(tracer) -> bool:
  """Whether ``tracer`` is (or wraps) one of ``jax.vmap``'s."""
  for _ in range(8):
    if type(tracer).__name__ == "BatchTracer":
      return True
    inner = getattr(tracer, "primal", None)
    tracer = getattr(tracer, "val", None) if inner is None else inner
    if not isinstance(tracer, jax.core.Tracer):
      return False
  return False


def trace_size(trace: Optional[int], max_steps, inputs) -> tuple[int, int]:
  """``(program, result)``: the trace entries a program keeps and those a result shows.

  ``trace``, or by default the whole run up to :data:`DEFAULT_TRACE` entries, and none under
  ``jax.vmap`` (``inputs`` are batched). The program keeps a power of two, so that budgets
  that round up alike share one program; the result is cut to ``max_steps + 1``.
  """
  if trace is not None:
    size = int(check_count("trace", trace, 0, "the number of last entries to keep"))
  elif any(map(is_batched, tracers(inputs))):
    size = 0
  else:
    size = DEFAULT_TRACE
  if isinstance(max_steps, jax.core.Tracer) or size == 0:
    return size, size
  shown = min(size, int(np.minimum(max_steps, size)) + 1)
  return min(size, 1 << (shown - 1).bit_length()), shown


def cut_trace(result, size: int):
  """``result`` with its trace cut to ``size`` entries (the last axis)."""
  if result.trace.value.shape[-1] == size:
    return result
  cut = _cut if tracers(result.trace) else _cut_compiled
  return result._replace(trace=cut(result.trace, size))


def _cut(trace, size):
  return jax.tree.map(lambda a: a[..., :size], trace)


_cut_compiled = jax.jit(_cut, static_argnums=1)  # one dispatch for the five arrays


def check_params(params, name: str = "init_params"):
  """``params`` as a pytree of float arrays: Python numbers and lists of them become arrays.

  Raises:
    ValueError, TypeError: empty params, or leaves that are not floating point.
  """
  numbers = lambda x: isinstance(x, (int, float, np.number)) and not isinstance(x, bool)
  if isinstance(params, (list, tuple, int, float)) and all(map(numbers, jax.tree.leaves(params))):
    if jax.tree.leaves(params):
      params = jnp.asarray(np.asarray(params, dtype=float))
  if not jax.tree.leaves(params):
    raise ValueError(f"{name} is an empty pytree: there is nothing to optimize; pass arrays.")
  try:
    _common.params_dtype(params)
  except (TypeError, ValueError) as err:
    raise type(err)(f"{name}: {err}") from None
  return params


def _check_every(check_every) -> int:
  if not isinstance(check_every, (int, np.integer)) or isinstance(check_every, bool):
    raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
  if check_every < 1:
    raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
  return int(check_every)


def _raise_with(error: BaseException, result) -> None:
  error.result = result
  error.add_note(
    "hdm_optax: the callback raised this; the run stopped, and the result so far "
    "is in this exception's .result."
  )
  raise error


def call(entry: Callable, statics: tuple, dynamic: tuple, *, callback, progress, traced):
  """Runs ``entry(*statics, handle, *dynamic)``, compiled once per ``statics`` and shapes.

  ``statics`` are hashable (the cache policy's keys); where one cannot be keyed
  (:class:`~hdm_optax.driver.programs.Uncacheable`) the entry is traced inline. The hook
  session (:func:`hdm_optax.driver.hooks.session`) is open around the call; an exception
  the callback raised is raised again with the partial result as its ``.result``.
  """
  with hooks.session(callback, progress, traced=traced) as handle:
    options = {} if traced or staged() else compiler_options(dynamic)
    program = _compiled(entry, options)
    try:
      hash(statics)
    except TypeError:
      program = entry
    result = program(*statics, handle, *dynamic)
    error = hooks.error(handle)
    if error is not None:
      _raise_with(error, jax.block_until_ready(result))
  return result


_PROGRAMS: dict = {}


def staged() -> bool:
  """Whether the caller is being staged out (inside ``jax.jit``, a loop body, ...)."""
  return isinstance(jnp.zeros(()), jax.core.Tracer)


def _compiled(entry, options: dict):
  key = (entry, tuple(sorted(options.items())))
  if key not in _PROGRAMS:
    _PROGRAMS[key] = jax.jit(
      entry, static_argnums=tuple(range(entry.num_statics)), compiler_options=options or None
    )
  return _PROGRAMS[key]


# Inputs of at most this many entries in all compile for a short first call.
SMALL_PROGRAM = 65_536


def compiler_options(inputs) -> dict:
  """XLA's options for a front door's program, by the size of its ``inputs`` (a pytree).

  On the CPU, a problem whose inputs (params, data, state) hold at most
  :data:`SMALL_PROGRAM` entries in all is compiled with XLA's elemental kernel emitters
  (``xla_cpu_use_fusion_emitters=False``), which compile faster; larger problems keep XLA's
  fusion emitters, whose kernels run faster (docs/speed.md). Other backends get ``{}``.
  :func:`call` passes no options where the program is staged inside a caller's trace (JAX
  takes them only at the top level).

  Returns:
    The ``compiler_options`` of ``jax.jit``, ``{}`` for XLA's defaults.
  """
  if jax.default_backend() != "cpu":
    return {}
  entries = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(inputs))
  return {"xla_cpu_use_fusion_emitters": False} if entries <= SMALL_PROGRAM else {}


def compiled_count() -> int:
  """How many programs the front doors have compiled in this process (each jit cache entry)."""
  return sum(program._cache_size() for program in _PROGRAMS.values())


def statics_of(optimizer, fun, params, fun_args):
  """``(optimizer_key, optimizer_arrays, closed, args)``, or raises ``Uncacheable``.

  The optimizer's ``init`` is traced first with its own values, so that its checks of its
  arguments against the params (a box's shape, NaN) run before they become traced.
  """
  jax.eval_shape(optimizer.init, params)
  key, arrays = programs.split_optimizer(optimizer)
  closed, args = programs.hoist(fun, params, tuple(fun_args))
  return key, arrays, closed, args


def _solve_entry(key, closed, program, primitive, adjoint, handle, arrays, x0, args, state, limits):
  def run(theta, rest):  # every traced value enters as an argument (none is closed over)
    arrays, x0, state, limits, handle = rest
    fun = lambda p: closed(p, *theta)
    loop_ = engine.make_loop(key.build(arrays), fun, limits, program.has_aux)
    primitive_ = make_primitive(primitive)
    return runs.run(loop_, program, fun, x0, state, primitive=primitive_, handle=handle)

  rest = (arrays, x0, state, limits, handle)
  if isinstance(adjoint, adjoint_lib.UnrolledAdjoint):
    return run(args, rest)
  objective = lambda x, theta: _value(closed(x, *theta), program.has_aux)
  return adjoint_lib.implicit_solution(adjoint, run, objective, args, rest)


_solve_entry.num_statics = 5


def _value(out, has_aux):
  return out[0] if has_aux else out


def primitive_of(adjoint, check_every: int, max_steps) -> tuple:
  """The loop primitive of a run, as a static key for :func:`make_primitive`: a scan of
  ``max_steps`` under :class:`UnrolledAdjoint`, blocks of ``check_every`` steps, or the
  plain while loop."""
  if isinstance(adjoint, adjoint_lib.UnrolledAdjoint):
    if check_every != 1:
      raise ValueError(
        f"UnrolledAdjoint runs a scan of max_steps iterations; check_every={check_every} "
        "blocks a while loop: pass check_every=1 with UnrolledAdjoint."
      )
    if isinstance(max_steps, jax.core.Tracer) or max_steps >= np.iinfo(np.int32).max:
      raise ValueError(
        f"UnrolledAdjoint needs max_steps as a Python int (the scan's length), got {max_steps}."
      )
    return ("scan", int(max_steps), adjoint.checkpoint)
  return ("blocks", check_every) if check_every > 1 else ("while",)


def make_primitive(key: tuple):
  """The primitive :func:`primitive_of` named."""
  if key[0] == "scan":
    return runs.scan_primitive(key[1], key[2])
  if key[0] == "blocks":
    return runs.blocks_primitive(key[1])
  return runs.while_primitive


@takes_limits
def solve(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., Any],
  init_params: Any,
  *,
  limits: Limits,
  init_state: Optional[Any] = None,
  fun_args: Sequence[Any] = (),
  has_aux: bool = False,
  check_every: int = 1,
  callback: Optional[Callable[[hooks.Snapshot], Any]] = None,
  progress: bool = False,
  adjoint: Any = None,
  trace: Optional[int] = None,
) -> SolveResult:
  r"""Minimizes ``fun(params, *fun_args)`` with ``optimizer``, compiled end to end.

  The run is the engine's loop (:mod:`hdm_optax.driver.engine`) over
  ``jax.value_and_grad(fun)``, in one ``lax.while_loop``. It stops once
  :math:`\|\nabla f(x)\|_\infty \le \max(\text{tol},\ \text{rtol}\,\|\nabla f(x_0)\|_\infty)`
  (the projected gradient where the optimizer holds a box, status ``CONVERGED_IN_BOX``),
  on SciPy's relative decrease ``ftol``, after ``max_steps`` updates or ``max_grad_evals``
  gradient calls, when f or grad f is not finite, when f < ``min_value``, after
  ``max_null_steps`` rejected updates in a row, or when ``callback`` says so; ``status``
  says which (:class:`Status`). Works for any optax transformation: ``update`` receives
  ``value``, ``grad`` and ``value_fn``. The reported value and gradient are always at the
  reported params; where the caching transformation (every hdm_optax method,
  ``optax.lbfgs``) is last in a chain, its cache is reused and an iteration costs no extra
  oracle call.

  Each call solves ``fun`` as it is at the call, and compiles once per configuration
  (:mod:`hdm_optax.driver.programs` states the rule): arrays in ``fun_args`` and those
  ``fun`` reads from outside its arguments (closure cells, globals, a bound method's
  object, an equinox Module) are arguments of the program; Python ints and bools in
  ``fun_args`` are static, as ``jax.jit``'s ``static_argnums``; two hdm_optax
  transformations built with equal arguments are one configuration, and the arrays among
  their arguments are read at each call; the limits are values of the program, so a new
  ``tol`` or budget does not compile again. Inside ``jax.jit``/``jax.vmap``/``jax.grad`` the
  same program is called, so ``jax.grad`` through ``solve`` reuses it.

  Args:
    optimizer: an optax transformation.
    fun: the objective, ``fun(params, *fun_args) -> scalar`` of the params' dtype
      (``-> (scalar, aux)`` with ``has_aux``).
    init_params: x0, any pytree of float arrays of one dtype (a Python number or list of
      numbers becomes an array).
    limits: when the run stops: a :class:`~hdm_optax.driver.limits.Limits`, or its fields
      as keywords (``tol=1e-6, max_steps=500``), each replacing its default (1000 steps,
      the paper's budget; ``tol`` 1e-4; no ``ftol``): :class:`~hdm_optax.driver.limits.Limits`
      says what each means. :attr:`SolveResult.tol` is the threshold used.
    init_state: resume from this state of the same optimizer (``result.state``); its box
      is replaced by the optimizer's.
    fun_args: extra arguments of ``fun`` (e.g. the data).
    has_aux: ``fun`` returns ``(value, aux)``; ``aux`` at the final params is in
      :attr:`SolveResult.aux` (one more evaluation of ``fun``, counted).
    check_every: test the stop rule in the ``while_loop`` once per this many steps (the
      result is the same; on a GPU each test is a round trip to the host).
    callback: ``callback(snapshot)`` on the host after every step
      (:class:`hdm_optax.driver.hooks.Snapshot`); returning True or raising
      ``StopIteration`` stops the run (``STOPPED``, unless the stop rule held at that step);
      another exception is raised again
      from ``solve`` with the partial result as its ``.result``. A new callback object does
      not compile a new program.
    progress: a live line on stderr (steps, calls, f, ||grad f||, null steps, seconds).
    adjoint: how ``jax.grad``/``jax.jvp`` see the result as a function of ``fun_args``
      and of the arrays ``fun`` closes over: :class:`hdm_optax.ImplicitAdjoint` (``None``,
      the default) or :class:`hdm_optax.UnrolledAdjoint` (through a ``lax.scan`` of
      ``max_steps`` iterations); see :mod:`hdm_optax.driver.adjoint`.
    trace: keep the last ``trace`` entries of the run in :attr:`SolveResult.trace`
      (default: up to 1024, and none under ``jax.vmap``).

  Returns:
    A :class:`SolveResult`.

  Raises:
    ValueError: a limit out of its range, a combination not offered (``check_every`` with
      a callback or :class:`UnrolledAdjoint`), an ``init_state`` of another optimizer.
    TypeError: ``fun`` returns another dtype than the params; a tolerance that is not a
      number.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x, a: jnp.sum(a * x ** 2)
    >>> a = jnp.array([1.0, 10.0, 100.0])
    >>> res = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.ones(3), fun_args=(a,))
    >>> bool(res.converged), res.message
    (True, 'converged: ||grad f||_inf <= tol')
  """
  init_params = check_params(init_params)
  check_every = _check_every(check_every)
  hook = hooks.check_hook(callback, progress)
  if hook is not None and check_every != 1:
    raise ValueError(
      f"callback= and progress= watch every step; they need check_every=1, got {check_every}."
    )
  adjoint = adjoint_lib.check_adjoint(adjoint)
  primitive = primitive_of(adjoint, check_every, limits.max_steps)
  inputs = (init_params, tuple(fun_args), init_state, limits.tol, limits.rtol)
  traced = bool(tracers(inputs))
  kept, shown = trace_size(trace, limits.max_steps, inputs)
  program = runs.Program(kept, hook, bool(has_aux))
  try:
    key, arrays, closed, args = statics_of(optimizer, fun, init_params, fun_args)
  except programs.Uncacheable:
    key, arrays, closed, args = _inline(optimizer, fun, init_params, fun_args)
  statics = (key, closed, program, primitive, adjoint)
  dynamic = (arrays, init_params, args, init_state, limits)
  result = call(_solve_entry, statics, dynamic, callback=callback, progress=progress, traced=traced)
  return cut_trace(result, shown)


class _Unkeyed:
  """A static that makes :func:`call` trace inline (it is not hashable)."""

  __hash__ = None

  def __init__(self, value):
    self.value = value

  def build(self, arrays):
    del arrays
    return self.value


def _inline(optimizer, fun, params, fun_args):
  """What :func:`statics_of` returns, for an optimizer that holds traced values (traced
  inline: a program keyed on it would hold the tracers)."""
  closed, args = programs.hoist(fun, params, tuple(fun_args))
  return _Unkeyed(optimizer), [], closed, args
