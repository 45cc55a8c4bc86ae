r"""Differentiating through a run: :class:`ImplicitAdjoint` and :class:`UnrolledAdjoint`.

Every front door takes ``adjoint=``, which says how ``jax.grad``, ``jax.vjp`` and ``jax.jvp``
see the returned ``params`` (and ``value``) as functions of ``fun_args`` and of the arrays
``fun`` closes over. The adjoint picks the loop (as optimistix's ``adjoint.apply`` does):
its ``primitive`` and ``batch_primitive`` are the runs' loops
(:mod:`hdm_optax.driver.runs`), and its ``apply`` wraps the run (the implicit rule, or
nothing):

- :class:`ImplicitAdjoint` (the default): the run itself is not differentiated. At the
  returned point :math:`x^*(\theta)`, where :math:`\nabla_x f(x^*, \theta) = 0`, the
  implicit function theorem gives :math:`\partial x^* = -H^{-1} \partial_\theta \nabla_x f`
  with :math:`H = \nabla^2_{xx} f(x^*, \theta)`, solved by conjugate gradients on
  Hessian-vector products (matrix-free, preconditioned by the run's own L-BFGS pairs where
  the optimizer kept some), in a ``jax.lax.custom_linear_solve``. The rule is a
  ``jax.custom_jvp`` whose tangent rule reaches the solution through the rule itself, so it
  can be differentiated again (``jax.hessian``, ``grad`` of ``grad``). With a box, the
  variables that L-BFGS-B's projected gradient puts on a bound
  (:func:`hdm_optax.pieces.box.free_at_solution` says why this set) (:math:`x_i - g_i \le l_i`
  with :math:`g_i > 0`, or the same at :math:`u_i`) move with their bound,
  :math:`\dot x_A = \dot l_A` (or :math:`\dot u_A`), and the others solve
  :math:`H_{FF} \dot x_F = -(\partial_\theta \nabla_F f\, \dot\theta + H_{FA} \dot x_A)`
  (the KKT conditions). ``x0`` and ``init_state`` get zero derivatives.
- :class:`UnrolledAdjoint`: the run of ``max_steps`` iterations is a ``lax.scan``
  (:class:`hdm_optax.driver.runs.Scan`) and reverse mode goes through every
  iteration, each under ``jax.checkpoint``: the derivative of the truncated run as it ran.

Where the implicit rule's assumptions fail it says so, once per differentiated call, with
an :class:`ImplicitGradientWarning`:

- the run did not converge: the derivative is that of the stationarity condition at the
  returned point (first-order accurate in its gradient norm);
- a variable lies on a bound with a zero gradient (strict complementarity fails): the
  derivative is one-sided there (L-BFGS-B's projected gradient decides the side);
- conjugate gradients met non-positive curvature (:math:`H_{FF}` singular or indefinite):
  the derivative does not exist and is NaN;
- conjugate gradients used ``max_steps`` iterations before their tolerance.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _checks
from hdm_optax.driver import limits
from hdm_optax.driver import protocol
from hdm_optax.driver import runs
from hdm_optax.driver.results import Status

__all__ = (
  "ImplicitAdjoint",
  "ImplicitGradientWarning",
  "UnrolledAdjoint",
  "check_adjoint",
  "conjugate_gradient",
)


class ImplicitGradientWarning(UserWarning):
  """An implicit derivative through a run whose assumptions do not hold (see the module)."""


class _ImplicitFields(NamedTuple):
  max_steps: int
  rtol: Optional[float]
  precondition: bool


class ImplicitAdjoint(_ImplicitFields):
  r"""Derivatives of the returned point by the implicit function theorem (the default).

  Attributes:
    max_steps: conjugate-gradient iterations per linear solve (one Hessian-vector
      product each).
    rtol: stop conjugate gradients once :math:`\|r\|_2 \le` ``rtol`` :math:`\|b\|_2`;
      ``None``: :math:`\epsilon^{0.6}` of the params' dtype (4e-10 in float64, 7e-5 in
      float32).
    precondition: precondition conjugate gradients by the L-BFGS operator of the secant
      pairs in the final optimizer state (restricted to the free variables in a box),
      where the state holds some (``trial_lbfgs``).

  Examples:
    >>> import jax, jax.numpy as jnp, hdm_optax
    >>> fun = lambda x, lam: jnp.sum((x - 1.0) ** 2) + lam * jnp.sum(x**2)
    >>> def g(lam):  # x*(lam) = 1 / (1 + lam)
    ...   res = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(2), max_steps=50,
    ...                         tol=1e-10, fun_args=(lam,))
    ...   return res.params[0]
    >>> round(float(jax.grad(g)(1.0)), 6)  # -1 / (1 + lam)^2
    -0.25
    >>> round(float(jax.grad(jax.grad(g))(1.0)), 6)  # 2 / (1 + lam)^3
    0.25
  """

  __slots__ = ()

  def __new__(cls, max_steps: int = 1000, rtol: Optional[float] = None, precondition: bool = True):
    """Checks the settings: a bad one would stop conjugate gradients at once (zero
    derivatives, no warning).

    Raises:
      ValueError: ``max_steps`` not an int >= 1, or ``rtol`` neither ``None`` nor finite
        and > 0.
    """
    integral = isinstance(max_steps, numbers.Integral) and not isinstance(max_steps, bool)
    if not integral or max_steps < 1:
      raise ValueError(
        f"ImplicitAdjoint(max_steps={max_steps!r}): max_steps is the number of "
        "conjugate-gradient iterations per linear solve and must be an int >= 1; pass e.g. "
        "ImplicitAdjoint(max_steps=1000) (the default)."
      )
    if rtol is not None:
      _checks.check_positive(
        f"ImplicitAdjoint(rtol={rtol!r}): rtol",
        rtol,
        "pass a relative residual such as ImplicitAdjoint(rtol=1e-8), or rtol=None for the "
        "dtype's default",
      )
    return super().__new__(cls, int(max_steps), rtol, precondition)

  def primitive(self, check_every: int, max_steps) -> Any:
    """The loop of one run: the plain ``while_loop``, or blocks of ``check_every`` steps."""
    del max_steps  # a value of the program
    return runs.Blocks(check_every) if check_every > 1 else runs.While()

  def retires(self) -> bool:
    """Whether a batch can retire its stopped members (``compact``): yes."""
    return True

  def batch_primitive(self, size: int, compact: bool, stop_at_first_converged: bool, max_steps):
    """The loop of a batch of ``size`` members: stages that retire the finished ones
    (:func:`~hdm_optax.driver.runs.stage_sizes`; one stage without ``compact``)."""
    del max_steps
    return runs.Staged(runs.stage_sizes(size, compact), bool(stop_at_first_converged))

  def apply(self, run, objective, theta, start, batched=None, bounds=None):
    """``run(theta, start)``, differentiable in ``theta`` by the implicit function theorem.

    Args:
      run: ``run(theta, start) -> SolveResult`` (batched: one row per member).
      objective: ``objective(x, theta) -> f`` of one member.
      theta: what the objective depends on (the dynamic arguments).
      start: what the run starts from (x0, a state, the optimizer's arrays): zero
        derivative, but for the bounds ``bounds`` reads from it.
      batched: for a batch, the axes of ``theta``'s leaves over the members (``0`` or
        ``None``, a pytree prefix as ``jax.vmap``'s ``in_axes``); ``None`` for one run.
      bounds: ``bounds(start) -> Box or None``, the box the run keeps its iterate in as a
        differentiable function of ``start`` (a batch's: one row per member), or ``None``:
        the box's derivative is then taken as 0.

    Returns:
      The :class:`~hdm_optax.driver.results.SolveResult` whose ``params`` and ``value``
      carry the derivative.
    """
    return _solution(self, run, objective, batched, bounds, theta, start)


class UnrolledAdjoint(NamedTuple):
  """Derivatives through the iterations of a fixed-budget run (``lax.scan``).

  The run makes ``max_steps`` iterations (those after the stop rule held leave the state
  unchanged, so the result is the ``while_loop``'s) as one ``lax.scan`` that reverse mode
  can enter. Memory: one loop state per iteration (with ``checkpoint``, each iteration's
  insides are recomputed in the backward pass).

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

  def primitive(self, check_every: int, max_steps) -> Any:
    """The loop of one run: a ``lax.scan`` of ``max_steps`` iterations.

    Raises:
      ValueError: ``check_every`` other than 1, or ``max_steps`` not a Python int.
    """
    if check_every != 1:
      raise ValueError(
        f"UnrolledAdjoint runs a scan of max_steps iterations; check_every={check_every} "
        "blocks a while loop: pass check_every=1 with UnrolledAdjoint."
      )
    if isinstance(max_steps, jax.core.Tracer):
      raise ValueError(
        "UnrolledAdjoint needs max_steps as a Python int (the scan's length), got a traced "
        "max_steps; pass a number of iterations that is not traced, e.g. max_steps=100."
      )
    if max_steps >= limits.NEVER:  # max_steps=None (no limit), as Limits.checked gives it
      raise ValueError(
        "UnrolledAdjoint needs max_steps as a Python int (the scan's length), got "
        "max_steps=None or a count past int32's range (no limit); pass the number of "
        "iterations to unroll, e.g. max_steps=100."
      )
    return runs.Scan(int(max_steps), self.checkpoint)

  def retires(self) -> bool:
    """Whether a batch can retire its stopped members (``compact``): no, a scan runs all."""
    return False

  def batch_primitive(self, size: int, compact: bool, stop_at_first_converged: bool, max_steps):
    """The loop of a batch: every member's scan, in lockstep.

    Raises:
      ValueError: ``compact`` or ``stop_at_first_converged``, which a scan of every member
        cannot honour.
    """
    del size
    if compact:
      raise ValueError(
        "UnrolledAdjoint with compact=True is not offered: retiring members needs while "
        "loops, which reverse mode cannot enter. Pass compact=False (a lockstep scan) or the "
        "default ImplicitAdjoint."
      )
    if stop_at_first_converged:
      raise ValueError(
        "UnrolledAdjoint with stop_at_first_converged=True is not offered: every member "
        "runs its scan of max_steps iterations. Drop one of them."
      )
    return runs.Lockstep(self.primitive(1, max_steps))

  def apply(self, run, objective, theta, start, batched=None, bounds=None):
    """``run(theta, start)``: reverse mode goes through the scan's iterations."""
    del objective, batched, bounds
    return run(theta, start)


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
  definite there: x is then NaN). ``jax.scipy.sparse.linalg.cg`` does not report the last
  case, which decides whether a derivative exists.

  Args:
    matvec: :math:`v \mapsto A v`.
    b: the right-hand side, a pytree.
    precond: :math:`v \mapsto M v` with M symmetric positive definite, or ``None``.
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
  target = jnp.asarray(rtol, bb.dtype) ** 2 * bb
  z = precond(b)
  start = _CGState(optax.tree.zeros_like(b), b, z, dot(b, z), jnp.int32(0), jnp.int32(_CG_OK))

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
    outcome = jnp.where(bent, _CG_CURVATURE, _CG_OK).astype(jnp.int32)
    return _CGState(x, r, p, rz, c.steps + 1, outcome)

  end = jax.lax.while_loop(going, step, start)
  unfinished = (end.outcome == _CG_OK) & (dot(end.r, end.r) > target)
  outcome = jnp.where(unfinished, _CG_MAX_STEPS, end.outcome)
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
  "degenerate": (
    "{count} variable(s) lie within tol of a bound with a gradient within tol of zero (strict "
    "complementarity fails): the derivative is not defined there, and a one-sided one is "
    "returned (L-BFGS-B's projected gradient decides which side). Move the bound, or compare "
    "with finite differences."
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


def _warn(outcome, converged, status, degenerate):
  outcome, converged, status = np.asarray(outcome), np.asarray(converged), np.asarray(status)
  if not np.all(converged):
    codes = sorted({int(c) for c in np.atleast_1d(status[~converged])})
    names = ", ".join(Status(c).name for c in codes)
    warnings.warn(_WARNINGS["unconverged"].format(status=names), ImplicitGradientWarning)
  if np.any(degenerate):
    count = int(np.sum(degenerate))
    warnings.warn(_WARNINGS["degenerate"].format(count=count), ImplicitGradientWarning)
  for code in (_CG_CURVATURE, _CG_MAX_STEPS):
    if np.any(outcome == code):
      warnings.warn(_WARNINGS[code], ImplicitGradientWarning)


def _where_free(free, v, other):
  if free is None:
    return v
  return jax.tree.map(lambda f, a, o: jnp.where(f, a, o), free, v, other)


def _zero_tangent(tree):
  def zero(a):
    if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
      return jnp.zeros_like(a)
    return np.zeros(np.shape(a), jax.dtypes.float0)

  return jax.tree.map(zero, tree)


def _check_forward_mode(objective, x, theta) -> None:
  """Raises :data:`_REVERSE_ONLY` where grad f has no forward-mode derivative (a
  ``jax.custom_vjp`` in f's gradient): JAX traces such a JVP and fails only when the program
  is lowered, in the backward pass, so its Hessian-vector product is lowered here, once per
  differentiated program (nothing is compiled or run)."""
  shaped = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
  hvp = lambda y, th: jax.jvp(lambda z: jax.grad(objective)(z, th), (y,), (y,))
  try:
    jax.jit(hvp).lower(jax.tree.map(shaped, x), jax.tree.map(shaped, theta))
  except TypeError as error:
    if "custom_vjp" in str(error):
      raise TypeError(_REVERSE_ONLY) from error
    raise


def _held_tangent(box_dot, x, grad_x):
  """The tangent of each variable held on a bound: its bound's tangent (the lower one where
  the gradient pushes down, :func:`~hdm_optax.pieces.box.free_at_solution`'s side)."""

  def leaf(lo_dot, hi_dot, xi, gi):
    held = jnp.where(gi > 0, lo_dot, hi_dot)
    return jnp.broadcast_to(held, jnp.shape(xi)).astype(jnp.result_type(xi))

  return jax.tree.map(leaf, box_dot.lower, box_dot.upper, x, grad_x)


def _tangent_of(adjoint, objective, result, theta, theta_dot, box_dot=None):
  r"""``(x_dot, value_dot)`` of one solution by the implicit function theorem.

  With a box, a variable held on a bound moves with it (``box_dot``, the box's tangent, or
  none), and the free ones solve :math:`H_{FF} \dot x_F = -(\partial_\theta \nabla_F f\,
  \dot\theta + H_{FA} \dot x_A)`."""
  x = result.params
  _check_forward_mode(objective, x, theta)
  gradient = jax.grad(objective)
  grad_x = gradient(x, theta)
  box = protocol.box_of(result.state)
  free, degenerate = (
    (None, jnp.int32(0)) if box is None else box.free_at_solution(x, grad_x, result.tol)
  )
  zero = optax.tree.zeros_like(x)
  # The right-hand side -(d/dtheta grad_x f) theta_dot - H_FA x_dot_A, on the free variables.
  _, cross = jax.jvp(lambda th: gradient(x, th), (theta,), (theta_dot,))
  held = None
  if free is not None and box_dot is not None:
    held = _where_free(free, zero, _held_tangent(box_dot, x, grad_x))
    pushed = jax.jvp(lambda y: gradient(y, theta), (x,), (held,))[1]
    cross = optax.tree.add(cross, pushed)
  rhs = _where_free(free, optax.tree.scale(-1.0, cross), zero)

  def matvec(v):  # H on the free variables, the identity on the others
    hv = jax.jvp(lambda y: gradient(y, theta), (x,), (_where_free(free, v, zero),))[1]
    return _where_free(free, hv, v)

  precond = None
  if adjoint.precondition:  # H_m of the run's pairs on the free variables (or None)
    precond = protocol.preconditioner(jax.lax.stop_gradient(result.state), free)
  dtype = jax.tree.leaves(x)[0].dtype
  rtol = adjoint.rtol if adjoint.rtol is not None else float(jnp.finfo(dtype).eps) ** 0.6

  def solve(matvec, b):
    x, _, outcome = conjugate_gradient(matvec, b, precond, max_steps=adjoint.max_steps, rtol=rtol)
    jax.debug.callback(_warn, outcome, result.converged, result.status, degenerate)
    return x

  x_dot = jax.lax.custom_linear_solve(matvec, rhs, solve, symmetric=True)
  if held is not None:
    x_dot = _where_free(free, x_dot, held)
  _, value_dot = jax.jvp(objective, (x, theta), (x_dot, theta_dot))
  return x_dot, value_dot


_REVERSE_ONLY = (
  "the implicit derivative of a solve needs forward-mode derivatives of grad f (jax.jvp of "
  "jax.grad(fun): Hessian-vector products and the cross term d/dtheta grad f), but fun, or "
  "its gradient, contains a jax.custom_vjp that JAX cannot differentiate in forward mode "
  "(such as diffrax's default RecursiveCheckpointAdjoint). Pass "
  "adjoint=hdm_optax.UnrolledAdjoint() (reverse mode through the iterations: it needs only "
  "reverse-over-reverse derivatives of fun), or make fun forward-differentiable (diffrax: "
  "adjoint=diffrax.DirectAdjoint() or diffrax.ForwardMode(); docs/gradients.md, 'What fun "
  "must support')."
)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3, 4))
def _solution(adjoint, run, objective, batched, bounds, theta, start):
  del adjoint, objective, batched, bounds
  return run(theta, start)


@_solution.defjvp
def _solution_jvp(adjoint, run, objective, batched, bounds, primals, tangents):
  theta, start = primals
  theta_dot, start_dot = tangents
  # Through the rule itself: the solution inside the tangent is differentiable again.
  result = _solution(adjoint, run, objective, batched, bounds, theta, start)
  box_dot = None if bounds is None else jax.jvp(bounds, (start,), (start_dot,))[1]
  tangent = functools.partial(_tangent_of, adjoint, objective)
  if batched is not None:  # one solution per member
    tangent = jax.vmap(tangent, in_axes=(0, batched, batched, 0))
  x_dot, value_dot = tangent(result, theta, theta_dot, box_dot)
  return result, _zero_tangent(result)._replace(params=x_dot, value=value_dot)
