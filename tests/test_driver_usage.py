"""The driver as users use it (issue 29): compile once per configuration, own loops that
cannot go silently wrong, sweeps over problem data, rtol's threshold, limits checked once."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax

from helpers import Compilations, counting, logistic, logistic_problem, python_blocks
from hdm_optax.driver import engine
from hdm_optax.driver import limits as limits_lib
from hdm_optax.driver import programs

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends

PROBLEM = logistic_problem(3, m=30, n=5)
ARGS = (PROBLEM.a, PROBLEM.y)

# (factory, the arguments a user gives, another configuration)
FACTORIES = [
  (hdm_optax.hdm, {}, dict(precond_lr=0.3)),
  (hdm_optax.hdm_hb, {}, dict(precond_lr=0.3)),
  (hdm_optax.hdm_agd, dict(lipschitz=PROBLEM.lip), dict(lipschitz=PROBLEM.lip, theta=0.5)),
  (hdm_optax.hdm_best, dict(lipschitz=PROBLEM.lip), dict(lipschitz=PROBLEM.lip, precond_lr=0.1)),
  (hdm_optax.hdm_auto, {}, dict(seed=1)),
  (hdm_optax.osgm_best, {}, dict(seed=1)),
  (hdm_optax.trial_lbfgs, {}, dict(memory_size=5)),
]
IDS = [f.__name__ for f, _, _ in FACTORIES]


def _cache_size():
  return programs.compiled_count()  # pylint: disable=protected-access


# ---------------------------------------------------------------------------
# 1. One compiled program per configuration; limits are traced
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("factory, base, other", FACTORIES, ids=IDS)
def test_factories_carry_their_configuration(factory, base, other):
  assert factory(**base) == factory(**base) and hash(factory(**base)) == hash(factory(**base))
  assert factory(**other) == factory(**other) and factory(**other) != factory(**base)
  assert factory.__name__ in repr(factory(**other))
  # An array argument is its own configuration (compared by identity).
  if factory is hdm_optax.hdm_best:
    lip = jnp.asarray(PROBLEM.lip)
    assert factory(lipschitz=lip) == factory(lipschitz=lip)
    assert factory(lipschitz=lip) != factory(lipschitz=jnp.asarray(PROBLEM.lip))


# A JAX objective's runs compile three programs (docs/guide.md, "Which program runs"): the
# method's and the objective's at the first run (the separate path), the fused one at the
# second (in the background), which serves the third and later runs.
_PROGRAMS_OF_AN_OBJECTIVE = 3


@pytest.mark.fused_program  # counts the programs the library's own choice builds
def test_a_fresh_optimizer_with_equal_arguments_reuses_the_program():
  hdm_optax.clear_caches()
  before = _cache_size()
  for seed in range(3):  # three datasets of one shape, the optimizer built inline
    data = logistic_problem(seed, m=30, n=5)
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(), logistic, data.x0, max_steps=80, fun_args=data[:2]
    )
    assert bool(res.converged)
  assert _cache_size() == before + _PROGRAMS_OF_AN_OBJECTIVE
  hdm_optax.solve(
    hdm_optax.trial_lbfgs(memory_size=4), logistic, PROBLEM.x0, max_steps=50, fun_args=ARGS
  )
  assert _cache_size() == before + _PROGRAMS_OF_AN_OBJECTIVE + 1  # its own method's program


@pytest.mark.fused_program  # counts the programs the library's own choice builds
def test_budgets_and_tolerances_are_traced():
  opt = hdm_optax.hdm_auto(seed=2)
  run = lambda **kw: hdm_optax.solve(opt, logistic, PROBLEM.x0, fun_args=ARGS, **kw)
  hdm_optax.clear_caches()
  before = _cache_size()
  results = [
    run(max_steps=600, tol=1e-6),
    run(max_steps=700, tol=1e-8, rtol=1e-3),
    run(max_steps=1000, tol=0.0, max_grad_evals=40, max_null_steps=50, min_value=-1.0),
  ]
  # 601 to 1001 entries: one trace length, 1024
  assert _cache_size() == before + _PROGRAMS_OF_AN_OBJECTIVE
  for res, steps in zip(results, (600, 700, 1000)):
    assert res.trace.value.shape == (steps + 1,) and res.trace.grad_evals.shape == (steps + 1,)
  assert 40 <= int(results[2].num_grad_evals) <= 41
  assert hdm_optax.Status(int(results[2].status)) == hdm_optax.Status.MAX_STEPS
  # The same trajectory as a program of the exact trace length (solve traced inline): bit
  # for bit on the CPU; another program elsewhere (an H100 summed f in another order: 1e-14).
  inline = jax.jit(
    lambda x: hdm_optax.solve(opt, logistic, x, max_steps=600, tol=1e-6, fun_args=ARGS)
  )
  exact = inline(PROBLEM.x0)
  assert int(exact.num_steps) == int(results[0].num_steps)
  backends.assert_same_across_programs(exact.trace.value, results[0].trace.value, np.float64)
  run(max_steps=1100)  # longer: the trace keeps the last 1024 entries, one program still
  assert _cache_size() == before + _PROGRAMS_OF_AN_OBJECTIVE


def test_solve_checks_its_limits_once(monkeypatch):
  calls, builds = [], []
  check, build = limits_lib.Limits.checked, engine.make_loop

  def counted_check(limits):
    calls.append(limits)
    return check(limits)

  monkeypatch.setattr(limits_lib.Limits, "checked", counted_check)
  monkeypatch.setattr(engine, "make_loop", lambda *a: builds.append(1) or build(*a))
  opt = hdm_optax.hdm(precond_lr=0.123)  # a new configuration: traced here
  hdm_optax.solve(opt, logistic, PROBLEM.x0, max_steps=20, tol=1e-5, rtol=1e-3, fun_args=ARGS)
  assert len(calls) == 1 and builds == [1]


# ---------------------------------------------------------------------------
# 2. Own loops compile once
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("chained", [False, True])
def test_value_and_grad_from_state_compiles_once_in_a_python_loop(chained):
  opt = hdm_optax.hdm_best(lipschitz=PROBLEM.lip)  # its cache is used: a lax.cond
  opt = optax.chain(opt, optax.scale(0.5)) if chained else opt  # its cache is not
  fun = lambda w: logistic(w, *ARGS)
  value_and_grad = hdm_optax.value_and_grad_from_state(fun)
  update = jax.jit(opt.update, static_argnames="value_fn")
  x, state = PROBLEM.x0, opt.init(PROBLEM.x0)
  counts = []
  with Compilations() as compiled:
    for _ in range(6):
      value, grad = value_and_grad(x, state=state)
      updates, state = update(grad, state, x, value=value, grad=grad, value_fn=fun)
      x = optax.apply_updates(x, updates)
      counts.append(compiled.count)
  assert counts[1] == counts[-1], counts
  np.testing.assert_allclose(value_and_grad(x, state=state)[0], fun(x), rtol=1e-12)


def _compilations_per_iteration(page: str) -> list:
  """Runs the first python block of ``page``; the compilation count at each start of its loop."""
  block = python_blocks(page)[0]
  header = re.search(r"^for \w+ in range\(\d+\):.*\n", block, re.M)
  assert header, f"the first block of {page} has a loop"
  marked = block.replace(header.group(0), header.group(0) + "  _mark()\n", 1)
  counts = []
  with Compilations() as compiled:
    namespace = {"_mark": lambda: counts.append(compiled.count)}
    exec(compile(marked, page, "exec"), namespace)  # pylint: disable=exec-used
  return counts


@pytest.mark.parametrize("page", ["docs/guide.md", "README.md"])
def test_the_first_loop_as_written_compiles_once(page):
  """The guide's own optax loop and README's solve over datasets: nothing compiles after
  the first iteration."""
  counts = _compilations_per_iteration(page)
  assert len(counts) >= 3 and counts[1] == counts[-1], counts


# 3. A stale cache is never acted on: evaluated again, counted, warned of once
# ---------------------------------------------------------------------------


def _own_loop(opt, value_and_grad, fun, x, steps, jit, tol=0.0):
  """optax's own-loop recipe; stops before an update once ||grad f|| <= tol at x (evaluated
  apart: optax's cached gradient may be another point's)."""

  def update(grad, state, x, value):  # grad once, as hdm_agd asks (one tracer under jit)
    return opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)

  update = jax.jit(update) if jit else update
  value_and_grad = jax.jit(value_and_grad)  # optax's is not: a cond traced at every call
  grad_norm = jax.jit(lambda x: optax.tree.norm(jax.grad(fun)(x)))
  state = opt.init(x)
  for _ in range(steps):
    if tol and float(grad_norm(x)) <= tol:
      break
    value, grad = value_and_grad(x, state=state)
    updates, state = update(grad, state, x, value)
    x = optax.apply_updates(x, updates)
  return x, state


def _stale(state) -> int:
  return sum(int(v) for _, v in optax.tree.get_all_with_path(state, "num_stale_updates"))


def _grad_evals(state) -> int:
  return sum(int(v) for _, v in optax.tree.get_all_with_path(state, "num_grad_evals"))


TAILS = {
  "scale": optax.scale(0.5),
  "weight_decay": optax.add_decayed_weights(1e-6),
  "clip": optax.clip_by_global_norm(0.1),
}
STALE_TOL = 1e-4


def _like_solve(opt, jit):
  """The own loop with optax's cache reaches solve's point in as many updates, with no more
  calls; returns its state."""
  fun = lambda w: logistic(w, *ARGS)
  with warnings.catch_warnings():  # warned of where the program compiles (maybe before)
    warnings.filterwarnings("ignore", "the optimizer caches f and grad f")
    res = hdm_optax.solve(opt, fun, PROBLEM.x0, max_steps=1000, tol=STALE_TOL)
  assert res.converged
  with pytest.warns(UserWarning, match="other than the point where it cached") as record:
    x, state = _own_loop(
      opt, optax.value_and_grad_from_state(fun), fun, PROBLEM.x0, 1000, jit, tol=STALE_TOL
    )
    jax.effects_barrier()
  assert sum("other than the point" in str(w.message) for w in record) == 1  # once, jit or not
  steps = int(optax.tree.get(state, "count"))
  assert float(optax.tree.norm(jax.grad(fun)(x))) <= STALE_TOL
  assert steps <= 1.1 * int(res.num_steps) + 3, (steps, int(res.num_steps))
  assert 1 + _grad_evals(state) <= int(res.num_grad_evals)  # no extra call after a null step
  np.testing.assert_allclose(float(fun(x)), float(res.value), rtol=1e-8)
  return state


@pytest.mark.parametrize(
  "tail, jit", [("scale", False)] + [(tail, True) for tail in TAILS], ids=lambda v: str(v)
)
def test_trial_lbfgs_then_a_transformation_with_optax_cache_converges_as_solve(tail, jit):
  """optax.chain(trial_lbfgs(), tail) with optax.value_and_grad_from_state: each update
  that receives the cache of another point evaluates f at the params."""
  state = _like_solve(optax.chain(hdm_optax.trial_lbfgs(), TAILS[tail]), jit)
  assert _stale(state) >= 2


@pytest.mark.parametrize("factory, base, _", FACTORIES, ids=IDS)
def test_every_method_then_scale_with_optax_cache_converges_as_solve(factory, base, _):
  _like_solve(optax.chain(factory(**base), optax.scale(0.5)), jit=True)


def _counted(fun, calls: list):
  """``fun`` that appends to ``calls`` at each executed (not traced) evaluation."""

  def counted(*args):
    jax.debug.callback(lambda: calls.append(1))
    return fun(*args)

  return counted


def test_every_stale_update_is_counted_and_evaluated_once_more():
  """Outside jit, with f's calls counted in Python: each update after an accepted scaled
  step is stale, is counted, and costs exactly one more call, in info's calls too."""
  calls = []
  fun = _counted(lambda w: logistic(w, *ARGS), calls)

  opt = optax.chain(hdm_optax.trial_lbfgs(), optax.scale(0.5))
  value_and_grad = optax.value_and_grad_from_state(fun)
  x, state, accepted, stale = PROBLEM.x0, opt.init(PROBLEM.x0), [], []
  with pytest.warns(UserWarning, match="other than the point"):
    for _ in range(12):
      value, grad = value_and_grad(x, state=state)
      updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
      x = optax.apply_updates(x, updates)
      accepted.append(bool(optax.tree.get(state, "accepted")))
      stale.append(_stale(state))
  jax.effects_barrier()
  # The update after an accepted step gets the cache at x + u, not x + u / 2.
  assert np.diff([0] + stale).tolist() == [0] + [int(a) for a in accepted[:-1]]
  assert sum(accepted[:-1]) >= 5
  assert len(calls) == 1 + _grad_evals(state)  # optax's first call, then info's


