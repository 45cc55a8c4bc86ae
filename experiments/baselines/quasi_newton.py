"""Host quasi-Newton baselines: SciPy's BFGS and L-BFGS-Mk (k = 1, 3, 5, 10) and CG_DESCENT.

Protocol (Section 5, ``experiments.protocol``): default SciPy parameters,
stopping when ``||grad f||_inf <= tol`` (tol = 1e-4; L-BFGS-B with ``ftol=0``,
so only the gradient stops it), at most 1000 gradient oracles. Every call of
the objective returns value and gradient, so one call is counted as one
gradient call. A run is solved by ``protocol.outcome`` at the reported point
(SciPy's ``x``; the last point evaluated where a run is stopped at its budget).
Table 1 runs SciPy to its ``maxiter`` of 999 iterations, as the paper did, and
counts the calls; the benchmark stops a run at the call past its budget. Each
run is reported as a ``protocol.Row``.

CG_DESCENT (Hager and Zhang, ACM TOMS 32(1), 2006; ``pycgdescent``, the C code 6.8) runs at its
defaults with its gradient stopping rule ``||grad f||_inf <= tol`` (``StopRule``, ``StopFac =
0``). It asks for f alone, grad f alone or both; each request evaluates f and grad f once and
counts as one call (a request for the gradient at the point whose value was just asked for
reuses that evaluation, uncounted), so f-only calls of its line search count in full.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

from experiments import protocol

ALGORITHMS = ("BFGS", "L-BFGS-M1", "L-BFGS-M3", "L-BFGS-M5", "L-BFGS-M10")
CG_DESCENT = "CG_DESCENT"
MAX_ITER = protocol.BUDGET - 1

FunNp = Callable[[np.ndarray], tuple[float, np.ndarray]]


def scipy_options(
  algorithm: str, tol: float = protocol.TOL, maxiter: int = MAX_ITER
) -> tuple[str, dict]:
  """Returns ``(method, options)`` for ``scipy.optimize.minimize``.

  Args:
      algorithm: ``"BFGS"`` or ``"L-BFGS-M<k>"``.
      tol: Gradient tolerance (inf-norm).
      maxiter: SciPy's iteration limit.
  """
  if algorithm == "BFGS":
    return "BFGS", {"gtol": tol, "maxiter": maxiter, "norm": np.inf}
  if algorithm.startswith("L-BFGS-M"):
    memory = int(algorithm[len("L-BFGS-M") :])
    return "L-BFGS-B", {"maxcor": memory, "ftol": 0.0, "gtol": tol, "maxiter": maxiter}
  raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")


class BudgetSpent(Exception):
  """Raised by the counted objective once the budget of gradient calls is spent."""


def run_baseline(
  fun_np: FunNp,
  x0: np.ndarray,
  algorithm: str,
  tol: float = protocol.TOL,
  blas_threads: Optional[int] = 1,
  *,
  budget: int = protocol.BUDGET,
  stop_at_budget: bool = False,
  maxiter: int = MAX_ITER,
  bounds: Optional[tuple[np.ndarray, np.ndarray]] = None,
) -> protocol.Row:
  """Runs one SciPy baseline from ``x0``, counting and recording every call.

  Args:
      fun_np: ``w -> (value, grad)`` in float64.
      x0: Starting point.
      algorithm: ``"BFGS"`` or ``"L-BFGS-M<k>"``.
      tol: Stopping tolerance on ``||grad f||_inf``.
      blas_threads: BLAS thread limit during the run (None: no limit).
      budget: gradient calls for ``protocol.outcome``.
      stop_at_budget: stop the run at the call past ``budget`` (its row then
        reports the last point evaluated, message ``"budget"``); otherwise SciPy
        runs to its own end.
      maxiter: SciPy's iteration limit.
      bounds: ``(lower, upper)`` arrays for L-BFGS-B; then the recorded and final
        ``grad_inf`` is the projected gradient's, ``||clip(x - g, lo, hi) - x||_inf``.

  Returns:
      The run's row; f and grad f at SciPy's ``x`` are evaluated once more,
      uncounted.
  """
  if algorithm == CG_DESCENT:
    method, options = CG_DESCENT, {"StopRule": True, "StopFac": 0.0, "maxit": maxiter}
  else:
    method, options = scipy_options(algorithm, tol, maxiter)
  values: list[float] = []
  grad_infs: list[float] = []
  last = None

  def stationarity(w, grad):
    if not np.size(grad):
      return 0.0
    if bounds is None:
      return float(np.max(np.abs(grad)))
    return float(np.max(np.abs(np.clip(w - grad, bounds[0], bounds[1]) - w)))

  def recorded(w):
    nonlocal last
    if stop_at_budget and len(values) >= budget:
      raise BudgetSpent
    value, grad = fun_np(w)
    values.append(float(value))
    grad_infs.append(stationarity(w, grad))
    last = (w, value, grad)
    return value, grad

  iterations = None
  with threadpool_limits(limits=blas_threads, user_api="blas"):
    start = time.perf_counter()
    x0 = np.asarray(x0, dtype=np.float64).copy()
    try:
      box = None if bounds is None else list(zip(*bounds))
      if algorithm == CG_DESCENT:
        res = _cg_descent(recorded, x0, tol, options)
      else:
        res = minimize(recorded, x0, jac=True, method=method, options=options, bounds=box)
    except BudgetSpent:
      res = None
    seconds = time.perf_counter() - start
  if res is None:
    x, final_value, final_grad = last
    message = "budget"
  else:
    x, iterations, message = res.x, int(res.nit), str(res.message)
    final_value, final_grad = fun_np(res.x)  # not recorded: not part of the run
  calls = len(values)
  final_grad_inf = stationarity(np.asarray(x), final_grad)
  solved, status = protocol.outcome(float(final_value), final_grad_inf, calls, tol, budget)
  if not status:
    status = "budget" if message == "budget" else f"stopped: {message}"
  return protocol.Row(
    algorithm=algorithm,
    solved=solved,
    iterations=iterations,
    value_calls=calls,
    grad_calls=calls,
    hyperparams=method + " " + " ".join(f"{k}={v}" for k, v in options.items()),
    final_value=float(final_value),
    final_grad_inf=final_grad_inf,
    seconds=seconds,
    trace_grad_calls=np.arange(1, calls + 1),
    trace_values=np.asarray(values),
    trace_grad_inf=np.asarray(grad_infs),
    message=message,
    x=np.asarray(x),
    status=status,
  )


def _cg_descent(recorded, x0, tol, options):
  """pycgdescent's ``minimize`` on ``recorded`` (one call per request; see the module doc)."""
  import pycgdescent

  last = {}

  def evaluate(x):
    value, grad = recorded(x)
    last.update(x=x.copy(), grad=grad)
    return value, grad

  def fun(x):
    return evaluate(x)[0]

  def jac(g, x):
    same = "x" in last and np.array_equal(last["x"], x)
    g[:] = last["grad"] if same else evaluate(x)[1]

  def funjac(g, x):
    value, g[:] = evaluate(x)
    return value

  opts = pycgdescent.OptimizeOptions(PrintLevel=0, **options)
  return pycgdescent.minimize(fun, x0, jac=jac, funjac=funjac, tol=tol, options=opts)


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
