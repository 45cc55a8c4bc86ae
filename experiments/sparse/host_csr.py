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
  ``~/.cache/hdm_optax``; ~5 s). No Python on the call path; big products
  are split over XLA's intra-op threads.
* ``"callback"``: SciPy on the host, called with JAX's internal
  ``emit_python_callback`` (NumPy views of the operands, ~25 us per call),
  or ``jax.pure_callback`` (~130 us: it copies every operand) if that
  internal function is missing or changed. Used when the kernel cannot be
  built (a warning says why) or with ``HDM_HOST_CSR=callback``.

Both run on the CPU only: use dense arrays or BCOO on accelerators or with
sharding.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import itertools
import os
import pathlib
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

try:  # JAX internals (see the module docstring); optional.
  from jax._src.callback import emit_python_callback as _emit_python_callback
except ImportError:  # pragma: no cover - depends on the JAX version
  _emit_python_callback = None

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
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(THREADS - 1, 1))
_REGISTRY: dict[int, tuple[list[sp.csr_matrix], list[sp.csr_matrix]]] = {}
_NEXT = itertools.count()


class CSRMatrix(NamedTuple):
  """A float64 (rows x cols) matrix as arguments of a compiled program.

  Attributes:
      handle: (1,) int32, the key of the SciPy copies used by the callback path.
      indptr, indices, data: CSR arrays of ``A`` (int32, int32, float64).
      t_indptr, t_indices, t_data: CSR arrays of ``A^T``.
  """

  handle: jax.Array
  indptr: jax.Array
  indices: jax.Array
  data: jax.Array
  t_indptr: jax.Array
  t_indices: jax.Array
  t_data: jax.Array

  @property
  def shape(self) -> tuple[int, int]:
    return self.indptr.shape[0] - 1, self.t_indptr.shape[0] - 1


