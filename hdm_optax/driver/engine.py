r"""The one loop every driver runs: ``start``, ``step``, one stop rule, one trace, one hook.

:func:`loop` builds the core iteration of a problem as a :class:`Loop`, whose methods are
pure functions: ``start(params)`` evaluates f and grad f at the first point, ``step(s)``
makes one optimizer update and leaves f and grad f at the new params in the
:class:`LoopState`, and :func:`judge` (the one stop rule) writes the run's status into the
state at both. Every driver runs this loop:

- :func:`hdm_optax.driver.runs.run` runs it to its end with a *primitive* (a
  ``while_loop``, blocks of steps, a checkpointed ``scan`` for reverse-mode
  differentiation), recording the :class:`~hdm_optax.driver.results.Trace` and calling the
  watch hook (:mod:`hdm_optax.driver.hooks`) after every step;
- :class:`hdm_optax.driver.runs.Staged` runs a batch of problems in stages that retire
  finished members;
- a user runs :func:`hdm_optax.loop`'s functions in a loop of their own.

.. code-block:: python

  run = hdm_optax.loop(hdm_optax.hdm_best(), fun, tol=1e-6, max_steps=500)
  s = run.start(x0)
  while not run.done(s):
    s = run.step(s)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import optax

from hdm_optax import _numerics
from hdm_optax import _oracle
from hdm_optax import _stale
from hdm_optax.driver import protocol
from hdm_optax.driver.limits import Limits
from hdm_optax.driver.resuming import FRESH
from hdm_optax.driver.resuming import RESUME
from hdm_optax.driver.resuming import Resume
from hdm_optax.driver.limits import takes_limits
from hdm_optax.driver.results import Status

__all__ = ("RUNNING", "Loop", "LoopState", "judge", "loop", "make_loop")

# The status a state carries while its run goes on (never reported: see Loop.status).
RUNNING = -1


class LoopState(NamedTuple):
  """Where a run is: the iterate, f and grad f there, the counters and the status.

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
    accepted: the step rule's verdict on the last update (an hdm_optax method's
      ``info.accepted``: the trial became the iterate); True for optimizers without a step
      rule, and at the start.
    null_run: consecutive null steps (rejected updates), up to the last.
    num_null_steps: null steps so far.
    status: the :class:`Status` the run ends with here, :data:`RUNNING` while it goes on.
    tol: the gradient threshold, ``max(tol, rtol ||grad f(x0)||_inf)``.
    stopped_by: what stopped a run that ended ``STOPPED`` (:meth:`Loop.stop`'s ``cause``,
      :attr:`hdm_optax.SolveResult.stopped_by`), 0 otherwise.
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
  num_null_steps: jax.Array
  status: jax.Array
  tol: jax.Array
  stopped_by: Any = 0


def _stationarity(params, grad, opt_state, norm=None):
  """``||grad||_inf``, or the box's projected gradient's; with ``norm``, that norm of them."""
  box = protocol.box_of(opt_state)
  measured = grad if box is None else box.projected_gradient(params, grad)
  return optax.tree.norm(measured, ord=jnp.inf) if norm is None else norm(measured)


def check_value_dtype(value, params, names: protocol.ArgNames = protocol.ArgNames()):
  """A ``TypeError`` where ``fun``'s value is not of the params' dtype (no silent promotion);
  ``names``: how the door names ``fun`` and ``fun_args`` in the message."""
  dtype = _numerics.params_dtype(params)
  if jnp.result_type(value) != dtype:
    data = names.fun_args
    raise TypeError(
      names.lead(f"{names.fun} returns a {jnp.result_type(value)} value for {dtype} params, ")
      + f"so the run would silently change precision; compute in {dtype}: cast the data in "
      + f"{data} (e.g. jax.tree.map(lambda a: a.astype(jnp.{dtype}), {data})) or the params "
      + f"to {jnp.result_type(value)}."
    )


