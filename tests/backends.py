"""Where a test runs, and what it may assume about exactness there.

The suite runs on any JAX backend. Two things depend on it:

* The CSR kernel of ``experiments/sparse/host_csr.py`` exists for the CPU only
  (its lowering is registered for ``platform="cpu"``). Its tests run on the CPU
  device explicitly (:func:`on_cpu_device`), whatever the default backend is,
  and are skipped, with the reason, where JAX has no CPU backend
  (``JAX_PLATFORMS`` without ``cpu``).
* Exactness. What holds everywhere and what holds on the CPU only:

  - Within one compiled program, the same inputs give the same bits on every
    backend: a run resumed from a checkpoint by the program that wrote it is
    bit-exact everywhere.
  - Across two compiled programs (an 80-step ``solve`` against a 40-step one
    resumed; a jitted step against eager ``update`` calls), XLA:CPU gives the
    same bits in these tests, and they stay strict there. XLA:GPU fuses and
    orders the two programs' reductions differently: on one NVIDIA H200 the
    80-step float64 runs of ``hdm(learner="ogd_sqrt")`` and ``hdm_hb`` differed
    from the 40 + 40 runs (by up to 3.3e-6 relative for ``hdm``; both runs
    had converged to gradients of 1e-12 to 1e-16, where the learners learn
    from rounding, and ``test_checkpoint_resume_is_bit_exact`` now stops short
    of that), a
    converged ``optax.lbfgs`` run's gradient differed between two values of
    ``solve``'s ``check_every`` by 6e-16 (entries of 1e-8: the rounding of
    terms of size 1, so the scale to compare it with is the gradient's at x0,
    not its own), and a trial point equal to x (a tie) was accepted by the
    jitted step and rejected by eager ``update``. Elsewhere than the CPU these
    comparisons use :func:`cross_program_rtol`, relative to each entry and to
    a stated scale.
  - Against the float64 NumPy reference loops (``tests/reference.py``):
    rtol 1e-10 on the CPU; :func:`reference_rtol` elsewhere (the quadratic
    and diagonal cases reached a relative error of 1.2e-10 on the H200: its
    matrix-vector products sum in another order than NumPy's).

Every function takes ``backend`` (default ``jax.default_backend()``), so the
non-CPU paths are tested on the CPU too (``tests/test_backends.py``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import jax
import numpy as np
import pytest

__all__ = [
  "NO_CPU_REASON",
  "assert_same_across_programs",
  "cpu_device",
  "cross_program_rtol",
  "is_cpu",
  "on_cpu_device",
  "reference_rtol",
  "rounding_tol",
]

NO_CPU_REASON = (
  "needs JAX's CPU backend (the CSR kernel of experiments/sparse/host_csr.py runs on the "
  "CPU only); JAX_PLATFORMS does not include cpu"
)
# The NumPy reference comparisons: strict on the CPU; the H200's 1.2e-10 with room elsewhere.
REFERENCE_RTOL_CPU = 1e-10
REFERENCE_RTOL_OTHER = 1e-9
# Two compiled programs of the same run elsewhere than the CPU: last-bit differences
# grown over a few dozen steps.
CROSS_PROGRAM_RTOL = {np.dtype(np.float64): 1e-5, np.dtype(np.float32): 1e-4}


def _backend(backend: Optional[str]) -> str:
  return jax.default_backend() if backend is None else backend


def is_cpu(backend: Optional[str] = None) -> bool:
  """Whether ``backend`` (default: JAX's default backend) is the CPU."""
  return _backend(backend) == "cpu"


def cpu_device() -> Optional[jax.Device]:
  """JAX's first CPU device, or None where JAX has no CPU backend."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:  # "Unknown backend cpu" / backend not in JAX_PLATFORMS
    return None


@contextlib.contextmanager
def on_cpu_device():
  """Runs the block with the CPU device as JAX's default; skips the test without one."""
  device = cpu_device()
  if device is None:
    pytest.skip(NO_CPU_REASON)
  with jax.default_device(device):
    yield device


def reference_rtol(backend: Optional[str] = None) -> float:
  """rtol of the float64 trajectories against the NumPy reference loops."""
  return REFERENCE_RTOL_CPU if is_cpu(backend) else REFERENCE_RTOL_OTHER


def rounding_tol(
  terms: int,
  steps: int = 1,
  condition: float = np.inf,
  amplification: float = 1.0,
  dtype=np.float64,
) -> float:
  """How far, relative to the size of its terms, a quantity may move when another program
  computes it: NumPy against XLA, or XLA on another CPU (its vector width), with its ops
  fused otherwise (jitted, vmapped, batched, a pytree's leaves one by one).

  Summing k terms in another order moves the sum by up to about k eps times the sum of the
  terms' absolute values (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
  Section 4.2); a step of size about 1/L turns that difference of the gradient into one of
  about k eps |x| in the iterate. Over ``steps`` steps of an iteration that does not expand a difference in its
  iterate (a gradient step of size at most 2/L on a convex f), the steps' differences add;
  one that contracts it by 1 - 1/``condition`` a step (L/mu on a strongly convex f) keeps at
  most ``condition`` of them: min(steps, condition) count. ``amplification`` is what the
  compared quantity multiplies the rounding by beyond that, as stated at the call.

  Returns 4 k min(steps, condition) amplification eps (4: the bound's constant, with room
  for the products' own rounding).
  """
  return 4.0 * terms * min(steps, condition) * amplification * float(np.finfo(dtype).eps)


def cross_program_rtol(dtype, backend: Optional[str] = None) -> float:
  """rtol between two compiled programs of the same run: 0 (bit-exact) on the CPU."""
  return 0.0 if is_cpu(backend) else CROSS_PROGRAM_RTOL[np.dtype(dtype)]


def assert_same_across_programs(
  got, want, dtype, backend: Optional[str] = None, scale: Optional[float] = None
) -> None:
  """``got == want`` bit for bit on the CPU, within :func:`cross_program_rtol` elsewhere.

  Elsewhere the tolerance is relative to each entry and to ``scale``: the size of
  the terms whose rounding the entries carry (default: the largest entry of
  ``want``; an entry near 0 carries the rounding of the largest).
  """
  rtol = cross_program_rtol(dtype, backend)
  if rtol == 0.0 or not np.issubdtype(np.asarray(want).dtype, np.inexact):  # counters, flags
    np.testing.assert_array_equal(got, want)
  else:
    if scale is None:
      scale = float(np.max(np.abs(np.asarray(want, np.float64)), initial=0.0))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)