def test_the_stale_warning_is_once_per_transformation_under_jit():
  fun = lambda w: logistic(w, *ARGS)
  value_and_grad = optax.value_and_grad_from_state(fun)
  opt = optax.chain(hdm_optax.hdm(), optax.scale(0.5))
  for expected in (1, 0):  # the same transformation, a second loop: no second warning
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      _, state = _own_loop(opt, value_and_grad, fun, PROBLEM.x0, 10, jit=True)
      jax.effects_barrier()
    assert sum("other than the point" in str(w.message) for w in record) == expected
    assert _stale(state) >= 2


def test_value_at_params_leaves_the_check_out():
  """A caller's promise is taken as given: the stale cache is then neither evaluated nor
  counted (the extra argument, and the drivers' context)."""
  fun = lambda w: logistic(w, *ARGS)
  opt = optax.chain(hdm_optax.hdm(), optax.scale(0.5))
  x, state = PROBLEM.x0, opt.init(PROBLEM.x0)
  value, grad = jax.value_and_grad(fun)(x)
  accepted = False
  while not accepted:  # until a step is taken: the cache is then at x + u, not x + u / 2
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    x = optax.apply_updates(x, updates)
    value, grad = optax.tree.get(state, "value"), optax.tree.get(state, "grad")
    accepted = bool(optax.tree.get(state, "accepted"))
  assert _stale(state) == 0
  calls = _grad_evals(state)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, promised = opt.update(
      grad, state, x, value=value, grad=grad, value_fn=fun, value_at_params=True
    )
    with hdm_optax.values_at_params():
      _, context = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
  assert _stale(promised) == _stale(context) == 0
  assert _grad_evals(promised) == _grad_evals(context) == calls + 1
  with pytest.warns(UserWarning, match="other than the point"):
    _, checked = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
  assert _stale(checked) == 1 and _grad_evals(checked) == calls + 2


