"""Tests of experiments/baselines/quasi_newton.py on tiny synthetic problems."""

import numpy as np
import pytest
from scipy.optimize import minimize

from experiments.baselines import quasi_newton as bs


def test_scipy_options():
  assert bs.scipy_options("BFGS", 1e-4) == ("BFGS", {"gtol": 1e-4, "maxiter": 999, "norm": np.inf})
  method, opts = bs.scipy_options("L-BFGS-M10", 1e-4)
  assert method == "L-BFGS-B"
  assert opts == {"maxcor": 10, "ftol": 0.0, "gtol": 1e-4, "maxiter": 999}
  with pytest.raises(ValueError):
    bs.scipy_options("Newton")


@pytest.mark.parametrize("kind", ["svm", "logistic"])
def test_all_baselines_solve_toy(kind, classification_problem):
  p = classification_problem(kind)
  results = bs.run_all_baselines(p.fun_np, p.x0, tol=1e-4)
  assert [r.algorithm for r in results] == list(bs.ALGORITHMS)
  f_star = bs.reference_optimum(p.fun_np, p.x0, tol=1e-8)
  for r in results:
    assert r.solved, (r.algorithm, r.message)
    assert r.value_calls == r.grad_calls == len(r.trace_values) == len(r.trace_grad_inf)
    np.testing.assert_array_equal(r.trace_grad_calls, np.arange(1, r.grad_calls + 1))
    assert 0 < r.grad_calls < 999 and r.iterations > 0 and r.seconds >= 0
    assert r.final_grad_inf <= 1e-4
    assert r.trace_grad_inf.min() <= 1e-4
    assert r.final_value == pytest.approx(p.fun_np(r.x)[0])
    assert r.final_value == pytest.approx(f_star, rel=1e-6, abs=1e-8)
    # The first call is at x0.
    assert r.trace_values[0] == pytest.approx(p.fun_np(p.x0)[0])


def test_trace_matches_direct_scipy_call(classification_problem):
  p = classification_problem("logistic")
  r = bs.run_baseline(p.fun_np, p.x0, "L-BFGS-M3")
  res = minimize(
    p.fun_np,
    p.x0,
    jac=True,
    method="L-BFGS-B",
    options={"maxcor": 3, "ftol": 0.0, "gtol": 1e-4, "maxiter": 999},
  )
  assert r.grad_calls == res.nfev and r.iterations == res.nit
  np.testing.assert_allclose(r.x, res.x)


def test_unsolved_when_tolerance_unreachable(classification_problem):
  p = classification_problem("svm")
  r = bs.run_baseline(p.fun_np, p.x0, "L-BFGS-M1", tol=1e-30)
  assert not r.solved


def test_budget_stops_the_run_at_the_last_point_evaluated(classification_problem):
  p = classification_problem("svm")
  r = bs.run_baseline(p.fun_np, p.x0, "L-BFGS-M1", tol=1e-30, budget=7, stop_at_budget=True)
  assert r.grad_calls == 7 and r.message == "budget" and r.status == "budget"
  assert not r.solved and r.iterations is None
  assert r.final_value == r.trace_values[-1] == pytest.approx(p.fun_np(r.x)[0])
