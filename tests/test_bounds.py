"""Bounds: trial_lbfgs(lower=, upper=), the projected-gradient stop, minimize, the box checks.

The bounded trajectory is compared with the NumPy reference (tests/reference.py,
``trial_lbfgs_box_reference``); the iterates of the ``cutest_bounded`` dev list's problems
whose box is active stay in the box; ``bounds=None`` leaves the unbounded program as it was (the box's
functions are never traced); a vmapped batch of bounded problems is one program.
"""

import importlib.util
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.pieces import box as box_lib
from hdm_optax.pieces.lbfgs import bounded

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import reference as ref
  import test_reference as problems
  from test_trial_lbfgs import _run
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import reference as ref
  from tests import test_reference as problems
  from tests.test_trial_lbfgs import _run

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _quadratic(n=8, seed=0):
  """A convex quadratic whose minimiser is outside the box [-1, 1]^n in about half the axes."""
  rng = np.random.default_rng(seed)
  q, _ = np.linalg.qr(rng.standard_normal((n, n)))
  a = (q * np.geomspace(0.05, 1.0, n)) @ q.T
  a = 0.5 * (a + a.T)
  center = 2.0 * rng.standard_normal(n)
  return a, center


@pytest.mark.parametrize("kind", ["quadratic", "logistic"])
def test_matches_reference(kind):
  """x, f and the accept flags match the explicit-matrix reference (float64, one-sided bounds,
  memory 3 so that the buffer wraps) until the run reaches f's rounding."""
  data, _ = problems.make_problem(kind, seed=3)
  f, grad = problems.np_oracle(data)
  fun = problems.jax_objective(data)
  n = problems.N
  lower = np.array([-np.inf, -np.inf, 0.0, -np.inf, -1.0, -np.inf])[:n]
  upper = np.array([np.inf, 1.0, np.inf, np.inf, np.inf, np.inf])[:n]
  x0 = np.clip(3.0 * problems.x_start(2), lower, upper)
  steps = 60
  want = ref.trial_lbfgs_box_reference(f, grad, x0, lower, upper, steps, memory_size=3)
  opt = hdm_optax.trial_lbfgs(3, lower=jnp.asarray(lower), upper=jnp.asarray(upper))
  _, (xs, values, accepted) = _run(opt, fun, jnp.asarray(x0), steps)
  # Up to the step where the reference reaches f's rounding (projected gradient 1e-9, or a
  # decrease of f within 1000 eps |f|, a null step aside): after it, the acceptance compares values that differ
  # in the last bits, and which trial is accepted depends on the machine's rounding.
  pg = [np.max(np.abs(np.clip(x - grad(x), lower, upper) - x)) for x in want["xs"]]
  v = np.asarray(want["values"])
  change = np.abs(np.diff(v))  # 0 after a null step
  flat = (change > 0) & (change <= 1e3 * np.finfo(np.float64).eps * np.abs(v[1:]))
  k = next((i for i, p in enumerate(pg) if p < 1e-9 or (i > 0 and flat[i - 1])), steps)
  assert k >= 10
  np.testing.assert_array_equal(np.asarray(accepted)[:k], np.asarray(want["accepted"])[:k])
  np.testing.assert_allclose(np.asarray(xs)[:k], np.asarray(want["xs"])[:k], rtol=1e-8, atol=1e-10)
  atol = problems.value_atol(data, want["xs"][:k])  # f's rounding, not a relative 1e-10
  np.testing.assert_allclose(np.asarray(values)[:k], np.asarray(want["values"])[:k], atol=atol)
  xs = np.asarray(xs)
  assert np.all(xs >= lower) and np.all(xs <= upper)
  at_bound = np.isclose(xs[-1], lower) | np.isclose(xs[-1], upper)
  assert at_bound.any()  # the box is active at the end: the test is about it


