"""The bounded rows' measure and the rows only the bounded suites have.

The bounded suites (``experiments.benchmark.suites``: ``cutest_bounded``, ``libsvm_bounded``)
give each problem its box, the start projected into it; a run is solved where the projected
gradient ``||clip(x - g, lo, hi) - x||_inf <= tol`` at the returned point, inside the box,
within the budget.

Rows (``solvers.BOUNDED``): ``trial_lbfgs(lower=LOWER, upper=UPPER)``; SciPy's L-BFGS-B
(the ``scipy-lbfgsb-*`` rows with the box); jaxopt 0.8.5's ``LBFGSB(tol, maxiter)``
(:data:`jaxopt_lbfgsb`, every call of f counted from its state); projected gradient descent,
``optax.sgd(1.0)`` with optax's backtracking line search and
``optax.projections.projection_box`` after each step (:func:`project_box`, the naive
way); and the clipping habit, an unconstrained solver on ``f(clip(x, lo, hi))``
(:func:`clipped`), the run's point reported as ``clip(x)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def projected_gradient_inf(x, grad, lower, upper):
  """``||clip(x - g, lo, hi) - x||_inf`` (jnp or NumPy arrays)."""
  return jnp.max(jnp.abs(jnp.clip(x - grad, lower, upper) - x), initial=0.0)


def outside(x, lower, upper):
  """How far x lies outside the box (0 inside)."""
  return jnp.maximum(jnp.max(lower - x, initial=0.0), jnp.max(x - upper, initial=0.0))


def clipped(fun):
  """``(x, lower, upper, *args) -> fun(clip(x, lower, upper), *args)``: the clipping habit."""

  def fun_of_clip(x, lower, upper, *args):
    return fun(jnp.clip(x, lower, upper), *args)

  return fun_of_clip


def project_box(lower, upper) -> optax.GradientTransformation:
  """The last link of a projected-gradient chain: ``params + u`` becomes its projection.

  ``u -> projection_box(params + u, lower, upper) - params``, what a user writes after
  ``optax.apply_updates`` (``params = optax.projections.projection_box(params, lo, hi)``).
  """

  def update_fn(updates, state, params=None):
    target = optax.projections.projection_box(optax.apply_updates(params, updates), lower, upper)
    return optax.tree.sub(target, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _jaxopt_lbfgsb(solver, fun, budget, x0, fun_args, lipschitz, f_star, box, tol):
  """jaxopt 0.8.5 ``LBFGSB(tol=tol, maxiter=budget)`` from ``x0`` (its own calls counted).

  ``state.num_fun_eval`` counts every value-and-gradient call jaxopt makes (the initial one
  and each line-search trial). The run's end point is evaluated once more, uncounted, for
  the row (as SciPy's). A run that ends outside the box is not solved.
  """
  import jaxopt  # pylint: disable=import-outside-toplevel

  del solver, lipschitz, f_star
  lbfgsb = jaxopt.LBFGSB(fun=fun, tol=tol, maxiter=budget, jit=True)
  params, state = lbfgsb.run(x0, box, *fun_args)
  value, grad = jax.value_and_grad(fun)(params, *fun_args)
  return dict(
    value=value,
    grad_inf=projected_gradient_inf(params, grad, *box),
    grad_calls=state.num_fun_eval,
    num_steps=state.iter_num,
    outside=outside(params, *box),
  )


# ``runner.run_optimistix``'s single-start program of the ``jaxopt-lbfgsb`` row.
jaxopt_lbfgsb = jax.jit(_jaxopt_lbfgsb, static_argnums=(0, 1, 2))
