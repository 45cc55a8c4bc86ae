"""The one runner of every experiment: ``run(solver, instance) -> rows`` under the protocol.

A solver is a row of the solver registry (:class:`experiments.solvers.Solver`: an optax
transformation run by ``hdm_optax.solve``, an optimistix minimiser, jaxopt, a SciPy baseline)
or a :class:`Grid` (one optax factory over a grid of settings, one vmapped ``hdm_optax.sweep``:
Table 1's rows); an instance is a ``protocol.Instance`` (``experiments.problems.instance``).
Each start of the instance gives one ``protocol.Row`` (each grid point, from the first start,
for a grid), solved by ``protocol.outcome``: the run ends at a point where f and grad f are
finite, f >= the library's unbounded threshold and ``||grad f||_inf <= tol``, with fewer than
``budget - 1`` gradient calls (every call counts: the initial one, probes, line-search steps,
each SciPy call).

The starts of an instance run as one vmapped, compiled program per optax solver; compiled
programs are kept per (solver configuration, objective, shapes), so problems that share an
objective and padded shapes (the LIBSVM ones) share them, and so do solvers of equal
configuration (:func:`program_key`).

:func:`run_suite` runs solvers on the benchmark's suites through :func:`run`, appending one
CSV row per (problem, solver, seed) as it finishes (and flushing it); a re-run skips the rows
already in the file; a problem or solver that raises gives error rows.
"""

from __future__ import annotations

import csv
import dataclasses
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import hdm_optax
from experiments import protocol
from experiments.baselines import quasi_newton
from experiments import bounded as bounded_lib
from experiments import memory
from experiments import solvers as solvers_lib
from experiments.solvers import optx

BUDGET = protocol.BUDGET
TOL = protocol.TOL
Row = protocol.Row
# SciPy runs until the call past the budget stops it (its iteration limit out of the way).
SCIPY_MAX_ITER = 10**6


@dataclasses.dataclass(frozen=True, eq=False)
class Grid:
  """One optax factory over a grid of settings, run as one vmapped ``hdm_optax.sweep``.

  Attributes:
    make: ``make(**point) -> optax.GradientTransformation``, module-level (the compiled
      sweep is cached on it, so problems of the same shapes share it).
    points: the settings, one dict per point.
    names: the algorithm (the row's name) of each point.
    labels: the ``hyperparams`` text of each point.
    calls_per_step: gradient calls per update (the steps are ``(budget - 1) //`` it).
    stop_at_first: stop every point once the first converges (the grid reports only its
      best point, which is then among the converged ones).
  """

  make: Callable
  points: Sequence[dict]
  names: Sequence[str]
  labels: Sequence[str]
  calls_per_step: int = 1
  stop_at_first: bool = False


def run(solver, inst: protocol.Instance, budget: int = BUDGET, starts=None) -> list[Row]:
  """The rows of ``solver`` on ``inst``: one per start (of ``starts``: seeds of ``inst``,
  default all), one per grid point for a :class:`Grid`; ``where`` columns n, dtype, seed set.
  """
  starts = inst.seeds if starts is None else tuple(starts)
  if isinstance(solver, Grid):
    return grid_rows(solver, inst, budget)
  if solver.is_scipy:
    return scipy_rows(solver, inst, budget, starts)
  program = solver.program
  if solver.is_optimistix:
    program = _minimise_jit
  elif solver.is_jaxopt:
    program = _jaxopt_minimise_jit
  if program is not None:
    out, compile_s, run_s = run_optimistix(solver, inst, budget, program)
  else:
    out, compile_s, run_s = run_optax(solver, inst, budget)
  k = len(inst.seeds)
  end = lambda i: _end_status(solver, out, i)
  rows = _rows(out, [solver.name] * k, inst, budget, compile_s / k, run_s / k, end)
  return [r for r in rows if r.seed in starts]


