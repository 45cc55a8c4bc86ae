"""``minimize``: the entry point a SciPy user recognises, with bounds, as one compiled program."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax import _common
from hdm_optax.driver import adjoint as adjoint_lib
from hdm_optax.driver import loops as loop_lib
from hdm_optax.driver import compiled as solve_lib
from hdm_optax.driver.results import SolveResult
from hdm_optax.pieces import box as box_lib
from hdm_optax.methods._trial_lbfgs import trial_lbfgs

__all__ = ("METHODS", "minimize")

# The methods ``minimize`` runs by name; each takes ``lower=`` and ``upper=``.
METHODS = {"trial_lbfgs": trial_lbfgs}


def _is_number_or_none(value) -> bool:
  return value is None or (
    isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  )


def _is_pair_list(bounds, x0) -> bool:
  """SciPy's sequence of (min, max) pairs, one per entry of a flat x0."""
  return (
    isinstance(bounds, (list, tuple))
    and np.ndim(x0) == 1
    and len(bounds) == np.size(x0)
    and all(
      isinstance(b, (list, tuple)) and len(b) == 2 and all(map(_is_number_or_none, b))
      for b in bounds
    )
  )


def _pairs_to_box(pairs, dtype):
  side = lambda i, empty: np.array(
    [empty if pair[i] is None else pair[i] for pair in pairs], dtype=dtype
  )
  return side(0, -np.inf), side(1, np.inf)


def bounds_to_box(bounds, x0) -> tuple[Any, Any]:
  """``(lower, upper)`` of what ``minimize(bounds=...)`` accepts (``(None, None)`` for None).

  Accepted: ``None``; a pair ``(lower, upper)`` of numbers, ``None`` or pytrees shaped like
  x0; ``scipy.optimize.Bounds`` (its ``lb``, ``ub``, cast to x0's dtype); and, for a flat x0
  of n entries, SciPy's sequence of n ``(min, max)`` pairs with ``None`` for an open side.
  A sequence of n pairs of numbers is read as SciPy's pairs (so for n = 2,
  ``[[0, 0], [1, 1]]`` means x_0 in [0, 0] and x_1 in [1, 1], as in SciPy); pass arrays
  or ``scipy.optimize.Bounds`` for (lower, upper) there.
  """
  if bounds is None:
    return None, None
  dtype = _common.params_dtype(x0)
  if hasattr(bounds, "lb") and hasattr(bounds, "ub"):  # scipy.optimize.Bounds
    cast = lambda b: jnp.asarray(np.broadcast_to(np.asarray(b, np.float64), np.shape(x0)), dtype)
    return cast(bounds.lb), cast(bounds.ub)
  if _is_pair_list(bounds, x0):
    return _pairs_to_box(bounds, dtype)
  if isinstance(bounds, (list, tuple)) and len(bounds) == 2:
    return bounds[0], bounds[1]
  raise TypeError(
    f"bounds must be None, a pair (lower, upper), scipy.optimize.Bounds, or for a flat x0 of "
    f"{np.size(x0)} entries a sequence of {np.size(x0)} (min, max) pairs; got "
    f"{type(bounds).__name__}{f' of length {len(bounds)}' if hasattr(bounds, '__len__') else ''}"
    ". Pass e.g. bounds=(0.0, None) for x >= 0."
  )


def _strong(x0, lower, upper, tol):
  """x0, the box's numbers and tol as arrays of x0's dtype that are not weakly typed.

  ``jnp.full(3, 2.0)`` or a Python float is weakly typed, another abstract value than
  ``jnp.zeros(3)`` for ``jit``: without this a second call would compile again (weakly
  typed arrays in ``args`` keep their dtype and lose the weak type). An array of another
  dtype is left for the box's check to refuse.
  """
  dtype = _common.params_dtype(x0)
  weak = lambda b: isinstance(b, (int, float)) or getattr(b, "weak_type", False)
  cast = lambda tree: jax.tree.map(lambda b: jnp.asarray(b, dtype) if weak(b) else b, tree)
  return cast(x0), cast(lower), cast(upper), cast(tol)


def _minimize(fun, method, max_steps, adjoint, x0, args, lower, upper, tol) -> SolveResult:
  optimizer = METHODS[method](lower=lower, upper=upper)
  return solve_lib.solve(
    optimizer, fun, x0, max_steps=max_steps, tol=tol, fun_args=args, adjoint=adjoint
  )


_minimize_jit = jax.jit(_minimize, static_argnums=(0, 1, 2, 3))


