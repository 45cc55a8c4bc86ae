"""``hdm_optax.loop`` stepped three ways: compiled, ``jax.jit(run.step)`` in Python, un-jitted.

    python -m experiments.perf.python_loop [--n 100] [--method trial_lbfgs]

The extended Rosenbrock function of n variables (float64, from (-1.2, 1, -1.2, 1, ...)),
``tol=1e-4``. For each way it prints the steps, the gradient calls, the seconds (first
call included, so compilation is counted where there is one) and the largest difference
of f at the start and after the first step from the compiled run's. The un-jitted loop
runs each operation of a step as its own small program, so it rounds differently from
the compiled step (which XLA fuses), and on an ill-conditioned problem the runs part.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import hdm_optax


def rosenbrock(x):
  return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def _python(run, x0, step, start, done):
  s = start(x0)
  while not done(s):
    s = step(s)
  return s


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--n", type=int, default=100)
  p.add_argument("--method", default="trial_lbfgs")
  args = p.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  x0 = jnp.tile(jnp.array([-1.2, 1.0]), args.n // 2)
  run = hdm_optax.loop(getattr(hdm_optax, args.method)(), rosenbrock, tol=1e-4, max_steps=5000)
  ways = {
    "compiled while_loop": lambda: jax.jit(
      lambda x: jax.lax.while_loop(lambda s: ~run.done(s), run.step, run.start(x))
    )(x0),
    "jax.jit(run.step) loop": lambda: _python(
      run, x0, jax.jit(run.step), jax.jit(run.start), jax.jit(run.done)
    ),
    "un-jitted loop": lambda: _python(run, x0, run.step, run.start, run.done),
  }
  print(f"Rosenbrock n = {args.n}, {args.method}(), {jax.devices()[0].device_kind}")
  for name, way in ways.items():
    start = time.perf_counter()
    s = way()
    s.value.block_until_ready()
    seconds = time.perf_counter() - start
    print(
      f"{name:<24} steps {int(s.num_steps):5d}  grad calls {int(s.num_grad_evals):5d}  "
      f"{seconds:8.2f} s"
    )
  compiled_step = jax.jit(run.step)
  first = jax.jit(run.start)(x0)
  eager = run.start(x0)
  print(
    "un-jitted vs compiled: |grad f(x0)| differs by up to "
    f"{float(jnp.max(jnp.abs(eager.grad - first.grad))):.3g}, f after one step by "
    f"{abs(float(run.step(first).value - compiled_step(first).value)):.3g}"
  )


if __name__ == "__main__":
  main()