def test_drivers_leave_the_stale_check_out_of_a_vmapped_solve():
  """A vmapped solve executes one oracle call per member per iteration: the check's cond,
  which would run both branches under vmap, is not in the program."""
  executed = []
  fun = _counted(logistic, executed)
  x0 = jnp.stack([PROBLEM.x0, 0.5 * PROBLEM.x0, -PROBLEM.x0])

  def solve(x):
    return hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, x, fun_args=ARGS, max_steps=50)

  res = jax.jit(jax.vmap(solve))(x0)
  jax.effects_barrier()
  # The batched loop runs until its slowest member stops; a callback under vmap runs once for
  # the batch.
  assert len(executed) == int(jnp.max(res.num_grad_evals))


# The point check is written twice (the iteration shell, hdm_agd's own update): every method
# in float32, where the check's tolerance is tightest, and one of each kind in float64.
LOOP_CASES = [(*case, jnp.float32) for case in FACTORIES] + [
  (*case, jnp.float64)
  for case in FACTORIES
  if case[0] in (hdm_optax.hdm_agd, hdm_optax.trial_lbfgs)
]


@pytest.mark.parametrize(
  "factory, base, _, dtype",
  LOOP_CASES,
  ids=[f"{c[0].__name__}-{jnp.dtype(c[3]).name}" for c in LOOP_CASES],
)
def test_correct_loops_are_never_flagged(factory, base, _, dtype):
  """The method last with optax's cache, a chain with hdm_optax's, and solve: no count."""
  a, y = (jnp.asarray(v, dtype) for v in ARGS)
  fun = lambda w: logistic(w, a, y)
  x0 = jnp.asarray(PROBLEM.x0, dtype) + 3.0  # away from 0, where the check is tightest
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    opt = factory(**base)
    _, state = _own_loop(opt, optax.value_and_grad_from_state(fun), fun, x0, 60, jit=True)
    assert _stale(state) == 0
    chain = optax.chain(opt, optax.scale(0.5))
    _, state = _own_loop(chain, hdm_optax.value_and_grad_from_state(fun), fun, x0, 30, jit=True)
    assert _stale(state) == 0
  res = hdm_optax.solve(opt, logistic, x0, max_steps=200, tol=0.0, fun_args=(a, y))
  assert _stale(res.state) == 0


