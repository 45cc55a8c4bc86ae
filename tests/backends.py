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
  - Across two compiled programs of the same run (an 80-step ``solve``
    against a 40-step one resumed; ``check_every`` 1, 3 and 64; ``solve``
    inlined in a user's ``jit`` against its own program), XLA:CPU gives the
    same bits, and these comparisons stay strict there. Not because it rounds
    every operation on its own: XLA:CPU contracts a multiply and an add into
    an FMA wherever the CPU has one, on every architecture (its LLVM target
    options set ``AllowFPOpFusion = FPOpFusion::Fast``, "Always allow FMA
    fusion", in ``xla/service/cpu/cpu_compiler.cc``; a jitted ``a * b + c``
    differs from the eager one in a quarter of the entries on an x86 CPU with
    FMA, and in none with ``--xla_cpu_max_isa=AVX``). Contraction happens
    inside one fused kernel, so two programs round alike where they compile
    the same kernels for what is compared: the runs above share the loop body,
    one computation whatever the trip count. They are bit-exact with
    contraction (``--xla_cpu_max_isa`` unset, ``AVX2``, ``AVX512``) and
    without (``AVX``, ``SSE4_2``); aarch64 always has FMA and the same
    options. A jitted step against eager ``update`` calls (programs of one
    operation each) differs in the last bit where the CPU has FMA, and is
    compared within :func:`rounding_tol` (``tests/test_minibatch.py``); the
    strict comparison of ``trial_lbfgs``'s reported f with an eager call holds
    because the only multiply-add that eager dispatch splits in its objective
    is a product by 0.5, which is exact. The measurements are in
    ``docs/research/rounding.md``.

    XLA:GPU fuses and orders the two programs' reductions differently: on one
    NVIDIA H200 the 80-step float64 runs of ``hdm(learner="ogd_sqrt")`` and
    ``hdm_hb`` differed from the 40 + 40 runs (by up to 3.3e-6 relative for
    ``hdm``; both runs had converged to gradients of 1e-12 to 1e-16, where the
    learners learn from rounding, and ``test_checkpoint_resume_is_bit_exact``
    now stops short of that), a converged ``optax.lbfgs`` run's gradient
    differed between two values of ``solve``'s ``check_every`` by 6e-16
    (entries of 1e-8: the rounding of terms of size 1, so the scale to compare
    it with is the gradient's at x0, not its own), and a trial point equal to
    x (a tie) was accepted by the jitted step and rejected by eager
    ``update``. Elsewhere than the CPU these comparisons use
    :func:`cross_program_rtol`, relative to each entry and to a stated scale.
  - Against the float64 NumPy reference loops (``tests/reference.py``), on
    every backend: :func:`spread_tol`, a tolerance estimated from the
    reference itself, run again with its oracle perturbed by the bound on its
    own rounding (:func:`rounding_tol`, :func:`rounding_noise`). Another
    summation order (NumPy's BLAS kernel, XLA's vector width or fusion; the
    H200's matrix-vector products reached a relative 1.2e-10 on the quadratic)
    moves each oracle value by at most that bound, so, to first order, the
    trajectory by about as much as the perturbed runs move, whatever the
    learned preconditioner does to it; the factor 10 is room for the rest.

Every function takes ``backend`` (default ``jax.default_backend()``), so the
non-CPU paths are tested on the CPU too (``tests/test_backends.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Optional, Sequence

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
  "per_step",
  "rounding_noise",
  "rounding_tol",
  "spread_tol",
]

NO_CPU_REASON = (
  "needs JAX's CPU backend (the CSR kernel of experiments/sparse/host_csr.py runs on the "
  "CPU only); JAX_PLATFORMS does not include cpu"
)
# spread_tol: how far beyond the perturbed runs' spread a trajectory may lie (see there).
SPREAD_FACTOR = 10.0
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


def rounding_noise(point, run: int, shape=()) -> np.ndarray:
  """Uniform noise on [-1, 1] of ``shape``, a deterministic function of ``point``'s bytes and
  ``run``: an oracle perturbed by it gives the same value at the same point within one run,
  so exact ties (a trial equal to x) stay ties, and different values in different runs."""
  key = np.ascontiguousarray(point, np.float64).tobytes() + int(run).to_bytes(4, "little")
  seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
  return np.random.default_rng(seed).uniform(-1.0, 1.0, shape)


def spread_tol(want, perturbed: Sequence, terms: int, factor: float = SPREAD_FACTOR) -> np.ndarray:
  """Per-step absolute tolerance of a trajectory against a reference run ``want`` (steps
  first), from the same reference run again with its oracle ``perturbed``.

  The idea of Monte Carlo arithmetic and of CESTAC (Parker, *Monte Carlo Arithmetic*, 1997;
  Vignes, *Discrete Stochastic Arithmetic for Validating Results of Numerical Software*,
  Numer. Algorithms 37, 2004): perturb a computation at its rounding level and watch how far
  its result moves. The reference's oracle returns f and grad f plus noise
  (:func:`rounding_noise`) of :func:`rounding_tol` of their terms times the size of those
  terms: the bound on how far another order of summation moves them (NumPy against XLA,
  another vector width). How far each perturbed run then lies from ``want`` measures what
  the iteration does to that rounding (its learned preconditioner, its momentum), which
  no a priori bound states.

  At step k the tolerance is ``factor`` times the largest spread max |perturbed - want| over
  the entries, the runs and the steps up to k (rounding passed on is not taken back, and
  the runs carry no rounding before the step where it first shows), plus a floor of
  :func:`rounding_tol` of ``terms`` times max |want_k|: a field that every run computes
  identically (its spread 0, such as P on a bound or a function of the step count) still
  carries the rounding of the ``terms`` products of its last update. ``factor`` 10: the
  perturbation is already as large as the bound (the rounding that it stands for is
  mostly far smaller); the factor covers the few random directions sampling the worst one,
  the update arithmetic's own rounding, which is not perturbed, and the step from a
  linear response to a small nonlinear one. None in a trajectory (a quantity not formed
  yet) counts as 0.
  """
  want = per_step(want)
  spread = np.zeros(want.shape[0])
  for run in perturbed:
    spread = np.maximum(spread, np.max(np.abs(per_step(run) - want), axis=1))
  spread = np.maximum.accumulate(spread)
  floor = rounding_tol(terms) * np.max(np.abs(want), axis=1)
  return factor * spread + floor


def per_step(traj) -> np.ndarray:
  """A trajectory as a (steps, entries) float64 array; None (not formed yet) counts as 0."""
  values = [0.0 if v is None else v for v in traj]
  return np.asarray(values, np.float64).reshape(len(values), -1)


def cross_program_rtol(dtype, backend: Optional[str] = None) -> float:
  """rtol between two compiled programs of the same run that compile the same kernels:
  0 (bit-exact) on the CPU (see the module's docstring)."""
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
