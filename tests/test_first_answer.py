"""The separate path: the method's program keyed on what the library owns, the objective on
its own (docs/speed.md, "The first answer"), the bounded program cache and the store."""

import contextlib
import contextvars
import gc
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from hdm_optax.driver import compiled as compiled_lib
from hdm_optax.driver import interrupts
from hdm_optax.driver import oracle as oracle_lib
from hdm_optax.driver import programs
from hdm_optax.driver import separate as separate_lib
from hdm_optax.driver import solving
from hdm_optax.driver import store

# The separate path, the fused program and the switch between them (tests/conftest.py).
pytestmark = pytest.mark.fused_program

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quadratic(x, a):
  return 0.5 * jnp.sum(a * (x - 1.0) ** 2) + 0.1 * jnp.sum(x**4)


def _tree_quadratic(p, a):
  return _quadratic(p["u"], a[:4]) + _quadratic(p["v"].ravel(), a[4:])


def _fused(optimizer, fun, x0, fun_args, **kw):
  """The fused program: staged in the caller's jit."""
  run = jax.jit(lambda x0, args: hdm_optax.solve(optimizer, fun, x0, fun_args=args, **kw))
  return run(x0, fun_args)


METHODS = {
  "trial_lbfgs": lambda: hdm_optax.trial_lbfgs(),
  "trial_lbfgs box": lambda: hdm_optax.trial_lbfgs(lower=-0.5, upper=0.9),
  "hdm_auto": lambda: hdm_optax.hdm_auto(),
  "hdm_best": lambda: hdm_optax.hdm_best(lipschitz=40.0),
  "hdm_agd": lambda: hdm_optax.hdm_agd(lipschitz=40.0),
  "osgm_best": lambda: hdm_optax.osgm_best(),
  "optax.lbfgs": lambda: optax.lbfgs(),
  "optax.adam": lambda: optax.adam(0.05),
}


# Every pair of (method, layout), (method, dtype) and (layout, dtype): each method in both
# layouts and both dtypes, half of them as (array, float64) and (pytree, float32), the other
# half as (array, float32) and (pytree, float64).
PAIRWISE = [
  pytest.param(name, tree, dtype, id=f"{name}-{'pytree' if tree else 'array'}-{dtype.__name__}")
  for i, name in enumerate(METHODS)
  for tree in (False, True)
  for dtype in [jnp.float64 if tree == (i % 2 == 1) else jnp.float32]
]


@pytest.mark.parametrize("name, tree, dtype", PAIRWISE)
def test_the_separate_path_gives_the_fused_iterates(name, tree, dtype, monkeypatch):
  """Same steps, calls and status; the params within the rounding of the few steps that
  XLA may order differently in two programs (eps of the dtype times the steps made)."""
  a = jnp.linspace(1.0, 30.0, 10, dtype=dtype)
  if tree:
    fun, x0 = _tree_quadratic, {"u": jnp.zeros(4, dtype), "v": jnp.zeros((2, 3), dtype)}
  else:
    fun, x0 = _quadratic, jnp.zeros(10, dtype)
  kw = dict(max_steps=60, tol=1e-3 if dtype == jnp.float32 else 1e-7)
  runs, run = [], separate_lib.run
  monkeypatch.setattr(separate_lib, "SEPARATE_RUNS", 10**9)  # whatever other tests ran
  monkeypatch.setattr(separate_lib, "run", lambda *args, **kw: runs.append(1) or run(*args, **kw))
  separate = hdm_optax.solve(METHODS[name](), fun, x0, fun_args=(a,), **kw)
  assert runs == [1]  # the separate path ran (not a fused program another test left)
  fused = _fused(METHODS[name](), fun, x0, (a,), **kw)
  for field in ("num_steps", "num_grad_evals", "num_value_evals", "status"):
    assert int(getattr(separate, field)) == int(getattr(fused, field)), field
  assert jax.tree.structure(separate.params) == jax.tree.structure(x0)
  assert jax.tree.structure(separate.state) == jax.tree.structure(fused.state)
  rtol = 64 * float(jnp.finfo(dtype).eps) * max(int(fused.num_steps), 1)
  for got, want in zip(jax.tree.leaves(separate.params), jax.tree.leaves(fused.params)):
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
  np.testing.assert_allclose(separate.value, fun(separate.params, a), rtol=rtol)


def test_a_resumed_state_of_the_separate_path_serves_either_path():
  """result.state comes back in the params' layout: it resumes the fused run too."""
  a = jnp.linspace(1.0, 30.0, 10)
  x0 = {"u": jnp.zeros(4), "v": jnp.zeros((2, 3))}
  opt = hdm_optax.trial_lbfgs(lower=-0.5)
  compiled_lib.clear_caches()
  first = hdm_optax.solve(opt, _tree_quadratic, x0, fun_args=(a,), max_steps=5, tol=0.0)
  again = hdm_optax.solve(
    opt, _tree_quadratic, first.params, fun_args=(a,), init_state=first.state, max_steps=30
  )
  fused = jax.jit(
    lambda p, s: (
      hdm_optax.solve(opt, _tree_quadratic, p, fun_args=(a,), init_state=s, max_steps=30).params
    )
  )(first.params, first.state)
  np.testing.assert_allclose(again.params["v"], fused["v"], rtol=1e-12)
  assert bool(again.converged)