def test_no_false_alarm_on_a_large_float32_pytree():
  """n = 2e5 in two leaves, x far from 0 and steps that cancel entries: still no count."""
  rng = np.random.default_rng(0)
  target = {
    "w": jnp.asarray(rng.normal(size=(400, 250)), jnp.float32),
    "b": jnp.zeros(100000, jnp.float32),
  }
  fun = lambda p: sum(jnp.sum((p[k] - target[k]) ** 2 * (1.0 + 0.5 * jnp.cos(p[k]))) for k in p)
  x0 = {"w": jnp.full((400, 250), 10.0, jnp.float32), "b": jnp.full(100000, -7.0, jnp.float32)}
  for opt in (hdm_optax.trial_lbfgs(), hdm_optax.hdm_auto()):
    _, state = _own_loop(opt, optax.value_and_grad_from_state(fun), fun, x0, 40, jit=True)
    assert _stale(state) == 0


# ---------------------------------------------------------------------------
# 4. sweep: problem data, shape-fixing settings, rtol
# ---------------------------------------------------------------------------


def ridge(w, a, y, lam):
  return 0.5 * jnp.sum((a @ w - y) ** 2) + 0.5 * lam * jnp.sum(w**2)


def test_sweep_over_an_axis_of_fun_args_and_x0():
  rng = np.random.default_rng(1)
  a, y = jnp.asarray(rng.normal(size=(20, 4))), jnp.asarray(rng.normal(size=20))
  lams = jnp.asarray([0.01, 0.1, 1.0])
  x0s = jnp.asarray(rng.normal(size=(3, 4)))
  out = hdm_optax.sweep(
    lambda memory_size: hdm_optax.trial_lbfgs(memory_size),
    {"memory_size": [3, 6]},
    ridge,
    x0s,
    max_steps=80,
    tol=1e-8,
    fun_args=(a, y, lams),
    in_axes=(0, (None, None, 0)),
  )
  assert len(out.points) == 6 and out.results.num_steps.shape == (6,)
  for i, point in enumerate(out.points):
    b = point["problem"]
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(point["memory_size"]),
      ridge,
      x0s[b],
      max_steps=80,
      tol=1e-8,
      fun_args=(a, y, lams[b]),
    )
    assert int(out.results.num_steps[i]) == int(res.num_steps)
    np.testing.assert_allclose(out.results.params[i], res.params, rtol=1e-9, atol=1e-12)
    assert out.results.state[i].direction.memory.s[0].shape[0] == point["memory_size"]
  exact = jnp.linalg.solve(a.T @ a + lams[2] * jnp.eye(4), a.T @ y)
  np.testing.assert_allclose(out.results.params[5], exact, rtol=1e-6)


