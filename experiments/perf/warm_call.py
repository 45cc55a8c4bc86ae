"""The time of a warm call of ``solve``, ``minimize`` and ``value_and_grad_from_state``.

    python -m experiments.perf.warm_call [--rounds 7] [--calls 50]

A warm call is one whose program is compiled already: what a user pays per call when
solving many problems of one shape. The problem is a logistic regression with n = 10
parameters and 200 rows (float64, CPU by default), solved to ``tol=1e-6`` by
``solve(trial_lbfgs(), ...)`` with the data in ``fun_args``, the same with the data closed
over in ``fun``, ``minimize(fun, x0, args=...)``, and one call of
``value_and_grad_from_state(fun)`` (a step of one's own loop). Each of these traces ``fun``
at every call (to find the arrays it reads); the same calls inside a ``jax.jit`` of the
caller's own trace once, and their time is the rest of the call. Each round times
``--calls`` calls of every case in turn, so all see the same machine; the table gives the
median and the minimum over rounds of the per-call mean (ms).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax


def logistic(w, a, y):
  return jnp.sum(jnp.logaddexp(0.0, -y * (a @ w)))


def cases(a, y):
  """name -> a call that solves the problem once (or takes one oracle call) and waits."""
  closed = lambda w: logistic(w, a, y)
  x0 = jnp.zeros(a.shape[1])
  vg = hdm_optax.value_and_grad_from_state(logistic)
  state = hdm_optax.trial_lbfgs().init(x0)

  def solve(fun, args):
    return hdm_optax.solve(
      hdm_optax.trial_lbfgs(), fun, x0, max_steps=500, tol=1e-6, fun_args=args
    ).params

  jitted_solve = jax.jit(lambda a, y: solve(logistic, (a, y)))
  jitted_vg = jax.jit(lambda x, a, y, state: vg(x, a, y, state=state)[0])
  return {
    "solve, fun_args": lambda: solve(logistic, (a, y)).block_until_ready(),
    "solve, closure": lambda: solve(closed, ()).block_until_ready(),
    "jax.jit(solve)": lambda: jitted_solve(a, y).block_until_ready(),
    "minimize, args": lambda: hdm_optax.minimize(logistic, x0, args=(a, y)).x,
    "value_and_grad_from_state": lambda: vg(x0, a, y, state=state)[0].block_until_ready(),
    "jax.jit(value_and_grad_...)": lambda: jitted_vg(x0, a, y, state).block_until_ready(),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--calls", type=int, default=50)
  args = p.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=(200, 10)))
  y = jnp.sign(a @ jnp.ones(10) + 0.1)
  calls = cases(a, y)
  for call in calls.values():  # compile
    call()
  times = {name: [] for name in calls}
  for _ in range(args.rounds):
    for name, call in calls.items():
      start = time.perf_counter()
      for _ in range(args.calls):
        call()
      times[name].append((time.perf_counter() - start) / args.calls * 1e3)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.rounds} rounds")
  print(f"{'ms per call':<30} {'median':>7} {'min':>7}")
  for name, t in times.items():
    print(f"{name:<30} {np.median(t):7.3f} {np.min(t):7.3f}")
  return times


if __name__ == "__main__":
  main()
