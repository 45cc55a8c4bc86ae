"""Shared test setup.

float64 is enabled once for the whole suite (the NumPy reference loops of
``tests/reference.py`` run in float64; float32 tests ask for it explicitly), each test
process has a program store of its own, and a process's compiled programs are released
when its memory mappings near the kernel's limit. A JAX objective's top-level runs stay on
the separate path (``separate_path_only``) except in tests marked ``fused_program``.
``classification_problem`` builds the paper's SVM / logistic objectives on a small synthetic
dataset; ``cpu_default_device`` runs a test on the CPU device (skipped without one, see
``tests/backends.py``).
"""

import atexit
import gc
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)


def _own_program_store() -> None:
  """The method's programs go to a store of this process's own (docs/speed.md), removed at
  exit: not the user's store, and not one shared between pytest-xdist's workers (each
  worker imports this file with the environment of the process that started it). A store
  named before pytest started (``HDM_OPTAX_PROGRAM_CACHE``, ``0`` to turn it off) is kept."""
  inherited = os.environ.get("HDM_OPTAX_PROGRAM_CACHE")
  if inherited is not None and inherited != os.environ.get("HDM_OPTAX_TEST_STORE"):
    return
  store = tempfile.mkdtemp(prefix="hdm_optax_programs_")
  os.environ["HDM_OPTAX_PROGRAM_CACHE"] = os.environ["HDM_OPTAX_TEST_STORE"] = store
  atexit.register(shutil.rmtree, store, ignore_errors=True)


_own_program_store()

# XLA:CPU maps each compiled kernel's code and data separately (about 200 mappings for one
# of the library's programs), and a process that passes the kernel's vm.max_map_count
# (65,530 by default) crashes inside XLA's compile when the next mapping fails. A test
# worker keeps the programs of hundreds of tests alive in JAX's caches, so the caches are
# released whenever the mappings pass this share of the limit (checked every few tests).
_MAPS_LIMIT = 0.75
_MAPS_CHECK_EVERY = 8
_tests_run = 0


def _max_map_count() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):  # not Linux
    return 0


def _map_count() -> int:
  with open("/proc/self/maps", "rb") as f:
    return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


_MAX_MAPS = _max_map_count()


# From an objective's third top-level run the library serves it with the fused program,
# which the second run compiles in the background (docs/guide.md, "Which program runs").
# Those compiles are about half of the suite's compile time, and a fused program computes
# the separate path's iterates (tests/test_first_answer.py). So the suite's runs stay on
# the separate path, the one every user's first answers take, except in tests marked
# ``fused_program``: those of the switch itself, of the fused program's store and cache,
# and the tests that count what a settled objective compiles. Under a caller's jit, vmap
# or grad the fused program runs in every test, as it always does there.


@pytest.fixture(autouse=True)
def separate_path_only(request, monkeypatch):
  """Keeps a JAX objective's top-level runs on the separate path (``helpers.SEPARATE_ONLY``
  runs of it before the fused program), unless the test is marked ``fused_program``."""
  if request.node.get_closest_marker("fused_program") is None:
    from hdm_optax.driver import separate  # pylint: disable=import-outside-toplevel

    from helpers import SEPARATE_ONLY  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(separate, "SEPARATE_RUNS", SEPARATE_ONLY)


def pytest_runtest_teardown(item, nextitem):
  """Releases JAX's and the library's compiled programs when this process's memory
  mappings near vm.max_map_count (see ``_MAPS_LIMIT``)."""
  global _tests_run
  _tests_run += 1
  if not _MAX_MAPS or _tests_run % _MAPS_CHECK_EVERY:
    return
  if _map_count() > _MAPS_LIMIT * _MAX_MAPS:
    import hdm_optax  # pylint: disable=import-outside-toplevel

    hdm_optax.clear_caches()
    gc.collect()


try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends


@pytest.fixture
def cpu_default_device():
  """The CPU device, JAX's default for the test (which is skipped where there is none)."""
  with backends.on_cpu_device() as device:
    yield device


@pytest.fixture
def classification_problem():
  """``make(kind, m=100, d=5, seed=0)``: an ``experiments.problems.Problem`` with noisy labels.

  The labels are not separable, so both problems have a finite minimiser.
  """
  from experiments import problems

  def make(kind, m=100, d=5, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((m, d))
    y = np.where(X @ rng.standard_normal(d) + 3.0 * rng.standard_normal(m) > 0, 1.0, -1.0)
    return problems.make_problem(X, y, kind, name=f"toy-{kind}")

  return make
