"""The solvers (rows) of the benchmark: a registry, extended from the command line.

A solver is named by a string. Registered names are the defaults below; anything else is a
Python expression evaluated with every public name of ``hdm_optax`` in scope, plus
``hdm_optax``, ``optax``, ``jnp`` and ``L`` (the problem's Lipschitz constant, traced):
``'hdm_best(precond_lr=0.1/L)'``, ``'optax.adam(3e-4)'``,
``'hdm_optax.hdm_best(lipschitz=L)'``. A bare name ``NAME`` means ``NAME()``
(``osgm_best`` -> ``hdm_optax.osgm_best()``). A solver that uses ``L`` runs only on problems
where L is known. New rows need no change to the runner.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np
import optax
from scipy.optimize import minimize

import hdm_optax

ADAM_LR = 1e-3  # optax.adam's row: the learning rate most examples use


@dataclasses.dataclass(frozen=True, eq=False)
class Solver:
  """One row of the benchmark (compared by identity: a stable key for compiled programs).

  Attributes:
    name: the name in the CSV.
    make: for an optax solver, ``make(L) -> optax.GradientTransformation`` (L may be traced).
    needs_lipschitz: whether ``make`` uses L.
    scipy_method: for a SciPy solver, the ``scipy.optimize.minimize`` method.
    scipy_options: for a SciPy solver, ``options(tol) -> dict``.
    max_n: the solver is not run (a ``skipped`` row) on problems with more variables.
  """

  name: str
  make: Optional[Callable] = None
  needs_lipschitz: bool = False
  scipy_method: Optional[str] = None
  scipy_options: Optional[Callable[[float], dict]] = None
  max_n: Optional[int] = None

  @property
  def is_scipy(self) -> bool:
    return self.scipy_method is not None


def namespace(lipschitz=None) -> dict:
  """Names an expression may use."""
  names = {name: getattr(hdm_optax, name) for name in hdm_optax.__all__}
  names.update(hdm_optax=hdm_optax, optax=optax, jnp=jnp, L=lipschitz)
  return names


def _uses_lipschitz(expression: str) -> bool:
  tree = ast.parse(expression, mode="eval")
  return any(isinstance(node, ast.Name) and node.id == "L" for node in ast.walk(tree))


def from_expression(name: str, expression: Optional[str] = None) -> Solver:
  """A solver built by evaluating ``expression`` (default: ``name``); checked once here."""
  expression = expression or name
  try:
    needs = _uses_lipschitz(expression)
  except SyntaxError as e:
    raise ValueError(
      f"solver {name!r} is neither a registered name ({', '.join(REGISTERED)}) nor a Python "
      f"expression: {e.msg}"
    ) from None
  code = compile(expression, f"<solver {name}>", "eval")

  def make(lipschitz):
    return eval(code, namespace(lipschitz))  # noqa: S307 (the command line's own expression)

  optimizer = make(1.0)
  if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
    raise ValueError(
      f"solver {name!r} evaluates to {type(optimizer).__name__}, not an optax transformation"
    )
  return Solver(name=name, make=make, needs_lipschitz=needs)


def lbfgsb_options(memory: int) -> Callable[[float], dict]:
  # ftol=0: stop on the gradient (and the budget) only, as the other rows do.
  return lambda tol: {"maxcor": memory, "gtol": tol, "ftol": 0.0, "maxiter": 10**6, "maxfun": 10**6}


def bfgs_options(tol: float) -> dict:
  return {"gtol": tol, "norm": np.inf, "maxiter": 10**6}


# SciPy's BFGS multiplies n x n matrices at every iteration (O(n^3)): at n = 3466 (the digits
# MLP) its 1000 calls take hours, so it runs up to n = 1000 (the CUTEst dev list's largest).
BFGS_MAX_N = 1000
SCIPY = {
  "scipy-lbfgsb-m5": ("L-BFGS-B", lbfgsb_options(5), None),
  "scipy-lbfgsb-m10": ("L-BFGS-B", lbfgsb_options(10), None),
  "scipy-bfgs": ("BFGS", bfgs_options, BFGS_MAX_N),
}
JAX = (
  "hdm_auto()",
  "osgm_best()",
  "hdm_best()",
  "hdm_best(lipschitz=L)",
  "hdm()",
  "hdm_hb()",
  "hdm_agd(lipschitz=L)",
  "optax.lbfgs()",
  f"optax.adam({ADAM_LR:g})",
)
REGISTERED = JAX + tuple(SCIPY)
DEFAULT = REGISTERED


@functools.cache
def get(name: str) -> Solver:
  """The solver called ``name`` (the same object for the same name)."""
  if name in SCIPY:
    method, options, max_n = SCIPY[name]
    return Solver(name=name, scipy_method=method, scipy_options=options, max_n=max_n)
  if name.isidentifier() and name not in namespace():
    return from_expression(name, f"hdm_optax.{name}()")
  if name.isidentifier():
    return from_expression(name, f"{name}()")
  return from_expression(name)


class BudgetSpent(Exception):
  """Raised by the counted objective once the budget of gradient calls is spent."""


@dataclasses.dataclass
class ScipyRun:
  grad_calls: int
  value: float
  grad_inf: float
  message: str  # SciPy's message, or "budget"


def run_scipy(solver: Solver, fun_np, x0: np.ndarray, tol: float, budget: int) -> ScipyRun:
  """One SciPy run; every call of ``fun_np`` (value and gradient) counts as one gradient call.

  A call past ``budget`` stops the run; the reported point is then the last one evaluated,
  otherwise SciPy's ``x`` (its value and gradient are evaluated once more, uncounted).
  """
  calls = 0
  last = None

  def counted(x):
    nonlocal calls, last
    if calls >= budget:
      raise BudgetSpent
    calls += 1
    value, grad = fun_np(x)
    last = (value, grad)
    return value, grad

  try:
    res = minimize(
      counted,
      np.array(x0, np.float64),
      jac=True,
      method=solver.scipy_method,
      options=solver.scipy_options(tol),
    )
  except BudgetSpent:
    value, grad = last
    message = "budget"
  else:
    value, grad = fun_np(res.x)
    message = str(res.message)
  grad_inf = float(np.max(np.abs(grad))) if np.size(grad) else 0.0
  return ScipyRun(calls, float(value), grad_inf, message)