def _default_precision_products(fun, params) -> int:
  """The float32 matrix products ``fun`` makes at JAX's default precision (traced once)."""

  def count(jaxpr) -> int:
    found = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        precision = eqn.params.get("precision")
        precisions = precision if isinstance(precision, tuple) else (precision,)
        default = all(p in (None, jax.lax.Precision.DEFAULT) for p in precisions)
        matrix = max(v.aval.ndim for v in eqn.invars) >= 2
        found += default and matrix and any(v.aval.dtype == jnp.float32 for v in eqn.invars)
    return found + sum(count(sub) for sub in jex.subjaxprs(jaxpr))

  return count(jax.make_jaxpr(fun)(params).jaxpr)


def backend() -> str:
  return jax.default_backend()


def _warn_tf32(fun, params) -> None:
  """On a GPU, warns of float32 products that JAX's default precision lets run in TF32."""
  if backend() != "gpu" or _numerics.params_dtype(params) != jnp.float32:
    return
  try:
    products = _default_precision_products(fun, params)
  except Exception:  # advisory only: a fun this check cannot trace is left to the run
    return
  if products:
    warnings.warn(
      f"fun makes {products} float32 matrix product(s) at JAX's default precision, which "
      "an NVIDIA GPU (Ampere or later) may compute in TF32 (inputs rounded to 10 bits of "
      "mantissa): f then carries errors near 1e-3 of its terms, and HDM's acceptance test "
      "compares that noise. Compute them in float32: jax.config.update("
      "'jax_default_matmul_precision', 'highest') (docs/pitfalls.md).",
      stacklevel=2,
    )


def judge(
  old: LoopState, new: LoopState, limits: Limits, slope=None, halt=False, flat_before=False
) -> jax.Array:
  r"""The one stop rule: the status of a run at ``new``, reached from ``old`` (int32).

  In order of precedence: ``NON_FINITE`` (f or the gradient norm is not finite),
  ``UNBOUNDED`` (f < ``min_value``), ``CONVERGED`` / ``CONVERGED_IN_BOX`` (the gradient, or
  the box's projected gradient, within ``new.tol``), ``STALLED`` (``max_null_steps``
  rejected updates in a row), ``CONVERGED_FTOL`` (SciPy L-BFGS-B's relative decrease
  ``(f_k - f_{k+1}) <= ftol max(|f_k|, |f_{k+1}|, 1)``, tested after an accepted update
  that decreased f: a null step keeps x, and L-BFGS-B's line search only ends on a
  decrease), ``FTOL_AT_NON_FINITE`` (the same small decrease, where a trial since the
  previous accepted update met a non-finite f or grad f: the update's step was cut short
  by the edge of the region where f is finite, so the small decrease is no sign of
  convergence and the run is not a success), ``MAX_STEPS`` (``max_steps`` updates or
  ``max_grad_evals`` calls), ``STOPPED`` (``halt``: a stop asked from outside the rule, by
  a callback, Ctrl-C or a batch's first converged member), else :data:`RUNNING`.

  Departure from L-BFGS-B: where ``slope`` (:math:`\langle \nabla f(x_k), x_{k+1} -
  x_k\rangle`) is given, ``ftol`` also needs the decrease the slope predicts to be small,
  ``-slope <= 2 ftol max(...)``. A method without a line search may step across the
  minimiser to a point of nearly the same f (a quadratic's mirror point), where L-BFGS-B's
  line search would not have ended; a small decrease there is no sign of convergence.

  ``flat_before``: the ``ftol`` test held at the last update of the run that ``new``
  resumes (:attr:`hdm_optax.driver.resuming.Resume.ftol_met`): ``new`` is where that run
  converged, and a resumed run does not move from there unless asked (a smaller ``ftol``).
  """
  dtype = new.value.dtype
  finite = jnp.isfinite(new.value) & jnp.isfinite(new.grad_norm)
  unbounded = finite & (new.value < jnp.asarray(limits.min_value, dtype))
  converged = (new.grad_norm <= new.tol) & finite & ~unbounded
  stalled = new.null_run >= limits.max_null_steps
  decrease = old.value - new.value
  scale = jnp.maximum(jnp.maximum(jnp.abs(old.value), jnp.abs(new.value)), jnp.ones([], dtype))
  small = decrease <= jnp.asarray(limits.ftol, dtype) * scale
  flat = new.accepted & (decrease > 0) & small
  if slope is not None:
    flat &= -slope <= 2 * jnp.asarray(limits.ftol, dtype) * scale
  flat |= flat_before
  # The trials since the previous accepted update: before this update, and this one's own.
  nonfinite = protocol.nonfinite_trials(old.opt_state) + protocol.nonfinite_trials(new.opt_state)
  edge = flat & (nonfinite > 0)
  spent = (new.num_steps >= limits.max_steps) | (new.num_grad_evals >= limits.max_grad_evals)
  converged_code = (
    Status.CONVERGED if protocol.box_of(new.opt_state) is None else Status.CONVERGED_IN_BOX
  )
  codes = [Status.NON_FINITE, Status.UNBOUNDED, converged_code, Status.STALLED]
  codes += [Status.FTOL_AT_NON_FINITE, Status.CONVERGED_FTOL, Status.MAX_STEPS, Status.STOPPED]
  conditions = [~finite, unbounded, converged, stalled, edge, flat, spent, jnp.asarray(halt)]
  return jnp.select(conditions, [jnp.int32(c) for c in codes], jnp.int32(RUNNING))


