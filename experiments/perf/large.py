"""Large problems: time to solution and peak memory at large n, and each solver's memory ceiling.

    python -m experiments.perf.large [--sizes 1e7] [--solvers hdm_auto(),optax.lbfgs()]
    python -m experiments.perf.large --ceiling [--start 1e6] [--max-n 2147483647]
                                     [--memory-gib G]

Time to solution (default): the sparse float32 logistic regression of
``experiments.problems.synthetic_logistic`` (``sum_i log(1 + exp(-y_i (A w)_i))``, a
``jax.experimental.sparse.BCOO`` A with n / 10 rows and 10 nonzeros per row,
labels from a planted model), solved from w = 0 by ``hdm_optax.solve`` to
``||grad f||_inf <= --rtol * ||grad f(0)||_inf`` within ``--calls`` gradient
calls. Each (n, solver) runs in its own process, so its peak is its own. One
row each: gradient calls, the best wall time of the compiled solve
(``--repeats``; compilation excluded), the compiled program's memory
(``memory_analysis``: arguments + outputs + temporaries, less donated
aliases) and the peak: the device's ``peak_bytes_in_use`` where JAX reports
it (GPUs, TPUs), else the process's maximum resident set (CPU; it includes
the Python process and the data's NumPy copies).

Memory ceiling (``--ceiling``): the largest n at which each solver runs
``--steps`` updates of a data-free smooth function of n float32 parameters
(``1/2 sum_i d_i (x_i - 1)^2`` with ``d_i = 1 + (i mod 7)`` computed in the
program: the parameters and the solver's own vectors are all the memory
there is). n doubles from ``--start`` until a run fails or passes
``--max-n`` (halves, if ``--start`` fails), then ``--bisect`` halvings of
the gap refine it; each run is a
subprocess with ``--timeout`` seconds, allocating on demand
(``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set). A failure prints its last error line
(``RESOURCE_EXHAUSTED: Out of memory ...``). On a CPU the machine's memory is
shared: ``--memory-gib`` (default 2 on a CPU) caps each run's data segment
(``RLIMIT_DATA``), the CPU's stand-in for a device's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from experiments import protocol
from experiments.perf import timing
from experiments.perf.batched import device_label

__all__ = ["SOLVERS", "data_free", "run_one", "ceiling", "main"]

NNZ_PER_ROW = 10
MAX_HALVINGS = 12
ROWS_PER_PARAM = 0.1


def _solvers():
  import optax

  import hdm_optax

  return {
    "hdm_auto()": hdm_optax.hdm_auto,
    "osgm_best()": hdm_optax.osgm_best,
    "trial_lbfgs()": hdm_optax.trial_lbfgs,
    "optax.lbfgs()": optax.lbfgs,
  }


SOLVERS = ("hdm_auto()", "osgm_best()", "trial_lbfgs()", "optax.lbfgs()")


def data_free(x):
  """``1/2 sum_i d_i (x_i - 1)^2``, ``d_i = 1 + (i mod 7)``: no data, every vector is the solver's."""
  d = 1 + jax.lax.iota(jnp.int32, x.shape[0]) % 7
  return 0.5 * jnp.sum(d.astype(x.dtype) * jnp.square(x - 1))


def _peak_bytes() -> tuple[int, str]:
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device peak"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS"


def run_one(
  solver: str,
  n: int,
  problem: str,
  calls: int,
  rtol: float,
  repeats: int,
  compiler_options=None,
) -> dict:
  """One solve of ``problem`` (``"sparse"`` or ``"free"``) at n by ``solver``, measured.

  ``compiler_options``: XLA's (for the tests).
  """
  import hdm_optax
  from experiments import problems

  opt = _solvers()[solver]()
  x0 = jnp.zeros(n, jnp.float32)
  if problem == "sparse":
    m = max(int(n * ROWS_PER_PARAM), 1)
    inst = problems.synthetic_logistic(m, n, nnz_per_row=NNZ_PER_ROW)
    fun, fun_args = inst.fun, inst.fun_args
    g0 = float(jnp.max(jnp.abs(jax.grad(fun)(x0, *fun_args))))
    tol = rtol * g0
  else:
    fun, fun_args, tol = data_free, (), 0.0

  def solve(x0, *args):
    return hdm_optax.solve(
      opt, fun, x0, max_steps=calls, max_grad_evals=calls, tol=tol, fun_args=args
    )

  start = time.perf_counter()
  compiled = jax.jit(solve).lower(x0, *fun_args).compile(compiler_options)
  compile_seconds = time.perf_counter() - start
  seconds, outputs = timing.best_times({"solve": lambda: compiled(x0, *fun_args)}, repeats)
  res = outputs["solve"]
  mem = compiled.memory_analysis()
  program = None
  if mem is not None:
    program = (
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      + mem.temp_size_in_bytes
      - mem.alias_size_in_bytes
    )
  peak, peak_kind = _peak_bytes()
  return dict(
    solver=solver,
    n=n,
    problem=problem,
    converged=bool(res.converged),
    grad_calls=int(res.num_grad_evals),
    seconds=seconds["solve"],
    compile_seconds=compile_seconds,
    program_bytes=program,
    peak_bytes=peak,
    peak_kind=peak_kind,
  )


