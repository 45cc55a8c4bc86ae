"""A compiled full-batch solver for any optax transformation, and vmapped sweeps."""

from __future__ import annotations

import enum
import itertools
import math
import numbers
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common
from hdm_optax import _staging

__all__ = (
  "Status",
  "SolveResult",
  "SweepResult",
  "Trace",
  "best_index",
  "cache_at_params",
  "solve",
  "status_message",
  "sweep",
  "value_and_grad_from_state",
)


class Status(enum.IntEnum):
  """How a run ended: :attr:`SolveResult.status` (an int32 array of these values).

  Attributes:
    CONVERGED: ``||grad f(params)||_inf <= tol``.
    MAX_STEPS: ``max_steps`` updates made, or ``max_grad_evals`` reached, before ``tol``.
    NON_FINITE: f or grad f is not finite at the current iterate.
    STOPPED: stopped by ``sweep(stop_at_first_converged=True)`` when another point converged.
    STALLED: ``max_null_steps`` consecutive null steps (updates that left the iterate
      where it was).
    UNBOUNDED: ``f(params) < min_value``: the objective looks unbounded below.
  """

  CONVERGED = 0
  MAX_STEPS = 1
  NON_FINITE = 2
  STOPPED = 3
  STALLED = 4
  UNBOUNDED = 5

  @property
  def message(self) -> str:
    """What the status means, in one line."""
    return _MESSAGES[self]


_MESSAGES = {
  Status.CONVERGED: "converged: ||grad f||_inf <= tol",
  Status.MAX_STEPS: "max_steps or max_grad_evals reached before ||grad f||_inf <= tol",
  Status.NON_FINITE: "f or grad f is not finite at the current iterate",
  Status.STOPPED: "stopped by sweep(stop_at_first_converged=True) before the end",
  Status.STALLED: "stalled: max_null_steps consecutive null steps (the iterate did not move)",
  Status.UNBOUNDED: "unbounded: f < min_value (the objective looks unbounded below)",
}

CONVERGED = Status.CONVERGED
MAX_STEPS = Status.MAX_STEPS
NON_FINITE = Status.NON_FINITE
STOPPED = Status.STOPPED
STALLED = Status.STALLED
UNBOUNDED = Status.UNBOUNDED
STATUS_MESSAGES = {int(s): s.message for s in Status}


def status_message(status) -> Union[str, list]:
  """The message of a status code (a list of messages for an array of codes)."""
  codes = np.asarray(status)
  if codes.ndim == 0:
    return Status(int(codes)).message
  return [Status(int(c)).message for c in codes.ravel()]


def _with_null_run(message: str, status: Status, null_run: int) -> str:
  if status != Status.MAX_STEPS or null_run == 0:
    return message
  return (
    f"{message}; the last {null_run} updates were null steps (the iterate did not move; "
    "max_null_steps= stops such a run early)"
  )


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
    value: f(params), always evaluated at ``params``.
    grad_norm: ||grad f(params)||_inf.
    num_steps: number of ``update`` calls made.
    num_value_evals: objective evaluations, the initial one included.
    num_grad_evals: gradient evaluations, the initial one included.
    converged: whether ||grad f(params)||_inf <= tol (and f(params) finite and
      >= ``min_value``).
    status: a :class:`Status` code; :attr:`message` says what it means.
    trace: :class:`Trace`, arrays of length ``max_steps + 1``.
    null_run: the number of null steps at the end of the run (consecutive
      updates that left the iterate where it was).
    aux: with ``has_aux=True``, the auxiliary output of ``fun`` at ``params``;
      ``None`` otherwise.
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
  null_run: jax.Array
  aux: Any = None

  @property
  def message(self) -> Union[str, list]:
    """:func:`status_message` of ``status``, and the final run of null steps if any.

    Outside ``jit``; a list for the batched results of :func:`sweep`.
    """
    codes = np.asarray(self.status)
    nulls = np.broadcast_to(np.asarray(self.null_run), codes.shape)
    messages = [
      _with_null_run(Status(int(code)).message, Status(int(code)), int(null))
      for code, null in zip(codes.ravel(), nulls.ravel())
    ]
    return messages[0] if codes.ndim == 0 else messages


class _Carry(NamedTuple):
  """The loop state of one run: the iterate, f and grad f there, the counters."""

  params: Any
  state: Any
  value: jax.Array
  grad: Any
  grad_norm: jax.Array
  num_steps: jax.Array
  num_value_evals: jax.Array
  num_grad_evals: jax.Array
  accepted: jax.Array
  null_run: jax.Array


