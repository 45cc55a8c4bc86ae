"""Sparse CSR products for JAX programs on a CPU.

XLA's CPU gather/scatter (what ``jax.experimental.sparse.BCOO`` lowers to)
costs ~10 ns per nonzero and a dense product reads every zero, so for the
sparse LIBSVM problems a CSR kernel (~1 ns per nonzero) is the fastest way to
do the two products of a value-and-gradient on a CPU.
``csr_matvec(w, matrix)`` computes ``A @ w`` for a :class:`CSRMatrix` (made
by :func:`register`) with a custom VJP ``A^T v``; the losses' elementwise
work (``exp``, ``log``) stays in XLA. The CSR arrays of ``A`` and ``A^T``
are arguments of the compiled program (nothing is folded into it, and one
compiled program serves every matrix of the same shapes). Under ``vmap`` the
batch becomes one CSR-times-(cols, batch) product.

Two lowerings compute the same numbers (SciPy's summation order):

* ``"ffi"`` (default): ``csr_kernel.cc``, an XLA FFI custom call built with
  the system C++ compiler on first use (cached in ``$HDM_KERNEL_CACHE`` or
  ``~/.cache/hdm_optax``, a private directory; ~5 s; loaded only where its SHA-256 is the
  one recorded when it was built). No Python on the call path; big products
  are split over XLA's intra-op threads.
* ``"callback"``: SciPy on the host through ``jax.pure_callback``, which
  receives the CSR arrays with ``w``. Used when the kernel cannot be built (a
  warning says why) or with ``HDM_HOST_CSR=callback``.

A :class:`CSRMatrix` is nothing but its arrays: no copy of the matrix is kept
anywhere else, so it is freed when they are. Nothing runs at import: the
kernel is built on the first compiled product, the callback path's thread
pool is started by its first product that is big enough to split.

Both run on the CPU only: use dense arrays or BCOO on accelerators or with
sharding. :func:`register` commits the arrays to JAX's CPU device, so a
program that reads a :class:`CSRMatrix` runs on the CPU whatever JAX's default
backend is (its other inputs are copied there).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import pathlib
import stat
import subprocess
import tempfile
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from hdm_optax._private_dir import private_dir

KERNEL_SOURCE = pathlib.Path(__file__).with_name("csr_kernel.cc")
# -ffp-contract=off: no fused multiply-adds, so the sums round as SciPy's do.
# -march=native: the cache is per machine (the batch loop uses its widest vectors).
CXX_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
# The FFI kernel splits a product over the intra-op threads from this many
# multiply-adds (nonzeros x batch) on. One vector is memory-bound and gains
# little (a9a, w6a, w7a: within the noise); 20 vectors on a9a: 1.8 -> 0.9 ms.
FFI_MIN_WORK = 200_000
# The callback path splits big products into row blocks of equal nonzero
# count, one per core (SciPy's kernels release the GIL). Below ~5e5
# multiply-adds the thread hand-off costs more than it saves: w8a (6.3e5
# nonzeros) 1.5 -> 1.0 ms for both products, a9a (4.8e5) no gain for one
# vector, 13 -> 7.5 ms for a batch of 20.
THREADS = min(2, os.cpu_count() or 1)
THREAD_MIN_WORK = 500_000


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  """The callback path's worker threads, started by the first split product."""
  return concurrent.futures.ThreadPoolExecutor(max_workers=max(THREADS - 1, 1))


class CSRMatrix(NamedTuple):
  """A float64 (rows x cols) matrix as arguments of a compiled program.

  Attributes:
      indptr, indices, data: CSR arrays of ``A`` (int32, int32, float64).
      t_indptr, t_indices, t_data: CSR arrays of ``A^T``.
  """

  indptr: jax.Array
  indices: jax.Array
  data: jax.Array
  t_indptr: jax.Array
  t_indices: jax.Array
  t_data: jax.Array

  @property
  def shape(self) -> tuple[int, int]:
    return self.indptr.shape[0] - 1, self.t_indptr.shape[0] - 1