def test_solution_at_bounds_without_zigzag():
  """A quadratic with its minimiser outside the box: KKT point reached, active variables
  stay at their bounds once there, the projected gradient is what stops the run."""
  a, center = _quadratic()
  fun = lambda x: 0.5 * (x - center) @ a @ (x - center)
  opt = hdm_optax.trial_lbfgs(lower=-1.0, upper=1.0)
  res = hdm_optax.solve(opt, fun, jnp.zeros(8), max_steps=200, tol=1e-10)
  assert int(res.status) == hdm_optax.Status.CONVERGED_IN_BOX and bool(res.converged)
  assert res.message.startswith("converged: ||P(x - grad f) - x||_inf")
  x = np.asarray(res.params)
  g = np.asarray(jax.grad(fun)(res.params))
  assert float(np.max(np.abs(np.clip(x - g, -1, 1) - x))) <= 1e-10
  active = (np.abs(x) == 1.0) & (np.abs(g) > 1e-6)
  assert active.sum() >= 2
  (_, _), (xs, _, _) = _run(opt, fun, jnp.zeros(8), int(res.num_steps))
  xs = np.asarray(xs)
  on = xs[:, active] == x[active]  # step k: the active variable sits at its final bound
  first = np.argmax(on, axis=0)
  for j in range(on.shape[1]):  # once there, it never leaves (no zig-zag along the bound)
    assert on[first[j] :, j].all()
  unbounded = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.zeros(8), max_steps=200, tol=1e-4)
  assert int(unbounded.status) == hdm_optax.Status.CONVERGED


# The problems of cutest_bounded_dev.txt on which the box shapes the first 25 updates, or whose
# box has a structure no other one has (each run compiles its own program, about a second).
BOX_PROBLEMS = (
  "AIRCRFTB",  # fixed variables (lower == upper) next to free ones, x0 on them
  "BQP1VAR",  # n = 1, on its bound from the first update
  "BQPGASIM",  # n = 50 box QP: 10 variables reach a bound mid-run, among rejected trials
  "DIAGIQE",  # n = 1000, f unbounded below inside the box: half the variables pinned, f -> -6e16
  "HATFLDB",  # one upper bound among four lower ones, reached after rejected trials
  "HS3",  # lower bound only, reached at update 14 after rejected trials
  "HS4",  # starts at the corner the gradient points out of, and stays there
  "PALMER8E",  # one-sided bound on one of eight variables, reached at the last update
  "S368",  # eight variables, six at a bound from the first update
  "TRIGON1B",  # n = 10, seven variables at a bound from the first update, no rejection
)


def test_never_leaves_the_box_on_the_bounded_suite():
  """The problems of cutest_bounded_dev.txt in BOX_PROBLEMS, 25 updates: every iterate (and
  trial) in the box, nothing NaN. The box is checked after optax.apply_updates, as a user's
  loop applies it.

  The rest of the dev list never reaches its box in 25 updates (or repeats one of these
  boxes' structures): each run compiles its own program, and those check nothing new."""
  # Not importorskip: `import sif2jax` builds every problem class of the package (about a
  # minute); the suite imports only the modules of the problems it runs.
  if importlib.util.find_spec("sif2jax") is None:
    pytest.skip("sif2jax is not installed (pip install -e '.[bench]')")
  from experiments.benchmark import suites as suites_lib

  path = suites_lib.CUTEST_BOUNDED_DEV_LIST
  if not path.exists():
    pytest.skip(f"no {path}")
  assert set(BOX_PROBLEMS) <= set(suites_lib.cutest_names(path))
  for task in suites_lib.cutest_bounded_tasks(1e-4, BOX_PROBLEMS):
    inst = task.build()
    lower, upper = jnp.asarray(inst.lower), jnp.asarray(inst.upper)
    fun = lambda x, inst=inst: inst.fun(x, *inst.fun_args)
    opt = hdm_optax.trial_lbfgs(lower=lower, upper=upper)
    (_, state), (xs, values, _) = _run(opt, fun, inst.x0[0], 25)
    xs = np.asarray(xs)
    assert np.all(xs >= inst.lower) and np.all(xs <= inst.upper), task.name
    assert np.all(np.isfinite(np.asarray(values))), task.name


def test_unbounded_program_never_traces_the_box(monkeypatch):
  """bounds=None compiles today's program: with every function of the box that touches an
  array poisoned, solve(trial_lbfgs()) traces to the same jaxpr, and the bounded one fails."""
  fun = lambda x: jnp.sum((x - 2.0) ** 2) + x[0] * x[1]
  x0 = jnp.ones(3)
  trace = lambda opt: str(jax.make_jaxpr(lambda x: hdm_optax.solve(opt, fun, x, max_steps=5))(x0))
  before = trace(hdm_optax.trial_lbfgs())

  def poisoned(*args, **kwargs):
    raise AssertionError("the unbounded program traced a box function")

  for name in ("project", "projected_step", "free_mask", "projected_gradient_norm"):
    monkeypatch.setattr(box_lib, name, poisoned)
  for name in ("free_part", "free_scaling", "two_metric_step", "restricted_memory"):
    monkeypatch.setattr(bounded, name, poisoned)
  assert trace(hdm_optax.trial_lbfgs()) == before
  assert trace(hdm_optax.trial_lbfgs(lower=None, upper=None)) == before
  with pytest.raises(AssertionError, match="traced a box function"):
    trace(hdm_optax.trial_lbfgs(lower=0.0))


