r"""The loop of a run, as three pure functions: ``start``, ``step``, ``done``.

:func:`loop` builds a :class:`Loop` for an optax transformation and an
objective, as ``optax`` builds a ``GradientTransformation`` (``init``,
``update``): ``start(params)`` evaluates f and grad f at the first point,
``step(s)`` makes one update and leaves f and grad f at the new params in the
:class:`LoopState`, ``done(s)`` is the stopping rule. Every function is pure
and traceable, so a loop runs in Python, under ``jax.lax.while_loop``, under
``jax.vmap`` or a step at a time in a training script:

.. code-block:: python

  run = hdm_optax.loop(hdm_optax.hdm_best(), fun, tol=1e-6, max_steps=500)
  s = run.start(x0)
  while not run.done(s):
    s = run.step(s)
  # or: s = jax.lax.while_loop(lambda s: ~run.done(s), run.step, run.start(x0))

:func:`hdm_optax.solve`, :func:`hdm_optax.sweep`,
:func:`hdm_optax.minibatch_step` and the optimistix adapter run this loop.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common
from hdm_optax.driver import cache as cache_lib
from hdm_optax.driver.results import Status
from hdm_optax.pieces import box as box_lib

__all__ = (
  "Limits",
  "Loop",
  "LoopState",
  "build",
  "carried",
  "check_limits",
  "check_tolerance",
  "converged_status",
  "loop",
  "restored",
  "stopping_rule",
)


class LoopState(NamedTuple):
  """Where a run is: the iterate, f and grad f there, and the counters.

  Attributes:
    params: the current iterate.
    opt_state: the optimizer state.
    value: f(params), always at ``params``.
    grad: grad f(params).
    grad_norm: ``||grad||_inf``; where the optimizer holds a box (``lower=`` / ``upper=``),
      the projected gradient ``||P(params - grad) - params||_inf``.
    num_steps: ``update`` calls made.
    num_value_evals: objective evaluations, the one at the first point included.
    num_grad_evals: gradient evaluations, the one at the first point included.
    accepted: whether the last step moved the iterate (True at the start).
    null_run: consecutive steps, up to the last, that left the iterate where it was.
  """

  params: Any
  opt_state: Any
  value: jax.Array
  grad: Any
  grad_norm: jax.Array
  num_steps: jax.Array
  num_value_evals: jax.Array
  num_grad_evals: jax.Array
  accepted: jax.Array
  null_run: jax.Array


class Limits(NamedTuple):
  """The stopping rule's numbers, as :func:`check_limits` returns them.

  Attributes:
    tol: stop once ``||grad f||_inf <= tol``.
    max_steps: stop after this many updates.
    max_grad_evals: stop before an update once this many gradient calls were made.
    max_null_steps: stop after this many consecutive null steps.
    min_value: stop once ``f < min_value``.
    ftol: SciPy's relative decrease of f (:func:`hdm_optax.minimize`'s watched loop,
      ``hdm_optax.driver.watch``); ``None`` elsewhere.
  """

  tol: Any
  max_steps: Any
  max_grad_evals: Any
  max_null_steps: Any
  min_value: Any
  ftol: Any = None


class Loop(NamedTuple):
  """The loop of one run (built by :func:`loop`); every function is pure.

  Attributes:
    start: ``start(params, opt_state=None) -> LoopState``: f and grad f at
      ``params`` (one oracle call); ``opt_state`` resumes a run (default:
      ``optimizer.init(params)``).
    update: ``update(s) -> (params, opt_state, value_evals, grad_evals)``: one
      ``optimizer.update`` at ``s`` (given f, grad f and ``value_fn``), applied,
      and the oracle calls it made; f and grad f at the new params are not
      known yet.
    step: ``step(s) -> LoopState``: ``update``, then f and grad f at the new
      params, from the optimizer's cache when it is at the params (no call),
      otherwise one counted call.
    done: ``done(s) -> bool``: the stopping rule holds (``status(s)`` is not
      ``STOPPED``).
    status: ``status(s) -> int32``: the :class:`Status` a run that ends at
      ``s`` reports; ``STOPPED`` while the rule does not hold.
  """

  start: Callable[..., LoopState]
  update: Callable[[LoopState], tuple]
  step: Callable[[LoopState], LoopState]
  done: Callable[[LoopState], jax.Array]
  status: Callable[[LoopState], jax.Array]


def _concrete(value) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value))


def _int_or_none(name, value, lower, never, fix):
  """An int >= lower (a concrete scalar; a traced value passes unchecked), None -> ``never``."""
  if value is None:
    return jnp.asarray(never, jnp.int32)
  if not _concrete(value):
    return value
  v = np.asarray(value)
  if isinstance(value, bool) or v.ndim != 0 or v.dtype.kind not in "iu" or not v >= lower:
    raise ValueError(f"{name} must be an int >= {lower} or None ({fix}), got {value!r}")
  return jnp.asarray(int(v), jnp.int32)


def check_tolerance(name: str, value: Any, meaning: str, fix: str) -> Any:
  """Checks a gradient tolerance (``tol``, ``rtol``): a scalar >= 0; traced values pass.

  Args:
    name: the argument's name.
    value: its value.
    meaning: what it stops, for the message.
    fix: an example of a valid value, for the message.

  Returns:
    ``value``.

  Raises:
    TypeError: ``value`` is not a number (a string, a bool, ``None``).
    ValueError: ``value`` is not a scalar >= 0 (``nan``, negative, an array).
  """
  if isinstance(value, (str, bytes, bool)) or value is None:
    raise TypeError(f"{name} must be a number >= 0 ({meaning}), got {value!r}; {fix}.")
  if _concrete(value):
    try:
      t = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
      raise TypeError(f"{name} must be a number >= 0 ({meaning}), got {value!r}; {fix}.") from None
    if t.ndim != 0 or not t >= 0:
      raise ValueError(f"{name} must be a scalar >= 0 ({meaning}), got {value!r}; {fix}.")
  return value


def check_limits(
  *,
  tol: Any = 1e-4,
  max_steps: Optional[int] = None,
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = None,
  min_value: Optional[float] = None,
) -> Limits:
  """Checks the stopping rule's numbers; traced values pass unchecked.

  Args:
    tol: a scalar >= 0.
    max_steps: an int >= 0, or ``None`` (no limit).
    max_grad_evals: an int >= 1, or ``None`` (no limit).
    max_null_steps: an int >= 1, or ``None`` (no limit).
    min_value: a number, or ``None`` (-inf).

  Returns:
    :class:`Limits`: the counts as int32 arrays (``None`` as the int32 maximum),
    ``min_value`` as a float.

  Raises:
    TypeError: ``tol`` is not a number.
    ValueError: a number out of its range, naming it and the fix.
  """
  check_tolerance(
    "tol",
    tol,
    "the run stops once ||grad f||_inf <= tol",
    "pass e.g. tol=1e-6, or tol=0.0 to run to max_steps",
  )
  never = np.iinfo(np.int32).max
  if min_value is None:
    min_value = -math.inf
  elif _concrete(min_value) and not isinstance(min_value, jax.Array):
    if not isinstance(min_value, numbers.Real) or isinstance(min_value, bool):
      raise ValueError(f"min_value must be a number or None, got {min_value!r}")
    if math.isnan(min_value):
      raise ValueError(f"min_value must be a number or None, got {min_value!r}")
    min_value = float(min_value)
  return Limits(
    tol=tol,
    max_steps=_int_or_none("max_steps", max_steps, 0, never, "no limit"),
    max_grad_evals=_int_or_none("max_grad_evals", max_grad_evals, 1, never, "no limit"),
    max_null_steps=_int_or_none("max_null_steps", max_null_steps, 1, never, "never stall"),
    min_value=min_value,
  )


def _check_value_dtype(value, params):
  dtype = _common.params_dtype(params)
  if jnp.result_type(value) != dtype:
    raise TypeError(
      f"fun returns a {jnp.result_type(value)} value for {dtype} params, so the run would "
      f"silently change precision; compute in {dtype}: cast the data in fun_args (e.g. "
      f"jax.tree.map(lambda a: a.astype(jnp.{dtype}), fun_args)) or the params to "
      f"{jnp.result_type(value)}."
    )


def _backend() -> str:
  return jax.default_backend()


def _default_precision_products(fun, params) -> int:
  """The float32 matrix products ``fun`` makes at JAX's default precision (traced once)."""

  def count(jaxpr) -> int:
    found = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        precision = eqn.params.get("precision")
        default = precision is None or all(
          p in (None, jax.lax.Precision.DEFAULT)
          for p in (precision if isinstance(precision, tuple) else (precision,))
        )
        matrix = max(v.aval.ndim for v in eqn.invars) >= 2  # not a dot of two vectors
        found += default and matrix and any(v.aval.dtype == jnp.float32 for v in eqn.invars)
    return found + sum(count(sub) for sub in jex.subjaxprs(jaxpr))

  return count(jax.make_jaxpr(fun)(params).jaxpr)


