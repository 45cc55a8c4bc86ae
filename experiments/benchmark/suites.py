"""The benchmark's suites: CUTEst (sif2jax), LIBSVM in float64 and float32, user problems, and
the bounded ones (CUTEst's bounded problems, LIBSVM's logistic regression with ``w >= 0``).

A suite is a list of :class:`Task` (cheap: a name and how to build it); ``Task.build()`` returns
a ``protocol.Instance``, the problem ready to run: ``fun(x, *fun_args)``, a batch of starting
points (one row per seed, run as one vmapped program), the tolerance of each, L where it is
known, and a float64 NumPy ``fun_np(x) -> (value, grad)`` for the SciPy rows; the objectives
and the instances come from the registry, ``experiments.problems``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import data as data_lib
from experiments import problems as problems_lib
from experiments import protocol

# ``$HDM_BENCHMARKS_DIR`` or ``<repo>/../shared/benchmarks``.
BENCHMARKS_DIR = Path(
  os.environ.get("HDM_BENCHMARKS_DIR") or data_lib.repo_root().parent / "shared" / "benchmarks"
)
CUTEST_DEV_LIST = BENCHMARKS_DIR / "cutest_dev.txt"
# The larger problems to develop on (1024 <= n <= 123,200; 42 problems): suite cutest_scale_dev.
CUTEST_SCALE_DEV_LIST = BENCHMARKS_DIR / "cutest_scale_dev.txt"
CUTEST_BOUNDED_DEV_LIST = BENCHMARKS_DIR / "cutest_bounded_dev.txt"
SEED0 = protocol.SEED  # the paper's x0 seed; seed i is SEED0 + i
FLOAT32_RELATIVE_TOL = problems_lib.FLOAT32_RELATIVE_TOL


@dataclasses.dataclass(frozen=True)
class Task:
  """One problem of a suite: ``build()`` makes the ``protocol.Instance`` (may be slow or raise)."""

  suite: str
  name: str
  seeds: tuple  # (None,) where the starting point is fixed
  build: Callable[[], protocol.Instance] = dataclasses.field(compare=False, repr=False)


# ----------------------------------------------------------------------------
# CUTEst (sif2jax)
# ----------------------------------------------------------------------------


@functools.cache
def _sif2jax_folder(kind: str = "_unconstrained_minimisation") -> tuple[Path, dict[str, str]]:
  """Directory of sif2jax's problems of ``kind`` and class name -> module name.

  ``import sif2jax`` builds every problem class of the package (1-3 minutes on 2 cores, one
  constrained module alone 86 s); the benchmark needs only unconstrained (and bounded) ones,
  so their parent packages are registered as bare namespaces and each problem's module is
  imported alone (3 s for the 66 of the dev list).
  """
  spec = importlib.util.find_spec("sif2jax")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("the cutest suite needs sif2jax: pip install -e '.[bench]'")
  root = Path(spec.submodule_search_locations[0])
  folder = root / "cutest" / kind
  for name, path in (
    ("sif2jax", root),
    ("sif2jax.cutest", root / "cutest"),
    (f"sif2jax.cutest.{kind}", folder),
  ):
    if name not in sys.modules:
      package = types.ModuleType(name)
      package.__path__ = [str(path)]
      # A spec, so that importlib.util.find_spec(name) still answers after this.
      package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
      package.__spec__.submodule_search_locations = [str(path)]
      sys.modules[name] = package
  source = (folder / "__init__.py").read_text()
  modules = {cls: mod for mod, cls in re.findall(r"^from \.(\w+) import (\w+) as", source, re.M)}
  return folder, modules


def _sif2jax_unconstrained() -> tuple[Path, dict[str, str]]:
  return _sif2jax_folder("_unconstrained_minimisation")


def cutest_problem(name: str, kind: str = "_unconstrained_minimisation"):
  """The sif2jax problem whose CUTEst name is ``name`` (e.g. ``"ROSENBR"``, ``"10FOLDTRLS"``).

  ``kind`` is sif2jax's folder (``"_bounded_minimisation"`` for the bounded problems).
  """
  folder, modules = _sif2jax_folder(kind)
  candidates = [name] if name in modules else []
  if not candidates:  # names that are not identifiers: the class returns it from ``name``
    candidates = [
      cls
      for cls, mod in modules.items()
      if f'"{name}"' in (folder / f"{mod}.py").read_text(errors="replace")
    ]
  for cls in candidates:
    module = importlib.import_module(f"sif2jax.cutest.{kind}.{modules[cls]}")
    problem = getattr(module, cls)()
    if problem.name == name:
      return problem
  raise KeyError(f"sif2jax has no problem named {name!r} in {kind}")


# sif2jax.bounded_minimisation_problems: the bounded problems and the bounded quadratic ones.
BOUNDED_FOLDERS = ("_bounded_minimisation", "_quadratic_problems")


def cutest_bounded_problem(name: str):
  """The problem of ``sif2jax.bounded_minimisation_problems`` whose CUTEst name is ``name``."""
  for kind in BOUNDED_FOLDERS:
    try:
      return cutest_problem(name, kind)
    except KeyError:
      pass
  raise KeyError(f"sif2jax has no bounded problem named {name!r}")


def cutest_names(path: Path = CUTEST_DEV_LIST) -> list[str]:
  """The dev list (``../shared/benchmarks/cutest_dev.txt``), one name a line."""
  return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


# Problems whose stated minimum value (sif2jax's ``expected_objective_value``) is contradicted
# by a point the committed benchmark rows reached with ||grad f||_inf <= 1e-4: a lower f
# (CHWIRUT2LS 513.048 < 513.05 as rounded, EXPFIT 0.2405 < 8.79, KOWOSB 3.08e-4 < 1.03e-3,
# PENALTY3 -1.0e-3 < 1e-3, PALMER6C 0.0164 < 0.0503), or the minimiser of a convex (linear
# least-squares) problem at another value (PALMER5C 2.13, PALMER5D 87.3, PALMER7C 0.602,
# PALMER8C 0.160: sif2jax repeats PALMER4C's 0.0503 for them). Their f* is not known here.
WRONG_F_STAR = frozenset(
  {
    "CHWIRUT2LS",
    "EXPFIT",
    "KOWOSB",
    "PENALTY3",
    "PALMER5C",
    "PALMER5D",
    "PALMER6C",
    "PALMER7C",
    "PALMER8C",
  }
)


def cutest_f_star(problem) -> Optional[float]:
  """The minimum value the SIF file states (sif2jax's ``expected_objective_value``), or None.

  None where the file states none, or where the stated value is not the problem's minimum
  (``WRONG_F_STAR``). Elsewhere the stated value may be the global minimum of a problem
  whose runs end at a local one (BIGGS6: 0, runs end at 0.0057): a lower bound, which is
  what ``optax.polyak_sgd``'s ``f_min`` asks for.
  """
  value = problem.expected_objective_value
  if value is None or problem.name in WRONG_F_STAR:
    return None
  return float(value)


def _float32(tree):
  """The float arrays of ``tree`` in float32."""
  return jax.tree.map(
    lambda a: a.astype(jnp.float32) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a,
    tree,
  )


def cutest_instance(problem, tol, *, dtype="float64", factor=1, scaled=False, bounded=False):
  """The sif2jax ``problem`` as a ``protocol.Instance``: ``fun(y, args)``, from its ``y0``.

  Args:
    problem: a sif2jax problem.
    tol: the tolerance.
    dtype: ``"float32"``: x0 and ``args`` cast, f's value cast (a problem that builds
      float64 constants inside computes those terms in float64), tol relative as the
      float32 LIBSVM suite's (``FLOAT32_RELATIVE_TOL``).
    factor: start from ``factor y0`` (More, Garbow and Hillstrom's far starts; a zero y0
      stays at zero).
    scaled: ``x -> f(D x)`` from ``y0 / D`` (D :func:`hard_scaling`, an argument of the
      compiled program).
    bounded: the problem's box, the start projected into it (f* not used).
  """
  y0 = factor * np.asarray(problem.y0, np.float64)
  fun, args = (lambda y, args: problem.objective(y, args)), (problem.args,)
  if dtype == "float32":
    fun = lambda y, args: jnp.asarray(problem.objective(y, args), jnp.float32)
    args = (_float32(problem.args),)
    g0 = np.max(np.abs(problems_lib.jax_fun_np(fun, args, dtype)(y0)[1]))
    tol = max(tol, FLOAT32_RELATIVE_TOL * float(g0))
  if scaled:
    d = hard_scaling(y0.size).reshape(y0.shape)
    fun = lambda y, args, scale: problem.objective(scale * y, args)
    args += (jnp.asarray(d, jnp.result_type(problem.y0)),)
    y0 = y0 / d
  f_star, box = cutest_f_star(problem), {}
  if bounded:
    f_star, box = (
      None,
      dict(zip(("lower", "upper"), (np.asarray(b, np.float64) for b in problem.bounds))),
    )
  return problems_lib.instance(fun, args, y0, tol, dtype=dtype, f_star=f_star, **box)


def cutest_tasks(
  tol: float,
  names: Optional[Sequence[str]] = None,
  dtype: str = "float64",
  suite: Optional[str] = None,
) -> list[Task]:
  """The dev list (or ``names``), each from its own ``y0`` with its ``args``.

  ``dtype="float32"``: the ``cutest32`` suite, ``||grad f||_inf <= max(tol,
  FLOAT32_RELATIVE_TOL ||grad f(x0)||_inf)``. ``suite`` names the rows (default
  ``cutest`` / ``cutest32``).
  """
  names = cutest_names() if names is None else list(names)
  suite = suite or ("cutest32" if dtype == "float32" else "cutest")
  build = lambda name: cutest_instance(cutest_problem(name), tol, dtype=dtype)
  return [Task(suite, name, (None,), functools.partial(build, name)) for name in names]


def cutest_problems():
  """Every unconstrained problem of sif2jax (each module imported alone), one per name."""
  _, modules = _sif2jax_unconstrained()
  out = {}
  for cls, mod in sorted(modules.items()):
    module = importlib.import_module(f"sif2jax.cutest._unconstrained_minimisation.{mod}")
    problem = getattr(module, cls)()
    out.setdefault(problem.name, problem)
  return out


def cutest_scale_tasks(tol: float, max_n: int, min_n: int = 1000) -> list[Task]:
  """The package's other unconstrained problems with ``min_n`` < n <= ``max_n`` (``--max-n``).

  Not part of the dev list: run on explicit request only, never to tune on.
  """
  dev = set(cutest_names())
  chosen = {
    name: p
    for name, p in cutest_problems().items()
    if name not in dev and min_n < np.size(p.y0) <= max_n
  }
  return [
    Task("cutest_scale", name, (None,), lambda p=p: cutest_instance(p, tol))
    for name, p in sorted(chosen.items())
  ]


# ----------------------------------------------------------------------------
# CUTEst made harder: far starts and a diagonal rescaling (suite cutest_hard)
# ----------------------------------------------------------------------------

# More, Garbow and Hillstrom (ACM TOMS 7(1), 1981) run each problem from x0, 10 x0 and 100 x0.
HARD_FACTORS = (10, 100)
# x -> f(D x), D log-spaced over [1e-2, 1e2] (deterministic), started at y0 / D.
HARD_SCALE_RANGE = (1e-2, 1e2)


def hard_scaling(n: int) -> np.ndarray:
  """D of the rescaled variant: n values log-spaced from 1e-2 to 1e2 (1e-2 where n = 1)."""
  lo, hi = HARD_SCALE_RANGE
  return np.logspace(np.log10(lo), np.log10(hi), n)


def cutest_hard_tasks(tol: float, names: Optional[Sequence[str]] = None) -> list[Task]:
  """Every dev problem from 10 y0 (``NAME@10x``), 100 y0 (``NAME@100x``) and rescaled
  (``NAME@D``: :func:`hard_scaling`). The problems from y0 are the ``cutest`` suite."""
  names = cutest_names() if names is None else list(names)
  out = []
  for name in names:
    for factor in HARD_FACTORS:
      build = lambda name=name, k=factor: cutest_instance(cutest_problem(name), tol, factor=k)
      out.append(Task("cutest_hard", f"{name}@{factor}x", (None,), build))
    build = lambda name=name: cutest_instance(cutest_problem(name), tol, scaled=True)
    out.append(Task("cutest_hard", f"{name}@D", (None,), build))
  return out


def cutest_bounded_tasks(tol: float, names: Optional[Sequence[str]] = None) -> list[Task]:
  """The bounded dev list (or ``names``), each with its own box and projected ``y0``."""
  names = cutest_names(CUTEST_BOUNDED_DEV_LIST) if names is None else list(names)
  build = lambda name: cutest_instance(cutest_bounded_problem(name), tol, bounded=True)
  return [Task("cutest_bounded", name, (None,), functools.partial(build, name)) for name in names]


# ----------------------------------------------------------------------------
# LIBSVM (Table 1's instances) with several starting points
# ----------------------------------------------------------------------------


def _libsvm_instance(dataset, kind, seeds, tol, dtype, data_dir, **box):
  problem = problems_lib.load_problem(dataset, kind, data_dir=data_dir)
  return problems_lib.libsvm_instance(problem, seeds=seeds, tol=tol, dtype=dtype, **box)


def libsvm_tasks(
  tol: float,
  num_seeds: int,
  dtype: str = "float64",
  datasets: Optional[Sequence[str]] = None,
  data_dir=None,
  bounded: bool = False,
) -> list[Task]:
  """Both problems (SVM, logistic) of every dataset on disk, seeds SEED0, SEED0 + 1, ...

  ``bounded``: the ``libsvm_bounded`` suite, logistic regression with ``w >= 0`` (the
  paper's x0 projected onto the box). A dataset that is not found is left out with a message
  (on stderr) that says where it was looked for and how to get it.
  """
  names = data_lib.list_datasets(data_dir) if datasets is None else list(datasets)
  note = data_lib.data_dir_note(data_dir) if datasets is None else None
  if note:
    print(f"libsvm suites: {note}", file=sys.stderr)
  for name in [n for n in names if data_lib.find_dataset(n, data_dir) is None]:
    names.remove(name)
    print(
      f"libsvm suites: skipping {name}: "
      + data_lib.missing_message(
        name, data_dir or data_lib.default_data_dir(), data_lib.default_cache_dir()
      ),
      file=sys.stderr,
    )
  seeds = tuple(SEED0 + i for i in range(num_seeds))
  suite = "libsvm" if dtype == "float64" else "libsvm32"
  kinds = [(kind, kind, {}) for kind in problems_lib.KINDS]
  if bounded:
    suite, kinds = (
      "libsvm_bounded",
      [("logistic", "logistic-nonneg", dict(lower=0.0, upper=np.inf))],
    )
  return [
    Task(
      suite,
      f"{name}/{label}",
      seeds,
      functools.partial(_libsvm_instance, name, kind, seeds, tol, dtype, data_dir, **box),
    )
    for name in names
    for kind, label, box in kinds
  ]


# ----------------------------------------------------------------------------
# What a new user tries
# ----------------------------------------------------------------------------


def user_tasks(tol: float) -> list[Task]:
  """Rosenbrock (n = 2, 100), the digits MLP, breast-cancer logistic (f32, f64), x - log x."""

  def rosen(n):
    x0 = np.tile([-1.2, 1.0], n // 2)
    return lambda: problems_lib.instance(problems_lib.rosenbrock, (), x0, tol, f_star=0.0)

  x_log_x = problems_lib.x_minus_log_x
  return [
    Task("user", "rosenbrock-2", (None,), rosen(2)),
    Task("user", "rosenbrock-100", (None,), rosen(100)),
    Task("user", "mlp-digits-f32", (None,), lambda: problems_lib.mlp_digits(tol)),
    Task("user", "logreg-cancer-f32", (None,), lambda: problems_lib.breast_cancer(tol, "float32")),
    Task("user", "logreg-cancer-f64", (None,), lambda: problems_lib.breast_cancer(tol, "float64")),
    Task(
      "user",
      "x-minus-log-x-10",
      (None,),
      lambda: problems_lib.instance(x_log_x, (), np.full(10, 5.0), tol, f_star=10.0),
    ),
  ]


SUITES = ("cutest", "cutest32", "libsvm", "libsvm32", "user")
# Run on request only: the scale dev list, the dev list made harder (far starts, a diagonal
# rescaling), the package's other problems by size, and the bounded suites (the box given to
# the bounded rows: experiments.bounded).
BOUNDED_SUITES = ("cutest_bounded", "libsvm_bounded")
EXTRA_SUITES = ("cutest_scale_dev", "cutest_scale", "cutest_hard") + BOUNDED_SUITES


def tasks(
  suite: str,
  *,
  tol: float,
  num_seeds: int = 1,
  datasets=None,
  data_dir=None,
  problems: Optional[Sequence[str]] = None,
  max_n: Optional[int] = None,
) -> list[Task]:
  """The tasks of ``suite`` (one of ``SUITES`` or ``EXTRA_SUITES``), optionally only ``problems``."""
  if suite in ("cutest", "cutest32"):
    out = cutest_tasks(tol, dtype="float64" if suite == "cutest" else "float32")
  elif suite == "cutest_hard":
    out = cutest_hard_tasks(tol)
  elif suite == "cutest_scale_dev":
    out = cutest_tasks(tol, cutest_names(CUTEST_SCALE_DEV_LIST), suite=suite)
  elif suite == "cutest_scale":
    if max_n is None:
      raise ValueError("the cutest_scale suite needs --max-n")
    out = cutest_scale_tasks(tol, max_n)
  elif suite in ("libsvm", "libsvm32"):
    dtype = "float64" if suite == "libsvm" else "float32"
    out = libsvm_tasks(tol, num_seeds, dtype, datasets, data_dir)
  elif suite == "user":
    out = user_tasks(tol)
  elif suite == "cutest_bounded":
    out = cutest_bounded_tasks(tol)
  elif suite == "libsvm_bounded":
    out = libsvm_tasks(tol, num_seeds, datasets=datasets, data_dir=data_dir, bounded=True)
  else:
    raise ValueError(f"suite must be one of {SUITES + EXTRA_SUITES}, got {suite!r}")
  if problems:
    wanted = set(problems)
    out = [t for t in out if wanted & {t.name, t.name.split("/")[0], t.name.split("@")[0]}]
  return out
