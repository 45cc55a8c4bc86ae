"""The problems of every experiment: each objective written once, each instance built by one function.

* The paper's test problems (Section 5) on a dataset (X, y) with y in {-1, +1}:

  - smoothed SVM: ``A = diag(y) [X, -1]``, ``f(w) = 1/2 sum_i max(0, 1 - (A w)_i)^2``;
  - logistic regression: ``A = [X, 1]``, ``f(w) = sum_i log(1 + exp(-y_i (A w)_i))``;

  sums (not means) without regularisation, ``L = sigma_max(A)^2``, x0
  ``protocol.initial_point(n)``. :func:`load_problem` builds a :class:`Problem`
  (Table 1, the benchmark's LIBSVM suites, the demo); :func:`libsvm_instance` makes it a
  ``protocol.Instance`` (dense problems padded to shared shapes, several starts, float32).
* :func:`logistic_objective` (weights per row, an optional ridge) is also the objective of
  the synthetic problems of ``experiments/perf`` (:func:`synthetic_logistic`) and of the
  benchmark's breast-cancer problem; the benchmark's other user problems
  (:func:`rosenbrock`, :func:`x_minus_log_x`, :func:`mlp_loss`) are here too.
* :func:`instance` is the one builder of a ``protocol.Instance``.

The JAX objectives take the data as arguments, ``fun(w, *fun_args)``, so that XLA does not
constant-fold them. ``A`` is in one of three representations (:func:`objective`,
:func:`choose_representation`): ``"dense"`` (a ``jnp`` array), ``"sparse"`` (a row-sorted
``jax.experimental.sparse.BCOO`` matrix) or ``"host"`` (a ``sparse.host_csr.CSRMatrix``:
CSR products by a CPU kernel). ``"auto"`` follows ``jax.default_backend()``: the CSR kernel
on a CPU, BCOO or dense on GPUs and TPUs, so Table 1 and every benchmark suite run
unchanged on an accelerator. ``Problem.fun_np(w) -> (value, grad)`` is the NumPy/SciPy
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

from experiments.data import load_dataset
from experiments import protocol
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
  selects and exponentials). ``max(t, 0)`` is a select on ``t >= 0``, so that the
  derivative at ``t = 0`` is 1/2 (``jnp.maximum`` splits the tie and ``|t|``'s
  derivative there is 1: at w = 0 the gradient was 0).
  """
  t = -margin
  return jnp.sum(weight * (jnp.where(t >= 0, t, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(t)))))


def svm_objective(w: jax.Array, A, weight: jax.Array) -> jax.Array:
  """Smoothed SVM loss ``1/2 sum_i max(0, 1 - (A w)_i)^2`` with ``A = diag(y)[X, -1]``.

  ``weight`` is 1 on the data's rows and 0 on zero rows appended for speed
  (see ``ROW_MULTIPLE``).
  """
  return svm_loss(matvec(A, w), weight)


def logistic_objective(w: jax.Array, A, y: jax.Array, weight, ridge=None) -> jax.Array:
  """Logistic loss ``sum_i weight_i log(1 + exp(-y_i (A w)_i)) [+ ridge / 2 ||w||^2]``.

  The paper's with ``A = [X, 1]`` and ``weight`` as SVM's (1 on the data's rows, 0 on the
  padding). A scalar ``weight`` 1/m makes the sum a mean; ``ridge`` (a 0-d array) adds the
  ridge term (the synthetic problems of ``experiments/perf``, the benchmark's breast cancer).
  """
  value = logistic_loss(y * matvec(A, w), weight)
  return value if ridge is None else value + 0.5 * ridge * jnp.sum(w * w)


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
      docs/research/speed.md): a9a 0.9-1.3 host vs 3.6-3.9 dense;
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


# ----------------------------------------------------------------------------
# Instances
# ----------------------------------------------------------------------------


# Dense problems up to 16384 rows are padded to these shapes (larger ones run as they are:
# padding would cost more than the compile it saves).
ROW_BUCKETS = (4096, 8192, 16384)
COL_BUCKETS = (64, 128, 320)
# float32 LIBSVM instances: ||grad f||_inf <= max(tol, FLOAT32_RELATIVE_TOL ||grad f(x0)||_inf).
# The sums run over up to 10^5 rows, so float32 rounding leaves gradients of about eps32 *
# ||grad f(x0)||_inf (eps32 = 1.2e-7) x (a growing factor) at the minimiser; 1e-5 is about
# 100 eps32.
FLOAT32_RELATIVE_TOL = 1e-5