class _Limits(NamedTuple):
  """The stopping rule's numbers (arguments of the compiled program)."""

  tol: Any
  max_grad_evals: Any
  max_null_steps: Any
  min_value: Any


def _inf_norm(tree):
  return optax.tree.norm(tree, ord=jnp.inf)


def _differ(a, b):
  return jnp.any(a != b)


def _total(state, key):
  """Sum of every ``key`` field in ``state`` (0 if there is none)."""
  found = optax.tree.get_all_with_path(state, key)
  return sum((jnp.asarray(v, jnp.int32) for _, v in found), jnp.zeros([], jnp.int32))


def _calls_in_update(old_state, new_state):
  """(value, grad) evaluations that ``update`` made between the two states.

  hdm_optax states count them in ``info`` (``num_value_evals``,
  ``num_grad_evals``); optax's linesearches (``optax.lbfgs``) make one
  value-and-gradient call per linesearch step (``num_linesearch_steps``); other
  transformations do not call the oracle. Every occurrence in the state counts
  (several HDM transformations in one chain).
  """
  searched = _total(new_state, "num_linesearch_steps")
  values = _total(new_state, "num_value_evals") - _total(old_state, "num_value_evals")
  grads = _total(new_state, "num_grad_evals") - _total(old_state, "num_grad_evals")
  return values + searched, grads + searched


# Wrappers whose update is their inner transformation's update, unchanged (or,
# for apply_if_finite, zero together with the inner state put back).
_FORWARDING_STATES = tuple(
  getattr(optax, name)
  for name in ("InjectHyperparamsState", "InjectStatefulHyperparamsState", "ApplyIfFiniteState")
  if hasattr(optax, name)
)


def cache_at_params(state) -> Optional[Any]:
  r"""The state whose cached ``value`` and ``grad`` are f and grad f at the new params.

  The contract: a transformation that caches ``value`` and ``grad`` in its
  state (every hdm_optax transformation, optax's linesearches and so
  ``optax.lbfgs``) caches them at ``params + u``, ``u`` the update *it*
  returned. They are f and grad f at ``optax.apply_updates(params, updates)``
  only if ``u`` reaches the params unchanged, that is if the cache holder is the
  last transformation: the state itself, the last state of an ``optax.chain``
  (a plain tuple), or the inner state of ``optax.inject_hyperparams`` or
  ``optax.apply_if_finite``, recursively. Anything else (``optax.chain(hdm_best(),
  optax.scale(0.5))``, a named chain, ``optax.MultiSteps``, ...) has no cache at
  the params. The test reads the structure of the state only: it costs nothing
  at run time.

  Args:
    state: an optimizer state.

  Returns:
    The cache-holding state (with fields ``value`` and ``grad``), or ``None``.
  """
  while True:
    if type(state) is tuple and state:  # pylint: disable=unidiomatic-typecheck
      state = state[-1]  # optax.chain: the last transformation's update is the chain's
    elif isinstance(state, _FORWARDING_STATES):
      state = state.inner_state
    else:
      break
  fields = getattr(state, "_fields", ())
  if "value" in fields and "grad" in fields and state.grad is not None:
    return state
  return None


def _has_any_cache(state) -> bool:
  return bool(optax.tree.get_all_with_path(state, "value")) and bool(
    optax.tree.get_all_with_path(state, "grad")
  )


def value_and_grad_from_state(
  fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., Any]:
  """``optax.value_and_grad_from_state`` that never returns a stale cache.

  ``value_and_grad(params, *args, state=state)`` returns the state's cached
  value and gradient only when :func:`cache_at_params` finds them at the params
  (the caching transformation is the last one); otherwise, or before the first
  update (a cached value of +inf), it evaluates ``fun``. optax's function reuses
  any cache it finds, e.g. the one of ``hdm_best`` inside ``optax.chain(hdm_best(),
  optax.scale(0.5))``, which is at another point.

  Args:
    fun: ``fun(params, *args) -> scalar`` (``-> (scalar, aux)`` with ``has_aux``).
    has_aux: as in ``jax.value_and_grad``; the aux output needs an evaluation,
      so the cache is never used with it.

  Returns:
    ``value_and_grad(params, *args, state) -> (value, grad)``.

  Examples:
    >>> import jax.numpy as jnp, optax, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> opt = optax.chain(hdm_optax.hdm_best(lipschitz=20.0), optax.scale(0.5))
    >>> x = jnp.ones(2)
    >>> state = opt.init(x)
    >>> value_and_grad = hdm_optax.value_and_grad_from_state(fun)
    >>> for _ in range(5):
    ...   value, grad = value_and_grad(x, state=state)
    ...   updates, state = opt.update(grad, state, x, value=value, grad=grad,
    ...                               value_fn=fun)
    ...   x = optax.apply_updates(x, updates)
    >>> bool(jnp.allclose(value_and_grad(x, state=state)[0], fun(x)))
    True
  """

  def evaluate(params, *args):
    return _common.value_and_grad(lambda p: fun(p, *args), params, has_aux=has_aux)

  def value_and_grad(params, *args, state):
    holder = None if has_aux else cache_at_params(state)
    if holder is None:
      return evaluate(params, *args)
    fresh = jnp.isfinite(holder.value)
    return jax.lax.cond(fresh, lambda: (holder.value, holder.grad), lambda: evaluate(params, *args))

  return value_and_grad


