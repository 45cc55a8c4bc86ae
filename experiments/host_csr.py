"""Sparse products on the host (SciPy CSR) for JAX programs, via ``pure_callback``.

XLA's CPU gather/scatter (what ``jax.experimental.sparse.BCOO`` lowers to)
costs ~10 ns per nonzero and a dense product reads every zero, so for the
sparsest LIBSVM problems (w4a-w8a, ~4% nonzeros) SciPy's CSR kernels are the
fastest way to do the two products of a value-and-gradient on a CPU.
``csr_matvec(w, handle)`` computes ``A @ w`` with a custom VJP ``A^T v``; the
matrices stay on the host in a registry and the compiled program receives
only an integer handle (an argument, so nothing is folded into the program
and one compiled program serves every matrix of the same shape). Under
``vmap`` the callback gets the whole batch and does one CSR-times-matrix
product. Host callbacks run on the CPU only: use dense arrays or BCOO on
accelerators or with sharding.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

_REGISTRY: dict[int, tuple[sp.csr_matrix, sp.csr_matrix]] = {}
_NEXT = itertools.count()


def register(A) -> jax.Array:
  """Keeps A and A^T (CSR, float64) on the host; returns the handle argument."""
  A = sp.csr_matrix(A, dtype=np.float64)
  A.sum_duplicates()
  A.sort_indices()
  handle = next(_NEXT)
  _REGISTRY[handle] = (A, A.T.tocsr())
  return jnp.asarray([handle], jnp.int32)


def _host_product(handle, w, transpose):
  A, AT = _REGISTRY[int(np.asarray(handle).reshape(-1)[0])]
  mat = AT if transpose else A
  if w.ndim == 1:
    return np.asarray(mat @ w, dtype=w.dtype)
  flat = w.reshape(-1, w.shape[-1])
  out = np.ascontiguousarray(np.asarray(mat @ flat.T, dtype=w.dtype).T)
  return out.reshape(w.shape[:-1] + (mat.shape[0],))


def _product(handle, w, rows, transpose):
  shape = jax.ShapeDtypeStruct(w.shape[:-1] + (rows,), w.dtype)
  return jax.pure_callback(functools.partial(_host_product, transpose=transpose), shape,
                           handle, w, vmap_method="expand_dims")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def csr_matvec(w, handle, rows, cols):
  """``A @ w`` for the registered (rows x cols) matrix ``handle``."""
  del cols
  return _product(handle, w, rows, False)


def _fwd(w, handle, rows, cols):
  return csr_matvec(w, handle, rows, cols), handle


def _bwd(rows, cols, handle, v):
  del rows
  return _product(handle, v, cols, True), None


csr_matvec.defvjp(_fwd, _bwd)


def svm_objective(w, handle, ones):
  """Smoothed SVM ``1/2 sum max(0, 1 - A w)^2``; ``ones`` (length m) fixes the shape."""
  r = jnp.maximum(0.0, ones - csr_matvec(w, handle, ones.shape[0], w.shape[0]))
  return 0.5 * jnp.sum(r * r)


def logistic_objective(w, handle, y):
  """Logistic loss ``sum log(1 + exp(-y A w))``."""
  return jnp.sum(jnp.logaddexp(0.0, -y * csr_matvec(w, handle, y.shape[0], w.shape[0])))