def jax_fun_np(fun, fun_args, dtype) -> Callable[[np.ndarray], tuple[float, np.ndarray]]:
  """float64 NumPy ``x -> (value, grad)`` of a JAX objective evaluated in ``dtype``."""
  value_and_grad = jax.jit(jax.value_and_grad(fun))

  def fun_np(x):
    value, grad = value_and_grad(jnp.asarray(x, dtype), *fun_args)
    return float(value), np.asarray(grad, np.float64)

  return fun_np


def instance(
  fun,
  fun_args,
  x0,
  tol=protocol.TOL,
  *,
  lipschitz=None,
  dtype: str = "float64",
  n: int | None = None,
  f_star=None,
  fun_np=None,
  x0_np=None,
  seeds=None,
  lower=None,
  upper=None,
) -> protocol.Instance:
  """The one builder of a ``protocol.Instance``: ``fun(x, *fun_args)`` from the starts ``x0``.

  Args:
    fun: the JAX objective.
    fun_args: its data arguments.
    x0: one start, or one row per start (float64; cast to ``dtype``).
    tol: the tolerance of every start, or one per start.
    lipschitz: L where it is known.
    dtype: ``"float64"`` or ``"float32"``.
    n: the number of variables (default: x0's; less where x0 is padded).
    f_star: the minimum value where it is known.
    fun_np: float64 NumPy ``x -> (value, grad)`` for SciPy (default: ``fun`` itself in
      ``dtype``, :func:`jax_fun_np`).
    x0_np: the starts of ``fun_np`` (default: ``x0``).
    seeds: the label of each start (default None for each).
    lower: a box's lower bounds (broadcast to x0's rows; -inf where open), every start
      projected into it.
    upper: its upper bounds.
  """
  x0 = np.atleast_2d(np.asarray(x0, np.float64))
  x0_np = x0 if x0_np is None else np.atleast_2d(x0_np)
  if lower is not None:
    lower, upper = (
      np.broadcast_to(np.asarray(b, np.float64), x0.shape[1:]).copy() for b in (lower, upper)
    )
    x0 = np.clip(x0, lower, upper)
    cut = x0_np.shape[1]
    x0_np = np.clip(x0_np, lower[:cut], upper[:cut])
  return protocol.Instance(
    n=int(n or x0.shape[1]),
    dtype=dtype,
    fun=fun,
    fun_args=tuple(fun_args),
    x0=jnp.asarray(x0, dtype),
    tol=np.broadcast_to(np.asarray(tol, np.float64), (x0.shape[0],)).copy(),
    lipschitz=lipschitz,
    fun_np=fun_np or jax_fun_np(fun, fun_args, dtype),
    x0_np=x0_np,
    f_star=f_star,
    lower=lower,
    upper=upper,
    seeds=tuple(seeds) if seeds is not None else (None,) * x0.shape[0],
  )


def _bucket(size, buckets):
  return next((b for b in buckets if size <= b), size)


def _as_dtype(args, dtype):
  """Float arrays and BCOO matrices of ``args`` in ``dtype`` (a host CSR matrix stays as it is:
  its kernel multiplies in w's dtype)."""
  converts = lambda a: (
    isinstance(a, (jax.Array, jsparse.BCOO)) and jnp.issubdtype(a.dtype, jnp.floating)
  )
  return tuple(a.astype(dtype) if converts(a) else a for a in args)


