"""trial_lbfgs on a logistic regression sharded over the devices of every process (JAX SPMD).

    python -m experiments.perf.sharded_logistic [--rows 65536] [--cols 512] [--steps 200]
        [--layout rows|cols] [--method trial_lbfgs|hdm_auto] [--float64] [--fixed-steps]
        [--cpu-devices N] [--coordinator HOST:PORT --num-processes N --process-id I | --multihost]

The data matrix A (m x n, entries N(0, 1/n); labels from a planted model) is placed on a 1-d
mesh of every device of every process with ``jax.sharding.NamedSharding``: ``--layout rows``
shards A's rows (the params are replicated), ``--layout cols`` shards its columns and the
params. Each process generates only the part of A its own devices hold (the same numbers
whatever the number of processes) and builds the global arrays with
``jax.make_array_from_process_local_data``. ``hdm_optax.solve`` runs unchanged inside
``jax.jit``; XLA's SPMD partitioner inserts the collectives. f is the mean logistic loss plus
``ridge``/2 ||x||^2 (one minimizer, also where n > m).

Process 0 prints the run (value, gradient, steps, status), its time per solve and per
iteration, the shardings of the params and of the optimizer state's vectors, the bytes each
device holds, and the same solve on one device of its own (when A takes at most
``--compare-limit`` bytes): the params' largest difference relative to their largest entry.

Several processes (docs/multihost.md): every process runs the same command with
``--coordinator HOST:PORT --num-processes N --process-id I`` (HOST is process 0's), or with
``--multihost`` alone where ``jax.distributed.initialize()`` reads the cluster's environment
(Slurm, Open MPI, Cloud TPU). On a CPU-only machine, ``--cpu-devices N`` fakes N devices per
process (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before jax is imported).
``--json`` prints the measurements as one JSON line instead (``sharded_scaling.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CHUNK = 4096  # rows per random stream: A is the same numbers however it is split


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=65536)
  parser.add_argument("--cols", type=int, default=512)
  parser.add_argument("--steps", type=int, default=200, help="max_steps of the solve")
  parser.add_argument("--tol", type=float, default=1e-6, help="tol of the solve")
  parser.add_argument(
    "--fixed-steps", action="store_true", help="run exactly --steps iterations (tol 0)"
  )
  parser.add_argument("--layout", choices=("rows", "cols"), default="rows")
  parser.add_argument("--method", choices=("trial_lbfgs", "hdm_auto"), default="trial_lbfgs")
  parser.add_argument("--float64", action="store_true")
  parser.add_argument("--ridge", type=float, default=1e-4, help="f's ridge term: ridge/2 ||x||^2")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cpu-devices", type=int, default=0, help="fake N CPU devices per process")
  parser.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator")
  parser.add_argument("--num-processes", type=int, help="the number of processes")
  parser.add_argument("--process-id", type=int, help="this process's index, 0 .. N-1")
  parser.add_argument(
    "--multihost",
    action="store_true",
    help="jax.distributed.initialize() from the cluster's environment (Slurm, Open MPI, TPU)",
  )
  parser.add_argument(
    "--compare-limit",
    type=float,
    default=2**31,
    help="compare with one device when A takes at most this many bytes (0: never)",
  )
  parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
  args = parser.parse_args(argv)
  explicit = (args.coordinator, args.num_processes, args.process_id)
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    parser.error("--coordinator, --num-processes and --process-id go together")
  if args.multihost and args.coordinator:
    parser.error("--multihost reads the cluster's environment: pass it or --coordinator")
  return args


def start_jax(args):
  """Imports jax with the device flags and joins the other processes; returns jax."""
  if args.cpu_devices:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={args.cpu_devices}"
    )
  import jax  # pylint: disable=g-import-not-at-top

  if args.coordinator or args.multihost:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across hosts
    jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )
  return jax


def generate(m, n, rows, cols, dtype, seed):
  """``A[rows, cols]`` and ``y[rows]`` of the m x n problem, made chunk by chunk."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  start, stop, _ = rows.indices(m)
  w_star = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
  a_parts, y_parts = [], []
  for chunk in range(start // CHUNK, (stop - 1) // CHUNK + 1):
    lo, hi = chunk * CHUNK, min(m, (chunk + 1) * CHUNK)
    rng = np.random.default_rng((seed, chunk))
    a = rng.standard_normal((hi - lo, n), dtype=np.float32) / np.float32(np.sqrt(n))
    prob = 1 / (1 + np.exp(-(a @ w_star)))
    y = np.where(rng.random(hi - lo) < prob, 1.0, -1.0)
    keep = slice(max(start, lo) - lo, min(stop, hi) - lo)
    a_parts.append(a[keep, cols].astype(dtype))
    y_parts.append(y[keep].astype(dtype))
  return np.concatenate(a_parts), np.concatenate(y_parts)


def local_block(sharding, shape):
  """The slices of a global array of ``shape`` that this process's devices hold together."""
  index = sharding.addressable_devices_indices_map(shape).values()
  return tuple(
    slice(min(i[d].indices(size)[0] for i in index), max(i[d].indices(size)[1] for i in index))
    for d, size in enumerate(shape)
  )


def place_data(jax, mesh, args, dtype):
  """The global A, y and x0 = 0 on ``mesh``; this process makes only its devices' part."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  m, n = args.rows, args.cols
  specs = (P("d", None), P("d"), P()) if args.layout == "rows" else (P(None, "d"), P(), P("d"))
  a_sharding, y_sharding, x_sharding = (NamedSharding(mesh, s) for s in specs)
  rows, cols = local_block(a_sharding, (m, n))
  a_local, y_local = generate(m, n, rows, cols, dtype, args.seed)  # all rows for "cols"
  (x_cols,) = local_block(x_sharding, (n,))
  x_local = np.zeros(x_cols.stop - x_cols.start, dtype)
  return (
    jax.make_array_from_process_local_data(a_sharding, a_local, (m, n)),
    jax.make_array_from_process_local_data(y_sharding, y_local, (m,)),
    jax.make_array_from_process_local_data(x_sharding, x_local, (n,)),
  )


def bytes_per_device(*arrays):
  """The most bytes any one device holds of ``arrays`` (jax.Arrays, pytrees of them)."""
  import jax  # pylint: disable=g-import-not-at-top

  held = {}
  for leaf in jax.tree.leaves(arrays):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return max(held.values())


def vector_shardings(state, n):
  """``path: spec`` of the state's arrays whose last axis is the params' (its n-vectors)."""
  import jax  # pylint: disable=g-import-not-at-top

  return {
    jax.tree_util.keystr(path): str(leaf.sharding.spec)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state)
    if leaf.ndim and leaf.shape[-1] == n
  }


def compare(jax, args, dtype, solve_one, params):
  """The params' largest difference from one device's, relative to that one's largest entry.

  Every process gathers the params; process 0 generates all of A and solves on its first
  device (``solve_one(x0, a, y)``). Returns ``(one device's result, difference)`` on process
  0, None elsewhere.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  params = np.asarray(multihost_utils.process_allgather(params, tiled=True))
  if jax.process_index():
    return None
  m, n = args.rows, args.cols
  device = jax.local_devices()[0]
  a, y = jax.device_put(generate(m, n, slice(None), slice(None), dtype, args.seed), device)
  ref = solve_one(jax.device_put(np.zeros(n, dtype), device), a, y)
  ref_params = np.asarray(ref.params)
  scale = np.max(np.abs(ref_params))
  if scale == 0:
    sys.exit("the one-device solve did not move from x0: nothing to compare")
  return ref, float(np.max(np.abs(params - ref_params)) / scale)


def main(argv=None):
  args = parse(argv)
  jax = start_jax(args)
  import numpy as np  # pylint: disable=g-import-not-at-top

  import hdm_optax  # pylint: disable=g-import-not-at-top
  from experiments import problems, protocol  # pylint: disable=g-import-not-at-top
  from experiments.perf import timing  # pylint: disable=g-import-not-at-top

  protocol.float32_products()
  if args.float64:
    jax.config.update("jax_enable_x64", True)
  dtype = np.float64 if args.float64 else np.float32
  ndev = jax.device_count()
  m, n = args.rows, args.cols
  if (m if args.layout == "rows" else n) % ndev:
    sys.exit(f"--{args.layout} must be a multiple of the number of devices, {ndev}")
  lead = jax.process_index() == 0

  def log(*a):
    if lead and not args.json:
      print(*a, flush=True)

  log(
    f"{jax.process_count()} process(es), {ndev} device(s) ({jax.devices()[0].platform}), "
    f"layout={args.layout}, A {m} x {n} {np.dtype(dtype).name}, {args.method}()"
  )
  mesh = jax.make_mesh((ndev,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  a, y, x0 = place_data(jax, mesh, args, dtype)
  opt = getattr(hdm_optax, args.method)()
  weight, ridge = np.asarray(1.0 / m, dtype), np.asarray(args.ridge, dtype)
  limits = dict(tol=0.0, max_null_steps=None) if args.fixed_steps else dict(tol=args.tol)

  def solve(x, a, y):
    return hdm_optax.solve(
      opt,
      problems.logistic_objective,
      x,
      max_steps=args.steps,
      fun_args=(a, y, weight, ridge),
      **limits,
    )

  run = jax.jit(solve)
  compiled = run.lower(x0, a, y).compile()
  seconds = timing.best_time(lambda: compiled(x0, a, y), repeats=3)
  res = compiled(x0, a, y)
  steps = int(res.num_steps)
  memory = compiled.memory_analysis()
  measured = dict(
    processes=jax.process_count(),
    devices=ndev,
    layout=args.layout,
    rows=m,
    cols=n,
    dtype=np.dtype(dtype).name,
    steps=steps,
    seconds_per_solve=seconds,
    seconds_per_iteration=seconds / max(steps, 1),
    data_bytes_per_device=bytes_per_device(a, y),
    params_state_bytes_per_device=bytes_per_device(res.params, res.state),
    temp_bytes_per_device=getattr(memory, "temp_size_in_bytes", None),
  )
  log(
    f"sharded:  f = {float(res.value):.8g}, ||grad||_inf = {float(res.grad_norm):.3g}, "
    f"steps = {steps}, status = {res.message}"
  )
  log(
    f"          {seconds:.4f} s per solve, {measured['seconds_per_iteration'] * 1e3:.3f} ms per iteration"
  )
  log(f"params sharding: {res.params.sharding.spec}")
  log(f"state's n-vectors: {vector_shardings(res.state, n)}")
  log(
    f"bytes per device: data {measured['data_bytes_per_device']}, "
    f"params and state {measured['params_state_bytes_per_device']}, "
    f"the program's temporaries {measured['temp_bytes_per_device']}"
  )
  if m * n * np.dtype(dtype).itemsize <= args.compare_limit:
    compared = compare(jax, args, dtype, solve, res.params)
    if compared is not None:
      ref, measured["relative_difference"] = compared
      log(
        f"one device: f = {float(ref.value):.8g}, steps = {int(ref.num_steps)}; "
        f"max relative difference of the params: {measured['relative_difference']:.1e}"
      )
  if args.json and lead:
    print(json.dumps(measured), flush=True)


if __name__ == "__main__":
  main()
