"""Two processes on localhost, as on two hosts: ``jax.distributed`` with CPU collectives over gloo.

tests/multiprocess_worker.py runs in two subprocesses that meet at a coordinator on a free port of
127.0.0.1; process 0 checks that ``solve(trial_lbfgs())`` on data spread over both processes
gives the one-process answer to 1e-10 (float64) with rows sharded, with columns and params
sharded, and with a box. The test skips only where the platform cannot run collectives across
processes (the worker exits with status 77 and says why); a process that does not finish within
``TIMEOUT`` seconds is killed and the test fails.
"""

import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
NUM_PROCESSES = 2
SKIP = 77
TIMEOUT = 240


def free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(port, out_dir):
  """Runs the processes; returns each one's (exit status, output).

  Once one process fails, or ``TIMEOUT`` passes, the others are killed (a process whose peer
  died would otherwise wait for it at the next collective).
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  # As FAST_COMPILE does in-process: both sides of the comparison compile alike.
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  logs = [out_dir / f"process{i}.txt" for i in range(NUM_PROCESSES)]
  procs = []
  try:
    for i, log in enumerate(logs):
      with open(log, "w") as out:
        procs.append(
          subprocess.Popen(
            [sys.executable, WORKER, str(port), str(NUM_PROCESSES), str(i)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
          )
        )
    deadline = time.monotonic() + TIMEOUT
    while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
      if time.monotonic() > deadline:
        pytest.fail(f"the processes did not finish within {TIMEOUT} s: {read(logs)}")
      time.sleep(0.2)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
  return [(proc.returncode, log.read_text()) for proc, log in zip(procs, logs)]


def read(logs):
  return "\n".join(f"{log.name}:\n{log.read_text()}" for log in logs)


def test_two_processes_match_one(tmp_path):
  results = launch(free_port(), tmp_path)
  if any(code == SKIP for code, _ in results):
    pytest.skip(next(out for code, out in results if code == SKIP).strip().splitlines()[-1])
  report = "\n".join(f"process {i} (exit {code}):\n{out}" for i, (code, out) in enumerate(results))
  assert all(code == 0 for code, _ in results), report
  assert all(out.strip().endswith("OK") for _, out in results), report
  lead = results[0][1]
  for layout in ("rows sharded", "columns sharded, params sharded:", "bounds"):
    assert layout in lead, report