def test_a_numpy_fun_compiles_nothing_after_the_method_program():
  """A new function, new data and a new x0 at every call: nothing compiles after the first."""

  def make(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(30, 5)), rng.normal(size=30)

    def fun(x):
      r = a @ x - b
      return 0.5 * float(r @ r), a.T @ r

    return fun, rng.normal(size=5), np.linalg.lstsq(a, b, rcond=None)[0]

  fun, x0, _ = make(0)
  hdm_optax.minimize(fun, x0, jac=True)
  before = programs.compiled_count()
  for seed in (1, 2, 3):
    fun, x0, solution = make(seed)
    res = hdm_optax.minimize(fun, x0, jac=True, options=dict(gtol=1e-10, ftol=0.0))
    np.testing.assert_allclose(res.x, solution, rtol=1e-6, atol=1e-8)
  assert programs.compiled_count() == before


def test_a_numpy_fun_s_later_calls_trace_nothing_and_pass_a_block_per_dtype(monkeypatch):
  """A NumPy ``fun`` rebuilt at each call (one code, new closures), with ``jac=True``: the
  first call's trial trace decides, the later ones trace nothing (no trial, no hoist for the
  fused program); the method's program takes its arguments (the handle, the site, x, the
  start's tens of leaves, the limits) as one block per dtype (each argument costs on JAX's
  Python path), a block of kept values alone as a kept device array (a NumPy one is a
  transfer at every call), and reaches ``fun`` through buffer callbacks, one per oracle
  call, where JAX has them."""
  from hdm_optax.adapters import objective as objective_lib
  from hdm_optax.driver import host
  from hdm_optax.driver import oracle as oracle_lib

  def make(seed):
    a = np.random.default_rng(seed).normal(size=(30, 5))

    def fun(x):
      r = a @ x - 1.0
      return float(r @ r), 2 * a.T @ r

    return fun

  counts = {"trial": 0, "hoist": 0, "filler": 0}
  passed = []

  def spy(name, original):
    def wrapped(*args, **kwargs):
      counts[name] += 1
      return original(*args, **kwargs)

    return wrapped

  monkeypatch.setattr(objective_lib, "_UNTRACEABLE_CODE", type(objective_lib._UNTRACEABLE_CODE)())
  hdm_optax.minimize(make(0), np.zeros(5), jac=True)
  monkeypatch.setattr(jax, "eval_shape", spy("trial", jax.eval_shape))
  monkeypatch.setattr(programs, "hoist", spy("hoist", programs.hoist))
  filled = host.Filler.__call__

  def fill(self, *args):
    counts["filler"] += isinstance(self.target, oracle_lib.Site)
    return filled(self, *args)

  monkeypatch.setattr(host.Filler, "__call__", fill)
  blocks = separate_lib._Arguments.blocks
  monkeypatch.setattr(
    separate_lib._Arguments,
    "blocks",
    lambda self, fresh: passed.append((self, blocks(self, fresh))) or passed[-1][1],
  )
  nfev = sum(hdm_optax.minimize(make(seed), np.zeros(5), jac=True).nfev for seed in (1, 2))
  assert counts["trial"] == 0 and counts["hoist"] == 0
  arguments, passed_blocks = passed[-1]
  assert passed[0][0] is arguments  # the kept part is made once
  treedef, specs, _ = arguments.layout
  assert len(passed_blocks) == len({dtype for _, dtype in specs}) < len(specs) // 4
  own = {dtype for _, dtype in specs[: arguments.layout[2]]}  # the call's own leaves' dtypes
  for block, before in zip(passed_blocks, passed[-2][1]):
    if block.dtype not in own:  # kept values alone: a kept device array
      assert isinstance(block, jax.Array) and block is before
    else:  # the call's own (x; the handles and a fresh start's counters), with kept ones
      assert isinstance(block, np.ndarray)  # as at the program's first call: C++ dispatch
  if host._buffer_callback is not None:
    assert counts["filler"] == nfev
  counts["trial"] = 0  # with jac=None the trace decides each time (finite differences or JAX's)
  for seed in (3, 4):
    with pytest.warns(UserWarning, match="forward difference"):
      hdm_optax.minimize(lambda x, a=make(seed): a(x)[0], np.zeros(5))
  assert counts["trial"] == 2


def _python_path_executions(monkeypatch) -> list:
  """The names of the programs JAX executes on its Python path from now on (a C++ call of
  a compiled program does not pass there)."""
  from jax._src.interpreters import pxla

  names, execute = [], pxla.ExecuteReplicated.__call__
  monkeypatch.setattr(
    pxla.ExecuteReplicated,
    "__call__",
    lambda self, *args: names.append(self.name) or execute(self, *args),
  )
  return names


def _has_cpp_calls() -> bool:
  from jax._src.interpreters import pxla

  return hasattr(pxla.MeshExecutable, "create_cpp_call")