def minimize(
  fun: Callable[..., Any],
  x0: Any,
  *,
  args: Sequence[Any] = (),
  bounds: Any = None,
  method: str = "trial_lbfgs",
  tol: Any = 1e-5,
  max_steps: int = 15000,
  adjoint: Any = None,
) -> SolveResult:
  r"""Minimizes ``fun(x, *args)`` from ``x0``, within ``bounds``, as one compiled program.

  ``scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=...)``'s
  counterpart: the run is :func:`hdm_optax.solve` of ``method`` (one oracle call per
  iteration, see :func:`hdm_optax.trial_lbfgs`) with the box given to the transformation. An
  infeasible ``x0`` is projected onto the box first (SciPy does the same). The run stops
  once :math:`\|P(x - \nabla f(x)) - x\|_\infty \le` ``tol`` with bounds (L-BFGS-B's
  ``pgtol``; status ``CONVERGED_IN_BOX``), :math:`\|\nabla f(x)\|_\infty \le` ``tol``
  without, or after ``max_steps`` iterations (each one oracle call; SciPy's ``maxfun``).
  The defaults are L-BFGS-B's (``gtol=1e-5``, 15000 calls); there is no test on f's
  relative change (SciPy's ``ftol``).

  Called outside ``jit``/``vmap`` it compiles once per (``fun``, ``method``,
  ``max_steps``) and the shapes and dtypes of ``x0``, ``args`` and the bounds: another
  start, data, box or ``tol`` reuses the program. Inside ``jax.vmap`` it traces inline, so
  per-problem boxes batch into one program:
  ``jax.vmap(lambda x0, lo, hi: minimize(fun, x0, bounds=(lo, hi), max_steps=200))``.
  float32 and float64 both work (bounds given as numbers or SciPy objects take x0's dtype;
  arrays must have it).

  Args:
    fun: ``fun(x, *args) -> scalar`` of x0's dtype, differentiable by JAX.
    x0: the start, any pytree of float arrays of one dtype.
    args: extra arguments of ``fun`` (data enters the program as arguments).
    bounds: ``None``; ``(lower, upper)``, each a number, ``None`` (open) or a pytree shaped
      like x0 (-inf / +inf for an open side); ``scipy.optimize.Bounds``; or, for a flat x0,
      SciPy's sequence of ``(min, max)`` pairs with ``None`` for an open side.
    method: the method's name, one of :data:`METHODS` (``"trial_lbfgs"``).
    tol: stop once the (projected) gradient's inf-norm is at most ``tol``.
    max_steps: iterations allowed (static; one oracle call each).
    adjoint: how ``jax.grad``/``jax.jvp`` see the result as a function of ``args``:
      :class:`hdm_optax.ImplicitAdjoint` (``None``, the default; with bounds on the free
      variables, the others have derivative 0) or :class:`hdm_optax.UnrolledAdjoint`
      (through the iterations of a ``max_steps`` run), as in :func:`hdm_optax.solve`.

  Returns:
    A :class:`hdm_optax.SolveResult` (``grad_norm`` is the projected gradient's with bounds).

  Raises:
    ValueError: ``lower > upper`` somewhere, a box of another structure or shape, an
      unknown ``method``; TypeError: bounds of another dtype than x0's, or of a form not
      listed above. Each message names the argument and the fix.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum((x - jnp.array([2.0, -1.0, 0.5])) ** 2)
    >>> res = hdm_optax.minimize(fun, jnp.zeros(3), bounds=[(0, 1), (0, None), (None, None)])
    >>> [round(float(v), 6) for v in res.params], res.message[:9]
    ([1.0, 0.0, 0.5], 'converged')
  """
  _common.lookup("method", method, METHODS)
  max_steps = solve_lib._check_max_steps(max_steps)  # pylint: disable=protected-access
  loop_lib.check_limits(tol=tol)
  _common.params_dtype(x0)
  lower, upper = bounds_to_box(bounds, x0)
  box_lib.check_order(lower, upper, "bounds' lower", "bounds' upper")
  x0, lower, upper, tol = _strong(x0, lower, upper, tol)
  own = lambda a: jnp.asarray(a, a.dtype) if getattr(a, "weak_type", False) else a
  args = jax.tree.map(own, tuple(args))
  traced = solve_lib._under_trace(x0, args, lower, upper, tol)  # pylint: disable=protected-access
  run = _minimize if traced else _minimize_jit
  adjoint = adjoint_lib.check_adjoint(adjoint)
  return run(fun, method, max_steps, adjoint, x0, args, lower, upper, tol)
