"""Variants of trial_lbfgs's step control and H0, all in one compiled program per problem.

    python -m experiments.stepctl_research --suite cutest cutest_hard --variants base ext ...

A variant is a point of :data:`KNOBS` (traced scalars), so every variant of a problem runs in one
vmapped ``hdm_optax.solve`` under the benchmark's protocol (1000 gradient calls, ``||grad
f||_inf <= 1e-4``, every call counted). Rows go to a CSV (problem, variant, solved, calls).
Only the dev lists (``cutest``, ``cutest_hard``, ``user``) are run.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import memory, protocol
from experiments.benchmark import suites as suites_lib
from hdm_optax import _common
from hdm_optax.methods import secant as secant_lib
from hdm_optax.methods._trial_lbfgs import _RESOLUTION as RESOLUTION

# Knobs of a variant: name -> default (the committed trial_lbfgs()).
KNOBS = dict(
  ext=0.0,  # 1: alpha may grow past 1 while the accepted trial's slope is steep
  ext_c=0.9,  # steep: <g+, s> < ext_c <g, s>
  ext_grow=1.5,  # factor of alpha while steep
  amax=1e6,
  keep_high=0.0,  # 1: an accepted, not steep step keeps alpha > 1 (else min(1, grow alpha))
  null=0.0,  # after a null step: 0 x shrink, 1 cubic, 2 quadratic (f, f+, <g, s>), 3 cubic/secant
  lo=0.1,
  hi=0.5,
  shrink=0.5,
  gamma=0.0,  # 0 newest accepted kept pair, 1 newest kept pair, 2 damped pairs (Powell)
  diag=0.0,  # 1: H0 = gamma D, D Gilbert-Lemarechal's diagonal from the pairs
  acc_interp=0.0,  # 1: an accepted step with <g+, s> > 0 scales alpha by the cubic/secant ratio
  grow=1.5,  # factor of alpha after an accepted step (up to 1)
  ext_secant=0.0,  # 1: while steep, alpha *= clip(secant t*, ext_grow, ext_max) (ext_max if concave)
  ext_max=4.0,
  high_secant=0.0,  # 1: an accepted step with alpha > 1 and <g+, s> > 0 scales alpha by max(t*, lo)
  pair_check=0.0,  # r > 0: a rejected trial's pair is kept only if cubic t / secant t is in [1/r, r]
  restart_keep=0.0,  # 1: a memory restart leaves alpha >= 1 (max(1, alpha)) instead of 1
  trust=0.0,  # 1: a null step whose pair has positive curvature leaves alpha (the pair corrects H)
)
VARIANTS = {
  "base": {},
  "ext": dict(ext=1.0),
  "ext_keep": dict(ext=1.0, keep_high=1.0),
  "cubic": dict(null=1.0),
  "quad": dict(null=2.0),
  "cubicsec": dict(null=3.0),
  "ext_cubic": dict(ext=1.0, null=1.0),
  "ext_cubicsec": dict(ext=1.0, null=3.0),
  "gamma_any": dict(gamma=1.0),
  "damped": dict(gamma=2.0),
  "ext_damped": dict(ext=1.0, gamma=2.0),
  "diag": dict(diag=1.0),
  "ext_diag": dict(ext=1.0, diag=1.0),
}


class Knobs(NamedTuple):
  values: jax.Array  # (len(KNOBS),)

  def __getattr__(self, name):
    return self.values[list(KNOBS).index(name)]


def knob_vector(overrides) -> np.ndarray:
  return np.array([overrides.get(k, v) for k, v in KNOBS.items()], np.float64)


class State(NamedTuple):
  count: Any
  memory: Any
  gamma: Any
  diag: Any
  step_size: Any
  value: Any
  grad: Any
  info: Any


def two_loop_diag(memory, gamma, diag, vector):
  """secant_lib.two_loop with H0 = gamma diag(d) (a research copy)."""
  size = memory.rho.shape[0]
  at = lambda stacked, i: jax.tree.map(lambda a: a[i], stacked)

  def first(k, carry):
    q, alphas = carry
    i = (memory.head - 1 - k.astype(jnp.int32)) % size
    a = memory.rho[i] * optax.tree.vdot(at(memory.s, i), q)
    return optax.tree.add_scale(q, -a, at(memory.y, i)), alphas.at[i].set(a)

  q, alphas = jax.lax.fori_loop(0, size, first, (vector, jnp.zeros([size], memory.rho.dtype)))
  r = optax.tree.scale(gamma, optax.tree.mul(diag, q))

  def second(k, r):
    i = (memory.head + k.astype(jnp.int32)) % size
    b = memory.rho[i] * optax.tree.vdot(at(memory.y, i), r)
    return optax.tree.add_scale(r, alphas[i] - b, at(memory.s, i))

  return jax.lax.fori_loop(0, size, second, r)


def cubic_min(value, trial_value, slope, trial_slope):
  """The minimiser in t of the cubic through (0, f, d0), (1, f+, d1); nan if none."""
  d1 = slope + trial_slope - 3 * (trial_value - value)
  disc = d1 * d1 - slope * trial_slope
  d2 = jnp.sqrt(jnp.maximum(disc, 0))
  t = 1 - (trial_slope + d2 - d1) / (trial_slope - slope + 2 * d2)
  return jnp.where((disc >= 0) & jnp.isfinite(t), t, jnp.nan)


def quad_min(value, trial_value, slope):
  curv = trial_value - value - slope
  return jnp.where(curv > 0, -slope / (2 * curv), jnp.nan)


def agrees(k, value, trial_value, slope, trial_slope):
  """Whether the secant's minimiser along s and the cubic's agree within a factor pair_check."""
  secant_t = slope / (slope - trial_slope)
  ratio = cubic_min(value, trial_value, slope, trial_slope) / secant_t
  ok = (trial_slope > slope) & (ratio >= 1 / k.pair_check) & (ratio <= k.pair_check)
  return ok & jnp.isfinite(ratio)


def step_control(k, alpha, *, value, trial_value, slope, trial_slope, finite, accepted, restart):
  """The research step control (see KNOBS)."""
  steep = trial_slope < k.ext_c * slope
  grow_capped = jnp.minimum(1, k.grow * alpha)
  high = jnp.where(k.keep_high > 0, jnp.maximum(alpha, grow_capped), grow_capped)
  secant_t = slope / (slope - trial_slope)
  ext_factor = jnp.where(trial_slope > slope, jnp.clip(secant_t, k.ext_grow, k.ext_max), k.ext_max)
  ext_factor = jnp.where(k.ext_secant > 0, ext_factor, k.ext_grow)
  ext = jnp.minimum(k.amax, alpha * ext_factor)
  high = jnp.where(
    (k.high_secant > 0) & (alpha > 1) & (trial_slope > 0),
    jnp.maximum(1, alpha * jnp.clip(secant_t, k.lo, 1)),
    high,
  )
  on_accept = jnp.where((k.ext > 0) & steep, ext, high)
  cubic_t = cubic_min(value, trial_value, slope, trial_slope)
  secant_ok = (trial_slope > slope) & jnp.isfinite(secant_t)
  ratio = jnp.where(secant_ok, cubic_t / secant_t, jnp.nan)
  # accepted but overshot (<g+, s> > 0): the cubic's minimiser relative to the secant's.
  acc_ratio = jnp.clip(jnp.where(jnp.isnan(ratio), 1, ratio), 0.5, 1.0)
  on_accept = jnp.where((k.acc_interp > 0) & (trial_slope > 0), alpha * acc_ratio, on_accept)
  t = jnp.where(
    k.null == 1,
    cubic_t,
    jnp.where(k.null == 2, quad_min(value, trial_value, slope), jnp.where(k.null == 3, ratio, 0)),
  )
  t = jnp.where(jnp.isfinite(t), jnp.clip(t, k.lo, k.hi), k.shrink)
  t = jnp.where(k.null == 0, k.shrink, t)
  t = jnp.where((k.trust > 0) & (trial_slope > slope), 1, t)
  # a refused pair (pair_check): H does not know the trial; the cubic's own t, safeguarded
  refused = (k.pair_check > 0) & ~agrees(k, value, trial_value, slope, trial_slope)
  own = jnp.where(jnp.isfinite(cubic_t), jnp.clip(cubic_t, k.lo, k.hi), k.shrink)
  t = jnp.where(refused, own, t)
  on_null = alpha * jnp.where(finite, t, k.shrink)
  alpha = jnp.where(accepted, on_accept, on_null)
  return jnp.where(restart, jnp.where(k.restart_keep > 0, jnp.maximum(1, alpha), 1), alpha)


def gilbert_lemarechal(diag, s, y, keep):
  """The diagonal BFGS update of D (inverse Hessian diagonal), M1QN3's DIS with scaling."""
  sy = optax.tree.vdot(s, y)
  ydy = optax.tree.vdot(y, optax.tree.mul(diag, y))
  sdinvs = optax.tree.vdot(s, optax.tree.div(s, diag))

  def leaf(d, si, yi):
    inv = ydy / (sy * d) + yi * yi / sy - ydy * si * si / (sy * sdinvs * d * d)
    new = 1 / inv
    ok = keep & jnp.isfinite(new) & (new > 0)
    return jnp.where(ok, new, d)

  new = jax.tree.map(leaf, diag, s, y)
  # normalise: gamma carries the scale (mean of D = 1), D the relative scaling
  mean = optax.tree.sum(new) / sum(x.size for x in jax.tree.leaves(new))
  return optax.tree.scale(1 / mean, new)