def cpu_device() -> jax.Device:
  """JAX's first CPU device, where the kernel runs."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError as e:
    raise RuntimeError(
      f"the CSR kernel runs on the CPU, and JAX has no CPU backend here ({e}); "
      "add cpu to JAX_PLATFORMS, or use the dense or BCOO representation"
    ) from e


def register(A) -> CSRMatrix:
  """``A`` (any SciPy/NumPy matrix) as a :class:`CSRMatrix` (float64, sorted indices).

  The arrays are committed to JAX's CPU device (:func:`cpu_device`).
  """
  A = sp.csr_matrix(A, dtype=np.float64)
  A.sum_duplicates()
  A.sort_indices()
  if A.nnz >= 2**31:
    raise ValueError(f"the CSR kernel indexes with int32: {A.nnz} nonzeros are too many")
  AT = A.T.tocsr()  # CSR of A^T: ~20% faster than the CSC view A.T @ v
  AT.sort_indices()
  cpu = cpu_device()
  arrays = lambda M: jax.device_put(
    (M.indptr.astype(np.int32), M.indices.astype(np.int32), M.data.astype(np.float64)), cpu
  )
  return CSRMatrix(*arrays(A), *arrays(AT))


def _row_blocks(indptr, indices, data, cols: int) -> list[sp.csr_matrix]:
  """The matrix split into ``THREADS`` row blocks of about equal nonzero count (views)."""
  nnz, rows = int(indptr[-1]), len(indptr) - 1
  cuts = [0, *np.searchsorted(indptr, nnz * np.arange(1, THREADS) / THREADS).tolist(), rows]
  blocks = []
  for a, b in zip(cuts[:-1], cuts[1:]):
    if b > a:
      lo, hi = int(indptr[a]), int(indptr[b])
      csr = (data[lo:hi], indices[lo:hi], indptr[a : b + 1] - lo)
      blocks.append(sp.csr_matrix(csr, shape=(b - a, cols), copy=False))
  return blocks


def host_product(indptr, indices, data, w) -> np.ndarray:
  """``M @ w`` with SciPy for the CSR arrays of ``M`` and ``w`` of shape (cols, ...).

  The product runs along the FIRST axis of ``w``: the trailing axes are
  batch axes (``vmap``), so a C-ordered batch is the (cols, batch) matrix
  SciPy multiplies and its (rows, batch) result needs no transposed copy.
  The result has ``w``'s dtype; the arrays are used in place (no copy).
  """
  indptr, indices, data, w = (np.asarray(a) for a in (indptr, indices, data, w))
  cols = w.shape[0]
  x = w if w.ndim == 1 else w.reshape(cols, -1)
  rows = len(indptr) - 1
  if THREADS == 1 or len(data) * (x.size // max(cols, 1)) < THREAD_MIN_WORK:
    out = sp.csr_matrix((data, indices, indptr), shape=(rows, cols), copy=False) @ x
  else:
    first, *rest = _row_blocks(indptr, indices, data, cols)
    futures = [_pool().submit(b.__matmul__, x) for b in rest]
    out = np.concatenate([first @ x] + [f.result() for f in futures])
  return np.asarray(out, dtype=w.dtype).reshape((rows,) + w.shape[1:])


# ----------------------------------------------------------------------------
# The FFI kernel: built once per source, JAX version and compiler command
# ----------------------------------------------------------------------------

# dtype of w -> (XLA target name, handler symbol in csr_kernel.cc)
_FFI_TARGETS = {
  np.dtype(np.float64): ("hdm_csr_spmm_f64", "HdmCsrSpmmF64"),
  np.dtype(np.float32): ("hdm_csr_spmm_f32", "HdmCsrSpmmF32"),
}


def lowering() -> str:
  """``"ffi"`` or ``"callback"``: what the next compiled product will use."""
  if os.environ.get("HDM_HOST_CSR", "ffi") == "callback":
    return "callback"
  return "ffi" if _load_kernel() else "callback"


def _cache_dir() -> pathlib.Path:
  """The kernel's cache: private (``hdm_optax._private_dir``: 0700, the user's, no link)."""
  path = os.environ.get("HDM_KERNEL_CACHE") or pathlib.Path.home() / ".cache" / "hdm_optax"
  return pathlib.Path(private_dir(path, name="HDM_KERNEL_CACHE"))


def _digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _build_kernel() -> pathlib.Path:
  """Compiles ``csr_kernel.cc`` into the cache (once per source, JAX version and command).

  The library's SHA-256 is written beside it (``.sha256``) when it is built, and checked by
  :func:`_checked_library` before it is loaded.
  """
  source = KERNEL_SOURCE.read_bytes()
  command = [os.environ.get("CXX", "g++"), *CXX_FLAGS, f"-I{jax.ffi.include_dir()}"]
  key = hashlib.sha256(source + jax.__version__.encode() + " ".join(command).encode())
  library = _cache_dir() / f"csr_kernel_{key.hexdigest()[:16]}.so"
  digest = library.with_suffix(".sha256")
  if not (library.exists() or library.is_symlink()) or not digest.exists():
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
      out = pathlib.Path(tmp) / library.name
      subprocess.run(
        [*command, str(KERNEL_SOURCE), "-o", str(out)], check=True, capture_output=True, text=True
      )
      (pathlib.Path(tmp) / digest.name).write_text(_digest(out.read_bytes()))
      os.replace(out, library)  # complete files only
      os.replace(pathlib.Path(tmp) / digest.name, digest)
  return library


class UncheckedLibrary(OSError):
  """A library in the kernel's cache that this module did not build as it is."""