def test_one_free_set_per_update(monkeypatch):
  """A bounded update computes the free set once and hands it on (the step, H_0's first
  scale and the pair's gamma read it)."""
  calls = []
  free_mask = box_lib.free_mask
  monkeypatch.setattr(box_lib, "free_mask", lambda *a: calls.append(1) or free_mask(*a))
  fun = lambda x: jnp.sum((x - 2.0) ** 2)
  opt, x = hdm_optax.trial_lbfgs(lower=0.0, upper=1.0), jnp.ones(3)
  value, grad = jax.value_and_grad(fun)(x)
  jax.make_jaxpr(lambda s: opt.update(grad, s, x, value=value, grad=grad, value_fn=fun))(
    opt.init(x)
  )
  assert len(calls) == 1


def test_the_driver_finds_a_box_by_the_protocol():
  """A state declares its box by driver_box() (hdm_optax.driver.protocol), at any depth; a
  state that holds a Box without saying so has none for the driver (no isinstance)."""

  class Holder(NamedTuple):
    bounds: Any

  class Speaker(NamedTuple):
    bounds: Any
    value: Any = 0.0
    grad: Any = 0.0

    def driver_verdict(self):
      return jnp.asarray(True)

    def driver_box(self):
      return self.bounds

  box = box_lib.make_box(jnp.zeros(2), 0.0, 1.0)
  assert protocol.box_of(Speaker(box)) is box
  assert protocol.box_of((Holder(None), Speaker(box))) is box  # the last of a chain
  assert protocol.box_of(Holder(box)) is None and protocol.box_of(Speaker(None)) is None
  for elsewhere in ((Speaker(box), Speaker(None)), {"inner": Speaker(box)}):
    with pytest.raises(ValueError, match="last one of the chain"):
      protocol.box_of(elsewhere)


def test_infeasible_start_is_projected_and_pytrees_with_scalars():
  """A pytree of two leaves, a scalar bound for one and an array for the other; x0 outside."""
  fun = lambda p: jnp.sum((p["w"] - 3.0) ** 2) + (p["b"] + 1.0) ** 2
  x0 = {"w": jnp.array([5.0, -5.0, 0.5]), "b": jnp.asarray(2.0)}
  lower = {"w": jnp.array([0.0, 0.0, -jnp.inf]), "b": None}
  upper = {"w": 1.0, "b": jnp.asarray(0.5)}
  res = hdm_optax.solve(
    hdm_optax.trial_lbfgs(lower=lower, upper=upper), fun, x0, max_steps=100, tol=1e-8
  )
  assert bool(res.converged)
  np.testing.assert_allclose(np.asarray(res.params["w"]), [1.0, 1.0, 1.0])
  assert float(res.params["b"]) == pytest.approx(-1.0)
  first = float(res.trace.value[0])
  assert first == pytest.approx(float(fun({"w": jnp.array([1.0, 0.0, 0.5]), "b": 0.5})))


def test_pytree_bounds_of_numbers_per_leaf_from_the_first_call():
  """Bounds as pytrees of the params' structure whose leaves are all numbers, one per leaf
  (the separate path packs the params; such bounds have no packed form, so it runs them
  unpacked): the box from the first call, as under jax.jit and in optax's own loop."""
  fun = lambda p: jnp.sum((p["a"] - 2.0) ** 2) + (p["b"] - 2.0) ** 2
  x0 = {"a": jnp.zeros(2), "b": jnp.zeros(())}
  opt = hdm_optax.trial_lbfgs(lower={"a": 0.0, "b": -1.0}, upper={"a": 1.0, "b": 0.5})
  for _ in range(2):
    res = hdm_optax.solve(opt, fun, x0, tol=1e-9)
    np.testing.assert_array_equal(np.asarray(res.params["a"]), [1.0, 1.0])
    assert float(res.params["b"]) == 0.5 and res.status == hdm_optax.Status.CONVERGED_IN_BOX


