"""Tests of experiments/sparse/host_csr.py: CSR products inside compiled JAX code.

Both lowerings (the FFI kernel and SciPy through a host callback) must give
SciPy's numbers bit for bit, in every batch layout and with the row split.
The kernel exists on the CPU only: every test runs on the CPU device, whatever
JAX's default backend is, and is skipped where JAX has no CPU backend.
"""

import gc
import subprocess
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from experiments.sparse import host_csr

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends

CPU = backends.cpu_device()
pytestmark = [
  pytest.mark.skipif(CPU is None, reason=backends.NO_CPU_REASON),
  pytest.mark.usefixtures("cpu_default_device"),
]

A = sp.random(37, 9, density=0.3, random_state=0, format="csr")
MATRIX = host_csr.register(A) if CPU is not None else None
W = np.random.default_rng(0).standard_normal((4, 9))
V = np.random.default_rng(1).standard_normal((4, 37))
LOWERINGS = ["ffi", "callback"]


@pytest.fixture(params=LOWERINGS)
def lowering(request, monkeypatch):
  """Compiles the product with one lowering (fresh jit caches each time)."""
  if request.param == "ffi":
    if not host_csr._load_kernel():
      pytest.skip("no C++ compiler: the FFI kernel cannot be built here")
    monkeypatch.setenv("HDM_HOST_CSR", "ffi")
  else:
    monkeypatch.setenv("HDM_HOST_CSR", "callback")
  jax.clear_caches()
  yield request.param
  jax.clear_caches()


def _loss(w, matrix):
  return jnp.sum(jnp.sin(host_csr.csr_matvec(w, matrix)))


def test_products_gradients_and_vmap_equal_scipy(lowering):
  vg = jax.jit(jax.value_and_grad(_loss))
  for w in W:
    v, g = vg(jnp.asarray(w), MATRIX)
    z = A @ w
    assert float(v) == pytest.approx(np.sum(np.sin(z)), rel=1e-13)
    np.testing.assert_allclose(np.asarray(g), A.T @ np.cos(z), rtol=1e-12, atol=1e-14)
  matvec = jax.jit(host_csr.csr_matvec)
  np.testing.assert_array_equal(np.asarray(matvec(jnp.asarray(W[0]), MATRIX)), A @ W[0])
  batched = jax.jit(jax.vmap(host_csr.csr_matvec, in_axes=(0, None)))(jnp.asarray(W), MATRIX)
  np.testing.assert_array_equal(np.asarray(batched), (A @ W.T).T)  # SciPy's csr_matvecs
  nested = jax.jit(jax.vmap(jax.vmap(host_csr.csr_matvec, in_axes=(0, None)), in_axes=(0, None)))(
    jnp.asarray(W.reshape(2, 2, 9)), MATRIX
  )
  np.testing.assert_array_equal(np.asarray(nested), (A @ W.T).T.reshape(2, 2, 37))
  transposed = jax.jit(jax.grad(lambda w, m, v: jnp.vdot(host_csr.csr_matvec(w, m), v)))
  np.testing.assert_array_equal(
    np.asarray(transposed(jnp.asarray(W[0]), MATRIX, jnp.asarray(V[0]))), A.T.tocsr() @ V[0]
  )
  vb, gb = jax.jit(jax.vmap(jax.value_and_grad(_loss), in_axes=(0, None)))(jnp.asarray(W), MATRIX)
  np.testing.assert_allclose(np.asarray(vb), np.sin(W @ A.T.toarray()).sum(1), rtol=1e-13)
  np.testing.assert_allclose(
    np.asarray(gb), np.cos(W @ A.T.toarray()) @ A.toarray(), rtol=1e-12, atol=1e-14
  )


def test_float32_stays_float32(lowering):
  out = jax.jit(host_csr.csr_matvec)(jnp.asarray(W[0], jnp.float32), MATRIX)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), (A @ W[0].astype(np.float32)).astype(np.float32))


def test_row_split_gives_the_same_numbers(lowering, monkeypatch):
  monkeypatch.setattr(host_csr, "FFI_MIN_WORK", 1)  # FFI: split over the intra-op threads
  monkeypatch.setattr(host_csr, "THREADS", 2)  # callback: split over a Python thread
  monkeypatch.setattr(host_csr, "THREAD_MIN_WORK", 0)
  big = sp.random(3000, 50, density=0.2, random_state=1, format="csr")
  matrix = host_csr.register(big)
  w = np.random.default_rng(2).standard_normal((20, 50))
  np.testing.assert_array_equal(
    np.asarray(jax.jit(host_csr.csr_matvec)(jnp.asarray(w[0]), matrix)), big @ w[0]
  )
  batched = jax.jit(jax.vmap(host_csr.csr_matvec, in_axes=(0, None)))(jnp.asarray(w), matrix)
  np.testing.assert_array_equal(np.asarray(batched), (big @ w.T).T)


