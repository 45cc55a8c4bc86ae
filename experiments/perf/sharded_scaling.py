"""Time per iteration and memory per device of a row-sharded logistic regression on 1-8 devices.

    python -m experiments.perf.sharded_scaling [--rows 262144] [--cols 256] [--steps 30]
        [--devices 1 2 4 8] [--platform cpu] [--out results/perf/sharded_scaling]

For each device count N, one subprocess runs ``experiments/perf/sharded_logistic.py`` with A's
rows sharded over N devices (``--cpu-devices N``: fake CPU devices, which share the machine's
cores; ``--platform gpu``: the first N GPUs) and exactly ``--steps`` iterations of
``trial_lbfgs()``. It prints a table (time per iteration; bytes per device of the data, of
the params and optimizer state, and of the compiled program's temporaries), the bytes a row
and a column cost a device, and writes ``<out>.txt`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=262144)
  parser.add_argument("--cols", type=int, default=256)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
  parser.add_argument("--out", default=str(ROOT / "results" / "perf" / "sharded_scaling"))
  return parser.parse_args(argv)


def measure(args, devices):
  """One subprocess's measurements (sharded_logistic's JSON line) on ``devices`` devices."""
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  command = [sys.executable, "-m", "experiments.perf.sharded_logistic", "--json"]
  command += ["--rows", str(args.rows), "--cols", str(args.cols), "--steps", str(args.steps)]
  command += ["--fixed-steps", "--compare-limit", "0"]
  if args.platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    command += ["--cpu-devices", str(devices)]
  else:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
  proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
  if proc.returncode:
    sys.exit(f"{devices} device(s) failed:\n{proc.stdout}{proc.stderr}")
  measured = json.loads(proc.stdout.strip().splitlines()[-1])
  assert measured["devices"] == devices, (measured, devices)
  return measured


def per_row_and_column(rows):
  """Bytes per device of one row of A (data and temporaries) and of one column (params and
  state), fitted exactly on the largest and smallest device counts."""
  first, last = rows[0], rows[-1]
  local = lambda r: r["rows"] // r["devices"]
  per_row = (
    (first["data_bytes_per_device"] + first["temp_bytes_per_device"])
    - (last["data_bytes_per_device"] + last["temp_bytes_per_device"])
  ) / (local(first) - local(last))
  per_col = first["params_state_bytes_per_device"] / first["cols"]
  return per_row, per_col


def table(rows, platform):
  lines = [
    "| devices | ms per iteration | data MiB/device | params + state KiB/device "
    "| temporaries MiB/device | total MiB/device |",
    "|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    total = r["data_bytes_per_device"] + r["params_state_bytes_per_device"]
    total += r["temp_bytes_per_device"]
    lines.append(
      f"| {r['devices']} | {r['seconds_per_iteration'] * 1e3:.1f} "
      f"| {r['data_bytes_per_device'] / MIB:.1f} "
      f"| {r['params_state_bytes_per_device'] / 1024:.1f} "
      f"| {r['temp_bytes_per_device'] / MIB:.2f} | {total / MIB:.1f} |"
    )
  per_row, per_col = per_row_and_column(rows)
  first = rows[0]
  lines += [
    "",
    f"A {first['rows']} x {first['cols']} {first['dtype']}, rows sharded, params replicated, "
    f"trial_lbfgs(), {first['steps']} iterations ({platform}).",
    f"A device holds {per_row:.0f} bytes per row of A it holds (the row, its label and the "
    f"program's temporaries) and {per_col:.0f} bytes per column of A (params and state, "
    f"replicated).",
  ]
  return "\n".join(lines), per_row, per_col


def figure(rows, png: Path, platform):
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  devices = [r["devices"] for r in rows]
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
  ax_t.plot(devices, [r["seconds_per_iteration"] * 1e3 for r in rows], "o-")
  ax_t.set_ylabel("ms per iteration")
  ax_t.set_ylim(bottom=0)
  parts = (
    ("data", "data_bytes_per_device"),
    ("temporaries", "temp_bytes_per_device"),
    ("params + state", "params_state_bytes_per_device"),
  )
  bottom = [0.0] * len(rows)
  for label, key in parts:
    height = [r[key] / MIB for r in rows]
    ax_m.bar([str(d) for d in devices], height, bottom=bottom, label=label)
    bottom = [b + h for b, h in zip(bottom, height)]
  ax_m.set_ylabel("MiB per device")
  ax_m.legend(frameon=False)
  ax_t.set_xticks(devices)
  for ax in (ax_t, ax_m):
    ax.set_xlabel(f"devices ({platform})")
    ax.grid(True, axis="y", alpha=0.3)
  first = rows[0]
  fig.suptitle(
    f"trial_lbfgs, logistic regression, A {first['rows']} x {first['cols']} "
    f"{first['dtype']}, rows sharded"
  )
  fig.tight_layout()
  png.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(png, dpi=120)
  plt.close(fig)


def main(argv=None):
  """Measures, prints and writes; returns the measurements (one dict per device count)."""
  args = parse(argv)
  platform = (
    f"fake CPU devices sharing {os.cpu_count()} cores" if args.platform == "cpu" else "GPUs"
  )
  rows = []
  for devices in args.devices:
    rows.append(measure(args, devices))
    print(f"{devices} device(s): {rows[-1]['seconds_per_iteration'] * 1e3:.1f} ms per iteration")
  text, _, _ = table(rows, platform)
  print(text)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".txt").write_text(text + "\n")
  figure(rows, out.with_suffix(".png"), platform)
  print(f"wrote {out.with_suffix('.txt')} and {out.with_suffix('.png')}")
  return rows


if __name__ == "__main__":
  main()
