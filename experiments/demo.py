"""The README's first command: trial_lbfgs, hdm_auto and HDM-Best against optax.lbfgs.

    python -m experiments.demo [--dataset ijcnn1] [--data-dir DIR] [--tol 1e-4]

Loads a LIBSVM dataset (the paper's protocol: A = [X, 1], f(w) = sum_i
log(1 + exp(-y_i (A w)_i)), x0 = randn / ||randn|| with seed 20250128), solves
it with ``hdm_optax.trial_lbfgs()`` and ``hdm_optax.hdm_auto()`` (no arguments),
``hdm_optax.hdm_best`` (its default step sizes, L = sigma_max(A)^2) and
``optax.lbfgs`` under the same budget of 1000 gradient calls, and
prints iterations, oracle calls, final value, ||grad f||_inf, whether the protocol counts
it solved and the seconds of one solve (compilation excluded), each run by
``experiments.runner.run``.
"""

from __future__ import annotations

import argparse

import optax

import hdm_optax
from experiments import problems
from experiments import protocol
from experiments import runner
from experiments.solvers import Solver


def main(argv=None):
  protocol.enable_float64()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="ijcnn1")
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--tol", type=float, default=1e-4)
  parser.add_argument("--max-grad-calls", type=int, default=1000)
  args = parser.parse_args(argv)
  problem = problems.load_problem(args.dataset, "logistic", data_dir=args.data_dir)
  inst = problems.libsvm_instance(problem, tol=args.tol, pad=False)
  print(
    f"logistic regression on {args.dataset}: m = {problem.m}, n = {problem.n}, "
    f"L = {problem.L:.6g}, {problem.representation} data, tol = {args.tol:g}"
  )
  print(
    f"{'method':<12} {'iters':>6} {'f-calls':>7} {'g-calls':>7} "
    f"{'final f':>16} {'|g|_inf':>10} {'solved':>9} {'seconds':>8}"
  )
  methods = {
    "trial_lbfgs": hdm_optax.trial_lbfgs,
    "hdm_auto": hdm_optax.hdm_auto,
    "HDM-Best": lambda: hdm_optax.hdm_best(lipschitz=problem.L),
    "optax.lbfgs": optax.lbfgs,
  }
  for name, make in methods.items():
    (r,) = runner.run(Solver(name, make=lambda *_, make=make: make()), inst, args.max_grad_calls)
    print(
      f"{name:<12} {r.iterations:>6} {r.value_calls:>7} {r.grad_calls:>7} "
      f"{r.final_value:>16.10e} {r.final_grad_inf:>10.3e} {str(r.solved):>9} {r.seconds:>8.3f}"
    )
  print("seconds: one compiled solve, compilation excluded (compiled before it runs)")


if __name__ == "__main__":
  main()
