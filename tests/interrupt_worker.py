"""Ctrl-C during a compiled run, in a process of its own (run by tests/test_seams_adversarial.py).

    python tests/interrupt_worker.py DOOR [DOOR ...]

For each front door it compiles a run, then starts one that would take minutes (10^8 steps
of ``optax.sgd`` on a logistic regression, ``tol=0``), sends itself SIGINT one second in
(from a thread, as a terminal's Ctrl-C reaches the main thread) and catches the
``KeyboardInterrupt``. It prints one JSON line per door: the seconds from the signal to the
exception, the partial result's steps and status, whether its params equal those of a
fresh run of exactly that many steps (the oracle), and whether the SIGINT handler and the
wakeup descriptor are the ones that were there before. ``user_handler`` installs a handler
of its own first: the call must leave it alone (and the run ends on its own).
"""

import json
import os
import signal
import sys
import threading
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import hdm_optax  # noqa: E402

RNG = np.random.default_rng(0)
A = jnp.asarray(RNG.standard_normal((400, 20)))
Y = jnp.asarray(np.sign(RNG.standard_normal(400)))
LONG = 100_000_000
# A terminal's process: Python's own SIGINT handler. A process started in the background by a
# non-interactive shell (``pytest ... &``) inherits SIGINT ignored, which the library leaves
# alone, as it leaves any handler of the user's.
signal.signal(signal.SIGINT, signal.default_int_handler)


def fun(w, a, y):
  return jnp.sum(jnp.logaddexp(0.0, -y * (a @ w))) + 1e-3 * w @ w


def run(door, steps):
  """The door's run of ``steps`` steps; returns (params of one problem, the raw result)."""
  sgd, x0 = optax.sgd(1e-4), jnp.zeros(20)
  common = dict(fun_args=(A, Y), max_steps=steps, tol=0.0)
  if door == "solve":
    res = hdm_optax.solve(sgd, fun, x0, **common)
  elif door == "solve_watched":  # a callback and a progress line: the check is their host call
    res = hdm_optax.solve(sgd, fun, x0, callback=lambda s: None, progress=True, **common)
  elif door == "minimize":
    options = {"maxiter": steps, "gtol": 0.0, "ftol": 0.0, "maxfun": LONG + 1}
    res = hdm_optax.minimize(fun, x0, args=(A, Y), options=options)
  elif door == "solve_batch":
    res = hdm_optax.solve_batch(sgd, fun, jnp.zeros((3, 20)), in_axes=(0, None), **common)
  elif door == "sweep":
    res = hdm_optax.sweep(optax.sgd, {"learning_rate": [1e-4, 2e-4]}, fun, x0, **common).results
  else:
    raise ValueError(door)
  params = np.asarray(res.params)
  return (params if params.ndim == 1 else params[0]), res


def interrupt_after(seconds, sent):
  def go():
    time.sleep(seconds)
    sent.append(time.perf_counter())
    os.kill(os.getpid(), signal.SIGINT)

  threading.Thread(target=go, daemon=True).start()


def one(door):
  run(door, 2000)  # compile (the program of a run of 1023 steps or more: its trace's size)
  run(door, 2000)  # and learn the time per step
  handler_before = signal.getsignal(signal.SIGINT)
  sent, out = [], {"door": door}
  interrupt_after(1.0, sent)
  try:
    run(door, LONG)
    out["interrupted"] = False
  except KeyboardInterrupt as error:
    out["latency"] = time.perf_counter() - sent[0]
    result = getattr(error.result, "results", error.result)  # a sweep's SweepResult
    steps = np.ravel(result.num_steps)
    out.update(interrupted=True, steps=steps.tolist(), status=np.ravel(result.status).tolist())
    message = result.message
    out["message"] = message[0] if isinstance(message, list) else message
    partial = np.asarray(result.params)
    partial = partial if partial.ndim == 1 else partial[0]
    replay, _ = run(door, int(steps[0]))  # the oracle: a fresh run of exactly that many steps
    out["replay_error"] = float(np.max(np.abs(partial - replay)) / (1 + np.max(np.abs(replay))))
  out["handler_restored"] = signal.getsignal(signal.SIGINT) is handler_before
  out["wakeup_fd_restored"] = signal.set_wakeup_fd(-1) == -1
  return out


def user_handler():
  """A handler of the user's: the call leaves it installed, and it is the one that runs."""
  got = []
  mine = lambda signum, frame: got.append(signum)
  signal.signal(signal.SIGINT, mine)
  run("solve", 2000)
  sent = []
  interrupt_after(0.0, sent)
  _, res = run("solve", 20_000)
  time.sleep(0.2)
  return {
    "door": "user_handler",
    "steps": [int(res.num_steps)],
    "user_handler_ran": got == [signal.SIGINT],
    "handler_restored": signal.getsignal(signal.SIGINT) is mine,
  }


if __name__ == "__main__":
  for name in sys.argv[1:]:
    print(json.dumps(user_handler() if name == "user_handler" else one(name)), flush=True)
