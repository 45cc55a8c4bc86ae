"""hdm_optax transformations as optimistix minimisers (needs ``pip install optimistix``).

``import hdm_optax`` does not import this module; it needs the optional
dependency ``optimistix`` (the ``bench`` extra).
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
  import equinox as eqx
  import equinox.internal as eqxi
  import optimistix as optx
except ImportError as err:
  raise ImportError(
    f"hdm_optax.optimistix_adapter needs optimistix ({err}); install it with "
    "`pip install optimistix` or `pip install 'hdm_optax[bench]'`."
  ) from err

from hdm_optax.driver import engine
from hdm_optax.driver import protocol
from hdm_optax.driver.adjoint import ImplicitGradientWarning
from hdm_optax.driver.limits import Limits
from hdm_optax.driver.results import Status

__all__ = ("ActiveBoundAdjointWarning", "HDMMinimiser", "HDMMinimiserState")


class ActiveBoundAdjointWarning(ImplicitGradientWarning):
  """optimistix's ``ImplicitAdjoint`` differentiated a solution held by a bound: wrong.

  A subclass of :class:`hdm_optax.ImplicitGradientWarning`, so a filter on either applies.
  """


_ACTIVE_BOUND = (
  "optx.minimise(..., HDMMinimiser(...)) returned a point where {count} variable(s) are "
  "held by a bound of the optimizer's box, and optimistix's ImplicitAdjoint differentiates "
  "it: that adjoint differentiates grad f(y) = 0, which does not hold on an active bound, "
  "so this derivative is wrong (it is not 0 for the bound variables, and the others are "
  "off too). For the right one pass adjoint=optx.RecursiveCheckpointAdjoint() to "
  "optx.minimise (it differentiates the iterations, projections included), or use "
  "hdm_optax.solve / hdm_optax.minimize with the same box (their implicit rule holds the "
  "bound variables fixed)."
)

# optimistix's ImplicitAdjoint (optimistix._ad.implicit_jvp) reruns the solve inside the
# tangent rule of its custom_jvp; a solve traced there is being differentiated by it.
_RULE_MODULE, _RULE_NAME = "optimistix._ad", "_implicit_impl_jvp"


@functools.cache
def _rule_is_known() -> bool:
  """Whether the installed optimistix's implicit custom_jvp has the tangent rule that
  :func:`_in_implicit_rule` looks for (equinox keeps it in its wrapper's closure)."""
  impl = getattr(sys.modules.get(_RULE_MODULE), "_implicit_impl", None)
  wrapper = getattr(getattr(impl, "fn", None), "jvp", None)
  for cell in getattr(wrapper, "__closure__", None) or ():
    try:
      code = getattr(cell.cell_contents, "__code__", None)
    except ValueError:  # an empty cell
      continue
    if getattr(code, "co_name", None) == _RULE_NAME:
      return True
  return False


def _in_implicit_rule() -> bool:
  """Whether this trace runs inside optimistix's implicit tangent rule (is differentiated).

  Where the installed optimistix has no such rule, True: a solve that may be
  differentiated by an adjoint it cannot see is warned about rather than left silent.
  """
  if not _rule_is_known():
    return True
  frame = sys._getframe(1)
  while frame is not None:
    code = frame.f_code
    if code.co_name == _RULE_NAME and frame.f_globals.get("__name__") == _RULE_MODULE:
      return True
    frame = frame.f_back
  return False


def _warn_active_bound(count):
  if int(count):
    warnings.warn(_ACTIVE_BOUND.format(count=int(count)), ActiveBoundAdjointWarning)


def _check_tolerance(name: str, value) -> None:
  """Refuses a concrete ``value`` that is no finite scalar >= 0; a traced one is the run's."""
  fix = f"pass a number >= 0, e.g. {name}={1e-6 if name == 'atol' else 0.0}"
  if isinstance(value, (str, bytes)):
    raise TypeError(f"HDMMinimiser: {name} must be a number, got {value!r}; {fix}.")
  try:
    concrete = np.asarray(value, dtype=np.float64)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  except (TypeError, ValueError):
    raise TypeError(
      f"HDMMinimiser: {name} must be a number, got {type(value).__name__}; {fix}."
    ) from None
  if concrete.ndim or not 0 <= concrete < np.inf:
    raise ValueError(
      f"HDMMinimiser: {name} must be finite and >= 0 (a scalar), got {value!r}; {fix}."
    )


class HDMMinimiserState(eqx.Module):
  """State of :class:`HDMMinimiser` (``solution.state`` after a solve).

  Attributes:
    loop: the :class:`hdm_optax.LoopState` of the run (``loop.params`` is y; its
      ``status`` is the stop rule's, :func:`hdm_optax.driver.engine.judge`).
  """

  loop: engine.LoopState

  @property
  def grad_norm(self):
    """``norm(grad)``, with the minimiser's ``norm`` (of the projected gradient with a box)."""
    return self.loop.grad_norm

  @property
  def tol(self):
    """The stopping threshold, ``atol + rtol * norm(grad f(y0))``."""
    return self.loop.tol

  @property
  def opt_state(self):
    """The optax state of the wrapped transformation."""
    return self.loop.opt_state

  @property
  def value(self):
    """f(y) at the current iterate y."""
    return self.loop.value

  @property
  def grad(self):
    """grad f(y)."""
    return self.loop.grad

  @property
  def accepted(self):
    """Whether the last step moved y (False after a null step)."""
    return self.loop.accepted

  @property
  def num_value_evals(self):
    """Objective evaluations so far, the one at y0 included."""
    return self.loop.num_value_evals

  @property
  def num_grad_evals(self):
    """Gradient evaluations so far, the one at y0 included."""
    return self.loop.num_grad_evals


class HDMMinimiser(optx.AbstractMinimiser):
  r"""Runs an hdm_optax (or any optax) transformation under ``optimistix.minimise``.

  Each step is one iteration of :func:`hdm_optax.solve`'s loop: ``update``
  gets f and grad f at y, and the value and gradient that hdm_optax
  transformations cache at their accepted point are reused, so an HDM
  iteration costs one oracle call (``optimistix.OptaxMinimiser`` makes two:
  it recomputes them at every step). Transformations without a cache (e.g.
  ``optax.adam``) get one value-and-gradient call after each update.

  The solve stops when

  .. math::
    \operatorname{norm}(\nabla f(y)) \le \mathrm{atol} + \mathrm{rtol}\,
    \operatorname{norm}(\nabla f(y^0)),

  checked at y0 and after every step (with ``rtol=0`` and the default max
  norm this is ``solve``'s ``||grad f||_inf <= tol``, ``tol = atol``), or with
  ``RESULTS.nonfinite`` when f or grad f is not finite at y, or with
  ``RESULTS.nonlinear_max_steps_reached`` before a step once ``max_grad_evals``
  gradient calls have been made (``solve``'s ``max_grad_evals``: the same run,
  call for call; optimistix's ``max_steps`` counts updates, as ``solve``'s
  ``max_steps``, so ``max_steps=1000`` alone allows 1001 gradient calls). A null step
  (y unchanged) does not stop it, unlike ``OptaxMinimiser``'s test on the
  change of y and f. ``solution.stats`` holds ``num_steps`` (updates, as
  ``solve``'s ``num_steps``), ``num_grad_evals`` and ``num_value_evals`` (every
  call, the one at y0 and linesearch or probe calls included; an aux output
  (``has_aux=True``) costs one more objective call at the solution), and
  ``solution.state`` is an :class:`HDMMinimiserState`.

  optimistix differentiates the solve with the ``adjoint=`` passed to
  ``optimistix.minimise``. Its default ``ImplicitAdjoint`` differentiates grad f(y) = 0,
  which does not hold where a bound of the optimizer's box holds a variable: differentiated
  there, the derivative is wrong and :class:`ActiveBoundAdjointWarning` says so (pass
  ``adjoint=optimistix.RecursiveCheckpointAdjoint()``, or use :func:`hdm_optax.solve` with
  the same box). As with optimistix's own solvers, a run that did not converge
  (``throw=False``) is differentiated without a warning; ``sol.result`` says it failed.

  The analysis of the paper is for deterministic, smooth f.

  Example:
    >>> import jax.numpy as jnp, optimistix as optx, hdm_optax
    >>> from hdm_optax.optimistix_adapter import HDMMinimiser
    >>> fn = lambda x, a: jnp.sum(a * x ** 2)
    >>> sol = optx.minimise(fn, HDMMinimiser(hdm_optax.hdm_best(lipschitz=200.0), atol=1e-4),
    ...                     jnp.ones(3), jnp.array([1.0, 10.0, 100.0]), max_steps=500)
    >>> bool(jnp.max(jnp.abs(sol.state.grad)) <= 1e-4)
    True
    >>> int(sol.stats["num_grad_evals"]) == int(sol.stats["num_steps"]) + 1
    True

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229 (2025).
  """

  optim: Any
  rtol: float
  atol: float
  norm: Callable[[Any], jax.Array]
  max_grad_evals: Optional[int]

  def __init__(
    self,
    optim: optax.GradientTransformation,
    rtol: float = 0.0,
    atol: float = 1e-4,
    norm: Callable[[Any], jax.Array] = optx.max_norm,
    max_grad_evals: Optional[int] = None,
  ):
    """Wraps ``optim``.

    Args:
      optim: an optax transformation (every hdm_optax transformation).
      rtol: relative tolerance on the gradient norm (relative to the norm at
        y0), a finite scalar >= 0 (checked where concrete, a JAX array included;
        a traced value is not).
      atol: absolute tolerance on the gradient norm, a finite scalar >= 0 (checked
        as ``rtol``).
      norm: the norm of the gradient, ``pytree -> scalar``
        (``optimistix.max_norm``, ``rms_norm`` or ``two_norm``).
      max_grad_evals: stop before a step once this many gradient calls have
        been made, the one at y0 included (an update that calls several times,
        such as a linesearch, may end above it), as ``solve``'s
        ``max_grad_evals``. ``None``: no limit but optimistix's ``max_steps``.

    Raises:
      ValueError: a concrete ``rtol`` or ``atol`` that is negative, infinite, NaN or not
        a scalar; a bad ``max_grad_evals``.
      TypeError: a tolerance that is no number; a ``norm`` that is not callable.
    """
    _check_tolerance("rtol", rtol)
    _check_tolerance("atol", atol)
    Limits(max_grad_evals=max_grad_evals).checked()
    if not callable(norm):
      raise TypeError(f"HDMMinimiser: norm must be callable, got {type(norm).__name__}.")
    # Optax transformations are closures; as pytrees, arrays they close over
    # are traced rather than baked into the program (as OptaxMinimiser does).
    self.optim = eqxi.closure_to_pytree(optim)
    self.rtol = rtol
    self.atol = atol
    self.norm = norm
    self.max_grad_evals = None if max_grad_evals is None else int(max_grad_evals)

  def _loop(self, fn, args):
    """:func:`hdm_optax.loop` for ``fn(y, args) -> (f, aux)`` (aux dropped), with the
    minimiser's norm; optimistix's ``max_steps`` is the only step limit."""
    return engine.loop(
      self.optim,
      lambda y: fn(y, args)[0],
      tol=self.atol,
      max_steps=None,
      max_grad_evals=self.max_grad_evals,
      min_value=None,
      norm=self.norm,
    )

  def init(self, fn, y, args, options, f_struct, aux_struct, tags):
    del options, f_struct, aux_struct, tags
    run = self._loop(fn, args)
    s = run.start(y)
    # optimistix's threshold, atol + rtol norm(grad f(y0)), judged again at y0.
    tol = jnp.asarray(self.atol + self.rtol * s.grad_norm, s.value.dtype)
    return HDMMinimiserState(loop=run.stop(s._replace(tol=tol), 0))

  def step(self, fn, y, args, options, state, tags):
    del options, tags
    s = self._loop(fn, args).step(state.loop._replace(params=y))
    # The aux of fn is not computed during the run (that would cost a call
    # per step); postprocess evaluates it once at the solution. args may hold
    # non-array leaves (functions): eval_shape closes over them.
    aux_struct = jax.eval_shape(lambda y: fn(y, args), y)[1]
    aux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_struct)
    return s.params, HDMMinimiserState(loop=s), aux

  def terminate(self, fn, y, args, options, state, tags):
    del y, options, tags
    run = self._loop(fn, args)
    status = run.status(state.loop)
    result = optx.RESULTS.where(
      status == Status.NON_FINITE, optx.RESULTS.nonfinite, optx.RESULTS.successful
    )
    spent = status == Status.MAX_STEPS
    result = optx.RESULTS.where(spent, optx.RESULTS.nonlinear_max_steps_reached, result)
    return run.done(state.loop), result

  def postprocess(self, fn, y, aux, args, options, state, tags, result):
    del options, tags, result
    box = protocol.box_of(state.opt_state)
    if box is not None and _in_implicit_rule():
      free, _ = box.free_at_solution(y, state.grad, state.tol)
      bound = sum(jnp.sum(~leaf) for leaf in jax.tree.leaves(free))
      jax.debug.callback(_warn_active_bound, bound)
    stats = dict(num_grad_evals=state.num_grad_evals, num_value_evals=state.num_value_evals)
    if jax.tree.leaves(aux):
      aux = fn(y, args)[1]
      stats["num_value_evals"] = stats["num_value_evals"] + 1
    return y, aux, stats
