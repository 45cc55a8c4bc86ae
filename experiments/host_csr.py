"""Sparse products on the host (SciPy CSR) for JAX programs.

XLA's CPU gather/scatter (what ``jax.experimental.sparse.BCOO`` lowers to)
costs ~10 ns per nonzero and a dense product reads every zero, so for the
sparse LIBSVM problems SciPy's CSR kernels (~1 ns per nonzero) are the
fastest way to do the two products of a value-and-gradient on a CPU.
``csr_matvec(w, handle, rows, cols)`` computes ``A @ w`` on the host with a
custom VJP ``A^T v`` (the second host call); the losses' elementwise work
(``exp``, ``log``) stays in XLA, whose vectorised transcendental functions are
~9x faster than NumPy's here. The matrices stay on the host in a registry and
the compiled program receives only an integer handle (an argument, so nothing
is folded into the program and one compiled program serves every matrix of
the same shape). Under ``vmap`` the host gets the whole batch, as a
(cols, batch) matrix, and does one CSR-times-matrix product.

The host call is lowered with JAX's internal ``emit_python_callback``, which
hands the host function NumPy views of the operands. ``jax.pure_callback``
first copies every operand into a ``jax.Array`` (``device_put``): ~130 us per
call, as much as both products of a 10,000-row problem. If that internal
function is missing (another JAX version) we fall back to
``jax.pure_callback``: same results, slower. Host calls run on the CPU only:
use dense arrays or BCOO on accelerators or with sharding.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os

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

# SciPy's CSR kernels release the GIL, so a big product is split into row
# blocks of equal nonzero count, one per core (while the callback runs, XLA's
# own threads wait for it). Below ~5e5 multiply-adds the thread hand-off costs
# more than it saves: w8a (6.3e5 nonzeros) 1.5 -> 1.0 ms for both products,
# a9a (4.8e5) no gain for one vector, 13 -> 7.5 ms for a batch of 20.
THREADS = min(2, os.cpu_count() or 1)
THREAD_MIN_WORK = 500_000
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(THREADS - 1, 1))
_REGISTRY: dict[int, tuple[list[sp.csr_matrix], list[sp.csr_matrix]]] = {}
_NEXT = itertools.count()


def _row_blocks(M: sp.csr_matrix) -> list[sp.csr_matrix]:
    """``[M]`` followed by ``M`` split into ``THREADS`` row blocks of about equal nonzero count."""
    if THREADS == 1:
        return [M]
    targets = M.nnz * np.arange(1, THREADS) / THREADS
    cuts = [0, *np.searchsorted(M.indptr, targets).tolist(), M.shape[0]]
    return [M] + [M[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def register(A) -> jax.Array:
    """Keeps ``A`` and ``A^T`` (CSR, float64) on the host; returns the handle argument."""
    A = sp.csr_matrix(A, dtype=np.float64)
    A.sum_duplicates()
    A.sort_indices()
    handle = next(_NEXT)
    # CSR of A^T: ~20% faster than the CSC view A.T @ v.
    _REGISTRY[handle] = (_row_blocks(A), _row_blocks(A.T.tocsr()))
    return jnp.asarray([handle], jnp.int32)


def host_product(handle, w, transpose: bool = False) -> np.ndarray:
    """``A @ w`` (or ``A^T @ w``) for ``w`` of shape (cols, ...), in ``w``'s dtype.

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
# The host product as a primitive (abstract eval, vmap rule, CPU lowering)
# ----------------------------------------------------------------------------

_product_p = jex_core.Primitive("host_csr_product")


def _abstract_eval(handle, w, *, rows, transpose):
    del handle, transpose
    return jax.core.ShapedArray((rows,) + w.shape[1:], w.dtype)


def _impl(handle, w, *, rows, transpose):
    del rows
    return jnp.asarray(host_product(handle, w, transpose))


def _batch(args, dims, *, rows, transpose):
    handle, w = args
    if dims[0] is not None:  # None: not mapped
        raise NotImplementedError("vmap over the host matrix handle is not supported")
    w = jnp.moveaxis(w, dims[1], 1)  # the product runs along axis 0
    return _product_p.bind(handle, w, rows=rows, transpose=transpose), 1


def _lower(ctx, handle, w, *, rows, transpose):
    def callback(h, x):
        return (host_product(h, x, transpose),)

    try:
        result, _, _ = _emit_python_callback(
            ctx, callback, None, [handle, w], ctx.avals_in, ctx.avals_out,
            has_side_effect=False, returns_token=False)
    except TypeError:  # pragma: no cover - the internal signature changed
        return _lower_fallback(ctx, handle, w, rows=rows, transpose=transpose)
    return result


def _lower_fallback(ctx, handle, w, *, rows, transpose):
    def fn(h, x):
        shape = jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype)
        return jax.pure_callback(functools.partial(host_product, transpose=transpose), shape,
                                 h, x)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, handle, w)


_product_p.def_impl(_impl)
_product_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[_product_p] = _batch
mlir.register_lowering(
    _product_p, _lower if _emit_python_callback is not None else _lower_fallback,
    platform="cpu")


# ----------------------------------------------------------------------------
# A w with the VJP A^T v
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def csr_matvec(w, handle, rows, cols):
    """``A @ w`` for the registered (rows x cols) matrix ``handle``."""
    del cols
    return _product_p.bind(handle, w, rows=rows, transpose=False)


def _fwd(w, handle, rows, cols):
    return csr_matvec(w, handle, rows, cols), handle


def _bwd(rows, cols, handle, v):
    del rows
    return _product_p.bind(handle, v, rows=cols, transpose=True), None


csr_matvec.defvjp(_fwd, _bwd)