def libsvm_instance(
  problem: Problem,
  *,
  seeds=(protocol.SEED,),
  tol=protocol.TOL,
  dtype: str = "float64",
  pad: bool = True,
  lower=None,
  upper=None,
) -> protocol.Instance:
  """``problem`` ready to run from ``protocol.initial_point(n, seed)`` for each of ``seeds``.

  A dense problem is zero-padded to a shape bucket (``ROW_BUCKETS`` x ``COL_BUCKETS``), so
  that problems of one bucket share compiled programs: padded rows carry weight 0 and
  padded columns have zero gradient, so their coordinates stay at 0 and the padded problem
  is the same problem (up to rounding order in the sums); sparse problems, and all with
  ``pad=False``, run as they are. In float32 the data are cast, each start's tol is
  ``max(tol, FLOAT32_RELATIVE_TOL ||grad f(x0)||_inf)`` (grad f(x0) in float64) and SciPy
  runs on the float32 objective. ``lower``/``upper``: a box (:func:`instance`).
  """
  m, n = problem.A.shape
  args, n_run = problem.fun_args, n
  if problem.representation == "dense" and pad and m <= ROW_BUCKETS[-1]:
    n_run = _bucket(n, COL_BUCKETS)
    A = sp.hstack([problem.A, sp.csr_matrix((m, n_run - n))], format="csr")
    _, args = objective(A, problem.y, problem.kind, "dense", rows=_bucket(m, ROW_BUCKETS))
  x0_np = protocol.initial_points(n, seeds)
  x0 = np.zeros((len(seeds), n_run))
  x0[:, :n] = x0_np
  args = _as_dtype(args, dtype)
  tols, fun_np = np.full(len(seeds), tol), problem.fun_np
  if dtype == "float32":
    g0 = np.array([np.max(np.abs(problem.fun_np(x)[1])) for x in x0_np])
    tols = np.maximum(tol, FLOAT32_RELATIVE_TOL * g0)
    fun_np, x0_np = None, x0  # SciPy on the float32 objective
  return instance(
    problem.fun,
    args,
    x0,
    tols,
    lipschitz=float(problem.L),
    dtype=dtype,
    n=n,
    fun_np=fun_np,
    x0_np=x0_np,
    seeds=seeds,
    lower=lower,
    upper=upper,
  )


def batch_sigma_max_sq(a) -> np.ndarray:
  """``sigma_max(A_b)^2`` of each matrix of a batch ``a`` (B, m, n): shape (B,)."""
  return np.linalg.svd(a, compute_uv=False)[..., 0] ** 2


def synthetic_logistic(
  m: int,
  n: int,
  *,
  nnz_per_row: int | None = None,
  batch: int | None = None,
  mean: bool = False,
  ridge: float | None = None,
  dtype="float32",
  seed: int = 0,
) -> protocol.Instance:
  """A logistic regression on random data, labels from a planted model (``experiments/perf``).

  ``A`` is dense m x n with entries N(0, 1/n) (``batch``: B such problems, ``(B, m, n)``),
  or, with ``nnz_per_row`` k, a row-sorted BCOO matrix with k entries N(0, 1/k) per row in
  random columns; ``y_i = +1`` with probability ``sigmoid(<a_i, w*>)``, ``w* ~ N(0, I)``.
  f is :func:`logistic_objective` with weight 1 (``1/m`` with ``mean``) and ``ridge``:
  ``fun_args = (A, y, weight[, ridge])`` (A and y batched, weight and ridge not); x0 = 0;
  L = ``weight sigma_max(A)^2 / 4 + ridge`` for dense data (one per problem with ``batch``),
  the upper bound ``weight ||A||_F^2 / 4 + ridge`` for BCOO.
  """
  rng = np.random.default_rng(seed)
  if nnz_per_row is None:
    shape = (m, n) if batch is None else (batch, m, n)
    a = rng.standard_normal(shape) / np.sqrt(n)
    margin = np.einsum("...ij,...j->...i", a, rng.standard_normal(shape[:-2] + (n,)))
    sigma2 = batch_sigma_max_sq(a) if batch else lipschitz_constant(a)
    matrix = jnp.asarray(a, dtype)
  else:
    cols = np.sort(rng.integers(0, n, size=(m, nnz_per_row), dtype=np.int32), axis=1)
    vals = rng.standard_normal((m, nnz_per_row)) / np.sqrt(nnz_per_row)
    margin = np.sum(vals * rng.standard_normal(n)[cols], axis=1)
    rows = np.repeat(np.arange(m, dtype=np.int32), nnz_per_row)
    sigma2 = float(np.sum(vals**2))  # ||A||_F^2 >= sigma_max^2: no pass over A beyond this
    data = (jnp.asarray(vals.ravel(), dtype), jnp.asarray(np.stack([rows, cols.ravel()], 1)))
    matrix = jsparse.BCOO(data, shape=(m, n), indices_sorted=True)
  y = np.where(rng.random(margin.shape) < expit(margin), 1.0, -1.0)
  weight = 1.0 / m if mean else 1.0
  args = (matrix, jnp.asarray(y, dtype), jnp.asarray(weight, dtype))
  if ridge is not None:
    args += (jnp.asarray(ridge, dtype),)
  lipschitz = weight * sigma2 / 4 + (ridge or 0.0)
  return instance(
    logistic_objective, args, np.zeros(n), lipschitz=lipschitz, dtype=str(np.dtype(dtype))
  )