def _check_value_dtype(value, params):
  dtype = _common.params_dtype(params)
  if jnp.result_type(value) != dtype:
    raise TypeError(
      f"fun returns a {jnp.result_type(value)} value for {dtype} params, so the run would "
      f"silently change precision; compute in {dtype}: cast the data in fun_args (e.g. "
      f"jax.tree.map(lambda a: a.astype(jnp.{dtype}), fun_args)) or the params to "
      f"{jnp.result_type(value)}."
    )


class _Run:
  """The pieces of one run, so that ``solve`` and ``sweep`` share one loop body.

  The :class:`Trace` is kept beside the :class:`_Carry` so that ``sweep`` can
  write one column per lockstep iteration (a cheap dynamic slice, not a
  batched scatter) and keep it out of the per-point select that freezes
  finished points.
  """

  def __init__(self, optimizer, fun, max_steps=0, fun_args=(), limits=None, has_aux=False):
    self.optimizer = optimizer
    self.max_steps = max_steps
    self.limits = _check_limits(0.0, None, None, None) if limits is None else limits
    self.has_aux = has_aux
    self.fun_and_aux = lambda p: fun(p, *fun_args)
    # The optimizer sees the scalar objective.
    self.value_fn = (lambda p: fun(p, *fun_args)[0]) if has_aux else self.fun_and_aux

  def evaluate(self, params):
    """f and grad f at ``params`` (one oracle call)."""
    out, grad = _common.value_and_grad(self.fun_and_aux, params, has_aux=self.has_aux)
    value = out[0] if self.has_aux else out
    _check_value_dtype(value, params)
    return value, grad

  def start(self, init_params, init_state) -> _Carry:
    state = self.optimizer.init(init_params) if init_state is None else init_state
    value, grad = self.evaluate(init_params)
    if cache_at_params(state) is not None:
      state = optax.tree.set(state, value=value, grad=grad)
    one = jnp.ones([], jnp.int32)
    return _Carry(
      params=init_params,
      state=state,
      value=value,
      grad=grad,
      grad_norm=_inf_norm(grad),
      num_steps=jnp.zeros([], jnp.int32),
      num_value_evals=one,
      num_grad_evals=one,
      accepted=jnp.asarray(True),
      null_run=jnp.zeros([], jnp.int32),
    )

  def new_trace(self, c: _Carry) -> Trace:
    size = [self.max_steps + 1]
    return Trace(
      value=jnp.full(size, c.value),
      grad_norm=jnp.full(size, c.grad_norm),
      accepted=jnp.ones(size, bool),
      grad_evals=jnp.ones(size, jnp.int32),
    )

  def record(self, trace: Trace, index, c: _Carry) -> Trace:
    return Trace(
      value=trace.value.at[index].set(c.value),
      grad_norm=trace.grad_norm.at[index].set(c.grad_norm),
      accepted=trace.accepted.at[index].set(c.accepted),
      grad_evals=trace.grad_evals.at[index].set(c.num_grad_evals),
    )

  def _finite(self, c):
    return jnp.isfinite(c.value) & jnp.isfinite(c.grad_norm)

  def _unbounded(self, c):
    return self._finite(c) & (c.value < jnp.asarray(self.limits.min_value, c.value.dtype))

  def _converged(self, c):
    tol = jnp.asarray(self.limits.tol, c.grad_norm.dtype)
    return (c.grad_norm <= tol) & self._finite(c) & ~self._unbounded(c)

  def _stalled(self, c):
    return c.null_run >= self.limits.max_null_steps

  def active(self, c: _Carry) -> jax.Array:
    return (
      (c.num_steps < self.max_steps)
      & (c.num_grad_evals < self.limits.max_grad_evals)
      & self._finite(c)
      & ~self._converged(c)
      & ~self._unbounded(c)
      & ~self._stalled(c)
    )

  def step(self, c: _Carry) -> _Carry:
    updates, state = self.optimizer.update(
      c.grad, c.state, c.params, value=c.value, grad=c.grad, value_fn=self.value_fn
    )
    params = optax.apply_updates(c.params, updates)
    values, grads = _calls_in_update(c.state, state)
    holder = cache_at_params(state)
    if holder is not None:
      value, grad = holder.value, holder.grad
    else:
      if _has_any_cache(state):
        warnings.warn(
          "solve: the optimizer caches f and grad f, but a later transformation may change "
          "its update, so the cache is not known to be at the new params: f is evaluated again "
          "at every step (one more oracle call). Put the caching transformation (hdm_*, "
          "optax.lbfgs) last in the chain.",
          stacklevel=2,
        )
      value, grad = self.evaluate(params)
      values, grads = values + 1, grads + 1
    moved = jnp.any(jnp.stack(jax.tree.leaves(jax.tree.map(_differ, params, c.params))))
    return _Carry(
      params=params,
      state=state,
      value=jnp.asarray(value, c.value.dtype),
      grad=grad,
      grad_norm=_inf_norm(grad),
      num_steps=c.num_steps + 1,
      num_value_evals=c.num_value_evals + values,
      num_grad_evals=c.num_grad_evals + grads,
      accepted=moved,
      null_run=jnp.where(moved, 0, c.null_run + 1),
    )

  def finish(self, c: _Carry, tr: Trace) -> SolveResult:
    # Freeze the tail of the trace at the final values.
    tail = jnp.arange(self.max_steps + 1, dtype=c.num_steps.dtype) > c.num_steps
    trace = Trace(
      value=jnp.where(tail, c.value, tr.value),
      grad_norm=jnp.where(tail, c.grad_norm, tr.grad_norm),
      accepted=jnp.where(tail, False, tr.accepted),
      grad_evals=jnp.where(tail, c.num_grad_evals, tr.grad_evals),
    )
    status = jnp.select(
      [
        ~self._finite(c),
        self._unbounded(c),
        self._converged(c),
        self._stalled(c),
        self.active(c),
      ],
      [NON_FINITE, UNBOUNDED, CONVERGED, STALLED, STOPPED],
      MAX_STEPS,
    )
    num_value_evals, aux = c.num_value_evals, None
    if self.has_aux:  # one more evaluation of f (no gradient) gives aux at params
      aux = self.fun_and_aux(c.params)[1]
      num_value_evals = num_value_evals + 1
    return SolveResult(
      params=c.params,
      state=c.state,
      value=c.value,
      grad_norm=c.grad_norm,
      num_steps=c.num_steps,
      num_value_evals=num_value_evals,
      num_grad_evals=c.num_grad_evals,
      converged=self._converged(c),
      status=status.astype(jnp.int32),
      trace=trace,
      null_run=c.null_run,
      aux=aux,
    )


