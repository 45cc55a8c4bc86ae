"""Batched bounded solves: B box-constrained problems, each with its own box, as one program.

    python -m experiments.perf.batched_bounded [--batches 1,1024,16384] [--dtype float32]
                                               [--solvers all] [--calls 1000] [--tol 1e-4]

B ridge-logistic regressions (``experiments.perf.batched``'s data, ``--rows`` x ``--cols``)
with a box per problem: ``0 <= w_j <= u_b`` for the first half of the coefficients (u_b
drawn in [0.05, 0.5] per problem, so that bounds are active at the solution) and
``|w_j| <= 1`` for the rest. Each solver's batch is one ``jax.jit(jax.vmap(...))`` with the
boxes as batched arguments:

- ``minimize(bounds)``: ``hdm_optax.minimize(..., bounds=(lo_b, hi_b))`` (trial_lbfgs with
  the box; one oracle call per iteration);
- ``pgd-box-backtracking``: ``optax.sgd(1.0)`` with optax's backtracking line search and
  ``optax.projections.projection_box`` after each step (the naive way);
- ``jaxopt.LBFGSB``: jaxopt 0.8.5's, ``tol`` and ``maxiter = calls`` (its calls from its state).

A problem counts as solved where the projected gradient ``||clip(w - g, lo, hi) - w||_inf
<= tol`` at the returned point and the point is in its box. Per (B, solver) it prints the
compile time, the best wall time of one batched solve (``--repeats`` interleaved runs),
the solved count, problems solved per second, the mean and largest gradient calls, and
the largest distance of a returned point outside its box (0 where every point is inside).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmark import bounded as bounded_lib
from experiments.perf import batched

__all__ = ["SOLVERS", "make_boxes", "run", "main"]


def make_boxes(batch: int, cols: int, dtype, seed: int = 1):
  """``(lower, upper)``, each (B, cols): ``[0, u_b]`` on the first half, ``[-1, 1]`` on the rest."""
  rng = np.random.default_rng(seed)
  half = cols // 2
  lower = np.full((batch, cols), -1.0)
  upper = np.full((batch, cols), 1.0)
  lower[:, :half] = 0.0
  upper[:, :half] = rng.uniform(0.05, 0.5, (batch, 1))
  return jnp.asarray(lower, dtype), jnp.asarray(upper, dtype)


def _outcome(w, a, y, lower, upper, tol, calls):
  grad = jax.grad(batched.ridge_logistic)(w, a, y)
  pg = bounded_lib.projected_gradient_inf(w, grad, lower, upper)
  outside = jnp.maximum(jnp.max(lower - w, initial=0.0), jnp.max(w - upper, initial=0.0))
  return (pg <= tol) & (outside <= 0), calls, outside


def _minimize(a, y, lower, upper, tol, calls):
  import hdm_optax

  x0 = jnp.zeros(a.shape[1], a.dtype)
  res = hdm_optax.minimize(
    batched.ridge_logistic, x0, args=(a, y), bounds=(lower, upper), tol=tol, max_steps=calls - 1
  )
  return _outcome(res.params, a, y, lower, upper, tol, res.num_grad_evals)


def _pgd(a, y, lower, upper, tol, calls):
  import optax

  import hdm_optax

  opt = optax.chain(
    optax.sgd(1.0),
    optax.scale_by_backtracking_linesearch(15, store_grad=True),
    bounded_lib.project_box(lower, upper),
  )
  x0 = jnp.zeros(a.shape[1], a.dtype)
  res = hdm_optax.solve(
    opt,
    batched.ridge_logistic,
    x0,
    max_steps=calls,
    max_grad_evals=calls,
    tol=tol,
    fun_args=(a, y),
  )
  return _outcome(res.params, a, y, lower, upper, tol, res.num_grad_evals)


def _jaxopt(a, y, lower, upper, tol, calls):
  import jaxopt

  solver = jaxopt.LBFGSB(fun=batched.ridge_logistic, tol=tol, maxiter=calls)
  x0 = jnp.zeros(a.shape[1], a.dtype)
  w, state = solver.run(x0, (lower, upper), a, y)
  return _outcome(w, a, y, lower, upper, tol, state.num_fun_eval)


def _solvers() -> dict[str, Callable]:
  return {"minimize(bounds)": _minimize, "pgd-box-backtracking": _pgd, "jaxopt.LBFGSB": _jaxopt}


SOLVERS = tuple(_solvers())


def _data(batch, rows, cols, dtype):
  a, y, _ = batched.make_batch(batch, rows, cols, dtype)
  return (a, y, *make_boxes(batch, cols, dtype))


# experiments.perf.batched.run's loop over these solvers and boxed problems.
run = functools.partial(batched.run, table=_solvers(), make_data=_data)


def main(argv=None) -> list[dict]:
  args = batched.parse_args(argv, SOLVERS, __doc__.split("\n")[0])
  jax.config.update("jax_default_matmul_precision", "highest")
  return batched.run_args(args, run)


if __name__ == "__main__":
  main()