def test_eager_call_uses_scipy():
  out = host_csr.csr_matvec(jnp.asarray(W[1]), MATRIX)
  np.testing.assert_array_equal(np.asarray(out), A @ W[1])
  np.testing.assert_allclose(host_csr.host_product(*MATRIX[3:6], V.T), A.T @ V.T)
  np.testing.assert_allclose(host_csr.host_product(*MATRIX[0:3], W.T[:, None, :])[:, 0], A @ W.T)


def test_matrix_lives_on_the_cpu():
  """Committed to the CPU device: a program that reads it runs there, the kernel's platform."""
  assert all(leaf.devices() == {CPU} and leaf.committed for leaf in MATRIX)
  out = jax.jit(host_csr.csr_matvec)(jnp.asarray(W[3]), MATRIX)
  assert out.devices() == {CPU}
  np.testing.assert_array_equal(np.asarray(out), A @ W[3])


def test_bad_shape_is_a_clear_error():
  with pytest.raises(ValueError, match=r"w must have shape \(9,\) .* \(37, 9\), got \(8,\)"):
    host_csr.csr_matvec(jnp.asarray(W[0, :8]), MATRIX)
  with pytest.raises(ValueError, match="got \\(8,\\)"):
    jax.jit(jax.grad(_loss))(jnp.asarray(W[0, :8]), MATRIX)
  assert MATRIX.shape == (37, 9)


def test_matrix_is_freed_with_its_arrays(lowering):
  """No registry, compiled program or cache keeps a matrix alive once its arrays are gone."""
  gc.collect()
  scipy_matrices = sum(isinstance(o, sp.spmatrix) for o in gc.get_objects())
  matrix = host_csr.register(sp.random(50, 9, density=0.3, random_state=3, format="csr"))
  jax.jit(jax.value_and_grad(_loss))(jnp.asarray(W[0]), matrix)
  jax.jit(jax.vmap(host_csr.csr_matvec, in_axes=(0, None)))(jnp.asarray(W), matrix)
  host_csr.csr_matvec(jnp.asarray(W[0]), matrix)
  refs = [weakref.ref(a) for a in matrix]
  del matrix
  gc.collect()
  assert all(r() is None for r in refs)
  assert sum(isinstance(o, sp.spmatrix) for o in gc.get_objects()) <= scipy_matrices


def test_import_starts_no_thread():
  code = (
    "import threading, concurrent.futures, gc\n"
    "before = threading.active_count()\n"
    "from experiments.sparse import host_csr\n"
    "pools = [o for o in gc.get_objects() if isinstance(o, concurrent.futures.Executor)]\n"
    "print(threading.active_count() - before, len(pools), host_csr._pool.cache_info().currsize)"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["0", "0", "0"], out.stdout + out.stderr


def test_missing_compiler_falls_back_with_a_warning(monkeypatch, tmp_path):
  monkeypatch.setenv("CXX", "no-such-compiler")
  monkeypatch.setenv("HDM_KERNEL_CACHE", str(tmp_path))
  monkeypatch.delenv("HDM_HOST_CSR", raising=False)
  host_csr._load_kernel.cache_clear()
  try:
    with pytest.warns(RuntimeWarning, match="CSR kernel could not be built"):
      assert host_csr.lowering() == "callback"
    jax.clear_caches()
    out = jax.jit(host_csr.csr_matvec)(jnp.asarray(W[2]), MATRIX)
    np.testing.assert_array_equal(np.asarray(out), A @ W[2])
    assert not list(tmp_path.iterdir())  # nothing half-built is left behind
  finally:
    host_csr._load_kernel.cache_clear()
    jax.clear_caches()


def test_kernel_is_built_once_into_the_cache(monkeypatch, tmp_path):
  if not host_csr._load_kernel():
    pytest.skip("no C++ compiler")
  monkeypatch.setenv("HDM_KERNEL_CACHE", str(tmp_path))
  library = host_csr._build_kernel()
  digest = library.with_suffix(".sha256")  # the library's SHA-256, checked before loading
  assert sorted(tmp_path.iterdir()) == sorted([library, digest]) and library.suffix == ".so"
  mtime = library.stat().st_mtime_ns
  assert host_csr._build_kernel() == library and library.stat().st_mtime_ns == mtime