def test_later_calls_take_jax_s_cpp_dispatch_and_still_raise_what_fun_raised(monkeypatch):
  """The method's program calls the host, which JAX's compiled objects serve on its Python
  path alone; calls of the same shapes after the program's first call in the process take
  the C++ dispatch (which ``jax.jit`` uses for such programs), the second already, and an
  error of ``fun`` on that path is still the user's, named, not XLA's."""

  def make(seed, fail_at=None):
    a = np.random.default_rng(seed).normal(size=(30, 5))
    calls = []

    def fun(x):
      calls.append(1)
      if len(calls) == fail_at:
        raise ValueError("fun failed on purpose")
      r = a @ x - 1.0
      return float(r @ r), 2 * a.T @ r

    return fun

  hdm_optax.minimize(make(0), np.zeros(5), jac=True)
  hdm_optax.clear_caches()  # the next call is the first of a new compiled object
  hdm_optax.minimize(make(1), np.zeros(5), jac=True)
  python_path = _python_path_executions(monkeypatch)
  results = [hdm_optax.minimize(make(seed), np.zeros(5), jac=True) for seed in range(3, 7)]
  assert all(r.success and r.nfev > 3 for r in results)
  if not _has_cpp_calls():
    pytest.skip("this JAX's compiled objects have no C++ call")
  assert python_path == []
  with pytest.raises(ValueError, match="on purpose"):
    hdm_optax.minimize(make(7, fail_at=3), np.zeros(5), jac=True)
  assert python_path == []
  assert hdm_optax.minimize(make(8), np.zeros(5), jac=True).success  # the program still serves


def test_the_fused_program_s_later_calls_take_jax_s_cpp_dispatch_and_keep_its_hooks(monkeypatch):
  """A repeated JAX objective moves to the fused program, which calls the host for its
  hooks (Ctrl-C, a callback): after its first call it is called on JAX's C++ dispatch too,
  and a callback's error there still stops the run with the result so far."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(30, 5)))

  def fun(w, a):
    return jnp.mean(jnp.logaddexp(0.0, -(a @ w))) + 1e-3 * jnp.sum(w**2)

  def solve(callback=None, tol=0.0):
    return hdm_optax.solve(
      hdm_optax.trial_lbfgs(),
      fun,
      jnp.zeros(5),
      fun_args=(a,),
      max_steps=5,
      tol=tol,
      callback=callback,
    )

  for _ in range(separate_lib.SEPARATE_RUNS + 2):
    solve()
  seen = []
  solve(callback=seen.append)  # the program with a callback, on its checked first call
  python_path = _python_path_executions(monkeypatch)
  assert int(solve().num_steps) == 5
  if not _has_cpp_calls():
    pytest.skip("this JAX's compiled objects have no C++ call")
  assert python_path == []

  def halt(snapshot):
    if int(snapshot.num_steps) == 2:
      raise RuntimeError("halt on purpose")

  with pytest.raises(RuntimeError, match="on purpose") as raised:
    solve(callback=halt)
  assert python_path == [] and int(raised.value.result.num_steps) >= 2


def test_dispatched_leaves_each_executable_as_it_found_it_and_builds_once_under_threads():
  """The C++ call is built with the executable's host-call flag set aside: the flag is put
  back as it was (a program without host calls keeps its own C++ call), and threads that ask
  at once share one build."""
  plain = jax.jit(lambda x: x + 1.0).lower(jnp.zeros(3)).compile()
  sine = lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  host = jax.jit(sine).lower(jnp.zeros(3)).compile()
  flags = {}
  for name, program in (("plain", plain), ("host", host)):
    execute = getattr(getattr(program._params, "executable", None), "unsafe_call", None)
    if not hasattr(execute, "has_host_callbacks"):
      pytest.skip("this JAX's compiled objects have no host-call flag")
    flags[name] = (execute, execute.has_host_callbacks)
  assert flags["plain"][1] is False and flags["host"][1] is True
  calls = []
  threads = [
    threading.Thread(target=lambda: calls.append(compiled_lib.dispatched(host))) for _ in range(8)
  ]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(calls) == 8 and all(call is calls[0] for call in calls)
  np.testing.assert_array_equal(compiled_lib.dispatched(plain)(jnp.zeros(3)), np.ones(3))
  for _ in range(2):
    np.testing.assert_allclose(calls[0](jnp.ones(3)), np.sin(np.ones(3)))
  assert all(execute.has_host_callbacks is flag for execute, flag in flags.values())


def test_handles_are_the_lowest_free_keys_so_calls_one_after_another_repeat_them():
  """A program's handle (its oracle's, its Ctrl-C watch's) is the lowest key not in use:
  calls one after another pass the same one, a call inside another's a new one."""
  from hdm_optax.driver import host

  table, lock = {}, threading.Lock()
  first = host.opened(table, "a", lock)
  assert first == 1 and host.opened(table, "b", lock) == 2  # open at once: distinct
  del table[first]
  assert host.opened(table, "c", lock) == 1 and table == {1: "c", 2: "b"}


@pytest.mark.parametrize("jac", [True, "callable"])
def test_a_numpy_fun_s_data_is_freed_after_its_call(jac):
  """The data a NumPy ``fun`` (or ``jac``) reads are freed once the call returns: JAX's
  trial trace of ``fun``, abandoned when ``fun`` needs concrete values, kept them alive (one
  copy of the data per call, for the life of the process)."""
  rng = np.random.default_rng(0)
  alive = []
  for _ in range(3):
    a = rng.normal(size=(40, 5))

    def fun(x, a=a):
      r = a @ x - 1.0
      return (float(r @ r), 2 * a.T @ r) if jac is True else float(r @ r)

    gradient = None if jac is True else (lambda x, a=a: 2 * a.T @ (a @ x - 1.0))
    res = hdm_optax.minimize(fun, np.zeros(5), jac=True if jac is True else gradient)
    assert res.success
    alive.append(weakref.ref(a))
    del a, fun, gradient, res
  gc.collect()
  assert [ref() is None for ref in alive] == [True] * 3