def _solve(optimizer, fun, max_steps, has_aux, init_params, fun_args, limits, init_state):
  run = _Run(optimizer, fun, max_steps, fun_args, limits, has_aux)

  def body(carry):
    c, trace = carry
    c = run.step(c)
    return c, run.record(trace, c.num_steps, c)

  c = run.start(init_params, init_state)
  c, trace = jax.lax.while_loop(lambda carry: run.active(carry[0]), body, (c, run.new_trace(c)))
  return run.finish(c, trace)


_solve_jit = jax.jit(_solve, static_argnums=(0, 1, 2, 3))

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
    return not _is_concrete(args)
  return _trace_state(None) != _EVAL_TRACE


def _is_concrete(value) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value))


def _check_limits(tol, max_null_steps, min_value, max_grad_evals) -> _Limits:
  """Checks the stopping rule's arguments (traced values are not checked)."""
  if isinstance(tol, (str, bytes, bool)) or tol is None:
    raise TypeError(f"tol must be a number >= 0, got {tol!r}")
  if _is_concrete(tol):
    t = np.asarray(tol)
    if t.ndim != 0 or not t >= 0:
      raise ValueError(
        f"tol must be a scalar >= 0 (the run stops once ||grad f||_inf <= tol), got {tol!r}; "
        "pass e.g. tol=1e-6, or tol=0.0 to run to max_steps."
      )
  if max_null_steps is None:
    max_null_steps = np.iinfo(np.int32).max
  elif (
    not isinstance(max_null_steps, (int, np.integer))
    or isinstance(max_null_steps, bool)
    or (max_null_steps < 1)
  ):
    raise ValueError(
      f"max_null_steps must be an int >= 1 or None (never stall), got {max_null_steps!r}"
    )
  if min_value is None:
    min_value = -math.inf
  elif (
    not isinstance(min_value, numbers.Real) or isinstance(min_value, bool) or math.isnan(min_value)
  ):
    raise ValueError(f"min_value must be a number or None, got {min_value!r}")
  if max_grad_evals is None:
    max_grad_evals = np.iinfo(np.int32).max
  elif not isinstance(max_grad_evals, (int, np.integer)) or max_grad_evals < 1:
    raise ValueError(f"max_grad_evals must be an int >= 1 or None, got {max_grad_evals!r}")
  return _Limits(
    tol=tol,
    max_grad_evals=jnp.asarray(max_grad_evals, jnp.int32),
    max_null_steps=jnp.asarray(max_null_steps, jnp.int32),
    min_value=float(min_value),
  )


