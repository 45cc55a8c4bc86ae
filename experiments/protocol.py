"""The paper's benchmark protocol (Section 5), written once for every experiment.

* ``BUDGET``: 1000 gradient calls per run; ``TOL``: stop once
  ``||grad f||_inf <= 1e-4``.
* A run is *solved* (:func:`is_solved`) when it met the tolerance with fewer
  than ``BUDGET - 1`` gradient calls (999 of 1000), as the published runs
  count: a run that needs the last calls of the budget is not solved.
  Per-point grid files write :func:`unsolved_calls` (``budget + 1``, 1001)
  as the call count of an unsolved run, as the authors' published grid does.
* x0 (:func:`initial_point`): ``np.random.seed(20250128); x0 = randn(n);
  x0 /= ||x0||`` for every algorithm; ``seed`` draws further starting points
  (20250129, ...).
* Each algorithm reports its best grid point (:func:`best_point`): fewest
  iterations among the solved points, then lowest final value, by
  ``hdm_optax.driver.results.best_index``.
* :class:`Row` is one algorithm's best run on one instance, the same type for
  the JAX algorithms and the SciPy baselines.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hdm_optax.driver.results import best_index

__all__ = [
  "BUDGET",
  "TOL",
  "SEED",
  "Row",
  "best_point",
  "initial_point",
  "is_solved",
  "unsolved_calls",
]

BUDGET = 1000
TOL = 1e-4
SEED = 20250128


def is_solved(converged, grad_calls, budget: int = BUDGET):
  """Whether a run counts as solved: ``converged`` with fewer than ``budget - 1`` calls.

  Args:
    converged: whether the run met the tolerance (a bool or a boolean array).
    grad_calls: gradient calls the run made (same shape as ``converged``).
    budget: the run's budget of gradient calls.

  Returns:
    A NumPy bool (array) of the shape of ``converged``.
  """
  return np.logical_and(converged, np.asarray(grad_calls) < budget - 1)


def unsolved_calls(budget: int = BUDGET) -> int:
  """The gradient-call count a grid file records for an unsolved run: ``budget + 1``."""
  return budget + 1


def initial_point(n: int, seed: int = SEED) -> np.ndarray:
  """The protocol's starting point (reseeds NumPy's global RNG).

  Exactly ``np.random.seed(seed); x0 = np.random.randn(n); x0 /= ||x0||``.

  Args:
    n: number of variables.
    seed: NumPy seed; ``SEED`` (20250128) is the paper's, 20250129, ...
      draw further starting points.
  """
  np.random.seed(seed)
  x0 = np.random.randn(n)
  x0 /= np.linalg.norm(x0)
  return x0


def best_point(results, solved) -> int:
  """Index of the best grid point: fewest steps among the solved, then lowest value.

  Args:
    results: a batched ``hdm_optax.SolveResult`` (one entry per grid point).
    solved: :func:`is_solved` of each point.

  Returns:
    The index ``hdm_optax.driver.results.best_index`` picks when "converged" means solved.
  """
  return best_index(results._replace(converged=np.asarray(solved)))


@dataclasses.dataclass
class Row:
  """One algorithm's best run on one instance (a line of the results CSV).

  Attributes:
    algorithm: its name in Table 1 (``"HDM-Best"``, ``"L-BFGS-M5"``, ...).
    solved: :func:`is_solved` of the run.
    iterations: iterations (``update`` calls, or SciPy's ``nit``).
    value_calls: objective evaluations.
    grad_calls: gradient evaluations (a SciPy call counts as one of each).
    hyperparams: the grid point or options, as text.
    final_value: f at the reported point.
    final_grad_inf: ``||grad f||_inf`` at the reported point.
    seconds: wall time (a whole sweep's for a JAX grid).
    trace_grad_calls, trace_values, trace_grad_inf: the run's trace against
      gradient calls.
    message: the solver's message (SciPy's), or empty.
    x: the reported point where the runner keeps it (SciPy), else None.
  """

  algorithm: str
  solved: bool
  iterations: int
  value_calls: int
  grad_calls: int
  hyperparams: str
  final_value: float
  final_grad_inf: float
  seconds: float
  trace_grad_calls: np.ndarray = dataclasses.field(repr=False)
  trace_values: np.ndarray = dataclasses.field(repr=False)
  trace_grad_inf: np.ndarray = dataclasses.field(repr=False)
  message: str = ""
  x: np.ndarray | None = dataclasses.field(default=None, repr=False)

  @classmethod
  def from_solve(cls, algorithm, result, solved, hyperparams, seconds) -> Row:
    """The row of one (unbatched, NumPy) ``hdm_optax.SolveResult``."""
    k = int(result.num_steps)
    return cls(
      algorithm=algorithm,
      solved=bool(solved),
      iterations=k,
      value_calls=int(result.num_value_evals),
      grad_calls=int(result.num_grad_evals),
      hyperparams=hyperparams,
      final_value=float(result.value),
      final_grad_inf=float(result.grad_norm),
      seconds=seconds,
      trace_grad_calls=result.trace.grad_evals[: k + 1],
      trace_values=result.trace.value[: k + 1],
      trace_grad_inf=result.trace.grad_norm[: k + 1],
    )
