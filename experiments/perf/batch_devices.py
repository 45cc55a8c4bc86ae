"""Problems per second of ``solve_batch`` spread over 1, 2, 4 and 8 devices.

    python -m experiments.perf.batch_devices [--batch 4096] [--cols 64] [--devices 1 2 4 8]
        [--platform cpu] [--repeats 3]

A batch of small logistic regressions (``--batch`` problems of 256 x ``--cols`` Gaussian data,
as ``experiments.perf.batched``), solved by ``hdm_optax.solve_batch(trial_lbfgs(), ...,
devices=jax.devices()[:N])`` to ``||grad f||_inf <= 1e-4``. For each N one subprocess (fake
CPU devices with ``--platform cpu``: ``--xla_force_host_platform_device_count=N``, which
share the machine's cores; the first N GPUs with ``--platform gpu``) prints the best of
``--repeats`` warm calls and the compile time. The table has problems/s, its ratio to one
device, and the most gradient calls a member made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--cols", type=int, default=64)
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def child(args) -> None:
  """Runs in the subprocess: times the batch on ``args.child`` devices, prints one JSON line."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import hdm_optax  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_enable_x64", True)
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=(args.batch, 256, args.cols)) / np.sqrt(args.cols))
  w = rng.normal(size=(args.batch, args.cols))
  y = jnp.asarray(np.where(np.einsum("bmn,bn->bm", np.asarray(a), w) > 0, 1.0, -1.0))
  fun = lambda x, a, y: jnp.sum(jax.nn.softplus(-y * (a @ x))) + 0.5e-3 * jnp.sum(x**2)
  devices = jax.devices()[: args.child]
  run = lambda: hdm_optax.solve_batch(
    hdm_optax.trial_lbfgs(),
    fun,
    jnp.zeros(args.cols),
    fun_args=(a, y),
    in_axes=(None, 0),
    devices=None if args.child == 1 else devices,
  )
  start = time.perf_counter()
  res = jax.block_until_ready(run())
  compile_seconds = time.perf_counter() - start
  best = np.inf
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    best = min(best, time.perf_counter() - start)
  print(
    json.dumps(
      dict(
        devices=len(devices),
        seconds=best,
        compile_seconds=compile_seconds,
        converged=int(np.sum(res.converged)),
        max_calls=int(np.max(res.num_grad_evals)),
      )
    )
  )


def measure(args, devices: int) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if args.platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
  command = [sys.executable, "-m", "experiments.perf.batch_devices", "--child", str(devices)]
  command += ["--batch", str(args.batch), "--cols", str(args.cols), "--repeats", str(args.repeats)]
  proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
  if proc.returncode:
    sys.exit(f"{devices} device(s) failed:\n{proc.stdout}{proc.stderr}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  args = parse(argv)
  if args.child:
    child(args)
    return
  rows = [measure(args, n) for n in args.devices]
  base = args.batch / rows[0]["seconds"]
  print(f"solve_batch(trial_lbfgs()), {args.batch} logistic problems of 256 x {args.cols}")
  print("| devices | problems/s | vs 1 device | converged | max calls | compile (s) |")
  print("|---|---|---|---|---|---|")
  for row in rows:
    rate = args.batch / row["seconds"]
    print(
      f"| {row['devices']} | {rate:,.0f} | {rate / base:.2f} | {row['converged']} | "
      f"{row['max_calls']} | {row['compile_seconds']:.1f} |"
    )


if __name__ == "__main__":
  main()
