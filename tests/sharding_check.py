"""Run as a script (by tests/test_sharding.py): HDM-Best and ``solve`` on 8
forced host devices, with the data row-sharded (params replicated) and with a
wide model (params sharded), against the single-device answer; trial_lbfgs on
params of a sharded leaf and small replicated ones, whose secant memory packs the
small leaves together and keeps the sharded one apart, in its sharding; batches
over the devices."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 8 CPU devices, whatever accelerator is there
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  )

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hdm_optax  # noqa: E402
from hdm_optax import _blocks  # noqa: E402


def logistic(w, a, y):
  return jnp.sum(jax.nn.softplus(-y * (a @ w)))


def rel_err(x, ref):
  return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


def same_sharding(x, sharding):
  return x.sharding.is_equivalent_to(sharding, x.ndim)


def check(name, m, n, a_spec, x_spec, mesh, steps=30):
  rng = np.random.default_rng(0)
  a = rng.normal(size=(m, n)) / np.sqrt(n)
  y = np.where(rng.normal(size=m) > 0, 1.0, -1.0)
  lip = float(np.linalg.norm(a, 2) ** 2 / 4)
  opt = hdm_optax.hdm_best(lipschitz=lip, precond_lr=10.0 / lip)
  x0 = jnp.zeros(n)
  ref = hdm_optax.solve(
    opt, logistic, x0, max_steps=steps, tol=0.0, fun_args=(jnp.asarray(a), jnp.asarray(y))
  )

  x_sh = NamedSharding(mesh, x_spec)
  a_s = jax.device_put(a, NamedSharding(mesh, a_spec))
  y_s = jax.device_put(y, NamedSharding(mesh, P(a_spec[0])))
  x_s = jax.device_put(x0, x_sh)
  assert len(a_s.sharding.device_set) == 8

  # solve, unchanged, inside a user's jax.jit.
  run = jax.jit(
    lambda x, a, y: hdm_optax.solve(opt, logistic, x, max_steps=steps, tol=0.0, fun_args=(a, y))
  )
  res = run(x_s, a_s, y_s)
  err = rel_err(res.params, ref.params)
  assert err < 1e-6, (name, err)
  assert int(res.num_steps) == int(ref.num_steps)
  for leaf in (
    res.params,
    res.state.direction.precond,
    res.state.direction.prev_params,
    res.state.grad,
    res.state.direction.precond_learner_state.sum_sq,
  ):
    assert same_sharding(leaf, x_sh), (name, leaf.sharding, x_sh)

  # A hand-written jitted update loop; init inherits the params' sharding.
  state = opt.init(x_s)
  for leaf in (
    state.direction.precond,
    state.direction.prev_params,
    state.grad,
    state.direction.precond_learner_state.sum_sq,
  ):
    assert same_sharding(leaf, x_sh), (name, leaf.sharding, x_sh)

  @jax.jit
  def step(x, state, a, y):
    fun = lambda w: logistic(w, a, y)
    value, grad = optax.value_and_grad_from_state(fun)(x, state=state)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    return optax.apply_updates(x, updates), state

  x = x_s
  for _ in range(steps):
    x, state = step(x, state, a_s, y_s)
  err_loop = rel_err(x, ref.params)
  assert err_loop < 1e-6, (name, err_loop)
  assert same_sharding(x, x_sh) and same_sharding(state.direction.precond, x_sh)
  print(
    f"{name}: solve rel err {err:.1e}, loop rel err {err_loop:.1e}, "
    f"precond sharding {state.direction.precond.sharding.spec}"
  )


def check_packed_memory(mesh, steps=30):
  """trial_lbfgs's memory packs the small leaves and keeps a large sharded leaf's block
  in the leaf's sharding; the run matches the single-device one."""
  _blocks.OWN_BLOCK = 512  # a leaf of 1024 entries is then large (the default is 65536)
  rng = np.random.default_rng(1)
  m, n = 64, 1024
  a = rng.normal(size=(m, n)) / np.sqrt(n)
  y = np.where(rng.normal(size=m) > 0, 1.0, -1.0)

  def f(p, a, y):
    margin = a @ p["w"] + p["b"][0] - p["b"][1] + p["c"]
    return jnp.sum(jax.nn.softplus(-y * margin)) + 0.5 * jnp.sum(p["w"] ** 2)

  params = {"w": jnp.zeros(n), "b": jnp.zeros(2), "c": jnp.zeros(())}
  opt = hdm_optax.trial_lbfgs()
  data = (jnp.asarray(a), jnp.asarray(y))
  ref = hdm_optax.solve(opt, f, params, max_steps=steps, tol=0.0, fun_args=data)
  w_sh = NamedSharding(mesh, P("d"))
  sharded = dict(params, w=jax.device_put(params["w"], w_sh))
  a_s = jax.device_put(a, NamedSharding(mesh, P(None, "d")))
  y_s = jax.device_put(y, NamedSharding(mesh, P()))
  memory_sh = NamedSharding(mesh, P(None, "d"))
  for how, res in (
    ("solve", hdm_optax.solve(opt, f, sharded, max_steps=steps, tol=0.0, fun_args=(a_s, y_s))),
    (
      "solve in jit",
      jax.jit(
        lambda x, a, y: hdm_optax.solve(opt, f, x, max_steps=steps, tol=0.0, fun_args=(a, y))
      )(sharded, a_s, y_s),
    ),
  ):
    err = rel_err(res.params["w"], ref.params["w"])
    assert err < 1e-9, (how, err)
    assert int(res.num_steps) == int(ref.num_steps), how
    assert same_sharding(res.params["w"], w_sh), (how, res.params["w"].sharding)
    assert same_sharding(res.state.grad["w"], w_sh), (how, res.state.grad["w"].sharding)
    memory = res.state.direction.memory
    # Blocks in the order of their first leaf: (b, c) packed, then w alone.
    assert [blk.shape for blk in memory.s] == [(10, 3), (10, n)], [b.shape for b in memory.s]
    for blk in (memory.s[1], memory.y[1]):
      assert same_sharding(blk, memory_sh), (how, blk.sharding)
  state = opt.init(sharded)  # eager: the sharded leaf's block is made in its sharding
  assert same_sharding(state.direction.memory.s[1], memory_sh), state.direction.memory.s[1]
  print(f"packed memory: rel err {err:.1e}, w's block {memory.s[1].sharding.spec}")


