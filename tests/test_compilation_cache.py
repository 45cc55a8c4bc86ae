"""enable_compilation_cache: a second process loads the programs the first one compiled.

Each run is a fresh process (JAX reads its cache directory once per process)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = """
import json, sys
import jax
jax.config.update("jax_platforms", "cpu")
from jax import monitoring
events = []
monitoring.register_event_listener(lambda name, **_: events.append(name))
import jax.numpy as jnp
import hdm_optax
path = hdm_optax.enable_compilation_cache(sys.argv[1])
fun = lambda x: jnp.sum((x - jnp.arange(4.0)) ** 2 + 0.1 * x**4)
res = hdm_optax.minimize(fun, jnp.zeros(4))
print(json.dumps(dict(path=path, hits=events.count("/jax/compilation_cache/cache_hits"),
                      ok=bool(res.success))))
"""


def _run(cache_dir):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(
    [sys.executable, "-c", RUN, cache_dir], capture_output=True, text=True, env=env, timeout=600
  )
  assert proc.returncode == 0, proc.stderr
  import json

  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_first_ones_programs(tmp_path):
  cache_dir = str(tmp_path / "cache")
  first = _run(cache_dir)
  assert first["ok"] and first["path"] == cache_dir and first["hits"] == 0
  assert os.listdir(cache_dir)  # the programs were written
  second = _run(cache_dir)
  assert second["ok"] and second["hits"] >= 1


def test_another_directory_in_the_same_process_is_refused(tmp_path):
  import jax

  from hdm_optax import compilation_cache

  before = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "one"))
    with pytest.raises(ValueError, match="one directory per process"):
      compilation_cache.enable_compilation_cache(str(tmp_path / "two"))
    with pytest.raises(ValueError, match="min_compile_seconds"):
      compilation_cache.enable_compilation_cache(str(tmp_path / "one"), min_compile_seconds=-1)
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
