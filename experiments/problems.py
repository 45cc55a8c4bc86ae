"""Test problems of the paper's experiments (Section 5): smoothed SVM and logistic regression.

For a dataset (X, y) with y in {-1, +1}:

* Smoothed SVM: ``A = diag(y) [X, -1]`` and ``f(w) = 1/2 sum_i max(0, 1 - (A w)_i)^2``.
* Logistic regression: ``A = [X, 1]`` and ``f(w) = sum_i log(1 + exp(-y_i (A w)_i))``.

Both are sums (not means) without regularisation. ``L = sigma_max(A)^2`` and the
starting point is ``protocol.initial_point(n)`` (``np.random.seed(20250128);
x0 = randn(n); x0 /= ||x0||``) with ``n`` the number of columns of ``A``.

The JAX objectives take the data as arguments, ``fun(w, *fun_args)``, so that
XLA does not constant-fold them. ``A`` is in one of three representations (see
``objective`` and ``choose_representation``): ``"dense"`` (a float64 ``jnp``
array), ``"sparse"`` (a row-sorted ``jax.experimental.sparse.BCOO`` matrix) or
``"host"`` (a ``sparse.host_csr.CSRMatrix``: CSR products by a CPU kernel).
``"auto"`` follows ``jax.default_backend()``: the CSR kernel on a CPU, BCOO
or dense on GPUs and TPUs, so Table 1 and every benchmark suite run unchanged
on an accelerator.
``fun_np(w) -> (value, grad)`` is the NumPy/SciPy version used by the SciPy
baselines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from jax.experimental import sparse as jsparse
from scipy.special import expit

from experiments.data import load_dataset
from experiments.protocol import initial_point
from experiments.sparse import host_csr


KINDS = ("svm", "logistic")
# Representation rule (see choose_representation).
VERY_SPARSE_DENSITY = 0.05
VERY_SPARSE_MIN_NNZ = 20_000
SPARSE_DENSITY = 0.15
SPARSE_MIN_ENTRIES = 2_500_000
DENSE_MAX_BYTES = 512 * 2**20
# XLA's CPU loops vectorise exp/log only when the length is a multiple of the
# vector width: the logistic loss of 32561 rows costs 3.5x that of 32560.
ROW_MULTIPLE = 8


# ----------------------------------------------------------------------------
# Matrices, L and x0
# ----------------------------------------------------------------------------


def design_matrix(X, y: np.ndarray, kind: str) -> sp.csr_matrix:
  """Builds the paper's ``A`` as a sorted float64 CSR matrix.

  Args:
      X: (m, d) data matrix (dense or scipy sparse).
      y: (m,) labels in {-1, +1}.
      kind: ``"svm"`` (``diag(y) [X, -1]``) or ``"logistic"`` (``[X, 1]``).

  Returns:
      ``A`` of shape (m, d + 1).
  """
  _check_kind(kind)
  X = sp.csr_matrix(X, dtype=np.float64)
  y = np.asarray(y, dtype=np.float64)
  if X.shape[0] != y.shape[0]:
    raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]} entries")
  if not np.all(np.abs(y) == 1.0):
    raise ValueError("labels must be -1 or +1")
  m = X.shape[0]
  if kind == "svm":
    A = sp.diags(y) @ sp.hstack([X, -np.ones((m, 1))])
  else:
    A = sp.hstack([X, np.ones((m, 1))])
  A = sp.csr_matrix(A, dtype=np.float64)
  A.sum_duplicates()
  A.sort_indices()
  return A


def lipschitz_constant(A) -> float:
  """Returns ``L = sigma_max(A)^2``, deterministically.

  With at most 4096 columns (all LIBSVM problems used here) this is the
  largest eigenvalue of the dense Gram matrix ``A^T A`` (``numpy.linalg.eigvalsh``);
  otherwise ``scipy.sparse.linalg.svds(k=1)`` with a fixed all-ones ``v0``.
  """
  A = sp.csr_matrix(A, dtype=np.float64)
  if A.shape[1] <= 4096:
    gram = (A.T @ A).toarray()
    return float(np.linalg.eigvalsh(gram)[-1])
  v0 = np.ones(min(A.shape)) / np.sqrt(min(A.shape))
  s = spla.svds(A, k=1, v0=v0, return_singular_vectors=False)
  return float(s[0] ** 2)


# ----------------------------------------------------------------------------
# JAX objectives
# ----------------------------------------------------------------------------


def to_bcoo(A: sp.csr_matrix) -> jsparse.BCOO:
  """Converts a CSR matrix to a row-sorted BCOO matrix (int32 indices)."""
  A = sp.csr_matrix(A, dtype=np.float64)
  A.sum_duplicates()
  A.sort_indices()
  rows = np.repeat(np.arange(A.shape[0], dtype=np.int32), np.diff(A.indptr))
  indices = np.stack([rows, A.indices.astype(np.int32)], axis=1)
  return jsparse.BCOO(
    (jnp.asarray(A.data), jnp.asarray(indices)),
    shape=A.shape,
    indices_sorted=True,
    unique_indices=True,
  )


def matvec(A, w: jax.Array) -> jax.Array:
  """Returns ``A @ w`` for a dense array, a row-sorted BCOO matrix or a ``host_csr.CSRMatrix``.

  The CSR product is ``host_csr.csr_matvec`` (a CSR kernel). The BCOO product is a gather plus a sorted segment sum; its reverse-mode
  derivative in ``w`` is one scatter-add (``A^T v``), so ``value_and_grad``
  costs two sparse matvecs. It is built from standard primitives, so
  ``jvp``/``vmap``/higher derivatives work too.
  """
  if isinstance(A, host_csr.CSRMatrix):
    return host_csr.csr_matvec(w, A)
  if isinstance(A, jsparse.BCOO):
    rows, cols = A.indices[:, 0], A.indices[:, 1]
    return jax.ops.segment_sum(
      A.data * w[cols], rows, num_segments=A.shape[0], indices_are_sorted=True
    )
  return A @ w


def svm_loss(z: jax.Array, weight: jax.Array) -> jax.Array:
  """``1/2 sum_i weight_i max(0, 1 - z_i)^2``."""
  r = jnp.maximum(0.0, 1.0 - z)
  return 0.5 * jnp.sum(weight * (r * r))


def logistic_loss(margin: jax.Array, weight: jax.Array) -> jax.Array:
  """``sum_i weight_i log(1 + exp(-margin_i))``, overflow-safe.

  Written as ``max(t, 0) + log1p(exp(-|t|))`` with ``t = -margin``: the value
  of ``jnp.logaddexp(0, t)``, with its gradient (``sigmoid(t)``) ~4.7x
  faster on a CPU (``logaddexp``'s derivative guards infinities with extra
  selects and exponentials).
  """
  t = -margin
  return jnp.sum(weight * (jnp.maximum(t, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(t)))))


def svm_objective(w: jax.Array, A, weight: jax.Array) -> jax.Array:
  """Smoothed SVM loss ``1/2 sum_i max(0, 1 - (A w)_i)^2`` with ``A = diag(y)[X, -1]``.

  ``weight`` is 1 on the data's rows and 0 on zero rows appended for speed
  (see ``ROW_MULTIPLE``).
  """
  return svm_loss(matvec(A, w), weight)


def logistic_objective(w: jax.Array, A, y: jax.Array, weight: jax.Array) -> jax.Array:
  """Logistic loss ``sum_i log(1 + exp(-y_i (A w)_i))`` with ``A = [X, 1]`` (``weight``: as SVM)."""
  return logistic_loss(y * matvec(A, w), weight)


OBJECTIVES = {"svm": svm_objective, "logistic": logistic_objective}
_JITTED: dict = {}


def _jitted(fun, with_grad: bool):
  key = (fun, with_grad)
  if key not in _JITTED:
    _JITTED[key] = jax.jit(jax.value_and_grad(fun) if with_grad else fun)
  return _JITTED[key]


# ----------------------------------------------------------------------------
# NumPy / SciPy objectives
# ----------------------------------------------------------------------------


def make_fun_np(A: sp.csr_matrix, y: np.ndarray, kind: str) -> Callable:
  """Returns ``fun_np(w) -> (value, grad)`` in float64 NumPy/SciPy."""
  _check_kind(kind)
  A = sp.csr_matrix(A, dtype=np.float64)
  AT = A.T.tocsr()  # a CSR transpose is ~20% faster than A.T (CSC) @ v
  y = np.asarray(y, dtype=np.float64)

  if kind == "svm":

    def fun_np(w):
      r = np.maximum(0.0, 1.0 - A @ w)
      return 0.5 * float(r @ r), -(AT @ r)

  else:

    def fun_np(w):
      margin = y * (A @ w)
      return float(np.sum(np.logaddexp(0.0, -margin))), AT @ (-y * expit(-margin))

  return fun_np


# ----------------------------------------------------------------------------
# Problem
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Problem:
  """One test instance.

  Attributes:
      name: Dataset name.
      kind: ``"svm"`` or ``"logistic"``.
      A: The paper's matrix as scipy CSR float64, shape (m, n).
      y: Labels in {-1, +1}, float64, shape (m,).
      L: ``sigma_max(A)^2``.
      x0: Starting point, float64 NumPy array of shape (n,).
      fun: Pure JAX objective ``fun(w, *fun_args) -> scalar``.
      fun_args: Data arguments of ``fun``: ``(A, weight)`` for SVM,
        ``(A, y, weight)`` for logistic, with ``A`` padded with zero rows in
        ``representation`` and ``weight`` 1 on the data's rows, 0 on the
        padding (see ``objective``).
      fun_np: NumPy/SciPy ``fun_np(w) -> (value, grad)``.
      representation: ``"dense"``, ``"sparse"`` (BCOO) or ``"host"`` (CSR
        kernel), see ``choose_representation``.
  """

  name: str
  kind: str
  A: sp.csr_matrix
  y: np.ndarray
  L: float
  x0: np.ndarray
  fun: Callable[..., jax.Array]
  fun_args: tuple[Any, ...]
  fun_np: Callable[[np.ndarray], tuple[float, np.ndarray]]
  representation: str

  @property
  def n(self) -> int:
    """Number of variables (columns of A)."""
    return self.A.shape[1]

  @property
  def m(self) -> int:
    """Number of examples (rows of A)."""
    return self.A.shape[0]

  def value(self, w) -> jax.Array:
    """Jitted ``fun(w, *fun_args)``."""
    return _jitted(self.fun, False)(jnp.asarray(w), *self.fun_args)

  def value_and_grad(self, w) -> tuple[jax.Array, jax.Array]:
    """Jitted ``jax.value_and_grad(fun)(w, *fun_args)``."""
    return _jitted(self.fun, True)(jnp.asarray(w), *self.fun_args)


def choose_representation(A: sp.spmatrix, backend: str | None = None) -> str:
  """Picks the representation of ``A`` for the backend the problem will run on.

  Args:
      A: the paper's matrix.
      backend: ``"cpu"``, ``"gpu"``, ``"tpu"``, ...; default ``jax.default_backend()``.

  Returns:
      On a CPU: ``"host"`` (CSR products, ``experiments.sparse.host_csr``) if ``A`` is sparse
      and big enough for a CSR kernel's ~1-2 ns per nonzero to beat the
      dense BLAS pair: density below 5% and at least 20,000 nonzeros, or
      density below 15% and at least 2.5e6 entries (m * n; a dense float64
      matrix that big no longer fits in cache), or dense storage above
      512 MiB; else ``"dense"``. Of the LIBSVM problems this makes w1a-w8a,
      a8a and a9a CSR. The thresholds were set when the products went
      through Python host callbacks (~25 us per call), with the measurements
      (one value and gradient in a compiled loop / the two SciPy products,
      ``python -m experiments.perf.speed``): a9a 0.9-1.3 host vs 3.6-3.9 dense;
      a7a (2.0e6 entries) 1.2-1.7 host vs 1.1-1.2 dense; w1a 1.6-2.4 host vs
      2.6-3.9 dense. The FFI kernel has no per-call cost, so they are
      conservative; they are kept so that Table 1's numbers stay comparable.
      BCOO (``"sparse"``) is slower than both on a CPU.

      On any other backend (GPUs, TPUs), where the CSR kernel does not exist:
      ``"sparse"`` (BCOO: a gather and a sorted segment sum, standard XLA
      primitives) where a CPU would use the kernel, else ``"dense"``. The
      rule keeps the CPU's thresholds (no accelerator measurement chose
      them); it keeps memory O(nnz) for the very sparse and the big matrices.
  """
  m, n = A.shape
  density = A.nnz / max(m * n, 1)
  too_big = m * n * 8 > DENSE_MAX_BYTES
  very_sparse = density < VERY_SPARSE_DENSITY and A.nnz >= VERY_SPARSE_MIN_NNZ
  sparse_and_big = density < SPARSE_DENSITY and m * n >= SPARSE_MIN_ENTRIES
  if not (very_sparse or sparse_and_big or too_big):
    return "dense"
  backend = jax.default_backend() if backend is None else backend
  return "host" if backend == "cpu" else "sparse"


def objective(
  A: sp.csr_matrix, y: np.ndarray, kind: str, representation: str, rows: int | None = None
):
  """``(fun, fun_args)`` for the paper's matrix ``A`` in one representation.

  ``"dense"`` (a jnp array), ``"sparse"`` (BCOO) or ``"host"`` (a
  ``host_csr.CSRMatrix``: CSR arrays of ``A`` and ``A^T``, on the CPU device
  whatever the default backend is, so the objective runs there). The rows are padded
  with zero rows of weight 0 to ``rows`` (default: the next multiple of
  ``ROW_MULTIPLE``); the value and gradient are those of the unpadded
  problem.
  """
  _check_kind(kind)
  m = A.shape[0]
  if rows is None:
    rows = -(-m // ROW_MULTIPLE) * ROW_MULTIPLE
  A = sp.vstack([A, sp.csr_matrix((rows - m, A.shape[1]))], format="csr")
  weight = np.zeros(rows)
  weight[:m] = 1.0
  y_pad = np.zeros(rows)
  y_pad[:m] = y
  if representation == "host":
    A_arg = host_csr.register(A)
  elif representation == "dense":
    A_arg = jnp.asarray(A.toarray())
  elif representation == "sparse":
    A_arg = to_bcoo(A)
  else:
    raise ValueError(
      f"representation must be 'dense', 'sparse' or 'host', got {representation!r} "
      "(make_problem also takes 'auto')"
    )
  if kind == "svm":
    return OBJECTIVES[kind], (A_arg, jnp.asarray(weight))
  return OBJECTIVES[kind], (A_arg, jnp.asarray(y_pad), jnp.asarray(weight))


def make_problem(
  X, y: np.ndarray, kind: str, name: str = "custom", representation: str = "auto"
) -> Problem:
  """Builds a Problem from a data matrix and -1/+1 labels.

  Args:
      X: (m, d) data (dense or scipy sparse).
      y: (m,) labels in {-1, +1}.
      kind: ``"svm"`` or ``"logistic"``.
      name: Instance name.
      representation: ``"dense"``, ``"sparse"`` (BCOO), ``"host"`` (CSR
        products, ``experiments.sparse.host_csr``, on the CPU) or ``"auto"``
        (``choose_representation`` for ``jax.default_backend()``).
  """
  A = design_matrix(X, y, kind)
  y = np.asarray(y, dtype=np.float64)
  if representation == "auto":
    representation = choose_representation(A)
  fun, fun_args = objective(A, y, kind, representation)
  return Problem(
    name=name,
    kind=kind,
    A=A,
    y=y,
    L=lipschitz_constant(A),
    x0=initial_point(A.shape[1]),
    fun=fun,
    fun_args=fun_args,
    fun_np=make_fun_np(A, y, kind),
    representation=representation,
  )


def load_problem(name: str, kind: str, representation: str = "auto", **load_kwargs) -> Problem:
  """Loads LIBSVM dataset ``name`` (see ``data.load_dataset``) and builds a Problem.

  Raises:
      FileNotFoundError: The dataset is missing (callers skip it with a message).
  """
  X, y = load_dataset(name, **load_kwargs)
  return make_problem(X, y, kind, name=name, representation=representation)


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