def test_a_shape_setting_gets_a_program_of_its_own():
  fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x**2)
  out = hdm_optax.sweep(
    hdm_optax.trial_lbfgs, {"memory_size": [5, 10, 20]}, fun, jnp.ones(3), max_steps=60
  )
  assert [p["memory_size"] for p in out.points] == [5, 10, 20]
  assert bool(jnp.all(out.results.converged))
  assert [int(s.direction.memory.s[0].shape[0]) for s in out.results.state] == [5, 10, 20]


def test_a_sweep_of_states_of_other_shapes_says_each_points_message():
  """``results.message`` reads each point's own state when the states differ in shape."""
  fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x**2)
  grid = {"memory_size": [2, 7]}
  for max_steps in (2, 60):  # stopped at max_steps (stall notes, advice), converged
    out = hdm_optax.sweep(hdm_optax.trial_lbfgs, grid, fun, jnp.ones(3), max_steps=max_steps)
    alone = [
      hdm_optax.solve(hdm_optax.trial_lbfgs(m), fun, jnp.ones(3), max_steps=max_steps).message
      for m in grid["memory_size"]
    ]
    assert isinstance(out.results.state, list)
    assert out.results.message == alone


def test_sweep_rtol_is_solves():
  kw = dict(max_steps=300, tol=0.0, rtol=1e-3, fun_args=ARGS)
  out = hdm_optax.sweep(hdm_optax.hdm, {"precond_lr": [0.1, 0.3]}, logistic, PROBLEM.x0, **kw)
  for i, lr in enumerate([0.1, 0.3]):
    res = hdm_optax.solve(hdm_optax.hdm(precond_lr=lr), logistic, PROBLEM.x0, **kw)
    assert int(res.num_steps) == int(out.results.num_steps[i])
    assert float(res.tol) == float(out.results.tol[i])


