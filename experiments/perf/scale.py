"""HDM-Best at scale: sparse logistic regression with 10^7 float32 parameters.

    python -m experiments.perf.scale [--n 10000000] [--m 1000000] [--nnz-per-row 10]
                                [--iters 20]

The data matrix is a ``jax.experimental.sparse.BCOO`` with ``m`` rows and
``nnz_per_row`` nonzeros per row (random columns), labels from a planted
model. The objective is ``sum_i softplus(-y_i (A w)_i)`` (overflow-safe).
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
import numpy as np
import optax
from jax.experimental import sparse as jsparse

import hdm_optax
from experiments import protocol
from experiments.perf import timing


def make_problem(n, m, nnz_per_row, seed=0):
  rng = np.random.default_rng(seed)
  rows = np.repeat(np.arange(m, dtype=np.int32), nnz_per_row)
  cols = rng.integers(0, n, size=m * nnz_per_row, dtype=np.int32)
  vals = (rng.standard_normal(m * nnz_per_row) / np.sqrt(nnz_per_row)).astype(np.float32)
  w_true = rng.standard_normal(n).astype(np.float32)
  logits = np.bincount(rows, weights=vals * w_true[cols], minlength=m)
  y = np.where(rng.random(m) < 1 / (1 + np.exp(-logits)), 1.0, -1.0).astype(np.float32)
  a = jsparse.BCOO(
    (jnp.asarray(vals), jnp.asarray(np.stack([rows, cols], 1))), shape=(m, n), indices_sorted=True
  )
  return a, jnp.asarray(y)


def logistic(w, a, y):
  return jnp.sum(jax.nn.softplus(-y * (a @ w)))


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
  a, y = make_problem(n, m, args.nnz_per_row)
  print(
    f"problem: n = {n:,} params (float32), m = {m:,} rows, "
    f"nnz = {a.nse:,} ({time.perf_counter() - t0:.1f} s to build)"
  )

  # A crude upper bound on L: ||A||_F^2 / 4.
  lip = float(jnp.sum(a.data**2)) / 4
  opt = hdm_optax.hdm_best(lipschitz=lip)
  x = jnp.zeros(n, jnp.float32)
  # x and the state are donated to the compiled iteration, so no two of them
  # may share a buffer (init stores x as x^0 and eta_p as eta_p0): copy.
  state = jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), opt.init(x))

  @jax.jit
  def value_and_grad(x, a, y):
    return jax.value_and_grad(logistic)(x, a, y)

  def step(x, state, a, y):
    fun = lambda w: logistic(w, a, y)
    value, grad = optax.value_and_grad_from_state(fun)(x, state=state)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    return optax.apply_updates(x, updates), state

  step_jit = jax.jit(step, donate_argnums=(0, 1))
  compiled = step_jit.lower(x, state, a, y).compile()

  t_oracle = timing.best_time(lambda: value_and_grad(x, a, y), repeats=5)

  # First call computes f(x^1) (the state cache is empty), then 1 call/iter.
  f0 = float(logistic(x, a, y))
  x, state = step_jit(x, state, a, y)
  jax.block_until_ready(x)
  t0 = time.perf_counter()
  for _ in range(args.iters):
    x, state = step_jit(x, state, a, y)
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
