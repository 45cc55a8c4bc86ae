"""Variants of trial_lbfgs's step control, each a configuration of the library's pieces.

    python -m experiments.stepctl_research --suite cutest cutest_hard special \\
        --variants design former ext ... [--set NAME:base=former,grow=2,...] [--problems ...]

A variant is ``hdm_optax.trial_lbfgs(..., step_control=...)``: the secant direction
(``pieces.directions.secant``, with its pair rule ``agree``), ``curvature_checked`` and a step
control, either the design (``pieces.step_control.evidence_step`` and its knobs) or the
former rule (``capped_step``) with the research controls below wrapped around it. Each runs
as a benchmark row (``experiments.runner.run``: 1000 gradient calls, ``||grad f||_inf <=
1e-4``, every call counted), so ``design`` reproduces the ``trial_lbfgs()`` rows before its
diagonal H_0; rows go to a CSV in the benchmark's columns (``--csv``). Only the dev lists (``cutest``,
``cutest_hard``, ``cutest_scale_dev``, ``user``) and ``special`` (:func:`special_tasks`) are
run. Variants of the direction's ``H_0`` (``docs/secant.md``, "A diagonal H_0"): ``diag0``,
``diag3``, ``diag6``, the pairs' diagonal (``pieces.secant.pairs_diagonal``) at every n with
gate 1, 1e3, 1e6; ``hdm``, ``hdm_lr2``, ``hdm_gate3``, HDM's learned diagonal
(:func:`learned_diagonal`). ``design`` is ``trial_lbfgs(diagonal=None)``, the rows before it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hdm_optax
from experiments import problems, protocol
from experiments.benchmark import runner as suite_runner
from experiments.benchmark import solvers as solvers_lib
from experiments.benchmark import suites as suites_lib
from hdm_optax import _common
from hdm_optax.pieces import acceptance, candidates, directions, learners, secant, shell
from hdm_optax.pieces import step_control


def quadratic_step(value, trial_value, slope, trial_slope):
  """The minimiser in t of the quadratic through f, f+ and the slope d0 along s; NaN if none."""
  del trial_slope
  curvature = trial_value - value - slope
  return jnp.where(curvature > 0, -slope / jnp.where(curvature > 0, 2 * curvature, 1), jnp.nan)


def steep_extrapolation(inner, grow=1.5, steep=0.9, max_step=1e6) -> shell.StepControl:
  """``inner``, but alpha x ``grow`` (up to ``max_step``) after an accepted trial whose slope
  along s is still steep, ``<g+, s> < steep <g, s>`` (docs/secant.md's (a))."""

  def update(alpha, trial, *, accepted, learned, ctx):
    slope, trial_slope = step_control.slopes(trial, ctx)
    new = inner.update(alpha, trial, accepted=accepted, learned=learned, ctx=ctx)
    steep_still = accepted & (trial_slope < steep * slope) & ~learned.restart
    return jnp.where(steep_still, jnp.minimum(max_step, alpha * grow), new).astype(alpha.dtype)

  return inner._replace(update=update)


def fixed_direction_interpolation(inner, model, bracket=(0.1, 0.5), shrink=0.5):
  """``inner``, but after a finite rejected trial alpha x the minimiser t of ``model`` along s
  (``step_control.cubic_step`` or :func:`quadratic_step`), clipped to ``bracket`` (``shrink``
  where there is none), as if the direction were fixed (docs/secant.md's (b))."""
  lo, hi = bracket

  def update(alpha, trial, *, accepted, learned, ctx):
    slope, trial_slope = step_control.slopes(trial, ctx)
    t = model(ctx.value, trial.value, slope, trial_slope)
    t = jnp.where(jnp.isfinite(t), jnp.clip(t, lo, hi), shrink)
    new = inner.update(alpha, trial, accepted=accepted, learned=learned, ctx=ctx)
    interpolated = ~accepted & trial.finite & ~learned.restart
    return jnp.where(interpolated, alpha * t, new).astype(alpha.dtype)

  return inner._replace(update=update)


def design(
  agree=3.0,
  memory_size=10,
  pair_tol=1e-10,
  shrink=0.5,
  steep=0.9,
  extrapolate=4.0,
  max_step=1e6,
  lo=0.1,
  hi=0.5,
  gate=0.0,
  bound=1e12,
):
  """``trial_lbfgs()`` with ``evidence_step``'s knobs (the defaults: the committed one); with
  ``gate`` > 0, :math:`H_0` the pairs' diagonal where its spread exceeds ``gate``
  (``pieces.secant.pairs_diagonal``, clipped to ``[gamma / bound, gamma bound]``)."""
  control = step_control.evidence_step(shrink, steep, extrapolate, max_step, (lo, hi), agree)
  memory_size = int(memory_size)
  if not gate:
    return hdm_optax.trial_lbfgs(
      memory_size, pair_tol=pair_tol, agree=agree, step_control=control, diagonal=None
    )
  diagonal = secant.pairs_diagonal(gate, bound)
  direction = directions.secant(memory_size, pair_tol=pair_tol, agree=agree, diagonal=diagonal)
  return shell.iteration(
    "trial_lbfgs", direction, acceptance=acceptance.curvature_checked(), step_control=control
  )


def _gamma(state, ctx):
  """The secant direction's scalar H_0 for this update (its first value before a pair)."""
  norm = optax.tree.norm(ctx.updates)
  first = jnp.where(norm > 0, jnp.minimum(1, 1 / jnp.where(norm > 0, norm, 1)), 1)
  return jnp.where(state.gamma > 0, state.gamma, first.astype(state.gamma.dtype))


def learned_diagonal(memory_size=10, lr=0.5, gate=0.0, agree=3.0):
  """The secant direction with H_0 = gamma diag(p), p learned online by HDM's hypergradient.

  Algorithm 1's feedback for the trial x+ = x - alpha H_m(gamma diag(p)) u: the gradient in p
  of h(p) = (f(x+) - f(x)) / ||g||^2, ``<grad f(x+), d x+ / d p>`` (a VJP through the
  two-loop), learned on log p by AdaGrad (``learners.learn_log``, lr ``lr``), p in
  [1e-6, 1e6]. With ``gate`` > 0, diag(p) is used only where the pairs' diagonal spread
  exceeds ``gate`` (``secant.pairs_diagonal``'s test); gamma I elsewhere.
  """
  base = directions.secant(int(memory_size), agree=agree)
  cand, learner = candidates.diagonal(), learners.adagrad()

  def step_of(state, ctx, p):
    gamma = _gamma(state[0], ctx)
    h0 = jax.tree.map(lambda v: gamma * v, p)
    on = jnp.asarray(True)
    if gate:
      on = secant.pairs_diagonal(gate)(state[0].memory, gamma)[1]
    h0 = jax.tree.map(lambda h: jnp.where(on, h, gamma * jnp.ones_like(h)), h0)
    return optax.tree.scale(-ctx.scale, secant.two_loop(state[0].memory, h0, ctx.updates))

  def init(params):
    p = cand.init(params, 1.0)
    return base.init(params), p, learner.init(p)

  def propose(state, ctx):
    return step_of(state, ctx, state[1]), None

  def learn(state, trial, accepted, ctx):
    inner = base.learn(state[0], trial, accepted, ctx)
    _, vjp = jax.vjp(lambda p: step_of(state, ctx, p), state[1])
    (grad_p,) = vjp(trial.grad)
    grad_p = optax.tree.scale(1 / optax.tree.vdot(ctx.grad, ctx.grad), grad_p)
    new = learners.learn_log(cand, learner, state[1], grad_p, state[2], lr, 1e-6, 1e6)
    p, lstate = _common.keep_if(trial.finite, new, (state[1], state[2]))
    return inner._replace(state=(inner.state, p, lstate))

  def observe(state, trial, ctx):
    inner, trial = base.observe(state[0], trial, ctx)
    return (inner,) + tuple(state[1:]), trial

  return base._replace(init=init, propose=propose, learn=learn, observe=observe)


def hdm_diag(lr=0.5, gate=0.0):
  """``trial_lbfgs()`` with :func:`learned_diagonal` as its direction."""
  return shell.iteration(
    "trial_lbfgs",
    learned_diagonal(lr=lr, gate=gate),
    acceptance=acceptance.curvature_checked(),
    step_control=step_control.evidence_step(),
  )


NULL_MODELS = {1: step_control.cubic_step, 2: quadratic_step}


def former(agree=3.0, shrink=0.5, grow=1.5, extrapolate=1.0, steep=0.9, null=0, lo=0.1, hi=0.5):
  """``capped_step(shrink, grow)``; x ``extrapolate`` while steep (1: never); a null step's
  factor from the cubic (``null=1``) or the quadratic (``null=2``) along s (0: ``shrink``)."""
  control = step_control.capped_step(shrink, grow)
  if null:
    control = fixed_direction_interpolation(control, NULL_MODELS[int(null)], (lo, hi), shrink)
  if extrapolate > 1:
    control = steep_extrapolation(control, extrapolate, steep)
  return hdm_optax.trial_lbfgs(agree=agree, step_control=control, diagonal=None)


FAMILIES = {"design": design, "former": former, "hdm_diag": hdm_diag}
# name -> (family, knobs)
VARIANTS = {
  "design": ("design", {}),
  "former": ("former", {}),
  "ext": ("former", dict(extrapolate=1.5)),
  "cubic": ("former", dict(null=1)),
  "quad": ("former", dict(null=2)),
  "ext_cubic": ("former", dict(extrapolate=1.5, null=1)),
  "agree4": ("design", dict(agree=4.0)),
  "ext2": ("design", dict(extrapolate=2.0)),
  "ext8": ("design", dict(extrapolate=8.0)),
  "steep08": ("design", dict(steep=0.8)),
  "diag0": ("design", dict(gate=1.0)),
  "diag3": ("design", dict(gate=1e3)),
  "diag6": ("design", dict(gate=1e6)),
  "hdm": ("hdm_diag", {}),
  "hdm_lr2": ("hdm_diag", dict(lr=2.0)),
  "hdm_gate3": ("hdm_diag", dict(gate=1e3)),
}


def solver(name, family, knobs, clip=None) -> solvers_lib.Solver:
  """The variant as a benchmark row (with ``clip``: ``clip_by_global_norm(clip)`` before it)."""
  make = lambda: FAMILIES[family](**knobs)
  if clip is not None:
    make = lambda: optax.chain(optax.clip_by_global_norm(clip), FAMILIES[family](**knobs))
    name = f"{name}+clip{clip:g}"
  make()  # the knobs are checked here
  return solvers_lib.Solver(name=name, make=lambda *args: make())


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


def special_tasks(clipped=False):
  """Rosenbrock-10 and Rosenbrock-10 under x -> f(D x) from its start / D, and the quartics
  (``clipped``: the quartics only, for the clipped rows)."""
  task = lambda name, build: suites_lib.Task("special", name, (None,), build)
  tasks = [
    task(name, lambda f=f, x0=x0: problems.instance(f, (), x0))
    for name, (f, x0) in quartics().items()
  ]
  if clipped:
    return tasks
  d, x0 = suites_lib.hard_scaling(10), np.tile([-1.2, 1.0], 5)
  scaled = lambda y, scale: problems.rosenbrock(scale * y)
  return tasks + [
    task("rosenbrock-10@D", lambda: problems.instance(scaled, (jnp.asarray(d),), x0 / d)),
    task("rosenbrock-10", lambda: problems.instance(problems.rosenbrock, (), x0)),
  ]


def parse_set(spec):
  """``NAME:base=FAMILY,k=v,...`` -> (NAME, family, knobs)."""
  name, _, body = spec.partition(":")
  knobs = dict(kv.split("=") for kv in body.split(",") if kv)
  return name, knobs.pop("base", "design"), {k: float(v) for k, v in knobs.items()}


def main(argv=None):
  protocol.enable_float64()
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--suite", nargs="+", default=["cutest"])
  p.add_argument("--variants", nargs="+", default=["design"], choices=tuple(VARIANTS))
  p.add_argument("--set", nargs="*", default=[], help="NAME:base=design|former,k=v,... variants")
  p.add_argument("--problems", nargs="+", default=None)
  p.add_argument("--csv", default="/tmp/stepctl/research.csv")
  args = p.parse_args(argv)
  chosen = [(v, *VARIANTS[v]) for v in args.variants] + [parse_set(s) for s in args.set]
  rows = [solver(*v) for v in chosen]
  for suite in args.suite:
    if suite == "special":
      suite_runner.run_suite(special_tasks(), rows, Path(args.csv), desc=suite)
      clipped = [solver(*v, clip=1.0) for v in chosen]
      suite_runner.run_suite(special_tasks(clipped=True), clipped, Path(args.csv), desc=suite)
    else:
      tasks = suites_lib.tasks(suite, tol=protocol.TOL, problems=args.problems)
      suite_runner.run_suite(tasks, rows, Path(args.csv), desc=suite)


if __name__ == "__main__":
  main()