def _rows(out, names, inst, budget, compile_s, run_s, end, labels=None) -> list[Row]:
  """One row per entry of ``out``: the starts of ``inst``, or (with ``labels``) the points
  of a grid, all from its first start."""
  rows = []
  for i, name in enumerate(names):
    value, grad_inf = float(out["value"][i]), float(out["grad_inf"][i])
    calls, start = int(out["grad_calls"][i]), 0 if labels else i
    solved, status = protocol.outcome(value, grad_inf, calls, float(inst.tol[start]), budget)
    if "outside" in out and float(out["outside"][i]) > 0:
      solved, status = False, f"outside the box by {float(out['outside'][i]):.3g}"
    steps = int(out["num_steps"][i]) if "num_steps" in out else None
    trace = {}
    if "trace" in out:
      t = out["trace"]
      cut = lambda a: a[i, : steps + 1]
      trace = dict(trace_grad_calls=cut(t.grad_evals), trace_values=cut(t.value))
      trace.update(trace_grad_inf=cut(t.grad_norm))
    rows.append(
      Row(
        name,
        solved,
        iterations=steps,
        grad_calls=calls,
        value_calls=int(out["value_calls"][i]),
        hyperparams="" if labels is None else labels[i],
        final_value=value,
        final_grad_inf=grad_inf,
        seconds=run_s,
        status=status or end(i),
        compile_seconds=compile_s,
        n=inst.n,
        dtype=inst.dtype,
        seed=inst.seeds[start],
        **trace,
      )
    )
  return rows


def _status_name(code: int) -> str:
  """A name for ``hdm_optax.solve``'s status code (``max_steps`` is the budget here)."""
  try:
    name = hdm_optax.Status(int(code)).name.lower()
  except (AttributeError, ValueError):
    return f"status {int(code)}"
  return "budget" if name == "max_steps" else name


def _end_status(solver, out, i) -> str:
  if "result" in out:  # optimistix
    return f"stopped: {_optimistix_status(out['result'][i])}"
  if "status" in out:
    return _status_name(out["status"][i])
  return "budget" if solver.is_jaxopt else "stopped: maxiter or tol"


def _solve_out(res) -> dict:
  """The outputs of a (batched) ``hdm_optax.SolveResult`` that rows read."""
  return dict(
    grad_calls=res.num_grad_evals,
    value_calls=res.num_value_evals,
    value=res.value,
    grad_inf=res.grad_norm,
    status=res.status,
    num_steps=res.num_steps,
    trace=res.trace,
  )


# ----------------------------------------------------------------------------
# Grids: one vmapped hdm_optax.sweep
# ----------------------------------------------------------------------------


def grid_rows(grid: Grid, inst: protocol.Instance, budget: int) -> list[Row]:
  """One row per grid point from the first start (``seconds``: the whole sweep's)."""
  start = time.perf_counter()
  out = hdm_optax.sweep(
    grid.make,
    list(grid.points),
    inst.fun,
    inst.x0[0],
    max_steps=(budget - 1) // grid.calls_per_step,
    tol=float(inst.tol[0]),
    fun_args=inst.fun_args,
    max_grad_evals=budget,
    stop_at_first_converged=grid.stop_at_first,
    trace=(budget - 1) // grid.calls_per_step + 1,  # the rows keep the whole run
  )
  jax.block_until_ready(out.results.value)
  seconds = time.perf_counter() - start
  out = jax.tree.map(np.asarray, _solve_out(out.results))
  end = lambda i: _status_name(out["status"][i])
  return _rows(out, grid.names, inst, budget, 0.0, seconds, end, grid.labels)


# ----------------------------------------------------------------------------
# optax solvers: the starts of an instance as one vmapped program
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Configured:
  """An optax solver by its configuration: equal configurations share compiled programs.

  For a solver whose expression uses neither ``L`` nor ``F_STAR`` and builds a
  transformation that compares by its configuration (every hdm_optax factory), two rows
  of equal configuration (``'trial_lbfgs'``, ``'trial_lbfgs()'``,
  ``'trial_lbfgs(memory_size=None)'``) are one program.
  """

  transformation: Any
  clip: bool = False

  def make(self, lipschitz, f_star, lower=None, upper=None):
    del lipschitz, f_star, lower, upper
    return self.transformation


def program_key(solver):
  """What the compiled program of an optax ``solver`` is keyed on: its configuration or itself."""
  if solver.needs_lipschitz or solver.needs_f_star or solver.needs_box:
    return solver
  built = solver.make(None, None)
  if getattr(built, "configuration", None) is not None:  # hdm_optax's factories
    return _Configured(built, solver.clip)
  return solver