def test_pytree_bounds_of_numbers_and_none_leaves_from_the_first_call():
  """A side whose leaves are numbers and None (open), or None alone, per leaf: the separate
  path runs it unpacked, as it runs sides of numbers alone (it packed the params and kept
  the side, whose structure then matched neither), and minimize takes it as SciPy's pair."""
  fun = lambda p: jnp.sum((p["a"] + 2.0) ** 2) + (p["b"] - 2.0) ** 2
  x0 = {"a": jnp.zeros(2), "b": jnp.zeros(())}
  for lower, upper in [
    ({"a": 0.0, "b": None}, None),
    (None, {"a": None, "b": 0.5}),
    ({"a": None, "b": None}, {"a": 1.0, "b": 0.5}),
  ]:
    want_a = 0.0 if lower is not None and lower["a"] is not None else -2.0
    want_b = 0.5 if upper is not None else 2.0
    res = hdm_optax.solve(hdm_optax.trial_lbfgs(lower=lower, upper=upper), fun, x0, tol=1e-9)
    other = hdm_optax.minimize(fun, x0, bounds=(lower, upper), options={"gtol": 1e-9})
    for params in (res.params, other.x):
      np.testing.assert_allclose(np.asarray(params["a"]), [want_a, want_a], atol=1e-8)
      np.testing.assert_allclose(float(params["b"]), want_b, atol=1e-8)


@pytest.mark.parametrize(
  "lower, upper, error, match",
  [
    (1.0, 0.0, ValueError, "lower > upper"),
    (jnp.array([0.0, 2.0]), jnp.array([1.0, 1.0]), ValueError, r"index \(1,\)"),
    (jnp.zeros(3), None, ValueError, "shape"),
    ({"a": 0.0}, None, ValueError, "pytree structure"),
    (jnp.zeros(2, jnp.float32), None, TypeError, "dtype float32"),
    (jnp.array([0.0, jnp.nan]), None, ValueError, "NaN"),
    ("0", None, TypeError, "lower must be a number"),
  ],
)
def test_bad_boxes(lower, upper, error, match):
  fun = lambda x: jnp.sum(x**2)
  with pytest.raises(error, match=match):
    hdm_optax.solve(hdm_optax.trial_lbfgs(lower=lower, upper=upper), fun, jnp.ones(2), max_steps=3)


