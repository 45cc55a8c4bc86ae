"""How small ``||grad f||_inf`` can be in float32 near a float64 minimiser (a cutest32 problem).

    python -m experiments.float32_floor [--problem NELSONLS] [--ulps 3]

Solves the CUTEst problem in float64 with ``trial_lbfgs()``, rounds the minimiser x* to
float32 and evaluates the float32 gradient there and at every float32 point within
``--ulps`` units in the last place of x* in each coordinate (a (2u + 1)^n lattice for
n <= 4, 4000 random points of it otherwise). It prints the cutest32 threshold
``max(tol, FLOAT32_RELATIVE_TOL ||grad f(x0)||_inf)`` beside the smallest
``||grad f||_inf`` found: where the smallest is far above the threshold, no float32 run
that ends near x* is counted as solved, and a run that reaches it is lost to rounding,
not to the method. The float32 run of ``trial_lbfgs()`` from the suite's x0 is printed too.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax
from experiments.benchmark import suites


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--problem", default="NELSONLS")
  p.add_argument("--ulps", type=int, default=3)
  args = p.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  [task64] = suites.tasks("cutest", tol=1e-4, problems=[args.problem])
  [task32] = suites.tasks("cutest32", tol=1e-4, problems=[args.problem])
  i64, i32 = task64.build(), task32.build()
  run64 = hdm_optax.solve(
    hdm_optax.trial_lbfgs(),
    i64.fun,
    jnp.asarray(i64.x0[0]),
    max_steps=1000,
    tol=1e-4,
    fun_args=i64.fun_args,
  )
  x_star = np.asarray(run64.params, np.float32)
  grad32 = jax.jit(jax.grad(lambda x: i32.fun(x, *i32.fun_args)))
  steps = range(-args.ulps, args.ulps + 1)
  n = x_star.size
  if n <= 4:
    offsets = np.array(list(itertools.product(steps, repeat=n)), np.float32)
  else:
    offsets = np.random.default_rng(0).integers(-args.ulps, args.ulps + 1, (4000, n))
  ulp = np.spacing(np.abs(x_star)).astype(np.float32)
  floor = min(
    float(jnp.max(jnp.abs(grad32(jnp.asarray(x_star + o.astype(np.float32) * ulp)))))
    for o in offsets
  )
  tol32 = float(i32.tol[0])
  run32 = hdm_optax.solve(
    hdm_optax.trial_lbfgs(),
    i32.fun,
    jnp.asarray(i32.x0[0]),
    max_steps=1000,
    tol=tol32,
    fun_args=i32.fun_args,
  )
  print(f"{args.problem} (n = {n})")
  print(
    f"  float64 trial_lbfgs(): f = {float(run64.value):.10g} in {int(run64.num_grad_evals)} "
    f"calls, ||grad f||_inf = {float(run64.grad_norm):.2e}"
  )
  print(f"  float32 ||grad f||_inf at x* rounded: {float(jnp.max(jnp.abs(grad32(x_star)))):.4g}")
  print(f"  smallest over {len(offsets)} float32 points within {args.ulps} ulps: {floor:.4g}")
  print(f"  cutest32 threshold: {tol32:.4g}")
  print(
    f"  float32 trial_lbfgs(): f = {float(run32.value):.10g} in {int(run32.num_grad_evals)} "
    f"calls, ||grad f||_inf = {float(run32.grad_norm):.4g}, converged "
    f"{bool(run32.converged)}"
  )


if __name__ == "__main__":
  main()