class Loop(NamedTuple):
  """The loop of one problem (:func:`loop`): ``fun`` minimized with ``optimizer`` within
  ``limits``; every method is a pure function of the :class:`LoopState`.

  Attributes:
    optimizer: the optax transformation.
    fun: ``fun(params)`` (``-> (value, aux)`` with ``has_aux``).
    limits: the stop rule's numbers (checked); where ``limits.ftol_on`` each step forms the
      slope that :func:`judge` tests ``ftol`` with.
    has_aux: ``fun`` returns ``(value, aux)``.
    norm: the stationarity measure's norm, or ``None`` for ``||.||_inf``.
    names: how the door that made the loop names its arguments in the checks' messages.
  """

  optimizer: Any
  fun: Callable[[Any], Any]
  limits: Limits
  has_aux: bool
  norm: Optional[Callable[[Any], jax.Array]]
  names: protocol.ArgNames = protocol.ArgNames()

  def value_fn(self, params):
    """f at ``params`` (what ``update`` receives as ``value_fn``)."""
    return self.fun(params)[0] if self.has_aux else self.fun(params)

  def evaluate(self, params):
    """``(f, grad f)`` at ``params``: one oracle call, its value of the params' dtype."""
    name = self.names.lead(self.names.fun)
    out, grad = _oracle.value_and_grad(self.fun, params, has_aux=self.has_aux, name=name)
    value = out[0] if self.has_aux else out
    check_value_dtype(value, params, self.names)
    return value, grad

  def start(self, params, opt_state=None) -> LoopState:
    """f and grad f at ``params`` (one oracle call), judged; ``opt_state`` resumes a run
    (its box is replaced by the optimizer's)."""
    _warn_tf32(self.value_fn, params)
    fresh = self.optimizer.init(params)
    protocol.check_state(fresh)
    resume = opt_state if isinstance(opt_state, Resume) else Resume.of(opt_state)
    if resume.opt_state is None:
      opt_state = fresh
    else:  # a Resume's state is a placeholder where the run is fresh (one program for all)
      given = protocol.with_box_of(fresh, resume.opt_state, self.names)
      opt_state = jax.tree.map(lambda f, g: jnp.where(resume.mode == FRESH, f, g), fresh, given)
    box = protocol.box_of(opt_state)
    if box is not None:  # an infeasible start is projected onto the box
      params = box.project(params)
    value, grad, calls = _first_values(self, resume, opt_state, params)
    if protocol.cache_at_params(opt_state) is not None:
      opt_state = optax.tree.set(opt_state, value=value, grad=grad)
    measure = _stationarity(params, grad, opt_state, self.norm)
    dtype = measure.dtype
    limits = self.limits
    tol = jnp.maximum(jnp.asarray(limits.tol, dtype), jnp.asarray(limits.rtol, dtype) * measure)
    s = LoopState(
      params=params,
      opt_state=opt_state,
      value=value,
      grad=grad,
      grad_norm=measure,
      num_steps=resume.num_steps,
      num_value_evals=resume.num_value_evals + calls,
      num_grad_evals=resume.num_grad_evals + calls,
      accepted=jnp.asarray(True),
      null_run=resume.null_run,
      num_null_steps=resume.num_null_steps,
      status=jnp.int32(RUNNING),
      tol=tol,
      stopped_by=jnp.int32(0),
    )
    flat_before = False
    if resume.ftol_met is not None:  # a run that converged on ftol, resumed: it stays there
      met = jnp.asarray(resume.ftol_met, jnp.float32)
      ftol = jnp.asarray(limits.ftol, jnp.float32)
      flat_before = (resume.mode == RESUME) & (ftol > 0) & (met <= ftol)
    return s._replace(status=judge(s, s, limits, flat_before=flat_before))

  def update(self, s: LoopState):
    """``(params, opt_state, value_evals, grad_evals)``: one ``optimizer.update`` at ``s``,
    applied, and the oracle calls it made."""
    # value and grad are f and grad f at the params: no stale-cache check in the program.
    with _stale.values_at_params():
      updates, opt_state = self.optimizer.update(
        s.grad, s.opt_state, s.params, value=s.value, grad=s.grad, value_fn=self.value_fn
      )
    params = optax.apply_updates(s.params, updates)
    return params, opt_state, *protocol.calls_in_update(s.opt_state, opt_state)

  def step(self, s: LoopState) -> LoopState:
    """``update``, then f and grad f at the new params (from the optimizer's cache where it
    is at the params, else one counted call), judged."""
    params, opt_state, values, grads = self.update(s)
    value, grad, calls = _at_new_params(self, params, opt_state)
    if calls:
      values, grads = values + 1, grads + 1
    accepted = protocol.accepted(opt_state)
    new = s._replace(
      params=params,
      opt_state=opt_state,
      value=jnp.asarray(value, s.value.dtype),
      grad=grad,
      grad_norm=_stationarity(params, grad, opt_state, self.norm),
      num_steps=s.num_steps + 1,
      num_value_evals=s.num_value_evals + values,
      num_grad_evals=s.num_grad_evals + grads,
      accepted=accepted,
      null_run=jnp.where(accepted, 0, s.null_run + 1),
      num_null_steps=s.num_null_steps + (~accepted).astype(jnp.int32),
    )
    slope = None
    if self.limits.uses_ftol:
      slope = optax.tree.vdot(s.grad, optax.tree.sub(params, s.params))
    return new._replace(status=judge(s, new, self.limits, slope))

  def done(self, s: LoopState) -> jax.Array:
    """Whether the run has ended at ``s``."""
    return s.status != RUNNING

  def stop(self, s: LoopState, cause) -> LoopState:
    """``s`` judged again with ``cause``, a stop asked from outside the rule: an int32 code
    of what asked it (:attr:`hdm_optax.SolveResult.stopped_by`: a callback, Ctrl-C, a
    batch's first converged member), 0 for none. A run still going on ends ``STOPPED``
    where ``cause`` is not 0, and keeps it in ``stopped_by``."""
    cause = jnp.asarray(cause, jnp.int32)
    status = self._judged_again(s, cause != 0)
    stopped = (s.status == RUNNING) & (status == Status.STOPPED)
    return s._replace(status=status, stopped_by=jnp.where(stopped, cause, s.stopped_by))

  def status(self, s: LoopState) -> jax.Array:
    """The :class:`Status` a run that ends at ``s`` reports (``STOPPED`` while it goes on)."""
    return self._judged_again(s, True)

  def _judged_again(self, s: LoopState, halt) -> jax.Array:
    """The status at ``s`` where the run still goes on, judged with ``halt``; else its own."""
    # At s itself no update was made, so the rule's other conditions read as they did.
    return jnp.where(s.status == RUNNING, judge(s, s, self.limits, halt=halt), s.status)

  def room(self, s: LoopState, steps: int) -> jax.Array:
    """Whether ``max_steps`` leaves ``steps`` more updates after ``s`` (a primitive that
    makes several steps per test asks it)."""
    return s.num_steps <= self.limits.max_steps - steps


