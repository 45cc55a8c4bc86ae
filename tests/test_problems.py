"""Tests of experiments/problems.py: the paper's SVM and logistic objectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

from experiments import data, problems

REAL_DIR = data.default_data_dir()


def _toy(m=40, d=6, density=0.5, seed=0):
  rng = np.random.default_rng(seed)
  X = sp.random(m, d, density=density, random_state=seed, format="csr")
  y = np.where(rng.random(m) < 0.5, -1.0, 1.0)
  return X, y


def test_design_matrix_matches_paper():
  X, y = _toy()
  Xd = X.toarray()
  A_svm = problems.design_matrix(X, y, "svm").toarray()
  np.testing.assert_array_equal(A_svm, y[:, None] * np.hstack([Xd, -np.ones((40, 1))]))
  A_log = problems.design_matrix(X, y, "logistic").toarray()
  np.testing.assert_array_equal(A_log, np.hstack([Xd, np.ones((40, 1))]))


def test_lipschitz_constant_is_sigma_max_squared():
  X, y = _toy()
  A = problems.design_matrix(X, y, "svm")
  sigma = np.linalg.svd(A.toarray(), compute_uv=False)[0]
  assert problems.lipschitz_constant(A) == pytest.approx(sigma**2, rel=1e-12)


@pytest.mark.usefixtures("cpu_default_device")  # the "host" representation: CPU only
@pytest.mark.parametrize("kind", ["svm", "logistic"])
def test_objectives_agree(kind):
  X, y = _toy()
  dense = problems.make_problem(X, y, kind, representation="dense")
  sparse = problems.make_problem(X, y, kind, representation="sparse")
  host = problems.make_problem(X, y, kind, representation="host")
  A = dense.A.toarray()
  # w = 0 puts every margin at 0, where the logistic loss's derivative must be 1/2 (the
  # nonnegative-weight problems start there and keep margins at 0).
  points = (dense.x0, np.zeros(dense.n), 3.0 * np.random.default_rng(1).standard_normal(dense.n))
  for w in points:
    if kind == "svm":
      r = np.maximum(0.0, 1.0 - A @ w)
      f, g = 0.5 * r @ r, -A.T @ r
    else:
      mgn = y * (A @ w)
      f = np.sum(np.log1p(np.exp(-mgn)))
      g = A.T @ (-y / (1.0 + np.exp(mgn)))
    for p in (dense, sparse, host):
      v, gj = p.value_and_grad(w)
      assert float(v) == pytest.approx(f, rel=1e-12)
      np.testing.assert_allclose(np.asarray(gj), g, rtol=1e-10, atol=1e-12)
      assert float(p.value(w)) == pytest.approx(f, rel=1e-12)
    vn, gn = dense.fun_np(w)
    assert vn == pytest.approx(f, rel=1e-12)
    np.testing.assert_allclose(gn, g, rtol=1e-10, atol=1e-12)
  assert isinstance(sparse.fun_args[0], jax.experimental.sparse.BCOO)
  assert dense.fun_args[0].dtype == jnp.float64


def test_logistic_is_overflow_safe():
  X, y = _toy()
  p = problems.make_problem(X, y, "logistic", representation="sparse")
  w = 1e4 * np.ones(p.n)
  v, g = p.value_and_grad(w)
  vn, gn = p.fun_np(w)
  assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(g)))
  assert float(v) == pytest.approx(vn, rel=1e-12)


def test_fun_takes_data_as_arguments():
  """The same jitted function serves two datasets of different sizes."""
  f = jax.jit(jax.value_and_grad(problems.svm_objective))
  for seed, m in ((0, 30), (1, 50)):
    X, y = _toy(m=m, seed=seed)
    p = problems.make_problem(X, y, "svm")
    v, _ = f(jnp.asarray(p.x0), *p.fun_args)
    assert float(v) == pytest.approx(p.fun_np(p.x0)[0], rel=1e-12)


def test_choose_representation():
  """The CPU's rule (other backends: test_representation_follows_the_default_backend)."""
  choose = lambda A: problems.choose_representation(A, backend="cpu")
  assert choose(sp.random(100, 10, density=0.9, format="csr")) == "dense"
  assert choose(sp.random(20000, 300, density=0.04, format="csr")) == "host"
  assert choose(sp.random(100, 300, density=0.04, format="csr")) == "dense"
  # a9a-like (12% dense): host CSR once the dense matrix leaves the cache
  assert choose(sp.random(32561, 124, density=0.12, format="csr")) == "host"
  assert choose(sp.random(16100, 124, density=0.12, format="csr")) == "dense"


@pytest.mark.parametrize("backend,want", [("cpu", "host"), ("gpu", "sparse"), ("tpu", "sparse")])
def test_representation_follows_the_default_backend(monkeypatch, backend, want):
  """The CSR kernel on a CPU, BCOO on accelerators; dense stays dense everywhere."""
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  assert problems.choose_representation(sp.random(20000, 300, density=0.04, format="csr")) == want
  assert problems.choose_representation(sp.random(100, 10, density=0.9, format="csr")) == "dense"
  very_sparse = sp.random(20000, 300, density=0.04, format="csr")
  assert problems.choose_representation(very_sparse, backend="cpu") == "host"


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("kind", ["svm", "logistic"])
def test_accelerator_representation_gives_the_cpu_numbers(monkeypatch, kind):
  """make_problem's "auto" under each backend: the same f and gradient (evaluated on the CPU)."""
  X, y = _toy(m=4000, d=200, density=0.03)  # 24,000 nonzeros: very sparse
  made = {}
  for backend in ("cpu", "gpu"):
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    made[backend] = problems.make_problem(X, y, kind)
  assert made["cpu"].representation == "host" and made["gpu"].representation == "sparse"
  assert isinstance(made["gpu"].fun_args[0], jax.experimental.sparse.BCOO)
  w = np.random.default_rng(2).standard_normal(made["cpu"].n)
  (v_host, g_host), (v_bcoo, g_bcoo) = (made[b].value_and_grad(w) for b in ("cpu", "gpu"))
  vn, gn = made["cpu"].fun_np(w)
  for v, g in ((v_host, g_host), (v_bcoo, g_bcoo)):
    assert float(v) == pytest.approx(vn, rel=1e-12)
    np.testing.assert_allclose(np.asarray(g), gn, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(REAL_DIR is None, reason="LIBSVM data directory not found")
def test_load_problem_real(tmp_path):
  p = problems.load_problem("heart_scale", "logistic", data_dir=REAL_DIR, cache_dir=tmp_path)
  assert (p.m, p.n) == (270, 14) and p.L > 0
  assert np.linalg.norm(p.x0) == pytest.approx(1.0)
