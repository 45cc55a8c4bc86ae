"""SciPy quasi-Newton baselines of the paper: BFGS and L-BFGS-Mk (k = 1, 3, 5, 10).

Protocol (Section 5, ``experiments.protocol``): default SciPy parameters,
stopping when ``||grad f||_inf <= tol`` (tol = 1e-4), at most 1000 gradient
oracles. Every call of the objective returns value and gradient, so one call
is counted as one gradient call. A run is *solved* iff SciPy reports success,
the best recorded ``||g||_inf`` is at most ``1.1 * tol`` and
``protocol.is_solved`` holds (fewer than 999 gradient calls). Each run is
reported as a ``protocol.Row``.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

from experiments import protocol

ALGORITHMS = ("BFGS", "L-BFGS-M1", "L-BFGS-M3", "L-BFGS-M5", "L-BFGS-M10")
MAX_ITER = protocol.BUDGET - 1
TOL_SLACK = 1.1

FunNp = Callable[[np.ndarray], tuple[float, np.ndarray]]


def is_solved(
  success: bool, best_grad_inf: float, grad_calls: int, tol: float, budget: int = protocol.BUDGET
) -> bool:
  """The paper's success criterion for a SciPy run (see the module docstring)."""
  met = bool(success) and best_grad_inf <= TOL_SLACK * tol
  return bool(protocol.is_solved(met, grad_calls, budget))


def scipy_options(algorithm: str, tol: float = protocol.TOL) -> tuple[str, dict]:
  """Returns ``(method, options)`` for ``scipy.optimize.minimize``.

  Args:
      algorithm: ``"BFGS"`` or ``"L-BFGS-M<k>"``.
      tol: Gradient tolerance (inf-norm).
  """
  if algorithm == "BFGS":
    return "BFGS", {"gtol": tol, "maxiter": MAX_ITER, "norm": np.inf}
  if algorithm.startswith("L-BFGS-M"):
    memory = int(algorithm[len("L-BFGS-M") :])
    return "L-BFGS-B", {"maxcor": memory, "ftol": 1e-25, "gtol": tol, "maxiter": MAX_ITER}
  raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")


def run_baseline(
  fun_np: FunNp,
  x0: np.ndarray,
  algorithm: str,
  tol: float = protocol.TOL,
  blas_threads: int | None = 1,
) -> protocol.Row:
  """Runs one SciPy baseline from ``x0`` and records the call trace.

  Args:
      fun_np: ``w -> (value, grad)`` in float64.
      x0: Starting point.
      algorithm: ``"BFGS"`` or ``"L-BFGS-M<k>"``.
      tol: Stopping tolerance on ``||grad f||_inf``.
      blas_threads: BLAS thread limit during the run (None: no limit).
  """
  method, options = scipy_options(algorithm, tol)
  values: list[float] = []
  grad_infs: list[float] = []

  def recorded(w):
    value, grad = fun_np(w)
    values.append(float(value))
    grad_infs.append(float(np.max(np.abs(grad))))
    return value, grad

  with threadpool_limits(limits=blas_threads, user_api="blas"):
    start = time.perf_counter()
    res = minimize(
      recorded, np.asarray(x0, dtype=np.float64).copy(), jac=True, method=method, options=options
    )
    seconds = time.perf_counter() - start

  final_value, final_grad = fun_np(res.x)  # not recorded: not part of the run
  calls = len(values)
  best = min(grad_infs) if grad_infs else np.inf
  solved = is_solved(res.success, best, calls, tol)
  return protocol.Row(
    algorithm=algorithm,
    solved=solved,
    iterations=int(res.nit),
    value_calls=calls,
    grad_calls=calls,
    hyperparams=method + " " + " ".join(f"{k}={v}" for k, v in options.items()),
    final_value=float(final_value),
    final_grad_inf=float(np.max(np.abs(final_grad))),
    seconds=seconds,
    trace_grad_calls=np.arange(1, calls + 1),
    trace_values=np.asarray(values),
    trace_grad_inf=np.asarray(grad_infs),
    message=str(res.message),
    x=np.asarray(res.x),
  )


def run_all_baselines(
  fun_np: FunNp,
  x0: np.ndarray,
  tol: float = protocol.TOL,
  algorithms: tuple[str, ...] = ALGORITHMS,
  blas_threads: int | None = 1,
) -> list[protocol.Row]:
  """Runs each algorithm of ``algorithms`` from ``x0`` (see ``run_baseline``)."""
  return [run_baseline(fun_np, x0, a, tol, blas_threads) for a in algorithms]


def reference_optimum(
  fun_np: FunNp, x0: np.ndarray, tol: float = 1e-4, maxiter: int = 100_000
) -> float:
  """Estimates ``f*`` as in the paper: BFGS run until ``||grad f||_inf <= tol``.

  The iteration budget is large (``maxiter``) instead of the benchmark's 999;
  the smallest value seen during the run is returned.
  """
  values: list[float] = []

  def recorded(w):
    value, grad = fun_np(w)
    values.append(float(value))
    return value, grad

  with threadpool_limits(limits=1, user_api="blas"):
    minimize(
      recorded,
      np.asarray(x0, dtype=np.float64).copy(),
      jac=True,
      method="BFGS",
      options={"gtol": tol, "maxiter": maxiter, "norm": np.inf},
    )
  return min(values)