def _row_blocks(M: sp.csr_matrix) -> list[sp.csr_matrix]:
  """``[M]`` followed by ``M`` split into ``THREADS`` row blocks of about equal nonzero count."""
  if THREADS == 1:
    return [M]
  targets = M.nnz * np.arange(1, THREADS) / THREADS
  cuts = [0, *np.searchsorted(M.indptr, targets).tolist(), M.shape[0]]
  return [M] + [M[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def register(A) -> CSRMatrix:
  """``A`` (any SciPy/NumPy matrix) as a :class:`CSRMatrix` (float64, sorted indices)."""
  A = sp.csr_matrix(A, dtype=np.float64)
  A.sum_duplicates()
  A.sort_indices()
  if A.nnz >= 2**31:
    raise ValueError(f"the CSR kernel indexes with int32: {A.nnz} nonzeros are too many")
  AT = A.T.tocsr()  # CSR of A^T: ~20% faster than the CSC view A.T @ v
  AT.sort_indices()
  handle = next(_NEXT)
  _REGISTRY[handle] = (_row_blocks(A), _row_blocks(AT))
  arrays = lambda M: (
    jnp.asarray(M.indptr, jnp.int32),
    jnp.asarray(M.indices, jnp.int32),
    jnp.asarray(M.data, jnp.float64),
  )
  return CSRMatrix(jnp.asarray([handle], jnp.int32), *arrays(A), *arrays(AT))


def host_product(handle, w, transpose: bool = False) -> np.ndarray:
  """``A @ w`` (or ``A^T @ w``) with SciPy, for ``w`` of shape (cols, ...), in ``w``'s dtype.

  The product runs along the FIRST axis of ``w``: the trailing axes are
  batch axes (``vmap``), so a C-ordered batch is the (cols, batch) matrix
  SciPy multiplies and its (rows, batch) result needs no transposed copy.
  """
  key = int(np.asarray(handle).reshape(-1)[0])
  if key not in _REGISTRY:
    raise KeyError(f"no host matrix is registered under handle {key}")
  blocks = _REGISTRY[key][1 if transpose else 0]
  w = np.asarray(w)
  cols = blocks[0].shape[1]
  if w.shape[0] != cols:
    raise ValueError(f"the product needs {cols} entries, got {w.shape[0]}")
  x = w if w.ndim == 1 else w.reshape(cols, -1)
  whole, parts = blocks[0], blocks[1:]
  if len(parts) < 2 or whole.nnz * (x.size // cols) < THREAD_MIN_WORK:
    out = whole @ x
  else:
    rest = [_POOL.submit(b.__matmul__, x) for b in parts[1:]]
    out = np.concatenate([parts[0] @ x] + [f.result() for f in rest])
  return np.asarray(out, dtype=w.dtype).reshape((out.shape[0],) + w.shape[1:])


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
  return pathlib.Path(
    os.environ.get("HDM_KERNEL_CACHE") or pathlib.Path.home() / ".cache" / "hdm_optax"
  )


def _build_kernel() -> pathlib.Path:
  """Compiles ``csr_kernel.cc`` into the cache (once per source, JAX version and command)."""
  source = KERNEL_SOURCE.read_bytes()
  command = [os.environ.get("CXX", "g++"), *CXX_FLAGS, f"-I{jax.ffi.include_dir()}"]
  key = hashlib.sha256(source + jax.__version__.encode() + " ".join(command).encode())
  library = _cache_dir() / f"csr_kernel_{key.hexdigest()[:16]}.so"
  if not library.exists():
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
      out = pathlib.Path(tmp) / library.name
      subprocess.run(
        [*command, str(KERNEL_SOURCE), "-o", str(out)], check=True, capture_output=True, text=True
      )
      os.replace(out, library)  # complete files only
  return library


_registered = False


@functools.cache
def _load_kernel() -> bool:
  """Builds (if needed) and registers the FFI kernel; False, with a warning, if it cannot."""
  global _registered
  try:
    library = _build_kernel()
    if not _registered:  # XLA refuses a second registration of the same name
      lib = ctypes.cdll.LoadLibrary(str(library))
      for target, symbol in _FFI_TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
      _registered = True
  except (OSError, subprocess.CalledProcessError, AttributeError) as e:
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
# The product as a primitive: operands (handle, indptr, indices, data, w)
# ----------------------------------------------------------------------------

_product_p = jex_core.Primitive("csr_product")


def _abstract_eval(handle, indptr, indices, data, w, *, transpose):
  del handle, indices, data, transpose
  return jax.core.ShapedArray((indptr.shape[0] - 1,) + w.shape[1:], w.dtype)


def _impl(handle, indptr, indices, data, w, *, transpose):
  del indptr, indices, data
  return jnp.asarray(host_product(handle, w, transpose))


def _batch(args, dims, *, transpose):
  if any(d is not None for d in dims[:4]):
    raise NotImplementedError("vmap over the matrix of csr_matvec is not supported")
  w = jnp.moveaxis(args[4], dims[4], 1)  # the product runs along axis 0
  return _product_p.bind(*args[:4], w, transpose=transpose), 1


def _lower(ctx, *args, transpose):
  if lowering() == "ffi":
    return _lower_ffi(ctx, *args, transpose=transpose)
  return _lower_callback(ctx, *args, transpose=transpose)


def _lower_ffi(ctx, handle, indptr, indices, data, w, *, transpose):
  del handle, transpose
  target, _ = _FFI_TARGETS[np.dtype(ctx.avals_in[4].dtype)]
  ctx = ctx.replace(avals_in=ctx.avals_in[1:])
  return jax.ffi.ffi_lowering(target)(
    ctx, indptr, indices, data, w, min_work=np.int64(FFI_MIN_WORK)
  )


def _lower_callback(ctx, handle, indptr, indices, data, w, *, transpose):
  if _emit_python_callback is None:  # pragma: no cover - depends on the JAX version
    return _lower_pure_callback(ctx, handle, indptr, indices, data, w, transpose=transpose)

  def callback(h, x):
    return (host_product(h, x, transpose),)

  try:
    avals = [ctx.avals_in[0], ctx.avals_in[4]]
    result, _, _ = _emit_python_callback(
      ctx.replace(avals_in=avals),
      callback,
      None,
      [handle, w],
      avals,
      ctx.avals_out,
      has_side_effect=False,
      returns_token=False,
    )
  except TypeError:  # pragma: no cover - the internal signature changed
    return _lower_pure_callback(ctx, handle, indptr, indices, data, w, transpose=transpose)
  return result


def _lower_pure_callback(ctx, handle, indptr, indices, data, w, *, transpose):
  def fn(h, indptr, indices, data, x):
    del indices, data
    shape = jax.ShapeDtypeStruct((indptr.shape[0] - 1,) + x.shape[1:], x.dtype)
    return jax.pure_callback(functools.partial(host_product, transpose=transpose), shape, h, x)

  return mlir.lower_fun(fn, multiple_results=False)(ctx, handle, indptr, indices, data, w)


_product_p.def_impl(_impl)
_product_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[_product_p] = _batch
mlir.register_lowering(_product_p, _lower, platform="cpu")


# ----------------------------------------------------------------------------
# A w with the VJP A^T v
# ----------------------------------------------------------------------------


def _bind(w, matrix: CSRMatrix, transpose: bool):
  arrays = matrix[4:7] if transpose else matrix[1:4]
  return _product_p.bind(matrix.handle, *arrays, w, transpose=transpose)


@jax.custom_vjp
def csr_matvec(w, matrix: CSRMatrix):
  """``A @ w`` for a :class:`CSRMatrix` ``A`` (``w``: (cols,), float32 or float64)."""
  return _bind(w, matrix, False)


def _fwd(w, matrix):
  return _bind(w, matrix, False), matrix


def _bwd(matrix, v):
  return _bind(v, matrix, True), None


csr_matvec.defvjp(_fwd, _bwd)
