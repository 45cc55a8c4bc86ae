"""``solve``: one problem, one compiled run of the engine."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _numerics
from hdm_optax.driver import adjoint as adjoint_lib
from hdm_optax.driver import engine
from hdm_optax.driver import runs
from hdm_optax.driver import hooks
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver import resuming
from hdm_optax.driver import separate
from hdm_optax.driver.limits import Limits
from hdm_optax.driver.limits import takes_limits
from hdm_optax.driver.results import SolveResult

__all__ = ("check_params", "solve")


def check_params(params, name: str = "init_params"):
  """``params`` as a pytree of float arrays: Python numbers and lists of them become arrays.

  Raises:
    ValueError, TypeError: empty params, or leaves that are not floating point.
  """
  if isinstance(params, np.ndarray) and params.dtype.kind == "f" and params.size:
    return params  # one float array with entries: nothing to convert or refuse
  numbers = lambda x: isinstance(x, (int, float, np.number)) and not isinstance(x, bool)
  if isinstance(params, (list, tuple, int, float)) and all(map(numbers, jax.tree.leaves(params))):
    if jax.tree.leaves(params):
      params = jnp.asarray(np.asarray(params, dtype=float))
  if not jax.tree.leaves(params):
    raise ValueError(f"{name} is an empty pytree: there is nothing to optimize; pass arrays.")
  _refuse_non_float(params, name)
  try:
    _numerics.params_dtype(params)
  except (TypeError, ValueError) as err:
    raise type(err)(f"{name}: {err}") from None
  return params


def _refuse_non_float(params, name: str) -> None:
  """Raises where an array of ``params`` is not real floating point, naming it (``name``: the
  argument), its dtype as given, and the cast."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or jnp.issubdtype(dtype, jnp.floating):
      continue  # not an array: params_dtype's check says what it is
    arg = name.split()[-1]  # a door's "step: params" names the argument params
    where = f" at {arg}{jax.tree_util.keystr(path)}" if path else ""
    target = "jnp.float64" if jax.config.read("jax_enable_x64") else "jnp.float32"
    cast = f"jnp.asarray({arg}, {target})"
    if path:
      cast = f"jax.tree.map(lambda x: jnp.asarray(x, {target}), {arg})"
    if jnp.issubdtype(dtype, jnp.complexfloating):
      fix = "optimize its real and imaginary parts as two real arrays"
    else:
      fix = f"cast it, e.g. {cast} (Python numbers, and lists of them, are cast for you)"
    raise TypeError(
      f"{name}: params must be real floating-point arrays, got dtype "
      f"{np.dtype(dtype).name}{where}: {fix}."
    )


def _watch_and_loop(check_every, callback, progress, adjoint, limits) -> tuple:
  """``(hook, adjoint, primitive)``: a call's callback and progress line, and its loop."""
  integer = isinstance(check_every, (int, np.integer)) and not isinstance(check_every, bool)
  if not integer or check_every < 1:
    raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
  hook = hooks.check_hook(callback, progress)
  if hook is not None and check_every != 1:
    raise ValueError(
      f"callback= and progress= watch every step; they need check_every=1, got {check_every}."
    )
  adjoint = adjoint_lib.check_adjoint(adjoint)
  return hook, adjoint, adjoint.primitive(int(check_every), limits.max_steps)


def _solve_entry(key, closed, program, primitive, adjoint, handle, arrays, x0, args, state, limits):
  def run(theta, rest):  # every traced value enters as an argument (none is closed over)
    arrays, x0, state, limits, handle = rest
    fun = lambda p: closed(p, *theta)
    loop_ = engine.make_loop(key.build(arrays), fun, limits, program.has_aux)
    make = lambda member: (loop_, fun)
    return runs.run(make, program, None, x0, state, primitive=primitive, handle=handle)

  def bounds(rest):  # the box of the run's fresh state (a resumed one keeps it)
    arrays, x0 = rest[:2]
    return protocol.box_of(key.build(arrays).init(x0))

  rest = (arrays, x0, state, limits, handle)
  return adjoint.apply(run, closed.objective(program.has_aux), args, rest, bounds=bounds)


_solve_entry.num_statics = 5


@takes_limits
@resuming.resumable
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
    init_state: where to start: ``None`` (the optimizer's ``init``); a result of this
      optimizer on this problem (``result``, or an exception's ``.result``) to resume the
      run: ``init_params`` must be its params, the counts go on from its own (``max_steps``
      and ``max_grad_evals`` count the whole run) and f and grad f at the params are the
      result's (no call; one counted call where ``fun`` or the data it reads are not its
      run's); or an optimizer state (``result.state``): a warm start from
      ``init_params``, the counts from 0. A state's box is replaced by the optimizer's. The
      three share one compiled program (docs/guide.md, "Resuming a run"). A resumed run
      that had converged stays where it is: on ``tol`` (the test holds at its params), and
      on ``ftol`` where this call's ``ftol`` is at least the relative decrease of the
      result's last update (read from its trace; without one, any ``ftol > 0``); a smaller
      ``ftol``, ``ftol=0`` or a warm start from ``result.state`` goes on.
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
  hook, adjoint, primitive = _watch_and_loop(check_every, callback, progress, adjoint, limits)
  found = programs.tracers((init_params, tuple(fun_args), init_state, limits.tol, limits.rtol))
  kept, shown = runs.trace_size(trace, limits.max_steps, batch=any(map(programs.is_batched, found)))
  key, arrays, shape = programs.prepare(protocol.check_optimizer("solve", optimizer), init_params)
  open_ = (bool(has_aux), (arrays, init_params, fun_args, init_state, limits))
  make_oracle = separate.host_maker(fun, fun_args, init_params, open_)
  on_host = make_oracle is not None  # it makes its own start: no trace, no program here
  closed, args = (None, ()) if on_host else programs.hoist(fun, init_params, tuple(fun_args))
  init_state = resuming.resumed_on(init_state, fun if on_host else closed, args)
  traced = bool(found) or bool(programs.tracers((arrays, args, limits)))  # what fun reads, too
  local = not traced and not on_host and not separate.spread((arrays, init_params, args))
  if local:  # passed alike at each call: kept on the device
    limits = programs.on_device(limits.typed or programs.numbers(limits), lambda: limits)
  start = None if on_host else resuming.start_of(init_state, init_params, shape, kept=local)
  dynamic = (arrays, init_params, args, start, limits)
  watch = hook is None and not isinstance(primitive, runs.Scan) and hooks.watchable(dynamic)
  program = runs.Program(kept, hook, bool(has_aux), watch)
  statics = (key, closed, program, primitive, adjoint)

  like = (hooks.Handle.like(hook is not None, watch), *dynamic)
  named = None if traced or on_host else programs.program_key(_solve_entry, statics, like)
  chosen = lambda: separate.chosen(
    _solve_entry, statics, like, key=named, program_=program, params=init_params
  )
  if not on_host and (traced or not chosen()):  # the fused program
    run = lambda h: programs.call(
      _solve_entry, statics, dynamic, handle=h, traced=traced, key=named
    )
    return runs.cut_trace(hooks.watched(run, callback, progress, watch=watch, key=named), shown)
  make_oracle = make_oracle if on_host else separate.jax_maker(closed, args, init_params)
  result = separate.run(
    optimizer,
    make_oracle,
    init_params,
    limits=limits,
    program_=program,
    primitive=primitive,
    init_state=init_state,
    callback=callback,
    progress=progress,
    key=key,
  )
  return runs.cut_trace(result, shown)
