"""Multi-device SPMD: runs tests/sharding_check.py in a fresh process, since
XLA_FLAGS (8 forced host devices) must be set before jax is imported. The
process is pinned to the CPU platform (JAX_PLATFORMS=cpu), so its 8 devices
are the CPU's on any machine, an accelerator's included. XLA's backend optimisation is off
there (as FAST_COMPILE does in-process): both sides of each comparison compile alike, and
compiling is most of the check's time."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sharded_logistic_matches_single_device():
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  )
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, "tests", "sharding_check.py")],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.strip().endswith("OK"), proc.stdout
