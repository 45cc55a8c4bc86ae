"""HDM-Best at scale: sparse logistic regression with 10^7 float32 parameters.

    python -m experiments.perf.scale [--n 10000000] [--m 1000000] [--nnz-per-row 10]
                                [--iters 20]

The data matrix is a ``jax.experimental.sparse.BCOO`` with ``m`` rows and
``nnz_per_row`` nonzeros per row (random columns), labels from a planted
model (``experiments.problems.synthetic_logistic``). The objective is
``sum_i log(1 + exp(-y_i (A w)_i))`` (``problems.logistic_objective``).
Prints:

- seconds per HDM-Best iteration (one jitted ``value_and_grad_from_state`` +
  ``update`` + ``apply_updates``, i.e. one oracle call per iteration);
- the ratio of that time to one jitted value-and-gradient call;
- the optimizer state size and the peak temporary memory of the compiled
  iteration, both in vectors of n float32 entries.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import hdm_optax
from experiments import problems
from experiments import protocol
from experiments.perf import timing


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=10_000_000)
  parser.add_argument("--m", type=int, default=1_000_000)
  parser.add_argument("--nnz-per-row", type=int, default=10)
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args(argv)
  protocol.float32_products()
  n, m = args.n, args.m

  t0 = time.perf_counter()
  inst = problems.synthetic_logistic(m, n, nnz_per_row=args.nnz_per_row)
  logistic, data = inst.fun, inst.fun_args
  print(
    f"problem: n = {n:,} params (float32), m = {m:,} rows, "
    f"nnz = {data[0].nse:,} ({time.perf_counter() - t0:.1f} s to build)"
  )
  opt = hdm_optax.hdm_best(lipschitz=inst.lipschitz)
  x = jnp.zeros(n, jnp.float32)
  # x and the state are donated to the compiled iteration, so no two of them
  # may share a buffer (init stores x as x^0 and eta_p as eta_p0): copy.
  state = jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), opt.init(x))
  value_and_grad = jax.jit(jax.value_and_grad(logistic))

  def step(x, state, data):
    fun = lambda w: logistic(w, *data)
    value, grad = optax.value_and_grad_from_state(fun)(x, state=state)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    return optax.apply_updates(x, updates), state

  step_jit = jax.jit(step, donate_argnums=(0, 1))
  compiled = step_jit.lower(x, state, data).compile()

  t_oracle = timing.best_time(lambda: value_and_grad(x, *data), repeats=5)

  # First call computes f(x^1) (the state cache is empty), then 1 call/iter.
  f0 = float(logistic(x, *data))
  x, state = step_jit(x, state, data)
  jax.block_until_ready(x)
  t0 = time.perf_counter()
  for _ in range(args.iters):
    x, state = step_jit(x, state, data)
  jax.block_until_ready(x)
  t_iter = (time.perf_counter() - t0) / args.iters

  vec_bytes = n * 4
  state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
  mem = compiled.memory_analysis()
  print(
    f"f(x^1) = {f0:.6g} -> f(x^{args.iters + 2}) = {float(state.value):.6g} "
    f"({int(state.info.num_null_steps)} null steps)"
  )
  print(f"value-and-gradient call: {t_oracle:.3f} s")
  print(
    f"HDM-Best iteration:      {t_iter:.3f} s  "
    f"(ratio to one value-and-gradient call: {t_iter / t_oracle:.2f})"
  )
  print(
    f"optimizer state: {state_bytes / vec_bytes:.2f} vectors of n "
    f"({state_bytes / 2**20:.0f} MiB; P, U, x^(k-1), cached grad f)"
  )
  if mem is not None:
    print(
      f"compiled iteration: temporaries {mem.temp_size_in_bytes / vec_bytes:.2f} "
      f"vectors of n, arguments {mem.argument_size_in_bytes / vec_bytes:.2f}, "
      f"outputs {mem.output_size_in_bytes / vec_bytes:.2f} "
      f"(donated x and state alias {mem.alias_size_in_bytes / vec_bytes:.2f})"
    )


if __name__ == "__main__":
  main()