def _warn_tf32(fun, params) -> None:
  """On a GPU, warns of float32 products that JAX's default precision lets run in TF32."""
  if _backend() != "gpu" or _common.params_dtype(params) != jnp.float32:
    return
  try:
    products = _default_precision_products(fun, params)
  except Exception:  # advisory only: a fun this check cannot trace is left to the run
    return
  if products:
    warnings.warn(
      f"fun makes {products} float32 matrix product(s) at JAX's default precision, which "
      "an NVIDIA GPU (Ampere or later) may compute in TF32 (inputs rounded to 10 bits of "
      "mantissa): f then carries errors near 1e-3 of its terms, far above float32's "
      "rounding, and a test that compares values of f (HDM's acceptance, a line search) "
      "compares that noise. Compute them in float32: jax.config.update("
      "'jax_default_matmul_precision', 'highest') or precision='highest' on the products "
      "(docs/pitfalls.md).",
      stacklevel=2,
    )


def _inf_norm(tree):
  return optax.tree.norm(tree, ord=jnp.inf)


def _box(opt_state):
  return box_lib.held_box(opt_state, cache_lib.cache_at_params(opt_state))


def converged_status(opt_state) -> Status:
  """The status of a converged run: ``CONVERGED_IN_BOX`` where the optimizer holds a box."""
  return Status.CONVERGED if _box(opt_state) is None else Status.CONVERGED_IN_BOX


