"""float32 with TF32 products: why the experiments set ``jax_default_matmul_precision``.

    python -m experiments.tf32 [--datasets fourclass_scale heart_scale a1a]

On NVIDIA GPUs (Ampere and later), JAX's default precision lets a float32 matrix
product round its inputs to TF32 (10 bits of mantissa, float32 accumulation).
This runs ``hdm_auto()`` and ``optax.lbfgs()`` on LIBSVM problems in float32 on
the CPU three times: with exact float32 products, with TF32 products in f's
forward pass only, and in both passes (the rounding emulated bit for bit:
round to nearest even at bit 13). It prints each run's gradient calls, status
and final value.

On an H200 with JAX's default precision (jax 0.11.2), the libsvm32 suite gave
hdm_auto() 21.0 of 54 solved per start against 49.6 on the CPU, and its final
values on fourclass_scale were the CPU emulation's, bit for bit: hdm_auto()'s
acceptance compares values of f, and with TF32 those carry errors of about
1e-3 of f's terms, so it settles where the TF32 value of f is lowest.
``optax.lbfgs()`` (53.8 of 54 on both) took the CPU's calls on the GPU. The
experiments compute float32 products in float32 (``protocol.MATMUL_PRECISION``);
a user computing f in float32 on such a GPU does the same with
``jax.default_matmul_precision("highest")`` or ``precision=`` on the product
(``docs/pitfalls.md``).
"""

from __future__ import annotations

import argparse
import csv
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax


def tf32(x: jax.Array) -> jax.Array:
  """float32 ``x`` rounded to TF32 (10 bits of mantissa, round to nearest even); others as they are."""
  if x.dtype != jnp.float32:
    return x
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  bits = (bits + jnp.uint32(0x0FFF) + ((bits >> 13) & jnp.uint32(1))) & jnp.uint32(0xFFFFE000)
  return lax.bitcast_convert_type(bits, jnp.float32)


def tf32_matvec(a: jax.Array, w: jax.Array) -> jax.Array:
  """``A @ w`` whose value is the TF32 product and whose derivatives are the exact ones."""
  exact = a @ w
  return exact + lax.stop_gradient(tf32(a) @ tf32(w) - exact)


_LABELS = {"float32": "float32", "tf32": "TF32 in f"}


def _run(products: str, datasets) -> None:
  """One process per kind of product: the runner caches compiled programs by problem."""
  from experiments import problems, protocol
  from experiments.benchmark import runner, solvers, suites

  protocol.enable_float64()
  exact = problems.matvec

  def matvec(a, w):
    dense = isinstance(a, jax.Array) and a.ndim == 2 and a.dtype == jnp.float32
    return tf32_matvec(a, w) if (products == "tf32" and dense) else exact(a, w)

  problems.matvec = matvec
  names = ("hdm_auto()", "optax.lbfgs()")
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "rows.csv"
    tasks = suites.libsvm_tasks(runner.TOL, 1, "float32", datasets)
    runner.run_suite(tasks, [solvers.get(n) for n in names], path, progress=False)
    with open(path, newline="") as f:
      for row in csv.DictReader(f):
        print(
          f"{_LABELS[products]:>20} {row['problem']:>26} {row['solver']:>14} "
          f"{row['grad_calls']:>6} {row['status']:>9}  {float(row['final_value']):.9g}",
          flush=True,
        )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--datasets", nargs="+", default=["fourclass_scale", "heart_scale", "a1a"])
  p.add_argument("--products", choices=tuple(_LABELS), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.products:
    _run(args.products, args.datasets)
    return
  print(f"{'products':>20} {'problem':>26} {'solver':>14} {'calls':>6} {'status':>9}  final f")
  for products in _LABELS:
    command = [sys.executable, "-m", "experiments.tf32", "--products", products, "--datasets"]
    subprocess.run(command + args.datasets, check=True)


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main()
