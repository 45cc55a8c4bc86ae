"""What the library's tests share: a counting oracle, a small logistic problem, doctests.

Library tests import this module (``import helpers``), never ``experiments``.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

from hdm_optax.driver import compiled as compiled_lib
from hdm_optax.driver import separate as separate_lib

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends

ROOT = Path(__file__).resolve().parents[1]


def counting(fun: Callable[..., Any]) -> tuple[Callable[..., Any], list]:
  """``(counted, calls)``: ``fun`` that appends to ``calls`` at every evaluation.

  The count comes from a ``jax.debug.callback``, so it sees every evaluation a
  compiled program makes (call ``jax.effects_barrier()`` before reading it).
  """
  calls = []

  def counted(*args):
    jax.debug.callback(lambda: calls.append(1))
    return fun(*args)

  return counted, calls


# solve's keyword for runs whose calls a counting oracle checks: one test of the
# stopping rule per step (check_every > 1 computes steps after the stop and discards
# them, and the callback sees their calls).
EVERY_STEP = {"check_every": 1}


def logistic(w, a, y):
  """Ridge logistic regression ``sum softplus(-y * (a @ w)) + 0.05 ||w||^2``."""
  return jnp.sum(jax.nn.softplus(-y * (a @ w))) + 0.05 * w @ w


def logistic_rtol(a, lip: float, steps: int) -> float:
  """rtol between two programs' ``steps``-step runs on :func:`logistic` with features ``a``
  (m x n) and a bound ``lip`` on L: :func:`backends.rounding_tol` of its m n + m terms over
  the steps, with condition number lip / 0.1 (0.1: the ridge's curvature, a bound on mu)."""
  m, n = np.shape(a)
  return backends.rounding_tol(m * n + m, steps, condition=lip / 0.1)


class LogisticProblem(NamedTuple):
  """Data of :func:`logistic`: ``a`` (m x n), labels ``y``, a bound ``lip`` on L, and ``x0``."""

  a: jax.Array
  y: jax.Array
  lip: float
  x0: jax.Array


def logistic_problem(seed: int, m: int = 40, n: int = 6) -> LogisticProblem:
  """Gaussian features, random labels (not separable: a finite minimiser), a random x0."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((m, n))
  y = np.where(rng.standard_normal(m) > 0, 1.0, -1.0)
  lip = float(0.25 * np.linalg.norm(a, 2) ** 2 + 0.1)
  return LogisticProblem(jnp.asarray(a), jnp.asarray(y), lip, jnp.asarray(rng.standard_normal(n)))


def check_doctests(module) -> None:
  """Runs ``module``'s docstring examples; at least one, none failing."""
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
  assert result.attempted > 0, f"{module.__name__} has no doctest"
  assert result.failed == 0, f"{result.failed} doctest(s) of {module.__name__} failed"


def python_blocks(page: str) -> list:
  """The ```python blocks of a page (path relative to the repository root)."""
  return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


def bash_blocks(page: str) -> list:
  """The ```bash blocks of a page (path relative to the repository root)."""
  return re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), re.S)


def run_page(page: str) -> None:
  """Runs a page's python blocks in order, in one namespace."""
  blocks = python_blocks(page)
  assert blocks, f"{page} has no python block"
  namespace = {}
  for block in blocks:
    exec(compile(block, page, "exec"), namespace)  # pylint: disable=exec-used


def replace_fields(state, **fields):
  """``state`` with ``fields`` replaced where they live: the direction's state
  (``IterationState.direction``) or, for HDM-AGD's own state, the state itself."""
  inner = getattr(state, "direction", None)
  if inner is not None and all(k in inner._fields for k in fields):
    return state._replace(direction=inner._replace(**fields))
  return state._replace(**fields)


class Compilations:
  """Counts XLA compilations while open (``jax.monitoring``'s backend compile events).

  Eager operations compile once per shape too, so a loop that compiles nothing new
  after its first iteration keeps :attr:`count` where the first iteration left it.
  """

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count = 0

  def _listen(self, event, duration, **kwargs):
    del duration, kwargs
    self.count += event == self.EVENT

  def __enter__(self):
    compiled_lib.wait()  # a program an earlier call builds in the background is not counted
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


# tests/conftest.py's SEPARATE_RUNS outside the tests marked fused_program.
SEPARATE_ONLY = 10**9


def settled(run: Callable[[], Any]) -> Any:
  """``run()`` until its programs are all built (the separate path's runs, the last of which
  builds the fused program in the background: docs/guide.md, "Which program runs"); returns
  the last result."""
  runs = separate_lib.SEPARATE_RUNS
  if runs >= SEPARATE_ONLY:  # the suite keeps runs on the separate path: one run builds it
    runs = 1
  for _ in range(runs):
    out = run()
  compiled_lib.wait()
  return out