def _in_box(fun, fun_args, res, box, clip):
  """f, the projected gradient and the distance outside the box at a bounded run's point.

  The point is ``clip(x)`` for the clipping habit, x itself otherwise (a point outside the
  box is reported by its distance, not moved); f and grad f there are evaluated once more,
  uncounted (as SciPy's final point).
  """
  lower, upper = box
  x = jnp.clip(res.params, lower, upper) if clip else res.params
  value, grad = jax.value_and_grad(fun)(x, *fun_args)
  return value, bounded_lib.projected_gradient_inf(x, grad, *box), bounded_lib.outside(x, *box)


def _batched_solve(solver, fun, max_steps, x0, fun_args, lipschitz, f_star, box, tol):
  lower, upper = (None, None) if box is None else box
  run_fun, run_args = fun, fun_args
  if solver.clip:  # the clipping habit: the box enters f, not the method
    run_fun, run_args = bounded_lib.clipped(fun), (lower, upper, *fun_args)

  def one(x, t):
    res = hdm_optax.solve(
      solver.make(lipschitz, f_star, lower, upper),
      run_fun,
      x,
      max_steps=max_steps,
      tol=t,
      fun_args=run_args,
      max_grad_evals=max_steps + 1,
      trace=max_steps + 1,  # the rows keep the whole run
    )
    out = _solve_out(res)
    if box is not None:
      out["value"], out["grad_inf"], out["outside"] = _in_box(fun, fun_args, res, box, solver.clip)
    return out

  if x0.shape[0] == 1:  # one start: the program a user's own solve() call compiles
    return jax.tree.map(lambda a: a[None], one(x0[0], tol[0]))
  return jax.vmap(one)(x0, tol)


_batched_solve_jit = jax.jit(_batched_solve, static_argnums=(0, 1, 2))
_COMPILED: dict = {}
# XLA options of every compile (None: XLA's defaults, which the committed rows use; the tests
# set {"xla_backend_optimization_level": 0} to compile faster).
COMPILE_OPTIONS: Optional[dict] = None