def _stationarity(params, grad, opt_state):
  """``||grad||_inf``, or the projected gradient's where the optimizer holds a box."""
  box = _box(opt_state)
  return _inf_norm(grad) if box is None else box_lib.projected_gradient_norm(box, params, grad)


def carried(s: LoopState) -> LoopState:
  """``s`` as a compiled loop carries it: ``grad`` left out where the optimizer's cache holds it.

  The cache's gradient and ``s.grad`` are one array (:func:`loop`'s ``step`` reads one
  from the other); carried twice, XLA copied it at every step. :func:`restored` puts it back.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> from hdm_optax.driver import loops
    >>> run = loops.loop(hdm_optax.trial_lbfgs(), lambda x: jnp.sum(x**2))
    >>> s = run.step(run.start(jnp.ones(3)))
    >>> back = loops.restored(loops.carried(s))
    >>> loops.carried(s).grad is None, bool(jnp.all(back.grad == s.grad))
    (True, True)
  """
  if cache_lib.cache_at_params(s.opt_state) is None:
    return s
  return s._replace(grad=None)


def restored(s: LoopState) -> LoopState:
  """The :class:`LoopState` that :func:`carried` left out ``grad`` of."""
  if s.grad is not None:
    return s
  return s._replace(grad=cache_lib.cache_at_params(s.opt_state).grad)


def _moved(new, old) -> jax.Array:
  # A count, not jnp.any: XLA on CPU fuses the comparison into a sum, not into an any.
  changed = jax.tree.map(lambda a, b: jnp.sum(a != b, dtype=jnp.int32), new, old)
  return functools.reduce(jnp.add, jax.tree.leaves(changed)) > 0


