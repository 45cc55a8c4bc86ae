"""One iteration of ``trial_lbfgs()`` against one of ``optax.lbfgs()``, same process, interleaved.

``trial_lbfgs(diagonal=None)`` (H_0 = gamma I, no pairs' diagonal) is timed beside them.

    python -m experiments.perf.secant_iteration [--n 100000] [--steps 50] [--repeats 5]

The ridge logistic regression of ``experiments.perf.overhead`` (BCOO data at n >= 1e5), float32.
Each optimizer runs ``hdm_optax.solve(..., tol=0)`` for K iterations (compiled once, then timed
in interleaved rounds, best of ``--repeats``); printed per iteration and per gradient call
(``optax.lbfgs`` makes one call per line-search step), with one ``jax.value_and_grad`` call for
scale, and the optimizer state in vectors of n.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from experiments import protocol
from experiments.perf import overhead
from experiments.perf import timing


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--n", type=float, default=1e5)
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args(argv)
  protocol.float32_products()
  import optax

  import hdm_optax

  n = int(args.n)
  fun, data, w0, _, kind = overhead.make_problem(n, np.float32)
  opts = {
    "trial_lbfgs()": hdm_optax.trial_lbfgs(),
    "trial_lbfgs(diagonal=None)": hdm_optax.trial_lbfgs(diagonal=None),
    "optax.lbfgs()": optax.lbfgs(),
  }
  solve = jax.jit(
    lambda opt, w, data: hdm_optax.solve(opt, fun, w, max_steps=args.steps, tol=0.0, fun_args=data),
    static_argnums=0,
  )
  vg = jax.jit(jax.value_and_grad(fun))
  fns = {name: (lambda o=o: solve(o, w0, data)) for name, o in opts.items()}
  fns["value_and_grad"] = lambda: vg(w0, *data)
  seconds, outs = timing.best_times(fns, args.repeats)
  print(f"n = {n} ({kind}), float32, {args.steps} iterations, best of {args.repeats}")
  t_vg = seconds["value_and_grad"]
  print(f"  one value_and_grad: {1e3 * t_vg:.3f} ms")
  for name in opts:
    res = outs[name]
    iters, calls = int(res.num_steps), int(res.num_grad_evals)
    big = sum(leaf.size for leaf in jax.tree.leaves(res.state) if leaf.size >= n) / n
    print(
      f"  {name}: {1e3 * seconds[name] / iters:.3f} ms per iteration "
      f"({seconds[name] / iters / t_vg:.2f} x value_and_grad), "
      f"{1e3 * seconds[name] / calls:.3f} ms per gradient call, {calls / iters:.2f} calls "
      f"per iteration, state {big:.0f} vectors of n"
    )


if __name__ == "__main__":
  main()