def _child(args: list[str], memory_gib: float | None, timeout: float) -> tuple[dict | None, str]:
  """Runs ``--one`` in a subprocess: (its JSON result, or None and the last error line)."""
  command = [sys.executable, "-m", "experiments.perf.large", "--one", *args]
  if memory_gib:
    command += ["--memory-gib", str(memory_gib)]
  # The whole device for the run: JAX's GPU allocator takes 75 % up front by default.
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
  try:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
  except subprocess.TimeoutExpired:
    return None, f"timed out after {timeout:g} s"
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line), ""
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  error = next((ln for ln in reversed(lines) if "Error" in ln or "RESOURCE" in ln), None)
  return None, (error or (lines[-1] if lines else f"exit status {proc.returncode}"))[-200:]


def ceiling(
  solver: str,
  start: int,
  max_n: int,
  steps: int,
  bisect: int,
  memory_gib: float | None,
  timeout: float,
) -> tuple[int | None, int | None, str]:
  """``(largest n that ran, smallest n that failed, its error)`` for ``solver``.

  n doubles from ``start`` while runs succeed (up to ``max_n``); if ``start``
  fails, n halves instead (at most ``MAX_HALVINGS`` times); then ``bisect``
  halvings of the gap between the two.
  """
  ran, failed, error = None, None, ""

  def attempt(n):
    nonlocal ran, failed, error
    out, err = _child([solver, str(n), "free", str(steps)], memory_gib, timeout)
    print(f"  {solver:<14} n = {n:>13,}: {'ran' if out else 'failed: ' + err}", flush=True)
    if out is None:
      failed, error = n, err
    else:
      ran = n
    return out is not None

  n = start
  if attempt(n):
    while 2 * n <= max_n and attempt(2 * n):
      n *= 2
  else:
    for _ in range(MAX_HALVINGS):
      n //= 2
      if n < 1 or attempt(n):
        break
  for _ in range(bisect if ran and failed else 0):
    attempt((ran + failed) // 2)
  return ran, failed, error


def _gib(b) -> str:
  return "n/a" if b is None else f"{b / 2**30:.3f}"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="1e7")
  p.add_argument("--solvers", default="hdm_auto(),optax.lbfgs()")
  p.add_argument("--calls", type=int, default=1000)
  p.add_argument("--rtol", type=float, default=1e-3)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--ceiling", action="store_true")
  p.add_argument("--start", type=float, default=1e6)
  p.add_argument("--max-n", type=float, default=2**31 - 1)
  p.add_argument("--steps", type=int, default=10, help="updates per ceiling run")
  p.add_argument("--bisect", type=int, default=2)
  p.add_argument("--timeout", type=float, default=600)
  p.add_argument("--memory-gib", type=float, default=None)
  p.add_argument(
    "--one", nargs=4, metavar=("SOLVER", "N", "PROBLEM", "CALLS"), help=argparse.SUPPRESS
  )
  args = p.parse_args(argv)
  protocol.float32_products()
  if args.memory_gib and args.one:
    limit = int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
  if args.one:
    solver, n, problem, calls = args.one
    print(json.dumps(run_one(solver, int(n), problem, int(calls), args.rtol, args.repeats)))
    return
  solvers = args.solvers.split(",")
  unknown = set(solvers) - set(SOLVERS)
  if unknown:
    p.error(f"--solvers: unknown {sorted(unknown)}; choose from {', '.join(SOLVERS)}")
  on_cpu = jax.default_backend() == "cpu"
  memory_gib = args.memory_gib or (2.0 if on_cpu and args.ceiling else None)
  print(f"device: {device_label()}; jax {jax.__version__}; float32")
  if args.ceiling:
    cap = f", each run's data segment capped at {memory_gib:g} GiB" if memory_gib else ""
    print(f"memory ceiling: data-free function, {args.steps} updates per run{cap}")
    rows = []
    for solver in solvers:
      rows.append(
        (
          solver,
          *ceiling(
            solver,
            int(args.start),
            int(args.max_n),
            args.steps,
            args.bisect,
            memory_gib,
            args.timeout,
          ),
        )
      )
    print(f"{'solver':<14} {'largest n that ran':>19} {'smallest n that failed':>23}  error")
    for solver, ran, failed, error in rows:
      shown = "none" if failed is None else f"{failed:,}"
      print(f"{solver:<14} {ran or 0:>19,} {shown:>23}  {error}")
    return
  print(
    f"time to solution: sparse logistic, {NNZ_PER_ROW} nonzeros per row, n/10 rows, "
    f"tol = {args.rtol:g} ||grad f(0)||_inf, {args.calls} calls"
  )
  print(
    f"{'n':>11} {'solver':<14} {'solved':>6} {'calls':>6} {'seconds':>9} "
    f"{'program GiB':>11} {'peak GiB':>9}"
  )
  for n in (int(float(s)) for s in args.sizes.split(",")):
    for solver in solvers:
      out, err = _child(
        [
          solver,
          str(n),
          "sparse",
          str(args.calls),
          "--rtol",
          str(args.rtol),
          "--repeats",
          str(args.repeats),
        ],
        memory_gib,
        args.timeout,
      )
      if out is None:
        print(f"{n:>11,} {solver:<14} failed: {err}", flush=True)
        continue
      print(
        f"{n:>11,} {solver:<14} {str(out['converged']):>6} {out['grad_calls']:>6} "
        f"{out['seconds']:>9.4f} {_gib(out['program_bytes']):>11} "
        f"{_gib(out['peak_bytes']):>9} ({out['peak_kind']})",
        flush=True,
      )


if __name__ == "__main__":
  main()