def loop(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., Any],
  *,
  fun_args: Sequence[Any] = (),
  tol: Any = 1e-4,
  max_steps: Optional[int] = None,
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = None,
  min_value: Optional[float] = None,
  has_aux: bool = False,
) -> Loop:
  r"""The loop that minimizes ``fun(params, *fun_args)`` with ``optimizer``.

  ``update`` receives ``value``, ``grad`` and ``value_fn`` (f of the params),
  as every hdm_optax transformation needs; other optax transformations ignore
  them. Every oracle call is counted: the one at the first point, those
  ``update`` makes (:func:`hdm_optax.driver.cache.calls_in_update`), and one
  after each update when the optimizer's cache is not at the new params
  (:func:`hdm_optax.driver.cache.cache_at_params`; a warning says to put the
  caching transformation last). ``done`` holds once
  :math:`\|\nabla f(x)\|_\infty \le` ``tol`` (where the optimizer holds a box,
  ``lower=`` / ``upper=``, once the projected gradient
  :math:`\|P(x - \nabla f(x)) - x\|_\infty \le` ``tol``, status ``CONVERGED_IN_BOX``;
  ``start`` projects an infeasible x0 onto the box), after ``max_steps`` updates, once
  ``max_grad_evals`` gradient calls were made (checked before an update: a
  linesearch may end above it), when f or grad f is not finite, when
  f < ``min_value`` or after ``max_null_steps`` consecutive null steps;
  ``status`` says which. The limits may be traced (e.g. a vmapped ``tol``).

  Args:
    optimizer: an optax transformation.
    fun: ``fun(params, *fun_args) -> scalar`` of the params' dtype
      (``-> (scalar, aux)`` with ``has_aux``; the aux output is dropped).
    fun_args: extra arguments of ``fun``, any pytree leaves (functions too).
    tol: stop once ``||grad f||_inf <= tol`` (>= 0).
    max_steps: stop after this many updates (``None``: no limit).
    max_grad_evals: stop before an update once this many gradient calls were
      made (``None``: no limit).
    max_null_steps: stop after this many consecutive null steps (``None``: never).
    min_value: stop once f < min_value (``None``: never).
    has_aux: ``fun`` returns ``(value, aux)``.

  Returns:
    A :class:`Loop`.

  Raises:
    ValueError, TypeError: as :func:`check_limits`; at ``start``, a
      ``TypeError`` if ``fun`` returns another dtype than the params'.

  Examples:
    >>> import jax, jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> run = hdm_optax.loop(hdm_optax.hdm_best(lipschitz=20.0), fun, tol=1e-6,
    ...                      max_steps=500)
    >>> s = run.start(jnp.ones(2))
    >>> while not run.done(s):
    ...   s = run.step(s)
    >>> hdm_optax.Status(int(run.status(s))).name, bool(s.grad_norm <= 1e-6)
    ('CONVERGED', True)
    >>> compiled = jax.jit(lambda x: jax.lax.while_loop(
    ...     lambda s: ~run.done(s), run.step, run.start(x)))
    >>> int(compiled(jnp.ones(2)).num_steps) == int(s.num_steps)
    True
  """
  limits = check_limits(
    tol=tol,
    max_steps=max_steps,
    max_grad_evals=max_grad_evals,
    max_null_steps=max_null_steps,
    min_value=min_value,
  )
  return build(optimizer, fun, tuple(fun_args), bool(has_aux), limits)


def build(optimizer, fun, fun_args: tuple, has_aux: bool, limits: Limits) -> Loop:
  """:func:`loop` from limits already checked (:func:`check_limits`): nothing is checked again."""
  done, status = stopping_rule(limits)
  start, update, step = _moves(optimizer, fun, fun_args, has_aux)
  return Loop(start=start, update=update, step=step, done=done, status=status)


