"""Shared test setup.

float64 is enabled once for the whole suite, and the program store is a temporary
directory of the session's (the NumPy reference loops of
``tests/reference.py`` run in float64; float32 tests ask for it explicitly).
``classification_problem`` builds the paper's SVM / logistic objectives on a
small synthetic dataset; ``cpu_default_device`` runs a test on the CPU device
(skipped without one, see ``tests/backends.py``).
"""

import os
import tempfile

import jax
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)
# The method's programs go to a store of the session's own (docs/speed.md), not the user's.
os.environ.setdefault("HDM_OPTAX_PROGRAM_CACHE", tempfile.mkdtemp(prefix="hdm_optax_programs_"))

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
