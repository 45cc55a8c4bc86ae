"""Sparse CSR products for JAX on a CPU: the C++ kernel (XLA FFI) and its wrapper."""
