"""Issue 28's targets for ``trial_lbfgs()``, checked against the rows of one measurement.

    python -m experiments.perf.targets --overhead OVERHEAD.json [--batched BATCHED.json]
    python -m experiments.perf.targets --compiled COMPILED.json

``OVERHEAD.json``: ``python -m experiments.perf.overhead --optimizer trial_lbfgs --kernels
--peers optax.lbfgs() --json ...`` (its sizes among 1e5, 1e6, 1e7); ``BATCHED.json``:
``python -m experiments.perf.batched --solvers trial_lbfgs(),optax.lbfgs() --json ...``. Each
ratio compares numbers of one run (one process, interleaved rounds). On a GPU:

- update / vg <= 1.3 at n = 1e7, <= 2.0 at 1e6, <= 3.0 at 1e5 (``t_update / t_vg``);
- at most 25 kernels per update (the update loop's iteration, the oracle's kernels included,
  nested loops by their trip counts);
- per oracle call, ``solve`` <= 0.8 x ``optax.lbfgs()``'s at 1e6 and 1e7 (its line search's
  calls counted);
- batched solves: problems per second >= 3 x ``optax.lbfgs()``'s at B = 16384, >= 2 x at
  B = 1024.

On a CPU: per oracle call <= ``optax.lbfgs()``'s at 1e5 and 1e6. With ``--compiled
COMPILED.json`` (``python -m experiments.perf.gpu_hlo --json ...``, no GPU needed): the
kernels per update as XLA compiles them for the named card. A target whose row is missing is
printed as not measured. Prints one line per target; returns the rows.
"""

from __future__ import annotations

import argparse
import json
import pathlib

__all__ = ["check", "main"]

UPDATE_OVER_VG = {100_000: 3.0, 1_000_000: 2.0, 10_000_000: 1.3}
MAX_KERNELS = 25
PER_CALL_GPU = {1_000_000: 0.8, 10_000_000: 0.8}
PER_CALL_CPU = {100_000: 1.0, 1_000_000: 1.0}
BATCHED = {16384: 3.0, 1024: 2.0}
PEER = "optax.lbfgs()"


def _row(target: str, value, limit: float, above: bool = False) -> dict:
  if value is None:
    return dict(target=target, value=None, limit=limit, met=None)
  met = value >= limit if above else value <= limit
  return dict(target=target, value=float(value), limit=limit, met=bool(met))


def _overhead_targets(rows: list[dict]) -> list[dict]:
  by_n = {r["n"]: r for r in rows}
  on_cpu = any(r["device"].startswith("CPU") for r in rows)
  out = []
  if not on_cpu:
    for n, limit in UPDATE_OVER_VG.items():
      r = by_n.get(n)
      out.append(_row(f"update / vg at n = {n:.0e}", r and r["ratio_update"], limit))
    kernels = [r["kernels"]["update"]["total"] for r in rows if "update" in r["kernels"]]
    out.append(
      _row("kernels per update (most over the sizes)", max(kernels, default=None), MAX_KERNELS)
    )
  for n, limit in (PER_CALL_CPU if on_cpu else PER_CALL_GPU).items():
    r = by_n.get(n)
    peer = r and r["peers"].get(PEER)
    ratio = peer and r["t_solve"] / peer[0]
    out.append(_row(f"per call / {PEER}'s at n = {n:.0e}", ratio, limit))
  return out


def _compiled_targets(rows: list[dict]) -> list[dict]:
  kernels = [r["kernels"]["update"]["total"] for r in rows]
  devices = sorted({r["device"] for r in rows})
  target = f"kernels per update, {', '.join(devices)}"
  return [_row(target, max(kernels, default=None), MAX_KERNELS)]


def _batched_targets(rows: list[dict]) -> list[dict]:
  rate = {(r["batch"], r["solver"]): r["per_second"] for r in rows}
  out = []
  for batch, limit in BATCHED.items():
    mine, peer = rate.get((batch, "trial_lbfgs()")), rate.get((batch, PEER))
    ratio = mine / peer if (mine is not None and peer) else None
    out.append(_row(f"batched problems/s / {PEER}'s at B = {batch}", ratio, limit, above=True))
  return out


def check(
  overhead_rows: list[dict],
  batched_rows: list[dict] | None = None,
  compiled_rows: list[dict] | None = None,
) -> list[dict]:
  """One dict per target: ``target``, ``value`` (None: not measured), ``limit``, ``met``."""
  out = _overhead_targets(overhead_rows) if overhead_rows else []
  if batched_rows is not None:
    out += _batched_targets(batched_rows)
  if compiled_rows:
    out += _compiled_targets(compiled_rows)
  return out


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--overhead", default=None)
  p.add_argument("--batched", default=None)
  p.add_argument("--compiled", default=None, help="rows of experiments/perf/gpu_hlo.py --json")
  args = p.parse_args(argv)
  if not (args.overhead or args.compiled):
    p.error("give --overhead (a measurement) or --compiled (kernel counts without a device)")
  load = lambda path: json.loads(pathlib.Path(path).read_text()) if path else None
  overhead_rows, batched_rows, compiled_rows = map(
    load, (args.overhead, args.batched, args.compiled)
  )
  measured = (overhead_rows or []) + (batched_rows or []) + (compiled_rows or [])
  devices = sorted({r["device"] for r in measured})
  print(f"issue 28's targets for trial_lbfgs() on {', '.join(devices)}")
  rows = check(overhead_rows or [], batched_rows, compiled_rows)
  for r in rows:
    value = "not measured" if r["value"] is None else f"{r['value']:.3f}"
    verdict = {None: "-", True: "met", False: "NOT met"}[r["met"]]
    bound = ">=" if "batched" in r["target"] else "<="
    print(f"  {r['target']:<48} {value:>12}  ({bound} {r['limit']:g})  {verdict}")
  return rows


if __name__ == "__main__":
  main()