def _signature(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


def _compiled(statics, args, program=_batched_solve_jit):
  """The compiled ``program`` for these static and abstract arguments, and its compile seconds."""
  key = (program,) + statics + (_signature(args),)
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  _COMPILED[key] = program.lower(*statics, *args).compile(COMPILE_OPTIONS)
  return _COMPILED[key], time.perf_counter() - start


def _constants(inst: protocol.Instance):
  """The data, L, f* and the box of ``inst`` as the program's arguments (NaN where not known,
  the box ``None`` for an unbounded problem)."""
  dtype = inst.x0.dtype
  known = lambda v: jnp.asarray(np.nan if v is None else v, dtype)
  box = None
  if inst.lower is not None:
    box = (jnp.asarray(inst.lower, dtype), jnp.asarray(inst.upper, dtype))
  return inst.fun_args, known(inst.lipschitz), known(inst.f_star), box


def run_optax(solver, inst: protocol.Instance, budget: int):
  """Runs every start of ``inst``; returns (outputs as NumPy, compile seconds, run seconds).

  The starts run as one vmapped program; where a transformation cannot be vmapped over the
  problem's operators (``optax.lbfgs``'s line search over the host CSR product raises
  ``NotImplementedError``), one compiled single-start program runs the starts in turn.
  """
  dtype = inst.x0.dtype
  statics = (program_key(solver), inst.fun, budget - 1)
  consts = _constants(inst)
  tol = jnp.asarray(inst.tol, dtype)
  batches = [(inst.x0, tol)]
  try:
    program, compile_seconds = _compiled(statics, (inst.x0, *consts, tol))
  except NotImplementedError:
    batches = [(inst.x0[i : i + 1], tol[i : i + 1]) for i in range(inst.x0.shape[0])]
    program, compile_seconds = _compiled(statics, (batches[0][0], *consts, tol[:1]))
  start = time.perf_counter()
  outs = [jax.block_until_ready(program(x0, *consts, t)) for x0, t in batches]
  seconds = time.perf_counter() - start
  out = jax.tree.map(lambda *a: np.concatenate([np.asarray(x) for x in a]), *outs)
  return out, compile_seconds, seconds


# ----------------------------------------------------------------------------
# optimistix and jaxopt: one compiled single-start program, the starts in turn
# ----------------------------------------------------------------------------


def _minimise(solver, fun, budget, x0, fun_args, lipschitz, f_star, box, tol):
  """One optimistix run from ``x0`` under the protocol (:class:`solvers.GradientStop`).

  Each step of optimistix's quasi-Newton minimisers evaluates f once (``jax.linearize``,
  the gradient by its transpose where the line search accepts), so ``budget`` steps make at
  most ``budget`` calls; each call is counted by ``solvers.COUNTER`` as the program runs.
  The reported point is the last accepted one, with f and grad f as the minimiser computed
  them there.
  """
  del box
  minimiser = solvers_lib.GradientStop(solver.make(lipschitz, f_star), tol)
  fn = solvers_lib.COUNTER.counted(fun)
  sol = optx.minimise(fn, minimiser, x0, fun_args, max_steps=budget, throw=False)
  f_info = sol.state.f_info
  return dict(
    value=f_info.f,
    grad_inf=optax.tree.norm(f_info.grad, ord=jnp.inf),
    num_steps=sol.stats["num_steps"],
    result=solvers_lib.result_code(sol.result),
  )


_minimise_jit = jax.jit(_minimise, static_argnums=(0, 1, 2))


def _jaxopt_minimise(solver, fun, budget, x0, fun_args, lipschitz, f_star, box, tol):
  """One jaxopt run from ``x0``: its ``update`` until ``||grad f||_inf <= tol`` or the budget.

  The gradient is the one jaxopt's state holds at its iterate; the loop stops once jaxopt's
  own count of evaluations reaches ``budget`` (a line search may end past it); the calls
  reported are ``solvers.COUNTER``'s, every evaluation the program made, line searches included.
  """
  del box
  minimiser = solver.make(lipschitz, f_star)(solvers_lib.COUNTER.counted(fun))
  state = minimiser.init_state(x0, fun_args)
  grad_inf = lambda s: optax.tree.norm(s.grad, ord=jnp.inf)

  def cond(carry):
    _, s = carry
    return (grad_inf(s) > tol) & (s.num_fun_eval < budget) & (s.iter_num < budget)

  def body(carry):
    return tuple(minimiser.update(*carry, fun_args))

  _, state = jax.lax.while_loop(cond, body, (x0, state))
  return dict(value=state.value, grad_inf=grad_inf(state))


_jaxopt_minimise_jit = jax.jit(_jaxopt_minimise, static_argnums=(0, 1, 2))


def run_optimistix(solver, inst: protocol.Instance, budget: int, program=_minimise_jit):
  """Runs the starts of ``inst`` in turn through one compiled single-start ``program``.

  Returns (outputs as NumPy, compile seconds, run seconds); ``grad_calls`` (and
  ``value_calls``) are counted by the host where the program does not return them.
  """
  statics = (solver, inst.fun, budget)
  consts = _constants(inst)
  tol = jnp.asarray(inst.tol, inst.x0.dtype)
  program, compile_seconds = _compiled(statics, (inst.x0[0], *consts, tol[0]), program)
  outs, seconds = [], 0.0
  for x0, t in zip(inst.x0, tol):
    solvers_lib.COUNTER.calls = 0
    start = time.perf_counter()
    out = jax.block_until_ready(program(x0, *consts, t))
    jax.effects_barrier()
    seconds += time.perf_counter() - start
    out = {k: np.asarray(v) for k, v in out.items()}
    out.setdefault("grad_calls", np.asarray(solvers_lib.COUNTER.calls))
    out.setdefault("value_calls", out["grad_calls"])
    outs.append(out)
  out = jax.tree.map(lambda *a: np.stack(a), *outs)
  return out, compile_seconds, seconds


def _optimistix_status(code) -> str:
  names = solvers_lib.RESULT_NAMES
  name = names[int(code)] if int(code) < len(names) else f"result {int(code)}"
  return "budget" if name in ("max_steps_reached", "nonlinear_max_steps_reached") else name


# ----------------------------------------------------------------------------
# SciPy
# ----------------------------------------------------------------------------


def scipy_rows(solver, inst: protocol.Instance, budget: int, starts) -> list[Row]:
  """SciPy (``experiments.baselines.quasi_newton``) from each start of ``starts``.

  The benchmark stops a run at the call past ``budget``; a solver with ``scipy_paper`` runs
  as Table 1 (the paper): to SciPy's ``maxiter`` of ``budget - 1`` iterations, one BLAS
  thread. A bounded instance gives SciPy its box (cut to ``x0_np``'s variables).
  """
  box = None
  if inst.lower is not None:
    cut = inst.x0_np.shape[1]
    box = inst.lower[:cut], inst.upper[:cut]
  options = dict(blas_threads=None, stop_at_budget=True, maxiter=SCIPY_MAX_ITER)
  if solver.scipy_paper:
    options = dict(blas_threads=1, stop_at_budget=False, maxiter=budget - 1)
  rows = []
  for seed in starts:
    i = inst.seeds.index(seed)
    row = quasi_newton.run_baseline(
      inst.fun_np,
      inst.x0_np[i],
      solver.scipy_algorithm,
      float(inst.tol[i]),
      budget=budget,
      bounds=box,
      **options,
    )
    where = dict(n=inst.n, dtype=inst.dtype, seed=seed)
    rows.append(dataclasses.replace(row, algorithm=solver.name, **where))
  return rows


# ----------------------------------------------------------------------------
# Suites: one CSV row per (problem, solver, seed), appended as they finish, resumed
# ----------------------------------------------------------------------------

# The CSV's columns, and the Row attribute of each where the names differ.
FIELDS = (
  "suite",
  "problem",
  "n",
  "dtype",
  "solver",
  "seed",
  "solved",
  "grad_calls",
  "value_calls",
  "final_value",
  "final_grad_inf",
  "status",
  "compile_seconds",
  "run_seconds",
)
ATTRIBUTES = {"solver": "algorithm", "run_seconds": "seconds"}


def cells(row: Row) -> list[str]:
  """The CSV cells of ``row`` in ``FIELDS`` order."""

  def cell(v):
    if v is None:
      return ""
    if isinstance(v, bool):
      return str(int(v))
    if isinstance(v, float):
      return repr(v)
    return str(v)

  values = [getattr(row, ATTRIBUTES.get(f, f)) for f in FIELDS]
  return [f"{v:.4f}" if f.endswith("seconds") else cell(v) for f, v in zip(FIELDS, values)]


# ----------------------------------------------------------------------------
# The run: CSV, resume, errors, progress
# ----------------------------------------------------------------------------


def _seed_cell(seed) -> str:
  return "" if seed is None else str(seed)


def done_keys(path: Path) -> set:
  """(suite, problem, solver, seed) of the rows already in the CSV (an ``env_error`` row is
  not done: a re-run retries it, and the summary reads the newer row)."""
  if not path.exists():
    return set()
  with open(path, newline="") as f:
    return {
      (r["suite"], r["problem"], r["solver"], r["seed"])
      for r in csv.DictReader(f)
      if not r["status"].startswith(ENV_ERROR)
    }


def merge(parts: Sequence[Path], csv_path: Path) -> int:
  """Appends the rows of the CSVs ``parts`` not yet in ``csv_path``; returns rows appended."""
  done = done_keys(Path(csv_path))
  log = CsvLog(csv_path)
  written = 0
  try:
    for part in parts:
      if not Path(part).exists():
        continue
      with open(part, newline="") as f:
        for r in csv.DictReader(f):
          key = (r["suite"], r["problem"], r["solver"], r["seed"])
          if key not in done:
            done.add(key)
            log.write_cells([r[name] for name in FIELDS])
            written += 1
  finally:
    log.close()
  return written


# Errors of the machine, not of the run: a GPU that another process holds ("Unable to
# initialize backend 'cuda'"), memory taken by other processes (RESOURCE_EXHAUSTED).
ENV_ERRORS = ("Unable to initialize backend", "RESOURCE_EXHAUSTED", "CUDA_ERROR_OUT_OF_MEMORY")
ENV_ERROR = "env_error"


def _where(task, inst, seed) -> dict:
  return dict(suite=task.suite, problem=task.name, n=inst.n, dtype=inst.dtype, seed=seed)


def _error(task, solver_name, seed, exc, n=None, dtype="") -> Row:
  """An error row: ``env_error: ...`` where the machine failed (:data:`ENV_ERRORS`; the
  summary names these apart and a re-run retries them), ``error: ...`` otherwise."""
  message = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
  kind = ENV_ERROR if any(e in message for e in ENV_ERRORS) else "error"
  where = dict(suite=task.suite, problem=task.name, n=n, dtype=dtype, seed=seed)
  return Row(solver_name, status=f"{kind}: {message}", **where)


class CsvLog:
  """Appends rows to the CSV (header first if the file is new) and flushes each one."""

  def __init__(self, path: Path):
    self.path = Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    new = not self.path.exists() or self.path.stat().st_size == 0
    self._file = open(self.path, "a", newline="")
    self._writer = csv.writer(self._file)
    if new:
      self._writer.writerow(FIELDS)
      self._file.flush()

  def write_cells(self, cells: Sequence[str]):
    self._writer.writerow(cells)
    self._file.flush()

  def write(self, rows: Sequence[Row]):
    for row in rows:
      self._writer.writerow(cells(row))
    self._file.flush()

  def close(self):
    self._file.close()


def run_suite(
  tasks: Sequence,
  solvers: Sequence[solvers_lib.Solver],
  csv_path: Path,
  *,
  budget: int = BUDGET,
  scipy_seeds: Optional[int] = None,
  progress: bool = True,
  desc: str = "",
  also_done: Sequence[Path] = (),
) -> int:
  """Runs every solver on every task (``benchmark.suites.Task``), appending rows to
  ``csv_path``; returns rows written.

  ``scipy_seeds`` limits the SciPy rows to the first seeds of each problem (None: all).
  Rows present in ``csv_path`` or in the CSVs of ``also_done`` are skipped.
  """
  done = done_keys(Path(csv_path)).union(*(done_keys(Path(p)) for p in also_done))
  log = CsvLog(csv_path)
  written = 0
  bar = tqdm(total=len(tasks) * len(solvers), desc=desc, disable=not progress, mininterval=5)
  try:
    for task in tasks:
      todo = []
      for solver in solvers:
        seeds = task.seeds
        if solver.is_scipy and scipy_seeds is not None and seeds != (None,):
          seeds = seeds[:scipy_seeds]
        missing = [
          s for s in seeds if (task.suite, task.name, solver.name, _seed_cell(s)) not in done
        ]
        if missing:
          todo.append((solver, missing))
        else:
          bar.update(1)
      if not todo:
        continue
      bar.set_postfix_str(task.name)
      try:
        inst = task.build()
      except Exception as exc:  # the run goes on: error rows
        traceback.print_exc()
        rows = [_error(task, s.name, seed, exc) for s, seeds in todo for seed in seeds]
        log.write(rows)
        written += len(rows)
        bar.update(len(todo))
        continue
      for solver, missing in todo:
        bar.set_postfix_str(f"{task.name} {solver.name}")
        if (
          (solver.needs_lipschitz and inst.lipschitz is None)
          or (solver.needs_f_star and inst.f_star is None)
          or not solver.runs_on(inst.lower is not None)
        ):
          bar.update(1)
          continue
        if solver.max_n is not None and inst.n > solver.max_n:
          reason = f"skipped: n = {inst.n} > {solver.max_n}"
          rows = [Row(solver.name, status=reason, **_where(task, inst, seed)) for seed in missing]
          log.write(rows)
          written += len(rows)
          bar.update(1)
          continue
        try:
          rows = run(solver, inst, budget, missing)
          rows = [dataclasses.replace(r, suite=task.suite, problem=task.name) for r in rows]
        except Exception as exc:
          traceback.print_exc()
          rows = [_error(task, solver.name, seed, exc, inst.n, inst.dtype) for seed in missing]
        log.write(rows)
        written += len(rows)
        bar.update(1)
      # The CUTEst suite compiles 66 objectives x 7 solvers, none shared: without this the
      # process runs out of memory maps (a segmentation fault) after about 50 problems.
      memory.release_compiled_programs(also=_COMPILED.clear)
  finally:
    bar.close()
    log.close()
  return written