def check_batch_over_devices():
  """solve_batch and sweep with devices=: each device retires its own members; solve_batch's
  answers are the one-device ones (the batch of 37 is padded to 40 for 8 devices), sweep's
  within what the stopping test allows (below)."""
  rng = np.random.default_rng(1)
  scales = jnp.asarray(10 ** rng.uniform(0, 3, (37, 5)))
  fun = lambda x, d: jnp.sum(d * (x - 1.0) ** 2) + 0.1 * jnp.sum(x**4)
  run = lambda **kw: hdm_optax.solve_batch(
    hdm_optax.trial_lbfgs(), fun, jnp.zeros(5), fun_args=(scales,), in_axes=(None, 0), **kw
  )
  one, many = run(), run(devices=jax.devices())
  err = float(jnp.max(jnp.abs(many.params - one.params)))
  assert err < 1e-12 and bool(jnp.all(many.num_steps == one.num_steps)), err
  assert many.params.shape == (37, 5) and bool(jnp.all(many.converged))
  make = lambda memory_size: hdm_optax.trial_lbfgs(memory_size)
  grid = {"memory_size": [3, 7]}
  sweep = lambda **kw: hdm_optax.sweep(
    make, grid, fun, jnp.zeros(5), fun_args=(scales[:6],), in_axes=(None, 0), **kw
  )
  one, many = sweep(), sweep(devices=jax.devices()[:4])
  err = float(jnp.max(jnp.abs(many.results.params - one.results.params)))
  # The members run in a program partitioned over four devices, whose sums may round apart
  # from the one-device program's, and a member's path may then part from it. Both stop at
  # ||grad f||_inf <= tol; f is separable with curvature >= 2 in every coordinate (scales
  # >= 1), so each answer is within tol / 2 of the minimiser in every coordinate.
  tol = 1e-4  # solve's default
  assert bool(jnp.all(one.results.converged)) and bool(jnp.all(many.results.converged))
  assert err <= tol, err
  print(f"batches over devices: solve_batch err {err:.1e}")


def main():
  assert jax.device_count() == 8 and jax.default_backend() == "cpu", jax.devices()
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  check("rows sharded, params replicated", 512, 16, P("d", None), P(), mesh)
  check("wide, params sharded", 64, 1024, P(None, "d"), P("d"), mesh)
  check_packed_memory(mesh)
  check_batch_over_devices()
  print("OK")


if __name__ == "__main__":
  main()