def test_sweep_refuses_bad_problem_axes():
  fun = lambda x, lam: lam * jnp.sum(x**2)
  make = lambda precond_lr: hdm_optax.hdm(precond_lr=precond_lr)
  kw = dict(max_steps=5, fun_args=(jnp.ones(3),))
  with pytest.raises(ValueError, match="one size"):
    hdm_optax.sweep(make, {"precond_lr": [0.1]}, fun, jnp.ones((2, 3)), in_axes=(0, 0), **kw)
  with pytest.raises(ValueError, match="in_axes must be a pair"):
    hdm_optax.sweep(make, {"precond_lr": [0.1]}, fun, jnp.ones(3), in_axes=0, **kw)
  with pytest.raises(ValueError, match="stop_at_first_converged"):
    hdm_optax.sweep(
      make,
      {"precond_lr": [0.1]},
      fun,
      jnp.ones(3),
      in_axes=(None, 0),
      stop_at_first_converged=True,
      **kw,
    )


# ---------------------------------------------------------------------------
# 5. rtol's threshold is reported
# ---------------------------------------------------------------------------


def test_the_threshold_is_reported():
  rng = np.random.default_rng(0)
  a = rng.normal(size=(2000, 20))
  y = jnp.asarray(np.sign(a @ rng.normal(size=20) + 0.5 * rng.normal(size=2000)), jnp.float32)
  a, w0 = jnp.asarray(a, jnp.float32), jnp.zeros(20, jnp.float32)
  g0 = float(jnp.max(jnp.abs(jax.grad(logistic)(w0, a, y))))
  res = hdm_optax.solve(
    hdm_optax.trial_lbfgs(), logistic, w0, max_steps=200, rtol=1e-5, fun_args=(a, y)
  )
  assert res.tol.dtype == jnp.float32
  np.testing.assert_allclose(float(res.tol), max(1e-4, 1e-5 * g0), rtol=1e-6)
  # f sums 2000 terms, ||grad f(x0)||_inf = 350: rtol=1e-5 stops 35 times above tol, which
  # float32 reaches here (docs/pitfalls.md).
  assert float(res.tol) > 30 * 1e-4 and float(res.grad_norm) > 1e-4
  plain = hdm_optax.solve(hdm_optax.trial_lbfgs(), logistic, w0, max_steps=200, fun_args=(a, y))
  assert float(plain.tol) == np.float32(1e-4) and bool(plain.converged)