def test_a_new_jax_objective_compiles_only_the_objective():
  a = jnp.linspace(1.0, 30.0, 10)
  hdm_optax.solve(hdm_optax.trial_lbfgs(), _quadratic, jnp.zeros(10), fun_args=(a,))
  counts = []
  for power in (2, 4, 6):
    before = programs.compiled_count()
    fun = lambda x, a, power=power: jnp.sum(a * (x - 1.0) ** power)
    res = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(10), fun_args=(a,), tol=1e-6)
    counts.append(programs.compiled_count() - before)
    assert bool(res.converged)
  assert counts == [1, 1, 1]  # the objective's value and gradient, the method's reused


def test_the_fused_program_serves_the_runs_after_the_second():
  """The rule (docs/speed.md): two runs on the separate path, the second compiles the fused
  program in the background, the third runs it; every run gives the same answer."""
  a = jnp.linspace(1.0, 5.0, 10)
  fun = lambda x, a: jnp.sum(a * jnp.cosh(x - 0.5))
  compiled_lib.clear_caches()
  results = [
    hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(10), fun_args=(a,), tol=1e-9)
    for _ in range(4)
  ]
  compiled_lib.wait()
  kinds = [key[0] for key in compiled_lib._CACHE.entries]  # pylint: disable=protected-access
  assert kinds.count(solving._solve_entry) == 1  # pylint: disable=protected-access
  assert kinds.count("method") == 1
  for res in results[1:]:
    assert int(res.num_steps) == int(results[0].num_steps)
    np.testing.assert_allclose(res.params, results[0].params, rtol=1e-12)


def test_params_of_many_leaves_stay_on_the_separate_path(monkeypatch):
  """Past :data:`FUSED_MAX_LEAVES` leaves every run of an objective takes the separate path
  and no fused program is built (its compile grows with the leaves); at the bound the third
  run is fused, as for one array."""
  spied = []
  run = separate_lib.run
  monkeypatch.setattr(separate_lib, "run", lambda *a, **k: spied.append(1) or run(*a, **k))
  monkeypatch.setattr(separate_lib, "FUSED_MAX_LEAVES", 3)
  for leaves, separate_runs in ((4, 3), (3, 2)):
    x0 = {f"w{i}": jnp.zeros(2) for i in range(leaves)}
    fun = lambda p: sum(jnp.sum(jnp.cosh(v - 0.5)) for v in p.values())
    spied.clear()
    for _ in range(3):
      res = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, x0, tol=1e-9)
      compiled_lib.wait()
      assert bool(res.converged)
    assert len(spied) == separate_runs, leaves


def test_the_cache_is_bounded_and_clear_caches_releases_the_programs():
  size = hdm_optax.cache_size()
  try:
    hdm_optax.set_cache_size(3)
    held = []
    for power in range(2, 10):
      fun = lambda x, power=power: jnp.sum((x - 1.0) ** power) + jnp.sum(x**2)
      hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(3), max_steps=5, tol=0.0)
      held.extend(weakref.ref(p) for p in compiled_lib._CACHE.entries.values())  # pylint: disable=protected-access
      assert compiled_lib.count() <= 3
    gc.collect()
    assert any(ref() is None for ref in held)  # evicted programs are released
    hdm_optax.clear_caches()
    gc.collect()
    assert compiled_lib.count() == 0
    assert all(ref() is None for ref in held)
  finally:
    hdm_optax.set_cache_size(size)
  with pytest.raises(ValueError, match="size must be an int >= 1"):
    hdm_optax.set_cache_size(0)


def _shifted(c):
  inner = jax.jit(lambda x: x - c)  # c: a constant of the inner jit's jaxpr
  return lambda x: jnp.sum(inner(x) ** 2)


def test_no_table_keeps_a_calls_bounds_or_its_inner_jit_constants():
  """The tables keyed on a call (the runs each fused program was asked for, the programs,
  the learned Ctrl-C chunks) hold what the call is compared by, not its arrays: a minimize
  with new bounds and a new objective at each call keeps none of them once the call has
  returned, and clear_caches empties every table."""
  x0, held = np.zeros(8), []
  for i in range(6):
    c = jnp.full(8, 0.25 + 0.01 * i)
    lower, upper = np.full(8, -1.0), np.full(8, 1.0)
    res = hdm_optax.minimize(_shifted(c), x0, bounds=(lower, upper))
    np.testing.assert_allclose(res.x, c, atol=1e-6)
    held += [weakref.ref(lower), weakref.ref(upper), weakref.ref(c)]
    del c, lower, upper, res
  compiled_lib.wait()
  gc.collect()
  assert [ref() is None for ref in held] == [True] * len(held)
  hdm_optax.clear_caches()
  assert not separate_lib._SIGHTINGS.counts  # pylint: disable=protected-access
  assert separate_lib._description.cache_info().currsize == 0  # pylint: disable=protected-access
  assert not interrupts._LEARNED and not programs._INIT_SHAPES  # pylint: disable=protected-access


_CHILD = """
import json, jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, hdm_optax
from hdm_optax.driver import store
res = hdm_optax.minimize(lambda x: jnp.sum(jnp.arange(1.0, 5.0) * (x - 2.0) ** 2), jnp.zeros(4))
print(json.dumps({"x": [float(v) for v in res.x], "counts": store.counts()}))
"""


