"""The separate path against the fused program on the CUTEst development list.

    python -m experiments.perf.separate_rows [--suite cutest|cutest_bounded] [--names A,B]

Each problem is solved by ``solve(trial_lbfgs())`` twice, float64, the benchmark's protocol
(1000 gradient calls, ``||grad f||_inf <= 1e-4``, the projected gradient's with a box): on
the separate path (the method's program, the objective called from the host) and in the
fused program (``solve`` inside ``jax.jit``). Printed per problem: steps, calls and status of
each, and the largest relative difference of the final params; then how many problems agree
in calls and status.
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hdm_optax  # noqa: E402
from experiments.benchmark import suites  # noqa: E402
from hdm_optax.driver import programs  # noqa: E402
from hdm_optax.driver import separate as separate_lib  # noqa: E402

BUDGET, TOL = 1000, 1e-4


def _runs(instance):
  box = {}
  if instance.lower is not None:
    box = dict(lower=jnp.asarray(instance.lower[0]), upper=jnp.asarray(instance.upper[0]))
  opt = hdm_optax.trial_lbfgs(**box)
  x0 = jnp.asarray(instance.x0[0])
  tol = float(instance.tol[0]) if instance.tol is not None else TOL
  kw = dict(max_steps=BUDGET, max_grad_evals=BUDGET, tol=tol, fun_args=instance.fun_args)
  hdm_optax.clear_caches()
  separate = hdm_optax.solve(opt, instance.fun, x0, **kw)
  fused = jax.jit(lambda x0: hdm_optax.solve(opt, instance.fun, x0, **kw))(x0)
  return separate, fused


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--suite", default="cutest", choices=("cutest", "cutest_bounded"))
  parser.add_argument("--names", default=None)
  parser.add_argument(
    "--options",
    default="front-door",
    choices=("front-door", "xla-defaults", "o0"),
    help="the method's program's XLA options: the front door's rule, XLA's defaults (as the "
    "benchmark's rows), or the elemental emitters at optimization level 0",
  )
  args = parser.parse_args(argv)
  if args.options == "xla-defaults":
    programs.compiler_options = lambda inputs, **kw: {}
  elif args.options == "o0":
    o0 = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
    programs.compiler_options = lambda inputs, **kw: o0
  names = args.names.split(",") if args.names else None
  tasks = (
    suites.cutest_tasks(TOL, names)
    if args.suite == "cutest"
    else suites.cutest_bounded_tasks(TOL, names)
  )
  separate_lib.SEPARATE_RUNS = 1  # the first run of each problem on the separate path
  same = 0
  start = time.perf_counter()
  for task in tasks:
    separate, fused = _runs(task.build())
    pair = [(int(r.num_steps), int(r.num_grad_evals), int(r.status)) for r in (separate, fused)]
    scale = np.maximum(np.abs(np.asarray(fused.params)), 1.0)
    diff = float(np.max(np.abs(np.asarray(separate.params) - np.asarray(fused.params)) / scale))
    agree = pair[0][1:] == pair[1][1:]
    same += agree
    print(
      f"{task.name:<14} separate {pair[0]} fused {pair[1]} params differ by {diff:.1e}"
      f"{'' if agree else '  <- calls or status differ'}",
      flush=True,
    )
  print(
    f"{same} of {len(tasks)} problems: the same calls and status "
    f"({time.perf_counter() - start:.0f} s)"
  )


if __name__ == "__main__":
  main()
