"""Compiling the tests' tiny programs without XLA's backend optimizations (compile time only)."""

import jax

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def run_jit(fn, *args):
  """``jax.jit(fn)(*args)``, compiled without backend optimizations."""
  return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)