def research_lbfgs(knobs: Knobs, memory_size: int = 10):
  acceptance = secant_lib.curvature_checked()
  k = knobs

  def init_fn(params):
    dtype = _common.params_dtype(params)
    return State(
      **_common.oracle_fields(params, dtype),
      memory=secant_lib.secant_memory(params, memory_size),
      gamma=jnp.zeros([], dtype),
      diag=optax.tree.ones_like(params),
      step_size=jnp.ones([], dtype),
    )

  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra):
    dtype = state.value.dtype
    direction = grad if updates is None else updates
    grad_norm = optax.tree.norm(direction)
    first_gamma = jnp.minimum(1, _common.safe_div(jnp.ones([], dtype), grad_norm))
    first_gamma = jnp.where(grad_norm > 0, first_gamma, 1).astype(dtype)
    gamma = jnp.where(state.gamma > 0, state.gamma, first_gamma)
    diag = jax.tree.map(lambda d: jnp.where(k.diag > 0, d, 1), state.diag)
    step = optax.tree.scale(-state.step_size, two_loop_diag(state.memory, gamma, diag, direction))
    trial_value, trial_grad = _common.value_and_grad(value_fn, optax.tree.add(params, step))
    change = optax.tree.sub(trial_grad, grad)
    sy = optax.tree.vdot(step, change)
    finite = jnp.isfinite(trial_value) & jnp.isfinite(sy) & _common.all_finite(trial_grad)
    accepted = finite & acceptance.accept(trial_value, value, trial_grad, grad, step=step)
    step_norm, change_norm = optax.tree.norm(step), optax.tree.norm(change)
    # Powell damping with B0 = I / gamma (gamma=2)
    sbs = optax.tree.vdot(step, step) / gamma
    theta = jnp.where(sy >= 0.2 * sbs, 1.0, 0.8 * sbs / (sbs - sy))
    damped = (k.gamma == 2) & finite & (sbs > 0)
    y_used = jax.tree.map(
      lambda yy, ss: jnp.where(damped, theta * yy + (1 - theta) * ss / gamma, yy), change, step
    )
    sy_used = optax.tree.vdot(step, y_used)
    yn_used = optax.tree.norm(y_used)
    keep = finite & (sy_used > 1e-10 * step_norm * yn_used)
    safe = lambda tree: optax.tree.where(finite, tree, optax.tree.zeros_like(tree))
    lost = finite & ((step_norm <= RESOLUTION * optax.tree.norm(params)) | (change_norm == 0))
    keep = keep & ~lost
    slope = optax.tree.vdot(grad, step)
    trial_slope = optax.tree.vdot(trial_grad, step)
    checked = accepted | (k.pair_check <= 0) | agrees(k, value, trial_value, slope, trial_slope)
    keep = keep & checked
    memory = secant_lib.secant_record(state.memory, safe(step), safe(y_used), keep)
    memory = secant_lib.reset(memory, lost)
    yy = optax.tree.vdot(y_used, y_used)
    gamma_pair = _common.safe_div(sy_used, yy)
    gamma_when = jnp.where(k.gamma == 0, keep & accepted, keep)
    new_gamma = jnp.where(gamma_when, gamma_pair, state.gamma)
    new_gamma = jnp.where(lost, 0, new_gamma)
    new_diag = gilbert_lemarechal(state.diag, safe(step), safe(y_used), keep)
    new_diag = jax.tree.map(lambda d: jnp.where(lost, 1, d), new_diag)
    step_size = step_control(
      k,
      state.step_size,
      value=value,
      trial_value=trial_value,
      slope=slope,
      trial_slope=trial_slope,
      finite=finite,
      accepted=accepted,
      restart=lost,
    )
    new_state = State(
      count=state.count + 1,
      memory=memory,
      gamma=new_gamma.astype(dtype),
      diag=new_diag,
      step_size=step_size.astype(dtype),
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      info=_common.next_info(
        state.info, accepted=accepted, hypergrad_norm=jnp.zeros([], dtype), calls=1
      ),
    )
    return _common.keep_if(accepted, step, optax.tree.zeros_like(params)), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _run(fun, knobs, x0, fun_args, tol, clip):
  import hdm_optax

  def one(kv):
    opt = research_lbfgs(Knobs(kv))
    if clip is not None:
      opt = optax.chain(optax.clip_by_global_norm(clip), opt)
    res = hdm_optax.solve(
      opt,
      fun,
      x0,
      max_steps=protocol.BUDGET - 1,
      tol=tol,
      fun_args=fun_args,
      max_grad_evals=protocol.BUDGET,
    )
    return res.num_grad_evals, res.value, res.grad_norm, res.status

  return jax.lax.map(one, knobs)