def _child(folder):
  env = dict(os.environ, HDM_OPTAX_PROGRAM_CACHE=folder, PYTHONPATH=ROOT)
  out = subprocess.run(
    [sys.executable, "-W", "always::ResourceWarning", "-c", _CHILD],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr
  assert "unclosed" not in out.stderr, out.stderr[-2000:]  # Ctrl-C's wakeup socket is closed
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_new_process_loads_the_method_program_from_the_store(tmp_path):
  folder = str(tmp_path / "programs")
  first, second = _child(folder), _child(folder)
  assert first["counts"] == {"saved": 1, "loaded": 0}
  assert second["counts"] == {"saved": 0, "loaded": 1}
  assert first["x"] == second["x"]
  np.testing.assert_allclose(first["x"], 2.0, rtol=1e-4)
  assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
  for name in os.listdir(folder):
    assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) & 0o077 == 0


_EXIT_PREAMBLE = """
import atexit, os, signal, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (interrupt_worker.py)
import jax, jax.stages
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, hdm_optax
from hdm_optax.driver import compiled

atexit.register(lambda: print("building at exit:", compiled.building()))
fun = lambda x: jnp.sum(jnp.arange(1.0, 5.0) * jnp.cosh(x - 2.0))
in_xla, compile_, lookup = threading.Event(), jax.stages.Lowered.compile, compiled.lookup
"""

_EXIT_DURING_BUILD = """
def compile_in_background(self, *args, **kwargs):
  if threading.current_thread().name == "hdm_optax compile":
    in_xla.set()
  return compile_(self, *args, **kwargs)

jax.stages.Lowered.compile = compile_in_background
for _ in range(2):  # the second run starts the fused program's compile in the background
  hdm_optax.solve(hdm_optax.hdm_best(), fun, jnp.zeros(4), max_steps=5)
assert in_xla.wait(600)  # and the process exits while XLA compiles it
"""

_CTRL_C_WHILE_WAITING = """
def slow_in_background(self, *args, **kwargs):
  if threading.current_thread().name == "hdm_optax compile":
    time.sleep(1.0)
  return compile_(self, *args, **kwargs)

def interrupted_lookup(key, build):
  if key in compiled._PENDING:  # Ctrl-C while the caller waits for the method's program
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
  return lookup(key, build)

jax.stages.Lowered.compile, compiled.lookup = slow_in_background, interrupted_lookup
try:
  hdm_optax.solve(hdm_optax.hdm_best(), fun, jnp.zeros(4), max_steps=5)
except KeyboardInterrupt:
  print("interrupted")
"""