def _moves(optimizer, fun, fun_args: tuple, has_aux: bool):
  """The loop's ``start``, ``update`` and ``step`` (they do not depend on the limits)."""

  def fun_and_aux(params):
    return fun(params, *fun_args)

  value_fn = (lambda p: fun_and_aux(p)[0]) if has_aux else fun_and_aux

  def evaluate(params):
    out, grad = _common.value_and_grad(fun_and_aux, params, has_aux=has_aux)
    value = out[0] if has_aux else out
    _check_value_dtype(value, params)
    return value, grad

  def start(params, opt_state=None) -> LoopState:
    _warn_tf32(fun_and_aux, params)
    opt_state = optimizer.init(params) if opt_state is None else opt_state
    box = _box(opt_state)
    if box is not None:  # an infeasible start is projected onto the box
      params = box_lib.project(box, params)
    value, grad = evaluate(params)
    if cache_lib.cache_at_params(opt_state) is not None:
      opt_state = optax.tree.set(opt_state, value=value, grad=grad)
    one = jnp.ones([], jnp.int32)
    zero = jnp.zeros([], jnp.int32)
    return LoopState(
      params=params,
      opt_state=opt_state,
      value=value,
      grad=grad,
      grad_norm=_stationarity(params, grad, opt_state),
      num_steps=zero,
      num_value_evals=one,
      num_grad_evals=one,
      accepted=jnp.asarray(True),
      null_run=zero,
    )

  def update(s: LoopState):
    # value and grad are f and grad f at the params: hdm_optax's transformations leave their
    # stale-cache check out of the program.
    with _common.values_at_params():
      updates, opt_state = optimizer.update(
        s.grad, s.opt_state, s.params, value=s.value, grad=s.grad, value_fn=value_fn
      )
    params = optax.apply_updates(s.params, updates)
    values, grads = cache_lib.calls_in_update(s.opt_state, opt_state)
    return params, opt_state, values, grads

  def step(s: LoopState) -> LoopState:
    params, opt_state, values, grads = update(s)
    holder = cache_lib.cache_at_params(opt_state)
    if holder is not None:
      value, grad = holder.value, holder.grad
    else:
      if cache_lib.caches_anywhere(opt_state):
        warnings.warn(
          "solve: the optimizer caches f and grad f, but a later transformation may change "
          "its update, so the cache is not known to be at the new params: f is evaluated again "
          "at every step (one more oracle call). Put the caching transformation (hdm_*, "
          "optax.lbfgs) last in the chain.",
          stacklevel=3,
        )
      value, grad = evaluate(params)
      values, grads = values + 1, grads + 1
    moved = _moved(params, s.params)
    return LoopState(
      params=params,
      opt_state=opt_state,
      value=jnp.asarray(value, s.value.dtype),
      grad=grad,
      grad_norm=_stationarity(params, grad, opt_state),
      num_steps=s.num_steps + 1,
      num_value_evals=s.num_value_evals + values,
      num_grad_evals=s.num_grad_evals + grads,
      accepted=moved,
      null_run=jnp.where(moved, 0, s.null_run + 1),
    )

  return start, update, step


def stopping_rule(limits: Limits):
  """``(done, status)`` of :class:`Loop` for these limits (checked by :func:`check_limits`).

  Args:
    limits: the stopping rule's numbers; any of them may be traced.

  Returns:
    ``done(s) -> bool`` and ``status(s) -> int32``, as in :class:`Loop`.
  """

  def conditions(s: LoopState):
    finite = jnp.isfinite(s.value) & jnp.isfinite(s.grad_norm)
    unbounded = finite & (s.value < jnp.asarray(limits.min_value, s.value.dtype))
    converged = (s.grad_norm <= jnp.asarray(limits.tol, s.grad_norm.dtype)) & finite & ~unbounded
    stalled = s.null_run >= limits.max_null_steps
    spent = (s.num_steps >= limits.max_steps) | (s.num_grad_evals >= limits.max_grad_evals)
    return [~finite, unbounded, converged, stalled, spent]

  def status(s: LoopState) -> jax.Array:
    codes = [Status.NON_FINITE, Status.UNBOUNDED, converged_status(s.opt_state), Status.STALLED]
    code = jnp.select(conditions(s), codes + [Status.MAX_STEPS], Status.STOPPED)
    return code.astype(jnp.int32)

  def done(s: LoopState) -> jax.Array:
    return functools.reduce(jnp.logical_or, conditions(s))

  return done, status