_run_jit = jax.jit(_run, static_argnums=(0, 5))


def run_task(task, knobs, clip=None):
  inst = task.build()
  tol = jnp.asarray(inst.tol[0], inst.x0.dtype)
  calls, value, gnorm, status = _run_jit(
    inst.fun, jnp.asarray(knobs, inst.x0.dtype), inst.x0[0], inst.fun_args, tol, clip
  )
  out = []
  for i in range(knobs.shape[0]):
    solved, _ = protocol.outcome(
      float(value[i]), float(gnorm[i]), int(calls[i]), float(inst.tol[0]), protocol.BUDGET
    )
    out.append((bool(solved), int(calls[i]), float(value[i]), float(gnorm[i])))
  return out


QUARTIC_N = 20


def quartics():
  """20-variable quartics whose gradient norm at the start exceeds 1 (a clip of 1 is active)."""
  i = jnp.arange(1.0, QUARTIC_N + 1)
  ones = np.ones(QUARTIC_N)
  return {
    "quartic-sqrt-i": (lambda x: jnp.sum((x**2 - i) ** 2), 0.5 * ones),
    "quartic-weighted": (lambda x: jnp.sum((i * (x - 1)) ** 4) / QUARTIC_N, 0 * ones),
    "quartic-chain": (
      lambda x: jnp.sum((x**2 - 1) ** 2) + jnp.sum((x[1:] - x[:-1]) ** 2),
      3 * ones,
    ),
  }