@pytest.mark.parametrize(
  "child", [_EXIT_DURING_BUILD, _CTRL_C_WHILE_WAITING], ids=["exit", "ctrl_c_while_waiting"]
)
def test_a_process_exits_cleanly_while_a_program_compiles_in_the_background(child, tmp_path):
  """The interpreter waits for a background compile before it finalizes: a thread that
  leaves XLA's compile during finalization aborts the process (SIGABRT, 'exception not
  rethrown'), so at ``atexit`` no build is under way, also after Ctrl-C interrupted the
  caller's wait for one (a ``Thread.join`` it interrupts marks the thread as ended)."""
  env = dict(os.environ, HDM_OPTAX_PROGRAM_CACHE=str(tmp_path / "programs"), PYTHONPATH=ROOT)
  out = subprocess.run(
    [sys.executable, "-c", _EXIT_PREAMBLE + child],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
  assert out.stdout.strip().endswith("building at exit: False"), out.stdout
  assert ("interrupted" in out.stdout) == (child is _CTRL_C_WHILE_WAITING), out.stdout


# A build that takes 3 s (a slow XLA compile) is under way when the script ends, and a
# Ctrl-C comes while the interpreter waits for it. The handler registered between JAX's
# import and the library's runs after the library's exit handler and before JAX's.
_CTRL_C_AT_EXIT = """
import atexit, os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
import jax
atexit.register(
  lambda: print("building as JAX cleans up:", sys.modules["hdm_optax"].driver.compiled.building())
)
import hdm_optax
from hdm_optax.driver import compiled

compiled.prepare("slow", lambda: time.sleep(3.0))
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
"""


def test_ctrl_c_while_the_process_waits_at_exit_for_a_background_compile():
  """Ctrl-C ended the interpreter's wait for the build thread (its join is interrupted and
  the thread counts as ended), and JAX's exit handler then cleared the backends with the
  build under way: with the build inside XLA's compile, the process aborted (SIGABRT,
  'terminate called after throwing an instance of ...'). The library's exit handler, which
  runs before JAX's, waits for the build through the Ctrl-C."""
  out = subprocess.run(
    [sys.executable, "-c", _CTRL_C_AT_EXIT],
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert "KeyboardInterrupt" in out.stderr, out.stderr[-2000:]  # the Ctrl-C came at the wait
  assert out.stdout.strip() == "building as JAX cleans up: False", (out.stdout, out.stderr)


def test_the_store_refuses_a_directory_it_cannot_trust(tmp_path, monkeypatch):
  target = tmp_path / "real"
  target.mkdir(mode=0o700)
  link = tmp_path / "link"
  link.symlink_to(target)
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(0o777)
  for folder, why in ((link, "symbolic link"), (shared, "writable by other users")):
    monkeypatch.setenv("HDM_OPTAX_PROGRAM_CACHE", str(folder))
    with pytest.warns(UserWarning, match=why):
      assert store.directory() is None
  monkeypatch.setenv("HDM_OPTAX_PROGRAM_CACHE", "0")
  assert store.directory() is None


_CHILD_OWN_CLASS = """
import json, warnings
import jax
jax.config.update("jax_enable_x64", True)
import equinox as eqx, jax.numpy as jnp, hdm_optax
from hdm_optax.driver import store

class Model(eqx.Module):
  w: jax.Array
  idx: jax.Array

params, static = eqx.partition(Model(jnp.zeros(4), jnp.array([0, 2])), eqx.is_inexact_array)
fun = lambda p: jnp.sum((eqx.combine(p, static).w[static.idx] - 1.0) ** 2) + jnp.sum(p.w**2)
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  res = hdm_optax.solve(hdm_optax.hdm_auto(), fun, params, max_steps=100)
print(json.dumps({"counts": store.counts(), "warnings": [str(w.message) for w in caught],
                  "converged": bool(res.converged)}))
"""


def test_a_program_whose_params_class_the_store_cannot_load_is_not_stored(tmp_path):
  """``eqx.partition``'s params name a class of equinox's in the program; the store loads
  classes of JAX, NumPy, optax and the library only, so it does not write such a program
  (it wrote it, and every later process warned and compiled it again)."""
  env = dict(os.environ, HDM_OPTAX_PROGRAM_CACHE=str(tmp_path / "programs"), PYTHONPATH=ROOT)
  for _ in range(2):
    out = subprocess.run(
      [sys.executable, "-c", _CHILD_OWN_CLASS], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["converged"]
    assert child["counts"] == {"saved": 0, "loaded": 0}, child
    assert not [w for w in child["warnings"] if "stored program" in w], child["warnings"]


def test_a_stored_program_others_can_write_is_not_loaded(tmp_path):
  folder = str(tmp_path / "programs")
  _child(folder)
  for name in os.listdir(folder):
    os.chmod(os.path.join(folder, name), 0o666)
  assert _child(folder)["counts"] == {"saved": 1, "loaded": 0}


def test_a_damaged_stored_program_is_compiled_again_not_run(tmp_path, monkeypatch):
  """Bytes flipped in a stored program (the object code included: loaded, it crashed the
  process) fail its digest: the next process warns, compiles and stores it again."""
  folder = str(tmp_path / "programs")
  first = _child(folder)
  (name,) = os.listdir(folder)
  path = os.path.join(folder, name)
  with open(path, "rb") as file:
    data = bytearray(file.read())
  for where in (0.1, 0.5, 0.9):
    i = int(len(data) * where)
    data[i : i + 16] = bytes(b ^ 0x5A for b in data[i : i + 16])
  with open(path, "wb") as file:
    file.write(bytes(data))
  monkeypatch.setenv("HDM_OPTAX_PROGRAM_CACHE", folder)
  with pytest.warns(UserWarning, match="stored program is damaged"):
    assert store.load(name[: -len(".program")]) is None
  monkeypatch.undo()
  again = _child(folder)
  assert again["counts"] == {"saved": 1, "loaded": 0}
  assert again["x"] == first["x"]
  with open(path, "rb") as file:
    assert store._unsealed(file.read()) is not None  # pylint: disable=protected-access


def test_the_store_keeps_the_most_recently_used_programs_within_its_bound(tmp_path, monkeypatch):
  """Older programs (by modification time) go first once the store passes
  HDM_OPTAX_PROGRAM_CACHE_MB; a load renews a program's time; other files stay."""
  folder = tmp_path / "programs"
  folder.mkdir(mode=0o700)
  for i, name in enumerate(["old_a", "old_b", "recent"]):
    (folder / f"{name}.program").write_bytes(bytes(300_000))
    os.utime(folder / f"{name}.program", (1e9 + i, 1e9 + i))
  (folder / "notes.txt").write_bytes(bytes(300_000))
  monkeypatch.setenv("HDM_OPTAX_PROGRAM_CACHE_MB", "1.2")  # the new program and two more
  first = _child(str(folder))
  assert first["counts"] == {"saved": 1, "loaded": 0}
  kept = sorted(os.listdir(folder))
  assert "old_a.program" not in kept and {"old_b.program", "recent.program", "notes.txt"} < set(
    kept
  )
  (new,) = [n for n in kept if n not in ("old_b.program", "recent.program", "notes.txt")]
  os.utime(folder / new, (1e9, 1e9))  # the oldest of all, until loaded
  assert _child(str(folder))["counts"] == {"saved": 0, "loaded": 1}
  assert os.stat(folder / new).st_mtime > 1e9 + 100  # renewed by the load
  monkeypatch.setenv("HDM_OPTAX_PROGRAM_CACHE_MB", "0")
  store._trim(str(folder), store._limit_bytes(), keep=new)  # pylint: disable=protected-access
  assert sorted(os.listdir(folder)) == sorted([new, "notes.txt"])


def test_the_store_removes_the_partial_file_of_a_write_that_never_finished(tmp_path):
  """A process killed while writing a program leaves its temporary ``.partial`` file (half
  a megabyte), which the bound did not count and nothing removed. The next trim removes one
  an hour old; one being written now stays."""
  folder = tmp_path / "programs"
  folder.mkdir(mode=0o700)
  for name in ("tmpdead.partial", "tmplive.partial", "kept.program"):
    (folder / name).write_bytes(bytes(1000))
  os.utime(folder / "tmpdead.partial", (1e9, 1e9))
  store._trim(str(folder), 2**30, keep="kept.program")  # pylint: disable=protected-access
  assert sorted(os.listdir(folder)) == ["kept.program", "tmplive.partial"]


def test_each_objective_on_the_separate_path_learns_its_ctrl_c_checks_anew(monkeypatch):
  """The method's program serves every objective of its shapes, so a cheap objective's long
  chunk between Ctrl-C checks is no guide to a dear one's (it held a 20 ms objective's
  Ctrl-C for 9.9 s): each call's first chunk is one step."""
  firsts, watching = [], interrupts.watching

  @contextlib.contextmanager
  def spy(key):
    with watching(key) as watch:
      firsts.append(int(watch[1]))
      yield watch

  monkeypatch.setattr(interrupts, "watching", spy)
  weights = np.arange(1.0, 6.0)
  for scale in (1.0, 2.0, 3.0):
    fun = lambda x, s=scale: (
      float(np.sum(s * weights * (x - 1) ** 4)),
      4 * s * weights * (x - 1) ** 3,
    )
    res = hdm_optax.minimize(fun, np.zeros(5), jac=True)
    assert res.nit > 2
  assert firsts == [1, 1, 1]


def test_a_numpy_funs_error_is_raised_as_itself():
  def fun(x):
    if x[0] > 0.5:
      raise ArithmeticError("outside the model's domain")
    return float(np.sum((x - 1.0) ** 2)), 2 * (x - 1.0)

  with pytest.raises(ArithmeticError, match="outside the model's domain"):
    hdm_optax.minimize(fun, np.zeros(3), jac=True)
  res = hdm_optax.minimize(lambda x: (float(np.sum(x**2)), 2 * x), np.ones(3), jac=True)
  assert res.success  # the oracle's table is clean after the error


_CALLERS = contextvars.ContextVar("hdm_optax_test_callers", default="unset")


def test_a_host_call_from_another_thread_runs_in_the_caller_s_context():
  """The oracle's host call runs the user's code in the context its run was opened in, from
  whichever thread XLA makes it; from the calling thread, as it is."""
  seen = []

  class Recording(oracle_lib.Oracle):
    def value_and_grad(self, leaves):
      seen.append((_CALLERS.get(), np.geterr()["over"], threading.get_ident()))
      return 0.0, [np.zeros_like(x) for x in leaves]

  site = oracle_lib.Site("value_and_grad", ((3,),), "float64")
  token = _CALLERS.set("the caller's")
  try:
    with np.errstate(over="raise"), oracle_lib.serving(Recording()) as (handle, _):
      site(handle, np.zeros(3))
      worker = threading.Thread(target=site, args=(handle, np.zeros(3)))
      worker.start()
      worker.join()
  finally:
    _CALLERS.reset(token)
  assert [s[:2] for s in seen] == [("the caller's", "raise")] * 2
  assert seen[0][2] == threading.get_ident() != seen[1][2]


# At this size XLA splits the method's kernels over its threads, and the host calls after
# such a kernel come from one of them (on a machine of two cores or more).
_SPLIT_OVER_THREADS = 20_000


def test_a_numpy_fun_and_callback_see_the_caller_s_context_on_xla_s_threads():
  """SciPy calls ``fun`` and ``callback`` in the caller's thread: what the caller set in its
  context (``np.errstate``, a ``ContextVar``) holds in them here too."""
  calls, seen = [], []
  target = np.random.default_rng(0).normal(size=_SPLIT_OVER_THREADS)

  def fun(x):
    calls.append(_CALLERS.get())
    r = np.asarray(x) - target
    return 0.5 * float(r @ r) + 0.25 * float(np.sum(r**4)), r + r**3

  token = _CALLERS.set("the caller's")
  try:
    hdm_optax.minimize(
      fun, np.zeros(_SPLIT_OVER_THREADS), jac=True, callback=lambda r: seen.append(_CALLERS.get())
    )
  finally:
    _CALLERS.reset(token)
  assert len(calls) > 3 and seen
  assert set(calls) | set(seen) == {"the caller's"}

  def overflows(x):  # past the trace and the first calls
    if len(calls) == 8:
      return np.float64(1e308) * 10.0, np.zeros_like(x)
    return fun(x)

  calls.clear()
  with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="overflow"):
    hdm_optax.minimize(overflows, np.zeros(_SPLIT_OVER_THREADS), jac=True)


def test_a_callback_on_the_separate_path_sees_the_params_layout():
  seen = []
  x0 = {"u": jnp.zeros(4), "v": jnp.zeros((2, 3))}
  a = jnp.linspace(1.0, 30.0, 10)
  compiled_lib.clear_caches()
  hdm_optax.solve(
    hdm_optax.trial_lbfgs(),
    _tree_quadratic,
    x0,
    fun_args=(a,),
    max_steps=3,
    tol=0.0,
    callback=lambda s: seen.append(jax.tree.map(np.shape, s.params)),
  )
  assert seen == [{"u": (4,), "v": (2, 3)}] * 3


@pytest.mark.parametrize("staged", [False, True], ids=["separate", "fused"])
def test_each_objectives_debug_callback_gets_its_own_values(staged):
  """Issue 55, item 2: the second objective's values went to the first one's callback."""
  logs = {"a": [], "b": []}

  def make(name):
    def fun(x):
      jax.debug.callback(lambda v: logs[name].append(float(v)), jnp.sum(x))
      return jnp.sum((x - 1.0) ** 2)

    return fun

  for name in "ab":
    call = lambda x0, name=name: (
      hdm_optax.solve(hdm_optax.trial_lbfgs(), make(name), x0, max_steps=3, tol=0.0).value
    )
    (jax.jit(call) if staged else call)(jnp.zeros(2))
    jax.effects_barrier()
  assert len(logs["a"]) == len(logs["b"]) > 0


def test_minimize_warns_once_in_32_bit_mode():
  code = textwrap.dedent(
    """
    import warnings, numpy as np, hdm_optax
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for _ in range(2):
        hdm_optax.minimize(lambda x: (float(np.sum((x - 1) ** 2)), 2 * (x - 1)), np.zeros(3), jac=True)
    print(sum("jax_enable_x64" in str(w.message) for w in caught))
    """
  )
  env = dict(os.environ, PYTHONPATH=ROOT, HDM_OPTAX_PROGRAM_CACHE="0", JAX_ENABLE_X64="0")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().splitlines()[-1] == "1"


_RATE = [0.1]


class _Holder:
  rate = 0.1


@pytest.mark.parametrize("where", ["global", "attribute", "schedule"])
def test_what_an_optimizer_reads_at_the_call_is_in_its_key(where):
  """Issue 55, item 1: a global or an attribute an optimizer's functions read, or a
  function given to an hdm_optax factory, is read at each call (the oracle: a fresh
  process, which traces anew: 0.729 after the first rate, 0.125 after the second)."""
  holder = _Holder()
  fun, x0, steps, rates = (lambda x: 0.5 * jnp.sum(x**2)), jnp.ones(2), 3, (0.1, 0.5, 0.1)
  if where == "schedule":
    from hdm_optax.pieces import decay  # pylint: disable=import-outside-toplevel

    base = decay.step_decay(every=1)
    schedule = decay.Schedule(
      init=base.init, update=lambda s, k, a: s._replace(factor=s.factor * _RATE[0])
    )
    opt = hdm_optax.hdm_best(lipschitz=4.0, schedule=schedule)
    fun = lambda x: 0.5 * jnp.sum(jnp.arange(1.0, 4.0) * x**2)
    x0, steps, rates = jnp.ones(3), 5, (0.9, 0.001, 0.9)
  else:
    rate = (lambda: _RATE[0]) if where == "global" else (lambda: holder.rate)
    update = lambda g, s, p=None, **k: (jax.tree.map(lambda v: -rate() * v, g), s)
    opt = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  results = []
  for value in rates:
    _RATE[0] = holder.rate = value
    for _ in range(3):  # the separate path twice, then the fused program
      res = hdm_optax.solve(opt, fun, x0, max_steps=steps, tol=0.0)
      results.append(np.asarray(res.params))
  _RATE[0] = 0.1
  first, second, third = results[0:3], results[3:6], results[6:9]
  for group in (first, second, third):
    for r in group[1:]:
      np.testing.assert_array_equal(r, group[0])
  np.testing.assert_array_equal(first[0], third[0])
  assert not np.allclose(first[0], second[0])
  if where != "schedule":
    np.testing.assert_allclose(first[0], 0.9**3, rtol=1e-12)
    np.testing.assert_allclose(second[0], 0.5**3, rtol=1e-12)


def test_only_a_small_fresh_start_is_kept_between_calls(monkeypatch):
  """The separate path keeps a fresh start's part of the program's arguments for the next
  call of the same shapes only where the state is small: a large one (the secant pairs of
  a big problem) would hold its memory in the cache."""

  def fun(x):
    return float(np.sum((x - 1.0) ** 2)), 2 * (x - 1.0)

  def kept_starts():
    return [k for k in compiled_lib._KEPT if k[0] == "arguments"]  # pylint: disable=protected-access

  hdm_optax.clear_caches()
  hdm_optax.minimize(fun, np.zeros(5), jac=True)
  assert len(kept_starts()) == 1
  hdm_optax.clear_caches()
  monkeypatch.setattr(programs, "SMALL_PROGRAM", 10)  # trial_lbfgs's state of 5 has more
  res = hdm_optax.minimize(fun, np.zeros(5), jac=True)
  np.testing.assert_allclose(res.x, 1.0, atol=1e-6)
  assert kept_starts() == []


def test_a_numpy_fun_that_writes_into_x_changes_nothing_of_the_run():
  """SciPy's ``fun`` may write into the x it is given; the program's buffers, which a host
  call reads without copying, are not that x."""
  a = np.random.default_rng(3).normal(size=(30, 5))

  def clean(x):
    r = a @ x - 1.0
    return float(r @ r), 2 * a.T @ r

  def scribbles(x):
    out = clean(x)
    x[:] = 1e9  # after computing: a fun that reuses its argument as scratch
    return out

  want = hdm_optax.minimize(clean, np.zeros(5), jac=True)
  got = hdm_optax.minimize(scribbles, np.zeros(5), jac=True)
  np.testing.assert_array_equal(got.x, want.x)
  assert (got.nfev, got.fun) == (want.nfev, want.fun)
