"""The README's first command: trial_lbfgs, hdm_auto and HDM-Best against optax.lbfgs.

    python -m experiments.demo [--dataset ijcnn1] [--data-dir DIR] [--tol 1e-4]

Loads a LIBSVM dataset (by default ijcnn1 from ``--data-dir``, ``$HDM_DATA_DIR``,
``../shared/datasets/libsvm`` or the download cache; where none has it, the bundled a9a,
with a message that says so and how to get ijcnn1; see ``experiments.data``), builds the
paper's logistic regression (A = [X, 1], f(w) = sum_i
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
import sys

import optax

import hdm_optax
from experiments import data as data_lib
from experiments import problems
from experiments import protocol
from experiments import runner
from experiments.solvers import Solver


DEFAULT = "ijcnn1"  # the paper's logistic regression
FALLBACK = "a9a"  # bundled with the repository (experiments/datasets)


def default_dataset(data_dir=None) -> str:
  """Returns DEFAULT where a data directory or the cache has it, else FALLBACK (and says so)."""
  if data_lib.find_dataset(DEFAULT, data_dir) is not None:
    return DEFAULT
  data_dir = data_dir if data_dir is not None else data_lib.default_data_dir()
  note = data_lib.missing_message(DEFAULT, data_dir, data_lib.default_cache_dir())
  print(f"{note}.\nThe demo runs on the bundled {FALLBACK} instead.", file=sys.stderr)
  return FALLBACK


def main(argv=None):
  protocol.enable_float64()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--dataset", default=None, help=f"default {DEFAULT} where found, else {FALLBACK} (bundled)"
  )
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--tol", type=float, default=1e-4)
  parser.add_argument("--max-grad-calls", type=int, default=1000)
  args = parser.parse_args(argv)
  args.dataset = args.dataset or default_dataset(args.data_dir)
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
