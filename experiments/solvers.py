"""The solvers (rows) of the benchmark: a registry, extended from the command line.

A solver is named by a string. Registered names are the defaults below; anything else is a
Python expression evaluated with every public name of ``hdm_optax`` in scope, plus
``hdm_optax``, ``optax``, ``optx`` (optimistix), ``jnp``, ``L`` (the problem's Lipschitz
constant, traced) and ``F_STAR`` (its minimum value, traced): ``'hdm_best(precond_lr=0.1/L)'``,
``'optax.adam(3e-4)'``, ``'optax.polyak_sgd(f_min=F_STAR)'``, ``'optx.BFGS(rtol=0.0,
atol=0.0)'``; on a bounded problem also ``LOWER`` and ``UPPER`` (its box, traced):
``'trial_lbfgs(lower=LOWER, upper=UPPER)'`` runs on bounded problems only. A bare name ``NAME`` means ``NAME()`` (``osgm_best`` ->
``hdm_optax.osgm_best()``). A solver that uses ``L`` (``F_STAR``) runs only on problems where
L (f*) is known. An expression may give an optax transformation (run by ``hdm_optax.solve``)
or an optimistix minimiser (run by ``optimistix.minimise`` under the protocol's stopping
rule: :class:`GradientStop`). New rows need no change to the runner.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hdm_optax

try:
  import optimistix as optx
except ImportError:  # the optimistix rows need the bench extra
  optx = None
try:
  with warnings.catch_warnings():  # "JAXopt is no longer maintained": the row is a peer's
    warnings.simplefilter("ignore", DeprecationWarning)
    import jaxopt
except ImportError:  # the jaxopt row needs the bench extra
  jaxopt = None

ADAM_LR = 1e-3  # optax.adam's row: the learning rate most examples use
# optax's line searches as their docstrings' examples build gradient descent with them.
LINESEARCH_STEPS = 15


@dataclasses.dataclass(frozen=True, eq=False)
class Solver:
  """One row of the benchmark (compared by identity: a stable key for compiled programs).

  Attributes:
    name: the name in the CSV.
    make: for an optax solver, ``make(L, f_star) -> optax.GradientTransformation`` (either
      may be traced); for an optimistix solver, ``make(L, f_star) ->
      optimistix.AbstractMinimiser``.
    needs_lipschitz: whether ``make`` uses L.
    needs_f_star: whether ``make`` uses f*.
    is_optimistix: whether ``make`` gives an optimistix minimiser.
    is_jaxopt: whether ``make`` gives ``fun -> jaxopt solver`` (run by its own ``update``
      under the protocol's stopping rule: ``experiments.runner``).
    scipy_algorithm: for a SciPy solver, its name in ``experiments.baselines.quasi_newton``
      (``"BFGS"``, ``"L-BFGS-M5"``, ...).
    scipy_paper: SciPy as Table 1 runs it (the paper: to its ``maxiter`` of budget - 1
      iterations, one BLAS thread) instead of stopped at the call past the budget.
    max_n: the solver is not run (a ``skipped`` row) on problems with more variables.
    needs_box: ``make`` uses the box (``LOWER``, ``UPPER``): it runs on bounded problems only.
    clip: the clipping habit: the transformation minimises ``f(clip(x, LOWER, UPPER))``
      and its point is reported as ``clip(x)`` (bounded problems only).
    program: a jitted single-start program of its own, ``program(solver, fun, budget, x0,
      fun_args, L, f_star, box, tol) -> dict`` run by ``runner.run_optimistix`` (jaxopt's
      LBFGSB).
  """

  name: str
  make: Optional[Callable] = None
  needs_lipschitz: bool = False
  needs_f_star: bool = False
  is_optimistix: bool = False
  is_jaxopt: bool = False
  scipy_algorithm: Optional[str] = None
  scipy_paper: bool = False
  max_n: Optional[int] = None
  needs_box: bool = False
  clip: bool = False
  program: Optional[Callable] = None

  @property
  def is_scipy(self) -> bool:
    return self.scipy_algorithm is not None

  def runs_on(self, bounded: bool) -> bool:
    """Whether the row runs on a bounded (or unbounded) problem."""
    boxed = self.needs_box or self.clip
    return self.is_scipy or boxed == bounded


def namespace(lipschitz=None, f_star=None, lower=None, upper=None) -> dict:
  """Names an expression may use."""
  from experiments import bounded  # pylint: disable=import-outside-toplevel

  names = {name: getattr(hdm_optax, name) for name in hdm_optax.__all__}
  names.update(hdm_optax=hdm_optax, optax=optax, optx=optx, jnp=jnp, L=lipschitz, F_STAR=f_star)
  names.update(LOWER=lower, UPPER=upper, project_box=bounded.project_box)
  return names


def _names_used(expression: str) -> set:
  tree = ast.parse(expression, mode="eval")
  return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def _is_minimiser(obj) -> bool:
  return optx is not None and isinstance(obj, optx.AbstractMinimiser)


def from_expression(name: str, expression: Optional[str] = None) -> Solver:
  """A solver built by evaluating ``expression`` (default: ``name``); checked once here."""
  expression = expression or name
  try:
    used = _names_used(expression)
  except SyntaxError as e:
    raise ValueError(
      f"solver {name!r} is neither a registered name ({', '.join(REGISTERED)}) nor a Python "
      f"expression: {e.msg}"
    ) from None
  if "optx" in used and optx is None:
    raise ValueError(f"solver {name!r} needs optimistix: pip install -e '.[bench]'")
  code = compile(expression, f"<solver {name}>", "eval")

  def make(lipschitz, f_star=None, lower=None, upper=None):
    names = namespace(lipschitz, f_star, lower, upper)
    return eval(code, names)  # noqa: S307 (the command line's own expression)

  built = make(1.0, 0.0, 0.0, 1.0)
  minimiser = _is_minimiser(built)
  if not minimiser and not (hasattr(built, "init") and hasattr(built, "update")):
    raise ValueError(
      f"solver {name!r} evaluates to {type(built).__name__}, not an optax transformation "
      "or an optimistix minimiser"
    )
  return Solver(
    name=name,
    make=make,
    needs_lipschitz="L" in used,
    needs_f_star="F_STAR" in used,
    is_optimistix=minimiser,
    needs_box=bool({"LOWER", "UPPER"} & used),
  )


# SciPy's BFGS multiplies n x n matrices at every iteration (O(n^3)): at n = 3466 (the digits
# MLP) its 1000 calls take hours, so it runs up to n = 1000 (the CUTEst dev list's largest).
BFGS_MAX_N = 1000
# SciPy rows: (the baseline of experiments.baselines.quasi_newton, largest n). L-BFGS-B runs
# with ftol=0 (it stops on the gradient and the budget only, as the other rows do).
SCIPY = {
  "scipy-lbfgsb-m5": ("L-BFGS-M5", None),
  "scipy-lbfgsb-m10": ("L-BFGS-M10", None),
  "scipy-bfgs": ("BFGS", BFGS_MAX_N),
  # Hager and Zhang's CG_DESCENT 6.8 (pycgdescent), every f and grad f request counted.
  "cg-descent": ("CG_DESCENT", None),
}
JAX = (
  "trial_lbfgs()",
  "hdm_auto()",
  "osgm_best()",
  "hdm_best()",
  "hdm_best(lipschitz=L)",
  "hdm()",
  "hdm_hb()",
  "hdm_agd(lipschitz=L)",
  "optax.lbfgs()",
  f"optax.adam({ADAM_LR:g})",
  # optax's tuning-free family at its documented defaults.
  "optax.contrib.prodigy()",
  "optax.contrib.dog()",
  "optax.contrib.dadapt_adamw()",
  "optax.contrib.cocob()",
  "optax.polyak_sgd(f_min=F_STAR)",
)
# Rows whose name is not their expression: gradient descent with optax's line searches, and
# optimistix's quasi-Newton minimisers with their Cauchy test switched off (rtol = atol = 0),
# stopped by the protocol's gradient test instead (GradientStop).
NAMED = {
  "optax-gd-zoom": (
    f"optax.chain(optax.sgd(1.0), optax.scale_by_zoom_linesearch({LINESEARCH_STEPS}))"
  ),
  "optax-gd-backtracking": (
    "optax.chain(optax.sgd(1.0), "
    f"optax.scale_by_backtracking_linesearch({LINESEARCH_STEPS}, store_grad=True))"
  ),
  "optx.BFGS": "optx.BFGS(rtol=0.0, atol=0.0)",
  "optx.LBFGS": "optx.LBFGS(rtol=0.0, atol=0.0)",
}
# optimistix's BFGS carries a dense n x n inverse Hessian and forms n x n outer products in
# each update (a few such arrays at once): 200 MB each at n = 5000 in float64, 0.8 GB at
# n = 10,000, 121 GB at n = 123,200 (YATP1LS). It runs up to n = 5000.
OPTX_BFGS_MAX_N = 5000
NAMED_MAX_N = {"optx.BFGS": OPTX_BFGS_MAX_N}
# The bounded suites' rows (``experiments.bounded``): the box given to the
# method, the naive projected gradient descent, the clipping habit (an unconstrained solver
# on f(clip(x)); name -> its expression), and jaxopt's LBFGSB (its own runner). The SciPy
# rows run there too, with the box.
BOUNDED = {
  "trial_lbfgs(box)": "trial_lbfgs(lower=LOWER, upper=UPPER)",
  "optax-pgd-box-backtracking": (
    "optax.chain(optax.sgd(1.0), "
    f"optax.scale_by_backtracking_linesearch({LINESEARCH_STEPS}, store_grad=True), "
    "project_box(LOWER, UPPER))"
  ),
}
CLIPPED = {"optax.lbfgs()-clip": "optax.lbfgs()", "trial_lbfgs()-clip": "trial_lbfgs()"}
JAXOPT_LBFGSB = "jaxopt-lbfgsb"
# jaxopt's L-BFGS at its defaults (zoom line search, m = 10): ``make(L, f_star)(fun)`` builds it.
JAXOPT = {"jaxopt.LBFGS": lambda fun: jaxopt.LBFGS(fun=fun)}
REGISTERED = (
  JAX
  + tuple(NAMED)
  + tuple(SCIPY)
  + tuple(JAXOPT)
  + tuple(BOUNDED)
  + tuple(CLIPPED)
  + (JAXOPT_LBFGSB,)
)
DEFAULT = tuple(
  n
  for n in REGISTERED
  if not (optx is None and "optx" in n)
  and not (jaxopt is None and (n in JAXOPT or n == JAXOPT_LBFGSB))
)


@functools.cache
def get(name: str) -> Solver:
  """The solver called ``name`` (the same object for the same name)."""
  if name in SCIPY:
    algorithm, max_n = SCIPY[name]
    return Solver(name=name, scipy_algorithm=algorithm, max_n=max_n)
  if name in JAXOPT:
    if jaxopt is None:
      raise ValueError(f"solver {name!r} needs jaxopt: pip install -e '.[bench]'")
    return Solver(name=name, make=lambda lipschitz, f_star=None: JAXOPT[name], is_jaxopt=True)
  if name in NAMED:
    return dataclasses.replace(from_expression(name, NAMED[name]), max_n=NAMED_MAX_N.get(name))
  if name in BOUNDED:
    return from_expression(name, BOUNDED[name])
  if name in CLIPPED:
    return dataclasses.replace(from_expression(name, CLIPPED[name]), clip=True)
  if name == JAXOPT_LBFGSB:
    from experiments import bounded  # pylint: disable=import-outside-toplevel

    return Solver(name=name, program=bounded.jaxopt_lbfgsb, needs_box=True)
  if name.isidentifier() and name not in namespace():
    return from_expression(name, f"hdm_optax.{name}()")
  if name.isidentifier():
    return from_expression(name, f"{name}()")
  return from_expression(name)


# ----------------------------------------------------------------------------
# optimistix rows: the protocol's stopping rule, and every objective call counted
# ----------------------------------------------------------------------------


class CallCounter:
  """Counts the calls of an objective made inside compiled code (a host callback per call).

  ``counted(fun)`` is ``fun`` as optimistix takes it, ``(y, args) -> fun(y, *args)``, with an
  ordered ``io_callback`` that adds one to :attr:`calls` each time the compiled program
  evaluates it, whichever branch, loop or line search the evaluation sits in. Counting
  happens when the program runs, not when it is traced, so it survives ``jit``.
  """

  def __init__(self):
    self.calls = 0

  def _tick(self, _):
    self.calls += 1
    return np.zeros((), np.int32)

  def counted(self, fun):
    from jax.experimental import io_callback

    def fn(y, args):
      # Its input carries no tangent: linearize runs it once, in the primal computation.
      io_callback(self._tick, jax.ShapeDtypeStruct((), jnp.int32), jnp.zeros(()), ordered=True)
      return fun(y, *args)

    return fn


COUNTER = CallCounter()

if optx is not None:

  class GradientStop(optx.AbstractMinimiser):
    """An optimistix quasi-Newton minimiser stopped by ``||grad f(y)||_inf <= tol``.

    optimistix's BFGS and LBFGS stop on a small change of y and f (a Cauchy test with
    ``rtol`` and ``atol``); the benchmark runs them with ``rtol = atol = 0``, which switches
    that test off, and this wrapper stops them where the protocol stops every row: at the
    first accepted point whose gradient (the one the minimiser computed there, held in
    its state) has ``||grad f||_inf <= tol``. y0 is the first accepted point, so a start
    that already meets ``tol`` stops after one call. Everything else (steps, line search,
    result codes) is the wrapped minimiser's.

    Attributes:
      inner: the optimistix minimiser (its state must hold ``first_step`` and
        ``f_info.grad``, as ``AbstractQuasiNewton``'s does).
      tol: the threshold (an array: no recompilation for another value).
    """

    inner: Any
    tol: jax.Array
    rtol: float = 0.0
    atol: float = 0.0
    norm: Callable = optx.max_norm

    def init(self, fn, y, args, options, f_struct, aux_struct, tags):
      return self.inner.init(fn, y, args, options, f_struct, aux_struct, tags)

    def step(self, fn, y, args, options, state, tags):
      return self.inner.step(fn, y, args, options, state, tags)

    def terminate(self, fn, y, args, options, state, tags):
      done, result = self.inner.terminate(fn, y, args, options, state, tags)
      small = optx.max_norm(state.f_info.grad) <= self.tol
      return done | (jnp.logical_not(state.first_step) & small), result

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
      return self.inner.postprocess(fn, y, aux, args, options, state, tags, result)

  # optimistix's result names (the entries of ``optx.RESULTS`` that this version has): a
  # compiled run reports the index of the one its result equals (``result_code``).
  RESULT_NAMES = tuple(
    name
    for name in (
      "successful",
      "max_steps_reached",
      "nonlinear_max_steps_reached",
      "nonlinear_divergence",
      "nonfinite",
      "nonfinite_input",
      "singular",
      "breakdown",
      "stagnation",
      "conlim",
    )
    if hasattr(optx.RESULTS, name)
  )

  def result_code(result) -> jax.Array:
    """The index in ``RESULT_NAMES`` of an optimistix result (traceable; ``len(RESULT_NAMES)``
    for an entry not listed there)."""
    hits = jnp.stack([result == getattr(optx.RESULTS, name) for name in RESULT_NAMES])
    return jnp.where(jnp.any(hits), jnp.argmax(hits), len(RESULT_NAMES))