def _checked_library(library: pathlib.Path) -> pathlib.Path:
  """``library`` if it is a plain file of this user's, writable by no one else, whose
  SHA-256 is the one recorded when it was built; else :class:`UncheckedLibrary`."""
  try:
    fd = os.open(library, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
  except OSError as error:
    raise UncheckedLibrary(f"{library}: cannot open it without following a link ({error})")
  with os.fdopen(fd, "rb") as f:
    info = os.fstat(f.fileno())
    data = f.read()
  uid = getattr(os, "getuid", lambda: info.st_uid)()
  if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022:
    raise UncheckedLibrary(
      f"{library}: not a file of this user's that only this user can write (mode "
      f"{stat.S_IMODE(info.st_mode):o}, uid {info.st_uid})"
    )
  recorded = library.with_suffix(".sha256")
  expected = recorded.read_text().strip() if recorded.is_file() else None
  if expected != _digest(data):
    raise UncheckedLibrary(
      f"{library}: its SHA-256 is not the one recorded when it was built "
      f"({recorded.name}: {expected}); delete both files to build it again"
    )
  return library


_registered = False


@functools.cache
def _load_kernel() -> bool:
  """Builds (if needed) and registers the FFI kernel; False, with a warning, if it cannot."""
  global _registered
  try:
    library = _build_kernel()
    if not _registered:  # XLA refuses a second registration of the same name
      lib = ctypes.cdll.LoadLibrary(str(_checked_library(library)))
      for target, symbol in _FFI_TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
      _registered = True
  except (OSError, ValueError, subprocess.CalledProcessError, AttributeError) as e:
    detail = getattr(e, "stderr", "") or str(e)
    warnings.warn(
      f"the CSR kernel could not be built ({detail.strip()[-500:]}); "
      "using SciPy through host callbacks (slower)",
      RuntimeWarning,
      stacklevel=2,
    )
    return False
  return True


# ----------------------------------------------------------------------------
# The product as a primitive: operands (indptr, indices, data, w)
# ----------------------------------------------------------------------------

_product_p = jex_core.Primitive("csr_product")


def _abstract_eval(indptr, indices, data, w):
  del indices, data
  return jax.core.ShapedArray((indptr.shape[0] - 1,) + w.shape[1:], w.dtype)


def _impl(indptr, indices, data, w):
  return jnp.asarray(host_product(indptr, indices, data, w))


def _batch(args, dims):
  if any(d is not None for d in dims[:3]):
    raise NotImplementedError("vmap over the matrix of csr_matvec is not supported")
  w = jnp.moveaxis(args[3], dims[3], 1)  # the product runs along axis 0
  return _product_p.bind(*args[:3], w), 1


def _lower(ctx, *args):
  if lowering() == "ffi":
    return _lower_ffi(ctx, *args)
  return _lower_callback(ctx, *args)


def _lower_ffi(ctx, indptr, indices, data, w):
  target, _ = _FFI_TARGETS[np.dtype(ctx.avals_in[3].dtype)]
  return jax.ffi.ffi_lowering(target)(
    ctx, indptr, indices, data, w, min_work=np.int64(FFI_MIN_WORK)
  )


def _lower_callback(ctx, indptr, indices, data, w):
  def fn(indptr, indices, data, x):
    shape = jax.ShapeDtypeStruct((indptr.shape[0] - 1,) + x.shape[1:], x.dtype)
    return jax.pure_callback(host_product, shape, indptr, indices, data, x)

  return mlir.lower_fun(fn, multiple_results=False)(ctx, indptr, indices, data, w)


_product_p.def_impl(_impl)
_product_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[_product_p] = _batch
mlir.register_lowering(_product_p, _lower, platform="cpu")


# ----------------------------------------------------------------------------
# A w with the VJP A^T v
# ----------------------------------------------------------------------------


def _bind(w, matrix: CSRMatrix, transpose: bool):
  rows, cols = matrix.shape[::-1] if transpose else matrix.shape
  if jnp.shape(w) != (cols,):
    raise ValueError(
      f"csr_matvec: w must have shape ({cols},) for a matrix of shape {(rows, cols)}, "
      f"got {jnp.shape(w)}"
    )
  arrays = matrix[3:6] if transpose else matrix[0:3]
  return _product_p.bind(*arrays, w)


@jax.custom_vjp
def csr_matvec(w, matrix: CSRMatrix):
  """``A @ w`` for a :class:`CSRMatrix` ``A`` (``w``: (cols,), float32 or float64)."""
  return _bind(w, matrix, False)


def _fwd(w, matrix):
  return _bind(w, matrix, False), matrix


def _bwd(matrix, v):
  return _bind(v, matrix, True), None


csr_matvec.defvjp(_fwd, _bwd)