def _check_max_steps(max_steps) -> int:
  if not isinstance(max_steps, (int, np.integer)) or isinstance(max_steps, bool) or max_steps < 0:
    raise ValueError(f"max_steps must be a non-negative int, got {max_steps!r}")
  return int(max_steps)


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
  init_state: Optional[Any] = None,
  fun_args: Sequence[Any] = (),
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = DEFAULT_MAX_NULL_STEPS,
  min_value: Optional[float] = -1e20,
  has_aux: bool = False,
) -> SolveResult:
  r"""Minimizes ``fun(params, *fun_args)`` with ``optimizer``, compiled end to end.

  The run is one ``lax.while_loop`` over ``jax.value_and_grad(fun)``. It stops
  (freezes) once :math:`\|\nabla f(x)\|_\infty \le` ``tol``, after
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

  Returns:
    A :class:`SolveResult`.

  Raises:
    ValueError: for a ``tol`` that is not a number >= 0 (``nan``, negative), and
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
  limits = _check_limits(tol, max_null_steps, min_value, max_grad_evals)
  fun_args = tuple(fun_args)
  _common.params_dtype(init_params)
  solve_fn = _solve if _under_trace(init_params, fun_args, tol, init_state) else _solve_jit
  return solve_fn(
    optimizer, fun, max_steps, bool(has_aux), init_params, fun_args, limits, init_state
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
    return _Run(make_optimizer(**point), fun, max_steps, fun_args, limits, has_aux)

  def active(batch):
    columns, c, _ = batch
    return jax.vmap(lambda point, c: run(point).active(c))(columns, c)

  def advance(batch, t):
    # Points that are done stay frozen (as in a vmapped while_loop); the active
    # ones have made t - 1 steps, so their entry t is step k + 1.
    columns, c, trace = batch
    keep = active(batch)
    c = jax.vmap(optax.tree.where)(keep, jax.vmap(lambda p, c: run(p).step(c))(columns, c), c)
    trace = jax.vmap(lambda p, tr, c: run(p).record(tr, t, c))(columns, trace, c)
    return columns, c, trace

  def stop(batch):
    if not stop_at_first:
      return jnp.asarray(False)
    columns, c, _ = batch
    return jnp.any(jax.vmap(lambda p, c: run(p)._converged(c))(columns, c))  # pylint: disable=protected-access

  c = jax.vmap(lambda point: run(point).start(init_params, None))(columns)
  trace = jax.vmap(lambda point, c: run(point).new_trace(c))(columns, c)
  batch = _staging.run_in_stages(
    sizes, (columns, c, trace), active=active, advance=advance, stop=stop
  )
  _, c, trace = batch
  return jax.vmap(lambda point, c, tr: run(point).finish(c, tr))(columns, c, trace)


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
  limits = _check_limits(tol, max_null_steps, min_value, max_grad_evals)
  dtype = _common.params_dtype(init_params)
  columns = {n: _grid_column(n, [p[n] for p in points], dtype) for n in names}
  results = _sweep_jit(
    make_optimizer,
    fun,
    max_steps,
    bool(has_aux),
    bool(stop_at_first_converged),
    _staging.stage_sizes(len(points), bool(compact)),
    columns,
    init_params,
    tuple(fun_args),
    limits,
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