def _first_values(p: Loop, resume: Resume, opt_state, params):
  """f and grad f at the first point, and the calls made: a resumed run takes them from
  the optimizer's cache where it holds them (it is at the params: the run's end)."""
  holder = protocol.cache_at_params(opt_state)
  if holder is None or resume.opt_state is None:
    return (*p.evaluate(params), jnp.ones([], jnp.int32))
  cached = lambda: (jnp.asarray(holder.value, _numerics.params_dtype(params)), holder.grad)
  value, grad = jax.lax.cond(resume.mode == RESUME, cached, lambda: p.evaluate(params))
  return value, grad, (resume.mode != RESUME).astype(jnp.int32)


def _at_new_params(p: Loop, params, opt_state):
  """``(value, grad, calls)``: f and grad f at the new params, from the optimizer's cache
  where it is at them, else from one more oracle call."""
  holder = protocol.cache_at_params(opt_state)
  if holder is not None:
    return holder.value, holder.grad, 0
  if protocol.caches_anywhere(opt_state):
    warnings.warn(
      "the optimizer caches f and grad f, but a later transformation may change its "
      "update, so the cache is not known to be at the new params: f is evaluated again "
      "at every step (one more oracle call). Put the caching transformation (hdm_*, "
      "optax.lbfgs) last in the chain (optax.chain); an optax.named_chain, whose state does not "
      "say which link is last, and wrappers other than optax.inject_hyperparams and "
      "optax.apply_if_finite always pay this call.",
      stacklevel=4,
    )
  return (*p.evaluate(params), 1)


