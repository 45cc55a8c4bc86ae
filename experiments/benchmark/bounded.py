"""The bounded suites and the rows only they have: jaxopt's LBFGSB, PGD, clipping inside f.

Suites (each problem with its box, the start projected into it; solved where the projected
gradient ``||clip(x - g, lo, hi) - x||_inf <= tol`` at the returned point, inside the box,
within the budget):

- ``cutest_bounded``: the 38 names of ``../shared/benchmarks/cutest_bounded_dev.txt``, from
  ``sif2jax.bounded_minimisation_problems`` with their own bounds and ``y0``;
- ``libsvm_bounded``: logistic regression with nonnegative weights on the LIBSVM datasets
  on disk (Table 1's logistic objective, ``w >= 0``, x0 the paper's projected onto the box).

Rows (``solvers.BOUNDED``): ``trial_lbfgs(lower=LOWER, upper=UPPER)``; SciPy's L-BFGS-B
(the ``scipy-lbfgsb-*`` rows with the box); jaxopt 0.8.5's ``LBFGSB(tol, maxiter)``
(:func:`jaxopt_rows`, every call of f counted from its state); projected gradient descent,
``optax.sgd(1.0)`` with optax's backtracking line search and
``optax.projections.projection_box`` after each step (:func:`project_box`, the naive
way); and the clipping habit, an unconstrained solver on ``f(clip(x, lo, hi))``
(:func:`clipped`), the run's point reported as ``clip(x)``.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import protocol
from experiments.benchmark import suites as suites_lib

CUTEST_BOUNDED_DEV_LIST = suites_lib.BENCHMARKS_DIR / "cutest_bounded_dev.txt"


# ----------------------------------------------------------------------------
# The measure and the rows' pieces
# ----------------------------------------------------------------------------


def projected_gradient_inf(x, grad, lower, upper):
  """``||clip(x - g, lo, hi) - x||_inf`` (jnp or NumPy arrays)."""
  return jnp.max(jnp.abs(jnp.clip(x - grad, lower, upper) - x), initial=0.0)


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


# ----------------------------------------------------------------------------
# Suites
# ----------------------------------------------------------------------------


def _boxed(inst: protocol.Instance, lower, upper) -> protocol.Instance:
  """``inst`` with its box and every start projected into it."""
  lower = np.broadcast_to(np.asarray(lower, np.float64), inst.x0.shape[1:]).copy()
  upper = np.broadcast_to(np.asarray(upper, np.float64), inst.x0.shape[1:]).copy()
  x0 = np.clip(np.asarray(inst.x0, np.float64), lower, upper)
  x0_np = np.clip(inst.x0_np, lower[: inst.x0_np.shape[1]], upper[: inst.x0_np.shape[1]])
  return protocol.Instance(
    **{
      **{f: getattr(inst, f) for f in inst.__dataclass_fields__},
      "x0": jnp.asarray(x0, inst.dtype),
      "x0_np": x0_np,
      "lower": lower,
      "upper": upper,
    }
  )


def _cutest_bounded_instance(problem, tol):
  lower, upper = (np.asarray(b, np.float64) for b in problem.bounds)
  fun = lambda y, args: problem.objective(y, args)
  inst = suites_lib._instance(fun, (problem.args,), problem.y0, tol)  # pylint: disable=protected-access
  return _boxed(inst, lower, upper)


def cutest_bounded_tasks(tol: float, names: Optional[Sequence[str]] = None):
  """The bounded dev list (or ``names``), each with its own box and projected ``y0``."""
  names = suites_lib.cutest_names(CUTEST_BOUNDED_DEV_LIST) if names is None else list(names)
  return [
    suites_lib.Task(
      "cutest_bounded",
      name,
      (None,),
      lambda name=name: _cutest_bounded_instance(suites_lib.cutest_bounded_problem(name), tol),
    )
    for name in names
  ]


def _libsvm_bounded_instance(dataset, seeds, tol, data_dir):
  inst = suites_lib._libsvm_instance(dataset, "logistic", seeds, tol, "float64", data_dir)  # pylint: disable=protected-access
  return _boxed(inst, 0.0, np.inf)


def libsvm_bounded_tasks(tol: float, num_seeds: int, datasets=None, data_dir=None):
  """Logistic regression with ``w >= 0`` on every dataset on disk (or ``datasets``)."""
  from experiments import data as data_lib  # pylint: disable=import-outside-toplevel

  names = data_lib.list_datasets(data_dir) if datasets is None else list(datasets)
  seeds = tuple(suites_lib.SEED0 + i for i in range(num_seeds))
  return [
    suites_lib.Task(
      "libsvm_bounded",
      f"{name}/logistic-nonneg",
      seeds,
      lambda name=name: _libsvm_bounded_instance(name, seeds, tol, data_dir),
    )
    for name in names
  ]


# ----------------------------------------------------------------------------
# jaxopt's LBFGSB
# ----------------------------------------------------------------------------


def _jaxopt_run(fun, budget, x0, fun_args, lower, upper, tol):
  import jaxopt  # pylint: disable=import-outside-toplevel

  solver = jaxopt.LBFGSB(fun=fun, tol=tol, maxiter=budget, jit=True)
  params, state = solver.run(x0, (lower, upper), *fun_args)
  value, grad = jax.value_and_grad(fun)(params, *fun_args)
  outside = jnp.maximum(jnp.max(lower - params, initial=0.0), jnp.max(params - upper, initial=0.0))
  return dict(
    value=value,
    grad_inf=projected_gradient_inf(params, grad, lower, upper),
    calls=state.num_fun_eval,
    steps=state.iter_num,
    outside=outside,
  )


_jaxopt_jit = jax.jit(_jaxopt_run, static_argnums=(0, 1))


def jaxopt_rows(solver, task, inst: protocol.Instance, budget: int, seeds) -> list:
  """jaxopt 0.8.5 ``LBFGSB(tol=tol, maxiter=budget)`` from each start (its own calls counted).

  ``state.num_fun_eval`` counts every value-and-gradient call jaxopt makes (the initial one
  and each line-search trial). The run's end point is evaluated once more, uncounted, for
  the row (as SciPy's). A run that ends outside the box is not solved.
  """
  from experiments.benchmark import runner  # pylint: disable=import-outside-toplevel

  dtype = inst.x0.dtype
  lower, upper = jnp.asarray(inst.lower, dtype), jnp.asarray(inst.upper, dtype)
  rows = []
  for seed in seeds:
    i = task.seeds.index(seed)
    x0, tol = inst.x0[i], jnp.asarray(inst.tol[i], dtype)
    start = time.perf_counter()
    lowered = _jaxopt_jit.lower(inst.fun, budget, x0, inst.fun_args, lower, upper, tol)
    compiled = lowered.compile(runner.COMPILE_OPTIONS)
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(x0, inst.fun_args, lower, upper, tol))
    seconds = time.perf_counter() - start
    out = {k: np.asarray(v) for k, v in out.items()}
    value, grad_inf, calls = float(out["value"]), float(out["grad_inf"]), int(out["calls"])
    solved, status = protocol.outcome(value, grad_inf, calls, float(inst.tol[i]), budget)
    if float(out["outside"]) > 0:
      solved, status = False, f"outside the box by {float(out['outside']):.3g}"
    rows.append(
      protocol.Row(
        solver.name,
        solved,
        iterations=int(out["steps"]),
        grad_calls=calls,
        value_calls=calls,
        final_value=value,
        final_grad_inf=grad_inf,
        seconds=seconds,
        status=status or "stopped: maxiter or tol",
        compile_seconds=compile_seconds,
        suite=task.suite,
        problem=task.name,
        n=inst.n,
        dtype=inst.dtype,
        seed=seed,
      )
    )
  return rows