def special_tasks():
  """Rosenbrock-10 under x -> f(D x) from its start / D, and the quartics alone and clipped."""
  d = suites_lib.hard_scaling(10)
  x0 = np.tile([-1.2, 1.0], 5)
  fun = lambda y, scale: suites_lib.rosenbrock(scale * y)
  tasks = [
    (
      suites_lib.Task(
        "special",
        "rosenbrock-10@D",
        (None,),
        lambda: suites_lib._instance(fun, (jnp.asarray(d),), x0 / d, protocol.TOL),
      ),
      None,
    ),
    (
      suites_lib.Task(
        "special",
        "rosenbrock-10",
        (None,),
        lambda: suites_lib._instance(suites_lib.rosenbrock, (), x0, protocol.TOL),
      ),
      None,
    ),
  ]
  for name, (f, start) in quartics().items():
    build = lambda f=f, start=start: suites_lib._instance(f, (), start, protocol.TOL)
    tasks.append((suites_lib.Task("special", name, (None,), build), None))
    tasks.append((suites_lib.Task("special", name + "+clip1", (None,), build), 1.0))
  return tasks


def main(argv=None):
  protocol.enable_float64()
  p = argparse.ArgumentParser()
  p.add_argument("--suite", nargs="+", default=["cutest"])
  p.add_argument("--variants", nargs="+", default=["base"])
  p.add_argument("--set", nargs="*", default=[], help="NAME:k=v,k=v extra variants")
  p.add_argument("--problems", nargs="+", default=None)
  p.add_argument("--csv", default="/tmp/stepctl/research.csv")
  args = p.parse_args(argv)
  variants = {v: VARIANTS[v] for v in args.variants}
  for spec in args.set:
    name, _, body = spec.partition(":")
    variants[name] = {kv.split("=")[0]: float(kv.split("=")[1]) for kv in body.split(",") if kv}
  knobs = np.stack([knob_vector(v) for v in variants.values()])
  path = Path(args.csv)
  path.parent.mkdir(parents=True, exist_ok=True)
  new = not path.exists()
  with open(path, "a", newline="") as f:
    w = csv.writer(f)
    if new:
      w.writerow(["suite", "problem", "variant", "solved", "calls", "value", "grad_inf"])
    for suite in args.suite:
      if suite == "special":
        tasks = special_tasks()
      else:
        tasks = [
          (t, None) for t in suites_lib.tasks(suite, tol=protocol.TOL, problems=args.problems)
        ]
      for task, clip in tasks:
        start = time.perf_counter()
        try:
          rows = run_task(task, knobs, clip)
        except Exception as e:  # noqa: BLE001
          print(task.name, "error", e, file=sys.stderr)
          continue
        for name, r in zip(variants, rows):
          w.writerow([suite, task.name, name, int(r[0]), r[1], r[2], r[3]])
        f.flush()
        print(
          f"{task.name} {time.perf_counter() - start:.1f}s "
          + " ".join(f"{n}:{r[1] if r[0] else 'x'}" for n, r in zip(variants, rows)),
          flush=True,
        )
        memory.release_compiled_programs()


if __name__ == "__main__":
  main()
