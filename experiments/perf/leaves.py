"""First-call seconds against the number of pytree leaves, each cold call in a fresh process.

    python -m experiments.perf.leaves [--leaves 1,4,40,200,1000] [--solvers ...]
        [--timeout 900] [--save results/perf/leaves.json] [--figure results/perf/leaves.png]

The problem: params a dict of L leaves of 8 float64 entries each,

.. math::
  f(x) = \\sum_k c_k \\sum_i \\bigl((x_{ki} - 1)^2 + x_{ki}^4 / 100\\bigr)
  + \\tfrac12 \\sum_k \\langle x_k, x_{k+1}\\rangle,

c_k from 1 to 100 over the leaves; the last term couples each leaf to the next, as layers
are coupled, so that each leaf's gradient reads its neighbours' (a term such as
:math:`(\\sum_{k,i} x_{ki})^2` puts every leaf in every leaf's gradient, and its program
grows as :math:`L^2`). Each solver
is called as its users call it (``tol=1e-6`` on the gradient's infinity norm, 2000 steps
at most), once, in a process of its own (imports and the problem excluded; tracing,
lowering, XLA's compile and the run included):

- ``trial_lbfgs``: ``hdm_optax.solve(hdm_optax.trial_lbfgs(), f, params)``;
- ``minimize``: ``hdm_optax.minimize(f, params)`` (trial_lbfgs with SciPy's defaults);
- ``hdm_auto``: ``hdm_optax.solve(hdm_optax.hdm_auto(), f, params)``;
- ``optax.lbfgs``: ``hdm_optax.solve(optax.lbfgs(), f, params)``;
- ``optx.LBFGS``: ``optimistix.minimise(f, optx.LBFGS(rtol=0, atol=1e-6), params)``.

A call that runs past ``--timeout`` seconds is reported as such. ``--save`` merges the rows
into a JSON file (a row per solver and L, the newest kept), so that runs of different L
add up; ``--figure`` draws the cold seconds against L on log-log axes (PNG), from that
file where one is given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SOLVERS = ("trial_lbfgs", "minimize", "hdm_auto", "optax.lbfgs", "optx.LBFGS")
LEAVES = (1, 4, 40, 200, 1000)
WIDTH = 8
TOL = 1e-6
MAX_STEPS = 2000


def problem(leaves: int):
  """``(f, params)``: the objective of a dict of ``leaves`` leaves and its start."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  scales = np.geomspace(1.0, 100.0, leaves)
  params = {
    f"w{k:04d}": jnp.asarray(np.linspace(-1.0, 1.0, WIDTH) * (k % 3)) for k in range(leaves)
  }

  def f(p):
    xs = jax.tree.leaves(p)
    fit = sum(c * jnp.sum((x - 1.0) ** 2 + 0.01 * x**4) for c, x in zip(scales, xs))
    chain = sum(0.5 * jnp.vdot(a, b) for a, b in zip(xs[:-1], xs[1:]))
    return fit + chain

  return f, params


def _runner(solver: str, leaves: int):
  """A function of no argument that runs ``solver`` on the problem with ``leaves`` leaves."""
  import jax
  import optax

  import hdm_optax

  f, params = problem(leaves)
  if solver == "optx.LBFGS":
    import optimistix as optx

    opt = optx.LBFGS(rtol=0.0, atol=TOL, norm=optx.max_norm)
    fn = lambda y, _: f(y)  # one function: the second call reuses the program
    run = lambda: optx.minimise(fn, opt, params, max_steps=MAX_STEPS, throw=False)
    return run, lambda out: f"{int(out.stats['num_steps'])} steps"
  if solver == "minimize":
    return (
      lambda: hdm_optax.minimize(f, params, tol=TOL, options=dict(maxiter=MAX_STEPS)),
      lambda out: f"{int(out.nfev)} calls",
    )
  opt = {
    "trial_lbfgs": hdm_optax.trial_lbfgs,
    "hdm_auto": hdm_optax.hdm_auto,
    "optax.lbfgs": optax.lbfgs,
  }[solver]()
  del jax
  return (
    lambda: hdm_optax.solve(opt, f, params, max_steps=MAX_STEPS, tol=TOL),
    lambda out: f"{int(out.num_grad_evals)} calls",
  )


def one(solver: str, leaves: int) -> dict:
  """The cold call's seconds in this process (call it in a fresh one)."""
  import jax

  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_platforms", "cpu")
  run, describe = _runner(solver, leaves)
  start = time.perf_counter()
  out = jax.block_until_ready(run())
  cold = time.perf_counter() - start
  start = time.perf_counter()
  jax.block_until_ready(run())
  warm = time.perf_counter() - start
  return dict(cold=cold, warm=warm, result=describe(out))


def _child(solver: str, leaves: int, timeout: float) -> dict:
  cmd = [sys.executable, "-m", "experiments.perf.leaves", "--one", solver, str(leaves)]
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(cold=float("inf"), warm=float("nan"), result=f"> {timeout:.0f} s")
  if out.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def figure(table: dict, path: str) -> None:
  """Cold seconds against L, one line per solver (log-log), written to ``path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for solver, rows in table.items():
    pts = sorted((L, r["cold"]) for L, r in rows.items() if r["cold"] != float("inf"))
    (line,) = ax.plot(*zip(*pts), marker="o", label=solver)
    over = [
      (L, float(r["result"].split()[1])) for L, r in rows.items() if r["cold"] == float("inf")
    ]
    if over:  # ran past the timeout: a triangle at the timeout
      ax.plot(*zip(*over), marker="^", linestyle="none", color=line.get_color(), markersize=9)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("pytree leaves L (8 entries each)")
  ax.set_ylabel("first call, seconds (compile + run)")
  ax.set_title("First call against the number of leaves (CPU, float64; ^: timed out)", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--leaves", default=",".join(map(str, LEAVES)))
  parser.add_argument("--solvers", default=",".join(SOLVERS))
  parser.add_argument("--timeout", type=float, default=900.0)
  parser.add_argument("--save", default=None, help="merge the rows into this JSON file")
  parser.add_argument("--figure", default=None, help="write the figure (PNG) here")
  parser.add_argument("--one", nargs=2, metavar=("SOLVER", "LEAVES"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(one(args.one[0], int(args.one[1]))))
    return
  solvers = args.solvers.split(",")
  for solver in solvers:
    if solver not in SOLVERS:
      parser.error(f"unknown solver {solver!r}; valid: {', '.join(SOLVERS)}")
  table = {solver: {} for solver in solvers}
  print(f"{'L':>5} {'solver':<12} {'cold s':>8} {'warm s':>8}   result", flush=True)
  for leaves in map(int, args.leaves.split(",")):
    for solver in solvers:
      r = _child(solver, leaves, args.timeout)
      table[solver][leaves] = r
      print(
        f"{leaves:>5} {solver:<12} {r['cold']:8.2f} {r['warm']:8.3f}   {r['result']}", flush=True
      )
  if args.save:
    table = _merged(table, args.save)
  if args.figure:
    figure(table, args.figure)


def _merged(table: dict, path: str) -> dict:
  """``table`` over the rows saved in ``path`` (which it then holds)."""
  import os

  saved = {}
  if os.path.exists(path):
    with open(path) as f:
      saved = {s: {int(k): r for k, r in rows.items()} for s, rows in json.load(f).items()}
  for solver, rows in table.items():
    saved.setdefault(solver, {}).update(rows)
  with open(path, "w") as f:
    json.dump(saved, f, indent=1, sort_keys=True)
  return saved


if __name__ == "__main__":
  main()
