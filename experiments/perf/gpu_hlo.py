"""Kernels per iteration on an NVIDIA GPU, counted on a machine without one.

    pip install "jax-cuda12-plugin==$JAXV" "jax-cuda12-pjrt==$JAXV"   # JAXV: jax's version
    python -m experiments.perf.gpu_hlo --optimizer trial_lbfgs --sizes 1e5,1e6 \\
      [--target h100] [--peers 'optax.lbfgs()'] [--hlo-dir DIR]

XLA:GPU compiles for a card described by a target configuration (its compute capability,
cores, shared memory, ...), with no device attached: JAX's CUDA plugin makes a
compile-only device from it (``jax.experimental.topologies``), and the programs of
:mod:`experiments.perf.overhead` (value and gradient, the update loop, ``solve``, the
peers) are lowered for that device from the shapes of their arguments alone (nothing is
run or placed on it). The optimized HLO is what the card would run, but for the choices
XLA makes by timing kernels on a card (autotuning of matrix products and sorts), so its
kernel counts (:mod:`experiments.perf.hlo`) are those of the card to within those. Against
the H200's own HLO (``results/perf/h200_2026-11-26/hlo_0a201af``, jax 0.11.2) the
same library compiled here for ``--target h200`` (jax 0.10.2) counts 12 / 40 / 49 kernels
per iteration of the value-and-gradient / ``hdm_auto`` update / ``solve`` loops, where the
card's were 12 / 42 / 51.

The targets (``gpu_specs/*.txtpb``, XLA's ``GpuTargetConfigProto``) hold the facts XLA's
fusion decisions read; ``h100`` is the H100 SXM 80GB, ``h200`` the H200. The CUDA plugin
must match jax's version; no CUDA library, driver or GPU is needed. Prints one line per
program and size.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax

from experiments import protocol
from experiments.perf import hlo, overhead

__all__ = ["compile_only_device", "count", "main"]

SPECS = pathlib.Path(__file__).with_name("gpu_specs")
TARGETS = tuple(sorted(p.stem for p in SPECS.glob("*.txtpb")))


def compile_only_device(target: str = "h100"):
  """A compile-only CUDA device for ``target`` (a name in :data:`TARGETS`).

  Raises:
    ValueError: for a target with no spec file.
    RuntimeError: where JAX's CUDA plugin is not installed, naming the install command.
  """
  if target not in TARGETS:
    raise ValueError(f"target={target!r}: no spec in {SPECS}; choose from {', '.join(TARGETS)}")
  from jax.experimental import topologies

  config = (SPECS / f"{target}.txtpb").read_text()
  try:
    # one card: one slice, one host, one device
    topology = topologies.get_topology_desc(target, "cuda", target_config=config, topology="1x1x1")
  except NotImplementedError as e:
    raise RuntimeError(
      "compiling for a GPU without one needs JAX's CUDA plugin at jax's version, registered: "
      f'pip install "jax-cuda12-plugin=={jax.__version__}" "jax-cuda12-pjrt=={jax.__version__}", '
      "and JAX_PLATFORMS=cpu where no CUDA library is installed (the plugin's check of its "
      "CUDA libraries would refuse to load it)"
    ) from e
  return topology.devices[0]


def count(
  optimizer: str, n: int, device, steps: int = 10, peers=(), hlo_dir=None, dtype="float32"
) -> dict:
  """name -> (kernels of one iteration, the same with nested loops by their trip counts) of
  :mod:`experiments.perf.overhead`'s programs at size n, compiled for ``device``."""
  import hdm_optax

  with jax.default_device(jax.devices("cpu")[0]):
    fun, data, w0, lip, _ = overhead.make_problem(n, dtype)
  factory, probe_calls = overhead.OPTIMIZERS[optimizer]
  start_state, vg_loop, update_loop, solve_run = overhead.loops(
    factory(hdm_optax, lip), fun, probe_calls, steps
  )
  sharding = jax.sharding.SingleDeviceSharding(device)
  spec = lambda tree: jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
  )
  args = spec((w0, data))
  state0 = spec(jax.eval_shape(start_state, w0, data))
  progs = overhead.programs(solve_run, vg_loop, update_loop, (1,))
  progs.update(
    {name: (p, False) for name, (p, _) in overhead.peer_programs(peers, fun, steps).items()}
  )
  counts = {}
  for name, (program, with_state) in progs.items():
    full = args + ((state0,) if with_state else ())
    text = program.trace(*full).lower().compile().as_text()
    counts[name] = (hlo.loop_kernels(text, n), hlo.loop_kernels(text, n, by_trips=True))
    if hlo_dir:
      path = pathlib.Path(hlo_dir) / f"{optimizer}_{name}_n{n}_{device.device_kind}.hlo"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text)
  return counts


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--optimizer", default="trial_lbfgs", choices=tuple(overhead.OPTIMIZERS))
  p.add_argument(
    "--sizes", default="1e5,1e6", help="comma-separated n (BCOO data from 1e5, dense below)"
  )
  p.add_argument("--target", default="h100", choices=TARGETS)
  p.add_argument("--peers", default="", help=f"comma-separated of {', '.join(overhead.PEERS)}")
  p.add_argument("--steps", type=int, default=10, help="iterations of each loop (K)")
  p.add_argument("--hlo-dir", default=None, help="write the optimized HLO texts here")
  p.add_argument(
    "--json", default=None, help="write the rows here (experiments/perf/targets.py --compiled)"
  )
  args = p.parse_args(argv)
  args.peers = tuple(filter(None, args.peers.split(",")))
  unknown = set(args.peers) - set(overhead.PEERS)
  if unknown:
    p.error(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(overhead.PEERS)}")
  return args


def main(argv=None) -> list[dict]:
  """Prints the counts; returns one row per size: ``n``, ``optimizer``, ``device`` and
  ``kernels`` (name -> counts as numbers, nested loops by their trip counts)."""
  args = _parse(argv)
  # The CPU runs nothing here but builds the data; the CUDA plugin is only a compiler.
  jax.config.update("jax_platforms", "cpu")
  protocol.float32_products()
  device = compile_only_device(args.target)
  print(f"{args.optimizer}: jax {jax.__version__}, compiled for {device.device_kind} (no device)")
  rows = []
  for n in (int(float(s)) for s in args.sizes.split(",")):
    counted = count(args.optimizer, n, device, args.steps, args.peers, args.hlo_dir)
    for name, (counts, by_trips) in counted.items():
      print(f"{n:>9} {name} loop, one iteration: {counts}", flush=True)
      if by_trips != counts:
        print(f"{'':>9}   nested loops by their trip counts: {by_trips}", flush=True)
    kernels = overhead.kernel_numbers(counted)
    device_label = f"{device.device_kind} (compiled, no device)"
    rows.append(dict(n=n, optimizer=args.optimizer, device=device_label, kernels=kernels))
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