def test_chain_order():
  """A transformation before the bounded one is honoured; one after it is refused."""
  fun = lambda x: jnp.sum((x - 3.0) ** 2)
  ok = optax.chain(optax.clip_by_global_norm(1.0), hdm_optax.trial_lbfgs(lower=0.0, upper=1.0))
  res = hdm_optax.solve(ok, fun, jnp.zeros(3), max_steps=50, tol=1e-8)
  assert bool(res.converged) and np.allclose(np.asarray(res.params), 1.0)
  bad = optax.chain(hdm_optax.trial_lbfgs(lower=0.0), optax.scale(0.5))
  with pytest.raises(ValueError, match="must be the last one of the chain"):
    hdm_optax.solve(bad, fun, jnp.zeros(3), max_steps=5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_float32_and_float64_under_strict_promotion(dtype):
  a, center = _quadratic(6, seed=1)
  a, center = jnp.asarray(a, dtype), jnp.asarray(center, dtype)
  fun = lambda x: 0.5 * (x - center) @ a @ (x - center)
  with jax.numpy_dtype_promotion("strict"):
    res = hdm_optax.minimize(fun, jnp.zeros(6, dtype), bounds=(-1.0, 1.0), tol=1e-4)
  assert res.params.dtype == dtype and res.value.dtype == dtype
  assert bool(res.converged)
  assert float(jnp.max(jnp.abs(res.params))) <= 1.0


def test_minimize_takes_bounds_as_scipy_does():
  """SciPy's (min, max) pairs with None, scipy.optimize.Bounds and (lower, upper) agree."""
  from scipy import optimize

  target = jnp.array([2.0, -1.0, 0.5, 4.0])
  fun = lambda x, t: jnp.sum((x - t) ** 2)
  x0 = jnp.zeros(4)
  forms = [
    [(0, 1), (0, None), (None, None), (-np.inf, 3.0)],
    optimize.Bounds([0, 0, -np.inf, -np.inf], [1, np.inf, np.inf, 3.0]),
    (jnp.array([0.0, 0.0, -jnp.inf, -jnp.inf]), jnp.array([1.0, jnp.inf, jnp.inf, 3.0])),
  ]
  for bounds in forms:
    res = hdm_optax.minimize(fun, x0, args=(target,), bounds=bounds)
    np.testing.assert_allclose(np.asarray(res.params), [1.0, 0.0, 0.5, 3.0], atol=1e-6)
    assert int(res.status) == hdm_optax.Status.CONVERGED_IN_BOX
  free = hdm_optax.minimize(fun, x0, args=(target,))
  assert int(free.status) == hdm_optax.Status.CONVERGED
  np.testing.assert_allclose(np.asarray(free.params), np.asarray(target), atol=1e-6)


def test_minimize_errors():
  fun = lambda x: jnp.sum(x**2)
  with pytest.raises(ValueError, match="bounds' lower > bounds' upper"):
    hdm_optax.minimize(fun, jnp.ones(2), bounds=[(1, 0), (0, 1)])
  with pytest.raises(TypeError, match="bounds must be None, a pair"):
    hdm_optax.minimize(fun, jnp.ones(3), bounds=[(0, 1)] * 2 + [0])
  with pytest.raises(ValueError, match="unknown method"):
    hdm_optax.minimize(fun, jnp.ones(2), method="lbfgsb")


@pytest.mark.fused_program  # counts the programs the library's own choice builds
def test_minimize_compiles_once():
  """Another start, box, data and tol reuse the compiled program."""
  fun = lambda x, t: jnp.sum((x - t) ** 2)
  hdm_optax.clear_caches()
  before = programs.compiled_count()
  hdm_optax.minimize(fun, jnp.zeros(3), args=(jnp.ones(3),), bounds=(jnp.zeros(3), jnp.ones(3)))
  first = programs.compiled_count()
  res = hdm_optax.minimize(
    fun,
    jnp.full(3, 2.0),
    args=(jnp.full(3, 5.0),),
    bounds=(jnp.full(3, -1.0), jnp.full(3, 0.5)),
    tol=1e-8,
  )
  # The first call compiles the method's program and the objective's; the second only the
  # fused one, in the background (docs/guide.md, "Which program runs").
  assert first == before + 2 and programs.compiled_count() == first + 1
  np.testing.assert_allclose(np.asarray(res.params), 0.5)


def test_vmapped_batch_of_boxes_is_one_program():
  """64 problems, each its own box and data, as one jit(vmap(minimize)); the same answers
  as one at a time, every point in its box."""
  batch, n = 64, 5
  rng = np.random.default_rng(0)
  targets = jnp.asarray(3.0 * rng.standard_normal((batch, n)))
  lower = jnp.asarray(-rng.uniform(0.1, 1.0, (batch, n)))
  upper = jnp.asarray(rng.uniform(0.1, 1.0, (batch, n)))
  scale = jnp.asarray(np.geomspace(1.0, 30.0, n))
  fun = lambda x, t: jnp.sum(scale * (x - t) ** 2) + 0.1 * jnp.sum(x[1:] * x[:-1])

  def one(t, lo, hi):
    return hdm_optax.minimize(fun, jnp.zeros(n), args=(t,), bounds=(lo, hi), max_steps=200)

  batched = jax.jit(jax.vmap(one)).lower(targets, lower, upper).compile(FAST_COMPILE)
  res = batched(targets, lower, upper)
  assert bool(jnp.all(res.converged))
  assert bool(jnp.all((res.params >= lower) & (res.params <= upper)))
  for i in (0, 17, 63):
    single = one(targets[i], lower[i], upper[i])
    np.testing.assert_allclose(np.asarray(res.params[i]), np.asarray(single.params), atol=1e-5)


def test_projected_step_lands_inside_after_rounding():
  """x + (P(x + d) - x) rounds outside the box in about one case in eight; the step
  ``projected_step`` returns never does (float32 and float64)."""
  rng = np.random.default_rng(0)
  for dtype in (np.float32, np.float64):
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-6, 6, 20000)).astype(dtype)
    hi = np.maximum(x, (rng.standard_normal(20000) * 10.0 ** rng.integers(-6, 6, 20000)))
    hi = hi.astype(dtype)
    box = box_lib.Box(lower=jnp.asarray(-np.inf, dtype), upper=jnp.asarray(hi))
    naive = x + (hi - x)
    assert np.sum(naive > hi) > 1000  # the case the function is for
    step = box_lib.projected_step(box, jnp.asarray(x), jnp.asarray(np.full_like(x, 1e30)))
    assert np.all(np.asarray(jnp.asarray(x) + step) <= hi)