# ----------------------------------------------------------------------------
# The benchmark's user problems
# ----------------------------------------------------------------------------


def rosenbrock(x):
  """The extended Rosenbrock function ``sum 100 (x_{i+1} - x_i^2)^2 + (1 - x_i)^2``."""
  return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def x_minus_log_x(x):
  """``sum(x - log x)``: minimum n at x = 1, not finite outside x > 0."""
  return jnp.sum(x - jnp.log(x))


MLP_LAYERS = (64, 32, 32, 10)


def _mlp_shapes():
  return [((a, b), (b,)) for a, b in zip(MLP_LAYERS[:-1], MLP_LAYERS[1:])]


def mlp_loss(x, features, labels):
  """Mean cross-entropy of a tanh MLP 64-32-32-10 whose weights and biases are the flat ``x``."""
  h, start = features, 0
  layers = _mlp_shapes()
  for i, (w_shape, b_shape) in enumerate(layers):
    w = x[start : start + w_shape[0] * w_shape[1]].reshape(w_shape)
    start += w.size
    b = x[start : start + b_shape[0]]
    start += b.size
    h = h @ w + b
    if i < len(layers) - 1:
      h = jnp.tanh(h)
  logp = jax.nn.log_softmax(h)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def mlp_digits(tol=protocol.TOL) -> protocol.Instance:
  """:func:`mlp_loss` on scikit-learn's digits in float32, from scaled Gaussian weights."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel

  digits = load_digits()
  features = jnp.asarray(digits.data / 16.0, jnp.float32)
  labels = jnp.asarray(digits.target, jnp.int32)
  rng = np.random.RandomState(0)
  parts = []
  for w_shape, b_shape in _mlp_shapes():
    parts += [rng.randn(*w_shape).ravel() / np.sqrt(w_shape[0]), np.zeros(b_shape)]
  return instance(mlp_loss, (features, labels), np.concatenate(parts), tol, dtype="float32")


CANCER_RIDGE = 1e-3


def l2_logistic(w, A, y, lam):
  """``mean log(1 + exp(-y_i a_i^T w)) + lam/2 ||w||^2``, as a user writes it.

  The benchmark's user problems measure what a user's own objective gives, so this one is
  written the common way (``jnp.logaddexp``, a mean) rather than as
  :func:`logistic_objective` (whose derivative rounds otherwise): the committed rows are
  of this one.
  """
  return jnp.mean(jnp.logaddexp(0.0, -y * (A @ w))) + 0.5 * lam * jnp.sum(w * w)


def breast_cancer(tol=protocol.TOL, dtype="float64") -> protocol.Instance:
  """:func:`l2_logistic` (lam 1e-3) on scikit-learn's standardised breast cancer data with an
  intercept, from 0."""
  from sklearn.datasets import load_breast_cancer  # pylint: disable=import-outside-toplevel

  X, y = load_breast_cancer(return_X_y=True)
  X = (X - X.mean(0)) / X.std(0)
  A = np.hstack([X, np.ones((X.shape[0], 1))])
  lipschitz = np.linalg.eigvalsh(A.T @ A)[-1] / (4 * A.shape[0]) + CANCER_RIDGE
  args = tuple(jnp.asarray(v, dtype) for v in (A, 2.0 * y - 1.0, CANCER_RIDGE))
  return instance(
    l2_logistic, args, np.zeros(A.shape[1]), tol, lipschitz=float(lipschitz), dtype=dtype
  )
