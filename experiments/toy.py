"""The toy quadratic of Figure 1a: vanilla HDM (no null step) first blows up, then converges.

``f(x) = 1/2 x^T A x`` with ``A = diag(logspace(0, 2, 5))`` (eigenvalues 1 ... 100,
so L = 100, mu = 1, f* = 0) and ``x^1 = (1, ..., 1)``.

Vanilla HDM with a diagonal P, online gradient descent with the constant step
``precond_lr = 1e-3`` and ``P_1 = 0.1 I`` (ten times 1/L: the trial step
overshoots on the stiff coordinates) runs through a warm-up phase where f(x^k)
climbs to about 1e27 f(x^1) while online gradient descent slowly drives
P toward A^{-1}, then converges superlinearly (f reaches 0 in float64 after
about 1300 iterations). With the null step the same run never exceeds
f(x^1) (Figure 1b). ``tests/test_claims.py`` checks both.

Usage::

    A, x0 = toy_quadratic()
    opt = hdm_optax.hdm(null_step=False, **VANILLA_HDM)
    res = hdm_optax.solve(opt, toy_objective, x0, max_steps=2000, tol=0.0,
                          fun_args=(A,), trace=2001)
"""

from __future__ import annotations

import numpy as np

# The HDM settings that show the two-phase behaviour on toy_quadratic().
VANILLA_HDM = dict(candidate="diagonal", learner="ogd", precond_lr=1e-3, init_precond=0.1)
TOY_MAX_STEPS = 2000


def toy_quadratic(n: int = 5, condition: float = 100.0):
  """Returns ``(A, x0)``: ``A = diag(logspace(0, log10(condition), n))`` (float64
  NumPy) and ``x0 = ones(n)``."""
  a = np.logspace(0.0, np.log10(condition), n)
  return np.diag(a), np.ones(n)


def toy_objective(x, A):
  """``f(x) = 1/2 x^T A x``."""
  return 0.5 * x @ (A @ x)


def toy_value(x, A) -> float:
  return float(0.5 * np.asarray(x) @ np.asarray(A) @ np.asarray(x))


__all__ = ["VANILLA_HDM", "TOY_MAX_STEPS", "toy_objective", "toy_quadratic", "toy_value"]