# ---------------------------------------------------------------------------
# 6. the common mistakes at the front doors: a clear error naming the argument and the fix
# ---------------------------------------------------------------------------


def _SQUARE(x, a):
  return jnp.sum((x - a) ** 2)


@pytest.mark.parametrize("array", [jnp.ones(2), np.ones(2)])
@pytest.mark.parametrize("door", ["solve", "solve_batch", "sweep", "loop"])
def test_fun_args_given_one_array_is_refused(door, array):
  # tuple(A) unpacked A row by row: "<lambda>() takes 2 positional arguments but 3 were given"
  x0 = jnp.zeros((3, 2)) if door == "solve_batch" else jnp.zeros(2)
  calls = {
    "solve": lambda: hdm_optax.solve(hdm_optax.trial_lbfgs(), _SQUARE, x0, fun_args=array),
    "solve_batch": lambda: hdm_optax.solve_batch(
      hdm_optax.trial_lbfgs(), _SQUARE, x0, fun_args=array, in_axes=(0, None)
    ),
    "sweep": lambda: hdm_optax.sweep(
      lambda m: hdm_optax.trial_lbfgs(m), {"m": [3]}, _SQUARE, x0, fun_args=array
    ),
    "loop": lambda: hdm_optax.loop(hdm_optax.trial_lbfgs(), _SQUARE, fun_args=array),
  }
  with pytest.raises(TypeError, match=r"fun_args.*shape \(2,\).*fun_args=\(A,\)"):
    calls[door]()
  # a tuple of one array, and minimize's args (SciPy's rule: one array is one argument), run
  res = hdm_optax.solve(hdm_optax.trial_lbfgs(), _SQUARE, jnp.zeros(2), fun_args=(array,))
  assert bool(res.converged)
  if door == "solve":
    out = hdm_optax.minimize(_SQUARE, np.zeros(2), args=np.ones(2), method="trial_lbfgs")
    assert out.success


@pytest.mark.parametrize("door", ["solve", "solve_batch"])
def test_the_factory_instead_of_the_optimizer_is_refused(door):
  # "'function' object has no attribute 'init'"
  x0 = jnp.zeros((3, 2)) if door == "solve_batch" else jnp.zeros(2)
  batch = {"in_axes": (0, None)} if door == "solve_batch" else {}
  run = getattr(hdm_optax, door)
  with pytest.raises(TypeError, match=r"optimizer.*trial_lbfgs.*hdm_optax\.trial_lbfgs\(\)"):
    run(hdm_optax.trial_lbfgs, _SQUARE, x0, fun_args=(jnp.ones(2),), **batch)
  with pytest.raises(TypeError, match=r"optimizer must be an optax transformation.*got 3"):
    hdm_optax.solve(3, _SQUARE, jnp.zeros(2), fun_args=(jnp.ones(2),))


def test_the_errors_of_three_common_mistakes_name_the_fix():
  """An HDM method inside optax.masked, update without params, and in_axes mapping a number
  (the errors named JAX's internals or a leaf without saying which)."""
  fun = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum((p["v"] - 1.0) ** 2)
  x0 = {"w": jnp.ones(2), "v": jnp.zeros(2)}
  inside = optax.masked(hdm_optax.trial_lbfgs(), {"w": False, "v": True})
  with pytest.raises(ValueError, match=r"inside optax.masked.*optax.chain\(optax.masked\("):
    hdm_optax.solve(inside, fun, x0)
  opt = hdm_optax.trial_lbfgs()
  with pytest.raises(TypeError, match=r"trial_lbfgs.update needs params"):
    opt.update(jnp.ones(2), opt.init(jnp.zeros(2)), value=jnp.asarray(1.0), grad=jnp.ones(2))
  quadratic = lambda x, a, weight: jnp.sum((x - a) ** 2) + weight * jnp.sum(x**2)
  with pytest.raises(ValueError, match=r"axis 0 of fun_args\[1\], of shape \(\).*None"):
    hdm_optax.solve_batch(opt, quadratic, jnp.zeros((3, 2)), fun_args=(jnp.ones((3, 2)), 0.1))


