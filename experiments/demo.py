"""The README's first command: trial_lbfgs, hdm_auto and HDM-Best against optax.lbfgs.

    python -m experiments.demo [--dataset ijcnn1] [--data-dir DIR] [--tol 1e-4]

Loads a LIBSVM dataset (the paper's protocol: A = [X, 1], f(w) = sum_i
log(1 + exp(-y_i (A w)_i)), x0 = randn / ||randn|| with seed 20250128), solves
it with ``hdm_optax.trial_lbfgs()`` and ``hdm_optax.hdm_auto()`` (no arguments),
``hdm_optax.hdm_best`` (its default step sizes, L = sigma_max(A)^2) and
``optax.lbfgs`` under the same budget of 1000 gradient calls, and
prints iterations, oracle calls, final value, ||grad f||_inf and the seconds of
one solve (compilation excluded: each solve is run once to compile it first).
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import optax

import hdm_optax
from experiments import problems
from experiments import protocol


def _run(name, optimizer, problem, max_grad_calls, tol):
  x0 = jnp.asarray(problem.x0)
  kwargs = dict(
    max_steps=max_grad_calls - 1, tol=tol, fun_args=problem.fun_args, max_grad_evals=max_grad_calls
  )
  hdm_optax.solve(optimizer, problem.fun, x0, **kwargs).value.block_until_ready()  # compile
  start = time.perf_counter()
  res = hdm_optax.solve(optimizer, problem.fun, x0, **kwargs)
  res.value.block_until_ready()
  seconds = time.perf_counter() - start
  print(
    f"{name:<12} {int(res.num_steps):>6} {int(res.num_value_evals):>7} "
    f"{int(res.num_grad_evals):>7} {float(res.value):>16.10e} "
    f"{float(res.grad_norm):>10.3e} {str(bool(res.converged)):>9} {seconds:>8.3f}"
  )


def main(argv=None):
  protocol.enable_float64()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="ijcnn1")
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--tol", type=float, default=1e-4)
  parser.add_argument("--max-grad-calls", type=int, default=1000)
  args = parser.parse_args(argv)
  problem = problems.load_problem(args.dataset, "logistic", data_dir=args.data_dir)
  print(
    f"logistic regression on {args.dataset}: m = {problem.m}, n = {problem.n}, "
    f"L = {problem.L:.6g}, {problem.representation} data, tol = {args.tol:g}"
  )
  print(
    f"{'method':<12} {'iters':>6} {'f-calls':>7} {'g-calls':>7} "
    f"{'final f':>16} {'|g|_inf':>10} {'converged':>9} {'seconds':>8}"
  )
  _run("trial_lbfgs", hdm_optax.trial_lbfgs(), problem, args.max_grad_calls, args.tol)
  _run("hdm_auto", hdm_optax.hdm_auto(), problem, args.max_grad_calls, args.tol)
  _run("HDM-Best", hdm_optax.hdm_best(lipschitz=problem.L), problem, args.max_grad_calls, args.tol)
  _run("optax.lbfgs", optax.lbfgs(), problem, args.max_grad_calls, args.tol)
  print("seconds: one compiled solve, compilation excluded (a first call compiled it)")


if __name__ == "__main__":
  main()
