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
* :func:`outcome` is the one solved rule of every experiment (Table 1, the
  benchmark, the SciPy baselines): the run ends at a point where f and grad f
  are finite, f >= ``UNBOUNDED`` (the library's threshold, ``solve``'s
  ``min_value``) and ``||grad f||_inf <= tol``, and :func:`is_solved` holds.
* Each algorithm reports its best grid point (:func:`best_row`): fewest
  iterations among the solved points, then lowest final value (the order of
  ``hdm_optax.SweepResult.best``, with solved where it has converged).
* :class:`Instance` is a problem ready to run and :class:`Row` one run's
  result: the same types for Table 1, the benchmark, the JAX algorithms and
  the SciPy baselines.
* Every experiment runs in float64 (float32 where a suite says so), and
  float32 products are computed in float32 on every backend
  (:data:`MATMUL_PRECISION`): entry points call :func:`enable_float64`;
  importing a module changes nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Optional

import jax
import numpy as np

import hdm_optax

__all__ = [
  "BUDGET",
  "TOL",
  "SEED",
  "UNBOUNDED",
  "MATMUL_PRECISION",
  "Instance",
  "Row",
  "best_row",
  "enable_float64",
  "float32_products",
  "initial_point",
  "initial_points",
  "is_solved",
  "outcome",
  "unsolved_calls",
]

BUDGET = 1000
TOL = 1e-4
SEED = 20250128
# f below this: the objective looks unbounded below (the library's threshold).
UNBOUNDED = inspect.signature(hdm_optax.solve).parameters["min_value"].default


# The precision of float32 matrix products. JAX's default lets an NVIDIA GPU compute
# them in TF32 (inputs rounded to 10 bits of mantissa): f then carries errors of about
# 1e-3 of its terms, far above float32's rounding, and a float32 suite measures the
# product's precision instead of the optimizer. On an H200 with the default,
# hdm_auto() solved 21.0 of libsvm32's 54 problems per start (49.6 on the CPU): its
# acceptance test compares values of f, and it settled where the TF32 value is
# lowest (docs/research/accelerators.md). CPUs compute float32 products in float32
# either way.
MATMUL_PRECISION = "highest"


def enable_float64() -> None:
  """Every experiment's entry point calls it first: 64-bit floats, float32 products in float32.

  Switches JAX to 64-bit floats (``jax_enable_x64``; a float32 suite casts its
  data) and sets ``jax_default_matmul_precision`` to :data:`MATMUL_PRECISION`.
  """
  jax.config.update("jax_enable_x64", True)
  float32_products()


def float32_products() -> None:
  """float32 matrix products in float32 on every backend (:data:`MATMUL_PRECISION`): the
  float32 measurement scripts call it first."""
  jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION)


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


def outcome(value, grad_inf, grad_calls, tol, budget: int = BUDGET) -> tuple[bool, str]:
  """(solved, status) of a run that ended at a point with ``value`` and ``grad_inf``.

  The one solved rule: f and ``||grad f||_inf`` finite, f >= ``UNBOUNDED``,
  ``grad_inf <= tol`` and :func:`is_solved`. The status is empty where the
  caller knows better why the run ended.

  Args:
    value: f at the reported point.
    grad_inf: ``||grad f||_inf`` there.
    grad_calls: gradient calls the run made.
    tol: the run's tolerance.
    budget: the run's budget of gradient calls.

  Returns:
    ``(solved, status)``, status one of ``"converged"``, ``"budget"``,
    ``"non_finite"``, ``"unbounded"`` or ``""``.
  """
  if not (math.isfinite(value) and math.isfinite(grad_inf)):
    return False, "non_finite"
  if value < UNBOUNDED:
    return False, "unbounded"
  if grad_inf <= tol:
    solved = bool(is_solved(True, grad_calls, budget))
    return solved, "converged" if solved else "budget"
  if grad_calls >= budget:
    return False, "budget"
  return False, ""


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


def initial_points(n: int, seeds) -> np.ndarray:
  """:func:`initial_point` for each of ``seeds``, one row per seed."""
  return np.stack([initial_point(n, seed) for seed in seeds])


