"""Test problems of the paper's experiments (Section 5): smoothed SVM and logistic regression.

For a dataset (X, y) with y in {-1, +1}:

* Smoothed SVM: ``A = diag(y) [X, -1]`` and ``f(w) = 1/2 sum_i max(0, 1 - (A w)_i)^2``.
* Logistic regression: ``A = [X, 1]`` and ``f(w) = sum_i log(1 + exp(-y_i (A w)_i))``.

Both are sums (not means) without regularisation. ``L = sigma_max(A)^2`` and the
starting point is ``np.random.seed(20250128); x0 = randn(n); x0 /= ||x0||``
with ``n`` the number of columns of ``A``.

The JAX objectives take the data as arguments, ``fun(w, *fun_args)``, so that
XLA does not constant-fold them. ``A`` is either a dense float64 ``jnp`` array
or a row-sorted ``jax.experimental.sparse.BCOO`` matrix (see
``choose_representation``). ``fun_np(w) -> (value, grad)`` is the NumPy/SciPy
version used by the SciPy baselines.
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

from experiments import host_csr
from experiments.data import load_dataset

jax.config.update("jax_enable_x64", True)

SEED = 20250128
KINDS = ("svm", "logistic")
# Representation rule, from value_and_grad timings on a 2-core CPU (see
# choose_representation): XLA's gather/scatter sparse matvec costs ~10-13 ns per
# nonzero, the dense BLAS pair ~1.5 ns per entry, so sparse pays off below
# ~10% density (a9a, 12%: a tie; w8a, 4%: ~3x faster sparse), and only for
# matrices big enough that fixed overheads do not dominate (w1a: a tie).
SPARSE_DENSITY_THRESHOLD = 0.10
SPARSE_MIN_ENTRIES = 1_000_000
DENSE_MAX_BYTES = 512 * 2**20


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


def initial_point(n: int) -> np.ndarray:
    """Returns the paper's starting point (reseeds NumPy's global RNG).

    Exactly ``np.random.seed(20250128); x0 = np.random.randn(n); x0 /= ||x0||``.
    """
    np.random.seed(SEED)
    x0 = np.random.randn(n)
    x0 /= np.linalg.norm(x0)
    return x0


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
    """Returns ``A @ w`` for a dense array or a row-sorted BCOO matrix.

    The sparse product is a gather plus a sorted segment sum; its reverse-mode
    derivative in ``w`` is one scatter-add (``A^T v``), so ``value_and_grad``
    costs two sparse matvecs. It is built from standard primitives, so
    ``jvp``/``vmap``/higher derivatives work too.
    """
    if isinstance(A, jsparse.BCOO):
        rows, cols = A.indices[:, 0], A.indices[:, 1]
        return jax.ops.segment_sum(
            A.data * w[cols], rows, num_segments=A.shape[0], indices_are_sorted=True
        )
    return A @ w


def svm_objective(w: jax.Array, A) -> jax.Array:
    """Smoothed SVM loss ``1/2 sum_i max(0, 1 - (A w)_i)^2`` with ``A = diag(y)[X, -1]``."""
    r = jnp.maximum(0.0, 1.0 - matvec(A, w))
    return 0.5 * jnp.sum(r * r)


def logistic_objective(w: jax.Array, A, y: jax.Array) -> jax.Array:
    """Logistic loss ``sum_i log(1 + exp(-y_i (A w)_i))`` with ``A = [X, 1]`` (overflow-safe)."""
    return jnp.sum(jnp.logaddexp(0.0, -y * matvec(A, w)))


OBJECTIVES = {"svm": svm_objective, "logistic": logistic_objective}
HOST_OBJECTIVES = {"svm": host_csr.svm_objective, "logistic": host_csr.logistic_objective}
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
        fun_args: Data arguments of ``fun``: ``(A,)`` for SVM, ``(A, y)`` for
          logistic, with ``A`` a dense ``jnp`` array or a BCOO matrix.
        fun_np: NumPy/SciPy ``fun_np(w) -> (value, grad)``.
        representation: ``"dense"`` or ``"sparse"``.
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


def choose_representation(A: sp.spmatrix) -> str:
    """Picks the representation of ``A`` for CPU runs.

    Returns:
        ``"host"`` (SciPy CSR products through a callback) if ``A`` has at
        least 1e6 entries (m * n) and density below 10%, or if dense storage
        would exceed 512 MiB; else ``"dense"``. Of the LIBSVM problems this
        makes w4a, w6a, w7a, w8a sparse. Measured on 2 cores (value and
        gradient of the logistic loss, 21 points vmapped): w8a 38 ms host,
        65 ms dense; a9a (12% dense) 25 ms host, 18 ms dense. BCOO
        (``"sparse"``) is slower than both on a CPU (``python -m
        experiments.speed``) but is the representation to use on accelerators.
    """
    m, n = A.shape
    density = A.nnz / max(m * n, 1)
    too_big = m * n * 8 > DENSE_MAX_BYTES
    sparse_pays = density < SPARSE_DENSITY_THRESHOLD and m * n >= SPARSE_MIN_ENTRIES
    return "host" if sparse_pays or too_big else "dense"


def objective(A: sp.csr_matrix, y: np.ndarray, kind: str, representation: str):
    """``(fun, fun_args)`` for the paper's matrix ``A`` in one representation.

    ``"dense"`` (a jnp array), ``"sparse"`` (BCOO) or ``"host"`` (SciPy CSR
    through a host callback, ``experiments.host_csr``).
    """
    if representation == "host":
        second = jnp.ones(A.shape[0]) if kind == "svm" else jnp.asarray(y)
        return HOST_OBJECTIVES[kind], (host_csr.register(A), second)
    if representation == "dense":
        A_jax = jnp.asarray(A.toarray())
    elif representation == "sparse":
        A_jax = to_bcoo(A)
    else:
        raise ValueError(
            f"representation must be 'dense', 'sparse', 'host' or 'auto', got {representation!r}")
    fun_args = (A_jax,) if kind == "svm" else (A_jax, jnp.asarray(y))
    return OBJECTIVES[kind], fun_args


def make_problem(
    X, y: np.ndarray, kind: str, name: str = "custom", representation: str = "auto"
) -> Problem:
    """Builds a Problem from a data matrix and -1/+1 labels.

    Args:
        X: (m, d) data (dense or scipy sparse).
        y: (m,) labels in {-1, +1}.
        kind: ``"svm"`` or ``"logistic"``.
        name: Instance name.
        representation: ``"dense"``, ``"sparse"`` (BCOO), ``"host"`` (SciPy CSR
          through a host callback, ``experiments.host_csr``) or ``"auto"``
          (``choose_representation``).
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


def load_problem(
    name: str, kind: str, representation: str = "auto", **load_kwargs
) -> Problem:
    """Loads LIBSVM dataset ``name`` (see ``data.load_dataset``) and builds a Problem.

    Raises:
        FileNotFoundError: The dataset is missing (callers skip it with a message).
    """
    X, y = load_dataset(name, **load_kwargs)
    return make_problem(X, y, kind, name=name, representation=representation)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