def _doors(optimizer):
  """Every front door that takes an optimizer, called with ``optimizer`` on ``_SQUARE``."""
  a, batch = jnp.ones(2), jnp.ones((3, 2))

  def optimistix():
    optx = pytest.importorskip("optimistix")
    from hdm_optax.optimistix_adapter import HDMMinimiser  # pylint: disable=import-outside-toplevel

    return optx.minimise(_SQUARE, HDMMinimiser(optimizer), jnp.zeros(2), a, max_steps=50)

  return {
    "solve": lambda: hdm_optax.solve(optimizer, _SQUARE, jnp.zeros(2), fun_args=(a,)),
    "solve_batch": lambda: hdm_optax.solve_batch(
      optimizer, _SQUARE, jnp.zeros(2), fun_args=(batch,), in_axes=(None, 0)
    ),
    "sweep": lambda: hdm_optax.sweep(lambda: optimizer, {}, _SQUARE, jnp.zeros(2), fun_args=(a,)),
    "loop": lambda: hdm_optax.loop(optimizer, _SQUARE, fun_args=(a,)).start(jnp.zeros(2)),
    "optimistix": optimistix,
  }


@pytest.mark.parametrize("door", ["solve", "solve_batch", "sweep", "loop", "optimistix"])
@pytest.mark.parametrize(
  "inner", [hdm_optax.trial_lbfgs, hdm_optax.hdm_auto, optax.lbfgs], ids=lambda f: f.__name__
)
def test_multisteps_around_a_method_that_calls_f_is_refused(door, inner):
  # MultiSteps kept the inner state of 1 mini-step in 3: 2 of 3 calls escaped the count
  calls = _doors(optax.MultiSteps(inner(), every_k_schedule=3))
  with pytest.raises(TypeError, match=r"optimizer: optax.MultiSteps.*alone.*minibatch_step"):
    calls[door]()
  within = optax.chain(optax.clip(1.0), optax.MultiSteps(inner(), 2).gradient_transformation())
  with pytest.raises(TypeError, match=r"optax.MultiSteps"):
    _doors(within)[door]()


def test_multisteps_around_a_transformation_without_calls_runs_and_counts():
  fun, calls = counting(_SQUARE)
  opt = optax.MultiSteps(optax.sgd(0.3), every_k_schedule=2)
  res = hdm_optax.solve(opt, fun, jnp.zeros(2), fun_args=(jnp.ones(2),), check_every=1)
  jax.effects_barrier()
  assert bool(res.converged)
  assert int(res.num_grad_evals) == int(res.num_steps) + 1 == len(calls)


def test_sweep_takes_every_optimizer_solve_takes_with_an_empty_grid():
  # "make_optimizer must be a factory ... (or an optimizer, with grid={})" with grid={}
  rows = jnp.array([[1.0, 2.0], [3.0, 4.0]])
  opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)  # no GradientTransformation
  out = hdm_optax.sweep(opt, {}, _SQUARE, jnp.zeros(2), fun_args=(rows,), in_axes=(None, (0,)))
  for b in range(2):
    res = hdm_optax.solve(opt, _SQUARE, jnp.zeros(2), fun_args=(rows[b],))
    np.testing.assert_allclose(out.results.params[b], res.params, rtol=1e-6)
    assert int(out.results.num_grad_evals[b]) == int(res.num_grad_evals)
  with pytest.raises(ValueError, match=r"make_optimizer is an optimizer \(MultiSteps\)"):
    hdm_optax.sweep(opt, {"k": [2, 3]}, _SQUARE, jnp.zeros(2), fun_args=(rows[0],))
  with pytest.raises(TypeError, match=r"optax.MultiSteps.*minibatch_step"):
    method = optax.MultiSteps(hdm_optax.trial_lbfgs(), 2)
    hdm_optax.sweep(method, {}, _SQUARE, jnp.zeros(2), fun_args=(rows[0],))