def best_row(rows):
  """The best of one algorithm's grid points: fewest iterations among the solved, then
  lowest final value (among all where none is solved; the first of equals).

  Args:
    rows: one :class:`Row` per grid point.

  Returns:
    The row.
  """
  finite = lambda v: v if v is not None and math.isfinite(v) else math.inf
  return min(
    rows, key=lambda r: (not r.solved, r.iterations if r.solved else 0, finite(r.final_value))
  )


@dataclasses.dataclass(frozen=True, eq=False)
class Instance:
  """A problem ready to run (compared by identity).

  Attributes:
    n: number of variables (before any padding).
    fun: ``fun(x, *fun_args) -> scalar``; the same object for every instance
      that can share a compiled program.
    fun_args: data arguments of ``fun``.
    x0: (starts, n_run) starting points, one row per start (``n_run >= n``
      when padded with coordinates whose gradient is zero).
    dtype: ``"float64"`` or ``"float32"``.
    tol: (starts,) tolerance of each start on ``||grad f||_inf``, or None.
    lipschitz: L where it is known, else None.
    fun_np: ``x -> (value, grad)`` in float64 NumPy, for SciPy (takes
      ``x0_np``'s shape), or None.
    x0_np: (starts, m) float64 starting points for ``fun_np``, or None.
    f_star: the minimum value where it is known, else None.
    lower: the box's lower bounds (float64, x0's row shape; -inf where open) for a bounded
      problem, else None.
    upper: its upper bounds, like ``lower``.
    seeds: the label of each start (its seed, or None where the start is fixed).
  """

  n: int
  fun: Callable[..., Any]
  fun_args: tuple
  x0: Any
  dtype: str = "float64"
  tol: Optional[np.ndarray] = None
  lipschitz: Optional[float] = None
  fun_np: Optional[Callable[[np.ndarray], tuple[float, np.ndarray]]] = None
  x0_np: Optional[np.ndarray] = None
  f_star: Optional[float] = None
  lower: Optional[np.ndarray] = None
  upper: Optional[np.ndarray] = None
  seeds: tuple = (None,)


@dataclasses.dataclass
class Row:
  """One run's result: a line of Table 1's per-instance CSV or of the benchmark's CSV.

  Attributes:
    algorithm: its name (``"HDM-Best"``, ``"L-BFGS-M5"``; the benchmark's solver
      name, its ``solver`` column).
    solved: :func:`outcome`'s verdict.
    iterations: iterations (``update`` calls, or SciPy's ``nit``), where known.
    value_calls: objective evaluations.
    grad_calls: gradient evaluations (a SciPy call counts as one of each).
    hyperparams: the grid point or options, as text.
    final_value: f at the reported point.
    final_grad_inf: ``||grad f||_inf`` at the reported point.
    seconds: wall time of the run (a whole sweep's for a JAX grid), compilation
      excluded where ``compile_seconds`` is given (the benchmark's ``run_seconds``).
    trace_grad_calls, trace_values, trace_grad_inf: the run's trace against
      gradient calls, where recorded.
    message: the solver's own message (SciPy's), or empty.
    x: the reported point where the runner keeps it (SciPy), else None.
    status: why the run ended (:func:`outcome`'s status, ``budget``,
      ``stopped: <message>``, ``skipped: ...``, ``error: ...``).
    suite, problem, n, dtype, seed: where it ran (the benchmark's columns).
    compile_seconds: seconds spent compiling its program.
  """

  algorithm: str
  solved: bool = False
  iterations: Optional[int] = None
  value_calls: Optional[int] = None
  grad_calls: Optional[int] = None
  hyperparams: str = ""
  final_value: Optional[float] = None
  final_grad_inf: Optional[float] = None
  seconds: float = 0.0
  trace_grad_calls: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
  trace_values: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
  trace_grad_inf: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
  message: str = ""
  x: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
  status: str = ""
  suite: str = ""
  problem: str = ""
  n: Optional[int] = None
  dtype: str = ""
  seed: Optional[int] = None
  compile_seconds: float = 0.0
