"""One of the processes of tests/test_multiprocess.py (run as a script).

    python tests/multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID

Every process joins ``jax.distributed`` on 127.0.0.1:PORT with CPU collectives over gloo,
builds the same data from a fixed seed, places its own part of it on a mesh of every
process's device with ``jax.make_array_from_process_local_data``, and runs
``hdm_optax.solve(trial_lbfgs())`` inside ``jax.jit`` in three layouts (rows sharded with the
params replicated; columns sharded with the params sharded; the same with bounds). Each
result is gathered and compared with the same solve on this process's own device alone. The
last line printed is ``OK`` when every layout agrees to ``TOL`` (process 0 compares; the others
only take part in the sharded solves); exit status 77 means the
platform cannot run collectives across processes (the test skips then).
"""

import os
import sys
import traceback

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
  f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
)

import jax  # noqa: E402

SKIP = 77
TOL = 1e-10
STEPS = 200


def join(port, num_processes, process_id):
  """Joins the distributed run; exits with ``SKIP`` where this platform has no gloo."""
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError) as e:  # an option this jax does not know
    print(f"no gloo CPU collectives in jax {jax.__version__}: {e}", flush=True)
    sys.exit(SKIP)
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
    heartbeat_timeout_seconds=10,
    shutdown_timeout_seconds=30,
  )
  try:
    jax.devices()
  except (AttributeError, RuntimeError) as e:
    if "gloo" not in str(e).lower():
      raise
    print(f"no gloo CPU collectives in this jaxlib: {e}", flush=True)
    sys.exit(SKIP)


def main():
  port, num_processes, process_id = (int(v) for v in sys.argv[1:4])
  join(port, num_processes, process_id)
  jax.config.update("jax_enable_x64", True)

  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import hdm_optax  # pylint: disable=g-import-not-at-top

  assert jax.process_count() == num_processes, jax.process_count()
  mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  local = jax.local_devices()[0]

  def logistic(w, a, y):
    return jnp.sum(jax.nn.softplus(-y * (a @ w))) + 0.5e-2 * jnp.sum(w * w)

  def place(x, spec):
    """This process's part of the global array ``x`` (every process holds all of x)."""
    sharding = NamedSharding(mesh, spec)
    index = sharding.addressable_devices_indices_map(x.shape)[local]
    return jax.make_array_from_process_local_data(sharding, x[index], x.shape)

  def check(name, m, n, a_spec, x_spec, **bounds):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(m, n)) / np.sqrt(n)
    y = np.where(a @ rng.normal(size=n) + rng.normal(size=m) > 0, 1.0, -1.0)
    opt = hdm_optax.trial_lbfgs(**bounds)
    x0 = np.zeros(n)
    run = jax.jit(
      lambda x, a, y: hdm_optax.solve(opt, logistic, x, max_steps=STEPS, tol=1e-8, fun_args=(a, y))
    )
    res = run(place(x0, x_spec), place(a, a_spec), place(y, P(a_spec[0])))
    params = np.asarray(multihost_utils.process_allgather(res.params, tiled=True))
    if process_id:
      return
    ref = hdm_optax.solve(
      opt,
      logistic,
      jax.device_put(x0, local),
      max_steps=STEPS,
      tol=1e-8,
      fun_args=jax.device_put((a, y), local),
    )
    ref_params = np.asarray(ref.params)
    err = float(np.max(np.abs(params - ref_params)) / np.max(np.abs(ref_params)))
    steps, ref_steps = int(res.num_steps), int(ref.num_steps)
    print(
      f"{name}: {steps} steps ({ref_steps} on one device), "
      f"status {hdm_optax.Status(int(res.status)).name}, max relative difference {err:.1e}",
      flush=True,
    )
    assert bool(ref.converged), (name, ref.message)
    assert err <= TOL and steps == ref_steps, (name, err, steps, ref_steps)

  check("rows sharded, params replicated", 256, 8, P("d", None), P())
  check("columns sharded, params sharded", 64, 128, P(None, "d"), P("d"))
  check(
    "columns sharded, params sharded, bounds", 64, 128, P(None, "d"), P("d"), lower=-2.0, upper=2.0
  )
  jax.distributed.shutdown()
  print("OK", flush=True)


if __name__ == "__main__":
  try:
    main()
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)  # at once: not through jax.distributed's shutdown barrier, which waits for peers
