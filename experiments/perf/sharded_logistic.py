"""HDM-Best on a logistic regression sharded over all devices (JAX SPMD).

    python -m experiments.perf.sharded_logistic [--rows 65536] [--cols 512] [--steps 200]
                                           [--layout rows|cols] [--cpu-devices 8]

The data matrix is sharded with ``jax.sharding.NamedSharding`` over a 1-d mesh
of every device (``jax.devices()``, all hosts): ``--layout rows`` row-shards A
(params replicated), ``--layout cols`` column-shards A and shards the params.
``hdm_optax.solve`` runs unchanged inside ``jax.jit``; XLA's SPMD partitioner
inserts the collectives. The result is compared with the same solve on one
device (when the problem fits on it), and the shardings of the params and the
optimizer state are printed. In float32 the sharded reductions sum in another
order, and after a few hundred steps the iterates differ from the
single-device ones by ~1e-4 relative; with ``--float64`` they agree to ~1e-10.

On a CPU-only machine, ``--cpu-devices 8`` fakes 8 devices
(``--xla_force_host_platform_device_count``). For a multi-host launch
(one process per host), see docs/multihost.md: every process runs this same
command with ``--multihost`` and the ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` environment variables set (or
none of them on Cloud TPU / SLURM, where ``jax.distributed.initialize()``
finds them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=65536)
  parser.add_argument("--cols", type=int, default=512)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--layout", choices=("rows", "cols"), default="rows")
  parser.add_argument(
    "--cpu-devices", type=int, default=0, help="fake this many CPU devices (single host only)"
  )
  parser.add_argument(
    "--multihost", action="store_true", help="call jax.distributed.initialize() first"
  )
  parser.add_argument("--float64", action="store_true")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse(argv)
  if args.cpu_devices:
    # Must happen before jax is imported.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={args.cpu_devices}"
    )
  import jax  # pylint: disable=g-import-not-at-top

  if args.multihost:
    jax.distributed.initialize()  # reads JAX_COORDINATOR_ADDRESS etc. / the cluster env
  from experiments import problems, protocol  # pylint: disable=g-import-not-at-top

  protocol.float32_products()
  if args.float64:
    jax.config.update("jax_enable_x64", True)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import hdm_optax  # pylint: disable=g-import-not-at-top

  dtype = jnp.float64 if args.float64 else jnp.float32
  ndev = jax.device_count()
  mesh = jax.make_mesh((ndev,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  lead = jax.process_index() == 0

  def log(*a):
    if lead:
      print(*a, flush=True)

  log(
    f"{jax.process_count()} process(es), {ndev} devices "
    f"({jax.devices()[0].platform}), layout={args.layout}"
  )
  m, n = args.rows, args.cols
  if args.layout == "rows" and m % ndev or args.layout == "cols" and n % ndev:
    sys.exit(f"the sharded dimension must be a multiple of {ndev}")

  # Same data on every process (fixed seed); each device keeps its shard.
  inst = problems.synthetic_logistic(m, n, dtype=dtype)
  a_np, y_np = (np.asarray(v) for v in inst.fun_args[:2])

  a_spec, x_spec = (P("d", None), P()) if args.layout == "rows" else (P(None, "d"), P("d"))
  y_spec = P("d") if args.layout == "rows" else P()

  def put(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  data = (put(a_np, a_spec), put(y_np, y_spec), put(np.asarray(inst.fun_args[2]), P()))
  x0 = put(np.zeros(n, dtype), x_spec)
  logistic = inst.fun
  opt = hdm_optax.hdm_best(
    lipschitz=inst.lipschitz,
    curvature_estimate=hdm_optax.pieces.curvature.running_mean(args.steps),
  )

  run = jax.jit(
    lambda x, data: hdm_optax.solve(opt, logistic, x, max_steps=args.steps, tol=1e-5, fun_args=data)
  )
  t0 = time.perf_counter()
  res = jax.block_until_ready(run(x0, data))
  t_first = time.perf_counter() - t0
  t0 = time.perf_counter()
  res = jax.block_until_ready(run(x0, data))
  t_run = time.perf_counter() - t0

  log(
    f"sharded:  f = {float(res.value):.8g}, ||grad||_inf = {float(res.grad_norm):.3g}, "
    f"steps = {int(res.num_steps)}, status = "
    f"{res.message}"
  )
  log(f"          {t_run:.3f} s per solve ({t_first:.1f} s with compilation)")
  log(f"params sharding:        {res.params.sharding.spec}")
  log(
    f"state.direction.precond sharding: {res.state.direction.precond.sharding.spec}, "
    f"state.grad: {res.state.grad.sharding.spec}, "
    f"state.direction.prev_params: {res.state.direction.prev_params.sharding.spec}"
  )

  if jax.process_count() == 1:
    dev = jax.devices()[0]
    ref = hdm_optax.solve(
      opt,
      logistic,
      jax.device_put(np.zeros(n, dtype), dev),
      max_steps=args.steps,
      tol=1e-5,
      fun_args=jax.device_put(inst.fun_args, dev),
    )
    params = np.asarray(res.params)
    ref_params = np.asarray(ref.params)
    rel = np.max(np.abs(params - ref_params)) / np.max(np.abs(ref_params))
    log(
      f"single device: f = {float(ref.value):.8g}, steps = {int(ref.num_steps)}; "
      f"max relative difference of the params: {rel:.2e}"
    )


if __name__ == "__main__":
  main()
