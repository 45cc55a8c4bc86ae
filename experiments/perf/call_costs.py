"""What a call costs however it is made: the engine's call paths, measured in one process.

    python -m experiments.perf.call_costs [--repeats 5] [--batches 200 3000]

Float64 on the default backend; each row is the best of ``--repeats`` (after a first call that
compiles), rounds interleaved where two things are compared:

- ``minimize, a new callback per call``: SciPy users write ``hist = []; cb = lambda r:
  hist.append(r.fun)`` inside a function, so each call brings a new callback object; against
  the same call with one callback reused (the program is keyed on the hook, not the object).
- ``jax.grad through solve, no jit``: the second call of ``jax.grad`` of a function that calls
  ``solve`` (README's ridge example), against ``jax.jit`` of it.
- ``vmap(minimize), whole result / .x``: ``jax.jit(jax.vmap(minimize))`` at B = 300 returning
  the whole result against returning ``.x`` (the trace is kept only where asked for).
- ``minimize(maxiter=1e8)``: the bytes of the compiled program's output and temporaries on a
  3-variable problem, against ``maxiter=1000`` (the trace is capped at 1024 entries).
- ``own vmapped optax loop``: optax's documented L-BFGS loop (``value_and_grad_from_state``,
  ``update``, ``apply_updates``) under ``jax.vmap`` at B = ``--batches``, 30 steps, with
  ``trial_lbfgs()`` against ``optax.lbfgs()`` in the same loop; ``stale`` counts the updates
  that evaluated again (0: no host call and no extra evaluation in a correct loop).
- ``update, check off / no check``: one ``trial_lbfgs`` update inside
  ``hdm_optax.values_at_params()`` (the drivers' way) against the same update with the check
  on, in jaxpr equations (what the program computes).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hdm_optax


def _best(fn, repeats: int) -> float:
  best = np.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def _pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
  jax.block_until_ready(fn_a())
  jax.block_until_ready(fn_b())
  a, b = np.inf, np.inf
  for _ in range(repeats):
    a, b = min(a, _best(fn_a, 1)), min(b, _best(fn_b, 1))
  return a, b


def _logistic(w, x, y):
  return jnp.sum(jnp.logaddexp(0.0, -y * (x @ w)))


def _data(seed, m=200, n=10):
  x = jax.random.normal(jax.random.key(seed), (m, n))
  return x, jnp.sign(x @ jnp.ones(n) + 0.1)


def callbacks(repeats):
  x, y = _data(0)
  kept = []
  reused = lambda intermediate_result: kept.append(float(intermediate_result.fun))

  def fresh():
    hist = []
    return hdm_optax.minimize(
      _logistic,
      jnp.zeros(10),
      args=(x, y),
      callback=lambda intermediate_result: hist.append(intermediate_result.fun),
    ).x

  same = lambda: hdm_optax.minimize(_logistic, jnp.zeros(10), args=(x, y), callback=reused).x
  return _pair(fresh, same, repeats)


def grad_without_jit(repeats):
  x, y = _data(1)
  xv, yv = _data(9, m=50)

  def validation(lam):
    ridge = lambda w, x, y, lam: _logistic(w, x, y) + lam * w @ w
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(), ridge, jnp.zeros(10), max_steps=500, tol=1e-5, fun_args=(x, y, lam)
    )
    return _logistic(res.params, xv, yv)

  plain = jax.grad(validation)
  jitted = jax.jit(plain)
  return _pair(lambda: plain(1.0), lambda: jitted(1.0), repeats)


def vmap_minimize(repeats, batch=300):
  x, y = _data(2)
  x0 = jnp.zeros((batch, 10))
  whole = jax.jit(jax.vmap(lambda x0: hdm_optax.minimize(_logistic, x0, args=(x, y))))
  only_x = jax.jit(jax.vmap(lambda x0: hdm_optax.minimize(_logistic, x0, args=(x, y)).x))
  return _pair(lambda: whole(x0), lambda: only_x(x0), repeats)


def maxiter_memory():
  fun = lambda x: jnp.sum((x - 1.0) ** 2)

  def size(maxiter):
    run = jax.jit(lambda x0: hdm_optax.minimize(fun, x0, options={"maxiter": maxiter}))
    stats = run.lower(jnp.zeros(3)).compile().memory_analysis()
    return stats.output_size_in_bytes + stats.temp_size_in_bytes

  return size(10**8), size(1000)


def own_vmapped_loop(opt, batch, steps=30):
  keys = jax.random.split(jax.random.key(3), batch)
  data = jax.vmap(lambda k: (jax.random.normal(k, (64, 16)), jnp.ones(64)))(keys)

  def one(x, y):
    fun = lambda w: _logistic(w, x, y)
    value_and_grad = optax.value_and_grad_from_state(fun)

    def body(carry, _):
      w, state = carry
      value, grad = value_and_grad(w, state=state)
      updates, state = opt.update(grad, state, w, value=value, grad=grad, value_fn=fun)
      return (optax.apply_updates(w, updates), state), None

    w0 = jnp.zeros(16)
    return jax.lax.scan(body, (w0, opt.init(w0)), length=steps)[0]

  return jax.jit(jax.vmap(one)), data


def own_loops(repeats, batches):
  rows = []
  for batch in batches:
    ours, data = own_vmapped_loop(hdm_optax.trial_lbfgs(), batch)
    peer, _ = own_vmapped_loop(optax.lbfgs(), batch)
    a, b = _pair(lambda: ours(*data), lambda: peer(*data), repeats)
    stale = int(np.sum(ours(*data)[1].info.num_stale_updates))
    rows.append((batch, a, b, stale))
  return rows


def check_off_equations():
  opt = hdm_optax.trial_lbfgs()
  fun = lambda w: jnp.sum((w - 1.0) ** 2)
  w = jnp.zeros(8)
  state = opt.init(w)

  def update(w, state):
    value, grad = jax.value_and_grad(fun)(w)
    return opt.update(grad, state, w, value=value, grad=grad, value_fn=fun)

  # A new function per trace: make_jaxpr caches traces on the function, not the context.
  on = len(jax.make_jaxpr(lambda *a: update(*a))(w, state).eqns)
  with hdm_optax.values_at_params():
    off = len(jax.make_jaxpr(lambda *a: update(*a))(w, state).eqns)
  return off, on


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batches", type=int, nargs="+", default=[200, 3000])
  args = parser.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| call | this (ms) | against (ms) | ratio |")
  print("|---|---|---|---|")
  row = lambda name, a, b: print(f"| {name} | {1e3 * a:.2f} | {1e3 * b:.2f} | {a / b:.2f} |")
  row("minimize, a new callback per call / one reused", *callbacks(args.repeats))
  row("jax.grad through solve, no jit / jitted", *grad_without_jit(args.repeats))
  row("jit(vmap(minimize)) at B = 300, whole result / .x", *vmap_minimize(args.repeats))
  big, small = maxiter_memory()
  print(
    f"| minimize(maxiter=1e8) / maxiter=1000, program bytes | {big} | {small} | {big / small:.2f} |"
  )
  for batch, a, b, stale in own_loops(args.repeats, args.batches):
    row(f"own vmapped loop, B = {batch}, trial_lbfgs / optax.lbfgs (stale: {stale})", a, b)
  off, on = check_off_equations()
  print(f"| update, stale-cache check off / on, jaxpr equations | {off} | {on} | {off / on:.2f} |")


if __name__ == "__main__":
  main()
