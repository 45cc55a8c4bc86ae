"""Tests of experiments/host_csr.py: SciPy CSR products inside compiled JAX code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from jax.interpreters import mlir

from experiments import host_csr

jax.config.update("jax_enable_x64", True)

A = sp.random(37, 9, density=0.3, random_state=0, format="csr")
HANDLE = host_csr.register(A)
W = np.random.default_rng(0).standard_normal((4, 9))
V = np.random.default_rng(1).standard_normal((4, 37))


def _loss(w, handle):
    z = host_csr.csr_matvec(w, handle, 37, 9)
    return jnp.sum(jnp.sin(z))


def _check(value_and_grad):
    nested = jax.vmap(jax.vmap(lambda w: host_csr.csr_matvec(w, HANDLE, 37, 9)))(
        jnp.asarray(W.reshape(2, 2, 9)))
    np.testing.assert_allclose(np.asarray(nested), (W @ A.T.toarray()).reshape(2, 2, 37))
    for w in W:
        v, g = value_and_grad(jnp.asarray(w), HANDLE)
        z = A @ w
        assert float(v) == pytest.approx(np.sum(np.sin(z)), rel=1e-13)
        np.testing.assert_allclose(np.asarray(g), A.T @ np.cos(z), rtol=1e-12, atol=1e-14)
    vb, gb = jax.jit(jax.vmap(value_and_grad, in_axes=(0, None)))(jnp.asarray(W), HANDLE)
    np.testing.assert_allclose(np.asarray(vb), np.sin(W @ A.T.toarray()).sum(1), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(gb), np.cos(W @ A.T.toarray()) @ A.toarray(),
                               rtol=1e-12, atol=1e-14)


def test_products_gradients_and_vmap():
    _check(jax.jit(jax.value_and_grad(_loss)))
    _check(jax.value_and_grad(_loss))  # eager: the primitive's impl


def test_pure_callback_fallback_gives_the_same_results():
    """The lowering used when JAX's internal emit_python_callback is missing."""
    mlir.register_lowering(host_csr._product_p, host_csr._lower_fallback, platform="cpu")
    try:
        _check(jax.jit(jax.value_and_grad(lambda w, h: _loss(w, h) + 0.0)))
    finally:
        mlir.register_lowering(host_csr._product_p, host_csr._lower, platform="cpu")


def test_float32_stays_float32():
    out = jax.jit(lambda w, h: host_csr.csr_matvec(w, h, 37, 9))(jnp.asarray(W[0], jnp.float32),
                                                                   HANDLE)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), A @ W[0], rtol=1e-5)


def test_transposed_and_batched_host_products():
    np.testing.assert_allclose(host_csr.host_product(HANDLE, V.T, transpose=True),
                               A.T @ V.T)
    np.testing.assert_allclose(host_csr.host_product(HANDLE, W.T[:, None, :])[:, 0], A @ W.T)


def test_bad_handle_and_shape_are_clear_errors():
    with pytest.raises(KeyError, match="no host matrix is registered under handle 99999"):
        host_csr.host_product(np.asarray([99999]), W[0])
    with pytest.raises(ValueError, match="needs 9 entries, got 8"):
        host_csr.host_product(HANDLE, W[0, :8])


def test_products_split_into_row_blocks_agree(monkeypatch):
    monkeypatch.setattr(host_csr, "THREADS", 2)
    monkeypatch.setattr(host_csr, "THREAD_MIN_WORK", 0)
    handle = host_csr.register(A)
    blocks, blocks_t = host_csr._REGISTRY[int(handle[0])]
    assert len(blocks) == 3 and len(blocks_t) == 3  # the whole matrix, then 2 row blocks
    np.testing.assert_allclose(host_csr.host_product(handle, W.T), A @ W.T, rtol=1e-13)
    np.testing.assert_allclose(host_csr.host_product(handle, V[0], transpose=True), A.T @ V[0],
                               rtol=1e-13)
