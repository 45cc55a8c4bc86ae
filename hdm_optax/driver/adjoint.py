r"""Differentiating through a run: :class:`ImplicitAdjoint` and :class:`UnrolledAdjoint`.

:func:`hdm_optax.solve` and :func:`hdm_optax.minimize` take ``adjoint=``, which says how
``jax.grad``, ``jax.vjp`` and ``jax.jvp`` see the returned ``params`` (and ``value``) as
functions of ``fun_args`` (``args``):

- :class:`ImplicitAdjoint` (the default): the run itself is not differentiated. At the
  returned point :math:`x^*(\theta)`, where :math:`\nabla_x f(x^*, \theta) = 0`, the
  implicit function theorem gives :math:`\partial x^* = -H^{-1} \partial_\theta \nabla_x f`
  with :math:`H = \nabla^2_{xx} f(x^*, \theta)`. The rule is one ``jax.custom_jvp`` whose
  tangent is a ``jax.lax.custom_linear_solve`` of :math:`H` (symmetric, so its transpose
  is itself): ``jax.jvp`` solves once per tangent, ``jax.grad``/``jax.vjp`` once per
  cotangent, both by conjugate gradients on Hessian-vector products (matrix-free,
  preconditioned by the run's own L-BFGS pairs where the optimizer kept some). With a box,
  the variables at a bound with the gradient pushing outward (the binding set of
  :func:`hdm_optax.pieces.box.free_mask`) have derivative 0 and the system is
  :math:`H_{FF}` on the free ones; this assumes strict complementarity (no variable at a
  bound with a zero gradient) and that the binding set does not change under a small
  change of :math:`\theta`. ``x0`` and ``init_state`` get zero derivatives.
- :class:`UnrolledAdjoint`: the run of ``max_steps`` iterations is a ``lax.scan`` (a step
  after the stopping rule held leaves the state as it is) and reverse mode goes through
  every iteration, each under ``jax.checkpoint``: the derivative of the truncated run as
  it ran, what an unconverged run or a hypergradient with respect to an optimizer's own
  settings (a step size passed as a traced value) needs.

Where the implicit rule's assumptions fail it says so, once per differentiated call, with
an :class:`ImplicitGradientWarning` (``warnings.filterwarnings("error",
category=hdm_optax.ImplicitGradientWarning)`` turns it into an error):

- the run did not converge: the derivative is that of the stationarity condition at the
  returned point (first-order accurate in its gradient norm), finite;
- conjugate gradients met non-positive curvature (:math:`H_{FF}` singular or indefinite:
  no minimiser, or not an isolated one): the derivative does not exist and is NaN (a
  singular direction that the right-hand side does not reach is not seen: there the
  minimum-norm solution is returned);
- conjugate gradients used ``max_steps`` iterations before their tolerance: the
  derivative is its last iterate, inexact.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax.driver import cache as cache_lib
from hdm_optax.driver.results import Trace
from hdm_optax.pieces import box as box_lib
from hdm_optax.pieces.lbfgs import bounded as bounded_lib
from hdm_optax.pieces.lbfgs import memory as memory_lib

__all__ = (
  "ImplicitAdjoint",
  "ImplicitGradientWarning",
  "UnrolledAdjoint",
  "check_adjoint",
  "conjugate_gradient",
  "differentiable_run",
  "unrolled_run",
)


class ImplicitGradientWarning(UserWarning):
  """An implicit derivative through a run whose assumptions do not hold (see the module)."""


class ImplicitAdjoint(NamedTuple):
  r"""Derivatives of the returned point by the implicit function theorem (the default).

  Attributes:
    max_steps: conjugate-gradient iterations per linear solve (one Hessian-vector
      product each).
    rtol: stop conjugate gradients once :math:`\|r\|_2 \le` ``rtol`` :math:`\|b\|_2`;
      ``None``: :math:`\epsilon^{0.6}` of the params' dtype (4e-10 in float64, 7e-5 in
      float32).
    precondition: precondition conjugate gradients by the L-BFGS operator of the secant
      pairs in the final optimizer state (restricted to the free variables in a box),
      where the state holds some (``trial_lbfgs``); no effect otherwise.

  Examples:
    >>> import jax, jax.numpy as jnp, hdm_optax
    >>> fun = lambda x, lam: jnp.sum((x - 1.0) ** 2) + lam * jnp.sum(x**2)
    >>> def g(lam):  # x*(lam) = 1 / (1 + lam)
    ...   res = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(2), max_steps=50,
    ...                         tol=1e-10, fun_args=(lam,))
    ...   return res.params[0]
    >>> round(float(jax.grad(g)(1.0)), 6)  # -1 / (1 + lam)^2
    -0.25
  """

  max_steps: int = 1000
  rtol: Optional[float] = None
  precondition: bool = True


class UnrolledAdjoint(NamedTuple):
  """Derivatives through the iterations of a fixed-budget run (``lax.scan``).

  The run makes ``max_steps`` iterations of the loop (those after the stopping rule held
  leave the state unchanged, so the result is the ``while_loop``'s), as one ``lax.scan``
  that reverse mode can enter. Memory: one loop state per iteration (the scan's carry;
  with ``checkpoint`` each iteration's insides are recomputed in the backward pass).

  Attributes:
    checkpoint: wrap each iteration in ``jax.checkpoint``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 4.0]) * x**2)
    >>> def final_value(lr):  # the classical hypergradient of a run's final loss
    ...   res = hdm_optax.solve(optax.sgd(lr), fun, jnp.ones(2), max_steps=5, tol=0.0,
    ...                         adjoint=hdm_optax.UnrolledAdjoint())
    ...   return res.value
    >>> bool(jax.grad(final_value)(0.05) < 0)
    True
  """

  checkpoint: bool = True


def check_adjoint(adjoint) -> Any:
  """``adjoint``, ``ImplicitAdjoint()`` for ``None``; a clear error for anything else."""
  if adjoint is None:
    return ImplicitAdjoint()
  if isinstance(adjoint, (ImplicitAdjoint, UnrolledAdjoint)):
    return adjoint
  raise TypeError(
    f"adjoint must be hdm_optax.ImplicitAdjoint() or hdm_optax.UnrolledAdjoint(), got "
    f"{adjoint!r}; pass adjoint=hdm_optax.UnrolledAdjoint() to differentiate through the "
    "iterations of a fixed-budget run."
  )


# --- conjugate gradients ---------------------------------------------------------------

# CG's outcome: its tolerance met; max_steps used first; non-positive curvature met.
_CG_OK, _CG_MAX_STEPS, _CG_CURVATURE = 0, 1, 2


class _CGState(NamedTuple):
  x: Any
  r: Any
  p: Any
  rz: jax.Array
  steps: jax.Array
  outcome: jax.Array


def conjugate_gradient(matvec, b, precond=None, *, max_steps=1000, rtol=1e-10):
  r"""Solves :math:`A x = b` for a symmetric positive definite ``matvec``, on pytrees.

  Preconditioned conjugate gradients (Hestenes and Stiefel; Nocedal and Wright,
  Algorithm 5.3) from x = 0, stopped once :math:`\|r\|_2 \le` ``rtol`` :math:`\|b\|_2`,
  after ``max_steps`` iterations, or where :math:`p^T A p \le 0` (A is not positive
  definite there: x is then NaN).

  Args:
    matvec: :math:`v \mapsto A v`.
    b: the right-hand side, a pytree.
    precond: :math:`v \mapsto M v` with M symmetric positive definite (M approximates
      :math:`A^{-1}`), or ``None``.
    max_steps: iterations allowed.
    rtol: relative residual at which to stop.

  Returns:
    ``(x, steps, outcome)``: the solution, the iterations made, and 0 (tolerance met),
    1 (``max_steps`` used first) or 2 (non-positive curvature).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.driver import adjoint
    >>> a = jnp.array([[4.0, 1.0], [1.0, 3.0]])
    >>> x, steps, outcome = adjoint.conjugate_gradient(lambda v: a @ v, jnp.array([1.0, 2.0]))
    >>> [round(float(v), 5) for v in x], int(steps), int(outcome)
    ([0.09091, 0.63636], 2, 0)
  """
  precond = precond or (lambda v: v)
  dot = lambda u, v: optax.tree.vdot(u, v).real
  bb = dot(b, b)
  dtype = bb.dtype
  target = jnp.asarray(rtol, dtype) ** 2 * bb
  z = precond(b)
  start = _CGState(
    optax.tree.zeros_like(b), b, z, dot(b, z), jnp.asarray(0, jnp.int32), jnp.asarray(_CG_OK)
  )

  def going(c):
    return (c.outcome == _CG_OK) & (dot(c.r, c.r) > target) & (c.steps < max_steps)

  def step(c):
    ap = matvec(c.p)
    pap = dot(c.p, ap)
    bent = ~(pap > 0)  # also NaN
    alpha = c.rz / jnp.where(bent, 1, pap)
    x = optax.tree.add_scale(c.x, alpha, c.p)
    r = optax.tree.add_scale(c.r, -alpha, ap)
    z = precond(r)
    rz = dot(r, z)
    p = optax.tree.add_scale(z, rz / jnp.where(c.rz == 0, 1, c.rz), c.p)
    outcome = jnp.where(bent, _CG_CURVATURE, _CG_OK)
    return _CGState(x, r, p, rz, c.steps + 1, outcome)

  end = jax.lax.while_loop(going, step, start)
  outcome = jnp.where(
    (end.outcome == _CG_OK) & (dot(end.r, end.r) > target), _CG_MAX_STEPS, end.outcome
  )
  bad = outcome == _CG_CURVATURE
  x = jax.tree.map(lambda a: jnp.where(bad, jnp.asarray(jnp.nan, a.dtype), a), end.x)
  return x, end.steps, outcome


# --- the implicit rule -------------------------------------------------------------------

_WARNINGS = {
  "unconverged": (
    "the run did not converge (status {status}), so its params are not a stationary point: "
    "the implicit derivative is that of the stationarity condition at them, accurate to "
    "first order in ||grad f||. Raise max_steps or lower tol, or pass "
    "adjoint=hdm_optax.UnrolledAdjoint() for the derivative of the truncated run."
  ),
  _CG_CURVATURE: (
    "the Hessian on the free variables is singular or indefinite at the returned point "
    "(conjugate gradients met non-positive curvature): the minimiser is not isolated, its "
    "derivative does not exist, and it is NaN."
  ),
  _CG_MAX_STEPS: (
    "conjugate gradients did not reach their tolerance in ImplicitAdjoint(max_steps=...) "
    "iterations: the derivative is their last iterate, inexact. Raise max_steps, or loosen "
    "rtol."
  ),
}


def _warn(outcome, converged, status):
  outcome, converged, status = np.asarray(outcome), np.asarray(converged), np.asarray(status)
  if not np.all(converged):
    codes = sorted({int(c) for c in status[~converged].ravel()}) if status.ndim else [int(status)]
    warnings.warn(_WARNINGS["unconverged"].format(status=codes), ImplicitGradientWarning)
  for code in (_CG_CURVATURE, _CG_MAX_STEPS):
    if np.any(outcome == code):
      warnings.warn(_WARNINGS[code], ImplicitGradientWarning)


class _Facts(NamedTuple):
  """What the rule needs of the run besides the point (no derivative flows through them)."""

  box: Any
  memory: Any
  converged: jax.Array
  status: jax.Array


def _where_free(free, v, other):
  if free is None:
    return v
  return jax.tree.map(lambda f, a, o: jnp.where(f, a, o), free, v, other)


def _preconditioner(memory, free):
  """:math:`v \\mapsto H_m v` of the run's pairs on the free variables (identity elsewhere)."""
  if memory is None:
    return None
  if free is not None:
    memory = bounded_lib.restricted_memory(memory, free)
  kept = memory.rho != 0
  per_pair = lambda a, b: sum(
    jnp.sum((u * v).reshape(u.shape[0], -1), axis=1)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  sy = jnp.sum(jnp.where(kept, per_pair(memory.s, memory.y), 0))
  yy = jnp.sum(jnp.where(kept, per_pair(memory.y, memory.y), 0))
  gamma = jnp.where(yy > 0, sy / jnp.where(yy > 0, yy, 1), 1)

  def apply(v):
    zero = optax.tree.zeros_like(v)
    return _where_free(
      free, memory_lib.two_loop_recursion(memory, gamma, _where_free(free, v, zero)), v
    )

  return apply


def _cg_solver(adjoint: ImplicitAdjoint, precond, facts: _Facts, dtype):
  rtol = adjoint.rtol if adjoint.rtol is not None else float(jnp.finfo(dtype).eps) ** 0.6

  def solve(matvec, b):
    x, _, outcome = conjugate_gradient(matvec, b, precond, max_steps=adjoint.max_steps, rtol=rtol)
    jax.debug.callback(_warn, outcome, facts.converged, facts.status)
    return x

  return solve


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _implicit_point(adjoint, objective, x, value, theta, facts):
  """``(x, value)``, differentiable in ``theta`` by the implicit function theorem."""
  del adjoint, objective, theta, facts
  return x, value


@_implicit_point.defjvp
def _implicit_point_jvp(adjoint, objective, primals, tangents):
  x, value, theta, facts = primals
  _, _, theta_dot, _ = tangents
  gradient = jax.grad(objective)
  grad_x = gradient(x, theta)
  free = None if facts.box is None else box_lib.free_mask(facts.box, x, grad_x)
  zero = optax.tree.zeros_like(x)
  # The right-hand side -(d/dtheta grad_x f) theta_dot, on the free variables.
  _, cross = jax.jvp(lambda th: gradient(x, th), (theta,), (theta_dot,))
  rhs = _where_free(free, optax.tree.scale(-1.0, cross), zero)

  def matvec(v):  # H on the free variables, the identity on the others
    hv = jax.jvp(lambda y: gradient(y, theta), (x,), (_where_free(free, v, zero),))[1]
    return _where_free(free, hv, v)

  precond = _preconditioner(facts.memory, free) if adjoint.precondition else None
  dtype = jax.tree.leaves(x)[0].dtype
  solver = _cg_solver(adjoint, precond, facts, dtype)
  x_dot = jax.lax.custom_linear_solve(matvec, rhs, solver, symmetric=True)
  _, value_dot = jax.jvp(objective, (x, theta), (x_dot, theta_dot))
  return (x, value), (x_dot, value_dot)


def _secant_memory(state) -> Optional[memory_lib.SecantMemory]:
  found = [
    leaf
    for leaf in jax.tree.leaves(state, is_leaf=lambda a: isinstance(a, memory_lib.SecantMemory))
    if isinstance(leaf, memory_lib.SecantMemory)
  ]
  return found[0] if len(found) == 1 else None


def _implicit_run(adjoint, run, fun, has_aux, init_params, fun_args, init_state):
  value_of = (lambda out: out[0]) if has_aux else (lambda out: out)
  # Arrays that fun closes over become arguments (differentiable as fun_args are).
  closed, consts = jax.closure_convert(lambda x, a: fun(x, *a), init_params, fun_args)
  stop = jax.lax.stop_gradient
  stopped = stop(consts)
  result = run(
    lambda x, *a: closed(x, a, *stopped),
    stop(init_params),
    stop(fun_args),
    stop(init_state),
  )
  box = box_lib.held_box(result.state, cache_lib.cache_at_params(result.state))
  facts = _Facts(box, _secant_memory(result.state), result.converged, result.status)
  objective = lambda x, theta: value_of(closed(x, theta[0], *theta[1]))
  params, value = _implicit_point(
    adjoint, objective, result.params, result.value, (fun_args, list(consts)), facts
  )
  return result._replace(params=params, value=value)


def differentiable_run(
  adjoint,
  run: Callable[..., Any],
  unrolled: Callable[..., Any],
  traced: bool,
  fun,
  has_aux,
  init_params,
  fun_args,
  init_state,
):
  """The run of ``solve``, differentiable as ``adjoint`` says.

  Args:
    adjoint: :class:`ImplicitAdjoint`, :class:`UnrolledAdjoint` or ``None`` (implicit).
    run: ``run(fun, init_params, fun_args, init_state) -> SolveResult``, the
      ``while_loop`` run.
    unrolled: the same signature, the ``lax.scan`` run of :class:`UnrolledAdjoint`
      (:func:`unrolled_run`).
    traced: whether the call is inside a JAX trace (outside one nothing is differentiated
      and ``run`` is called as it is).
    fun: the objective.
    has_aux: whether ``fun`` returns ``(value, aux)``.
    init_params: x0.
    fun_args: the objective's arguments.
    init_state: the optimizer state to start from, or ``None``.

  Returns:
    The :class:`hdm_optax.SolveResult`, whose ``params`` and ``value`` carry the derivative.
  """
  adjoint = check_adjoint(adjoint)
  if isinstance(adjoint, UnrolledAdjoint):
    return unrolled(fun, init_params, fun_args, init_state)
  if not traced:
    return run(fun, init_params, fun_args, init_state)
  return _implicit_run(adjoint, run, fun, has_aux, init_params, fun_args, init_state)


# --- the unrolled run --------------------------------------------------------------------


def _unrolled(
  adjoint, optimizer, fun, has_aux, max_steps, init_params, fun_args, limits, state, rtol
):
  from hdm_optax.driver import compiled  # pylint: disable=import-outside-toplevel

  run, s, tol = compiled._start(  # pylint: disable=protected-access
    optimizer, fun, fun_args, has_aux, limits, rtol, init_params, state
  )

  def body(s, _):
    s = jax.lax.cond(run.done(s), lambda s: s, run.step, s)  # frozen once the rule held
    return s, (s.value, s.grad_norm, s.accepted, s.num_grad_evals)

  if adjoint.checkpoint:
    body = jax.checkpoint(body)
  end, entries = jax.lax.scan(body, s, length=max_steps)
  first = (s.value, s.grad_norm, s.accepted, s.num_grad_evals)
  trace = Trace(*(jnp.concatenate([a[None], b]) for a, b in zip(first, entries)))
  return compiled._finish(run, end, trace, fun, fun_args, has_aux, tol)  # pylint: disable=protected-access


_unrolled_jit = jax.jit(_unrolled, static_argnums=(0, 1, 2, 3, 4))


def unrolled_run(adjoint, optimizer, has_aux, max_steps, traced, limits, rtol):
  """``solve``'s run as a ``lax.scan`` of ``max_steps`` iterations (:class:`UnrolledAdjoint`).

  Returns ``run(fun, init_params, fun_args, init_state) -> SolveResult``. An iteration after
  the stopping rule held leaves the loop state as it is (a ``lax.cond``: reverse mode goes
  through the iterations made; under ``vmap`` both branches run and the frozen ones get a
  zero cotangent), so the result, counts and trace are those of the ``while_loop`` run.
  Compiled once per configuration outside a trace, inline inside one.
  """
  scan = _unrolled if traced else _unrolled_jit

  def run(fun, init_params, fun_args, init_state):
    settings = (adjoint, optimizer, fun, bool(has_aux), max_steps)
    return scan(*settings, init_params, fun_args, limits, init_state, rtol)

  return run