def make_loop(
  optimizer,
  fun: Callable[[Any], Any],
  limits: Limits,
  has_aux: bool = False,
  norm=None,
  names: protocol.ArgNames = protocol.ArgNames(),
) -> Loop:
  """The :class:`Loop` that minimizes ``fun(params)`` (``-> (value, aux)`` with ``has_aux``)
  within ``limits`` (checked). ``norm``: the stationarity measure's norm (default
  ``||.||_inf``); ``names``: how the calling door names its arguments in the messages."""
  return Loop(optimizer, fun, limits, bool(has_aux), norm, names)


@takes_limits
def loop(
  optimizer: optax.GradientTransformation,
  fun: Callable[..., Any],
  *,
  limits: Limits,
  fun_args: Sequence[Any] = (),
  has_aux: bool = False,
  norm: Optional[Callable[[Any], jax.Array]] = None,
) -> Loop:
  r"""The loop that minimizes ``fun(params, *fun_args)`` with ``optimizer``, for your own loop.

  ``update`` receives ``value``, ``grad`` and ``value_fn``, as every hdm_optax
  transformation needs. Every oracle call is counted. ``done`` holds once the stop rule
  (:func:`judge`) does: :math:`\|\nabla f(x)\|_\infty \le \max(\text{tol},\ \text{rtol}\,
  \|\nabla f(x_0)\|_\infty)` (the projected gradient where the optimizer holds a box;
  ``start`` projects an infeasible x0 onto it), ``ftol``, ``max_steps`` updates,
  ``max_grad_evals`` calls, a non-finite f or grad f, f < ``min_value`` or
  ``max_null_steps`` rejected updates in a row; ``status`` says which. The limits may be
  traced (e.g. a vmapped ``tol``). :func:`hdm_optax.solve` runs this loop compiled.

  Args:
    optimizer: an optax transformation.
    fun: ``fun(params, *fun_args) -> scalar`` of the params' dtype (``-> (scalar, aux)``
      with ``has_aux``).
    limits: the stopping rule's numbers: a :class:`~hdm_optax.driver.limits.Limits`, or
      its fields as keywords (``tol``, ``rtol``, ``ftol``, ``max_steps``,
      ``max_grad_evals``, ``max_null_steps``, ``min_value``), as every front door takes them.
    fun_args: extra arguments of ``fun``.
    has_aux: ``fun`` returns ``(value, aux)``; the aux output is dropped.
    norm: the norm of the gradient (or of the box's projected gradient) that ``tol`` bounds,
      ``pytree -> scalar`` (default: the max norm, ``||.||_inf``).

  Returns:
    A :class:`Loop`.

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
  optimizer = protocol.check_optimizer("loop", optimizer)
  if norm is not None and not callable(norm):
    raise TypeError(f"norm must be callable (pytree -> scalar) or None, got {norm!r}.")
  fun_args = tuple(fun_args)
  return make_loop(optimizer, lambda p: fun(p, *fun_args), limits, bool(has_aux), norm)
