"""solve and sweep: budgets, status codes and the early-stopping sweep."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import backends
import hdm_optax
from backends import assert_same_across_programs
from helpers import EVERY_STEP, counting, logistic, logistic_problem
from hdm_optax.driver import results
from hdm_optax.driver import programs
from hdm_optax.driver import solving
from hdm_optax.driver import engine
from hdm_optax.driver import runs


A = jnp.array([1.0, 10.0, 100.0])


def quadratic(x, a):
  return jnp.sum(a * x**2)


def make_best(precond_lr, momentum_lr):
  return hdm_optax.hdm_best(lipschitz=200.0, precond_lr=precond_lr, momentum_lr=momentum_lr)


GRID = {"precond_lr": [1e-4, 1e-3, 1e-2], "momentum_lr": [1.0, 3.0]}


def test_stop_at_first_converged_keeps_the_best_point():
  full = hdm_optax.sweep(
    make_best, GRID, quadratic, jnp.ones(3), max_steps=400, tol=1e-6, fun_args=(A,)
  )
  first = hdm_optax.sweep(
    make_best,
    GRID,
    quadratic,
    jnp.ones(3),
    max_steps=400,
    tol=1e-6,
    fun_args=(A,),
    stop_at_first_converged=True,
  )
  # The two sweeps are different compiled programs, so their trajectories agree
  # to rounding, and a point that meets tol at the last step in one may need
  # one more step in the other.
  b = first.best
  full_steps = np.asarray(full.results.num_steps)
  k = int(first.results.num_steps[b])
  assert abs(k - full_steps[full.best]) <= 1 and abs(k - full_steps[b]) <= 1
  np.testing.assert_allclose(
    first.results.trace.value[b, :k], full.results.trace.value[b, :k], rtol=1e-8
  )
  steps = np.asarray(first.results.num_steps)
  assert np.all(steps <= steps[b])  # everyone stopped with the winner
  status = np.asarray(first.results.status)
  assert status[b] == hdm_optax.Status.CONVERGED
  assert np.any(status == hdm_optax.Status.STOPPED)  # the test can fail: someone was cut short
  assert np.asarray(full.results.num_steps).max() > steps[b]


def test_max_grad_evals_budget_and_status():
  res = hdm_optax.solve(
    optax.lbfgs(),
    quadratic,
    jnp.ones(3) * 5,
    max_steps=100,
    tol=0.0,
    fun_args=(A,),
    max_grad_evals=12,
  )
  assert int(res.status) == hdm_optax.Status.MAX_STEPS
  assert 12 <= int(res.num_grad_evals) <= 12 + 30  # a linesearch step may overshoot
  assert not bool(res.converged)
  grad_evals = np.asarray(res.trace.grad_evals)
  assert grad_evals[int(res.num_steps)] == int(res.num_grad_evals)
  assert np.all(np.diff(grad_evals) >= 0)


def test_trace_is_frozen_after_the_last_step():
  res = hdm_optax.solve(
    make_best(1e-2, 3.0), quadratic, jnp.ones(3), max_steps=300, tol=1e-6, fun_args=(A,)
  )
  k = int(res.num_steps)
  assert bool(res.converged) and 0 < k < 300
  assert np.all(np.asarray(res.trace.value)[k:] == float(res.value))
  assert np.all(np.asarray(res.trace.grad_norm)[k:] == float(res.grad_norm))
  assert not np.any(np.asarray(res.trace.accepted)[k + 1 :])
  assert int(res.num_grad_evals) == k + 1  # one oracle call per HDM-Best iteration


def test_compact_sweep_gives_the_same_results():
  """Moving the active points into smaller batches (6 -> 2 -> 1) changes no result."""
  assert runs.stage_sizes(6, True) == (6, 2, 1) and runs.stage_sizes(6, False) == (6,)
  kw = dict(max_steps=400, tol=1e-6, fun_args=(A,))
  full = hdm_optax.sweep(make_best, GRID, quadratic, jnp.ones(3), **kw)
  compact = hdm_optax.sweep(make_best, GRID, quadratic, jnp.ones(3), compact=True, **kw)
  steps = np.asarray(full.results.num_steps)
  assert len(set(steps.tolist())) >= 4  # points finish at different times: stages run
  np.testing.assert_array_equal(np.asarray(compact.results.status), np.asarray(full.results.status))
  assert np.max(np.abs(np.asarray(compact.results.num_steps) - steps)) <= 1
  assert compact.best == full.best
  for i, k in enumerate(steps):
    np.testing.assert_allclose(
      compact.results.trace.value[i, :k], full.results.trace.value[i, :k], rtol=1e-8
    )
    np.testing.assert_allclose(
      compact.results.trace.grad_evals[i, :k], full.results.trace.grad_evals[i, :k]
    )
  np.testing.assert_allclose(compact.results.params, full.results.params, rtol=1e-6, atol=1e-9)
  first = hdm_optax.sweep(
    make_best, GRID, quadratic, jnp.ones(3), compact=True, stop_at_first_converged=True, **kw
  )
  assert first.best == full.best
  assert np.all(np.asarray(first.results.num_steps) <= steps[full.best] + 1)


def test_value_fn_returning_aux_gets_a_clear_error_in_update():
  """A (loss, aux) value_fn: a TypeError naming has_aux, not JAX's conversion error."""
  opt = hdm_optax.hdm_best(lipschitz=200.0)
  x = jnp.ones(3)
  fun = lambda p: (quadratic(p, A), p)
  with np.testing.assert_raises_regex(TypeError, "has_aux=True"):
    opt.update(2 * A * x, opt.init(x), x, value=quadratic(x, A), grad=2 * A * x, value_fn=fun)


# ---------------------------------------------------------------------------
# The reported value and gradient are at the reported params (issue 10.1)
# ---------------------------------------------------------------------------


def _check_at_params(res, tol):
  value, grad = jax.value_and_grad(quadratic)(res.params, A)
  np.testing.assert_allclose(float(res.value), float(value), rtol=1e-12)
  np.testing.assert_allclose(float(res.grad_norm), float(jnp.max(jnp.abs(grad))), rtol=1e-12)
  assert bool(res.converged) == (float(jnp.max(jnp.abs(grad))) <= tol)
  k = int(res.num_steps)
  np.testing.assert_allclose(float(res.trace.value[k]), float(value), rtol=1e-12)


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.chain(hdm_optax.hdm_best(lipschitz=200.0), optax.scale(0.5)),
    lambda: optax.chain(hdm_optax.hdm_best(), optax.clip_by_global_norm(0.1)),
    lambda: optax.chain(optax.lbfgs(), optax.scale(0.5)),
  ],
  ids=["hdm_best-scale", "hdm_best-clip", "lbfgs-scale"],
)
def test_chain_after_a_caching_transformation_reports_f_at_params(make):
  """Both cases of the issue: the value was 8.3e-2 for f = 26.4, and 80.09 for 132.14."""
  fun, calls = counting(quadratic)
  x0 = jnp.ones(3)
  assert float(quadratic(x0, A)) == 111.0
  for max_steps, tol in ((1, 0.0), (3, 0.0), (400, 1e-6)):
    calls.clear()
    with pytest.warns(UserWarning, match="last in the chain"):
      res = hdm_optax.solve(
        make(), fun, x0, max_steps=max_steps, tol=tol, fun_args=(A,), **EVERY_STEP
      )
    jax.effects_barrier()
    _check_at_params(res, tol)
    assert len(calls) == int(res.num_grad_evals)  # the re-evaluations are counted
  assert bool(res.converged)


@pytest.mark.parametrize(
  "make,per_step",
  [(lambda: hdm_optax.hdm_best(lipschitz=200.0), 1), (lambda: optax.lbfgs(), None)],
  ids=["hdm_best", "lbfgs"],
)
def test_a_bare_caching_transformation_costs_no_extra_call(make, per_step):
  fun, calls = counting(quadratic)
  res = hdm_optax.solve(
    make(), fun, jnp.ones(3) * 5, max_steps=30, tol=1e-8, fun_args=(A,), **EVERY_STEP
  )
  jax.effects_barrier()
  _check_at_params(res, 1e-8)
  assert len(calls) == int(res.num_grad_evals)
  k = int(res.num_steps)
  if per_step is not None:
    assert int(res.num_grad_evals) == per_step * k + 1
  else:  # L-BFGS: the linesearch's calls only, never one more per iteration
    searched = int(res.state[-1].info.num_linesearch_steps)
    assert int(res.num_grad_evals) < 3 * k + 1 and searched >= 1


def test_cache_at_params_reads_the_structure():
  best = hdm_optax.hdm_best(lipschitz=200.0)
  x = jnp.ones(3)
  cached = [best, optax.chain(optax.scale(2.0), best), optax.lbfgs()]
  cached += [optax.apply_if_finite(best, 3), optax.inject_hyperparams(optax.sgd)(0.1)]
  for opt in cached[:4]:
    assert hdm_optax.driver.protocol.cache_at_params(opt.init(x)) is not None
  for opt in (optax.chain(best, optax.scale(0.5)), optax.adam(0.1), optax.named_chain(("b", best))):
    assert hdm_optax.driver.protocol.cache_at_params(opt.init(x)) is None
  assert hdm_optax.driver.protocol.cache_at_params(cached[4].init(x)) is None  # sgd caches nothing


def test_a_named_chain_with_the_method_last_is_warned_of_as_what_it_is():
  """A named chain's state (a dict, rebuilt in sorted key order) does not say which link is
  last: f is evaluated again at every step, and the warning says a named chain pays that
  call where "put it last" would not help."""
  fun = lambda x: jnp.sum((x - 1.0) ** 2)
  opt = optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("m", hdm_optax.hdm_best()))
  with pytest.warns(UserWarning, match="optax.named_chain, whose state does not say"):
    hdm_optax.solve(opt, fun, jnp.zeros(3), max_steps=5)


def test_value_and_grad_from_state_never_returns_a_stale_cache():
  opt = optax.chain(hdm_optax.hdm_best(lipschitz=200.0), optax.scale(0.5))
  x = jnp.ones(3)
  fun = lambda p: quadratic(p, A)
  state = opt.init(x)
  ours = hdm_optax.value_and_grad_from_state(fun)
  theirs = optax.value_and_grad_from_state(fun)
  stale = 0
  for _ in range(20):
    value, grad = ours(x, state=state)
    np.testing.assert_allclose(float(value), float(fun(x)), rtol=1e-12)
    np.testing.assert_allclose(grad, jax.grad(fun)(x), rtol=1e-12)
    stale += not np.isclose(float(theirs(x, state=state)[0]), float(fun(x)), rtol=1e-12)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    x = optax.apply_updates(x, updates)
  assert stale > 0  # optax's function would have reused the cache of another point
  # A bare transformation: the cache is reused (no evaluation after the first).
  best = hdm_optax.hdm_best(lipschitz=200.0)
  state = best.init(x)
  value, grad = ours(x, state=state)
  _, state = best.update(grad, state, x, value=value, grad=grad, value_fn=fun)
  cached_value, _ = ours(jnp.full(3, 7.0), state=state)  # any params: the cache is trusted
  assert float(cached_value) == float(state.value)


# ---------------------------------------------------------------------------
# Bad input (issue 10.4)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("tol", [float("nan"), -1.0, jnp.asarray(-1e-3), "1e-6"])
def test_bad_tol_is_refused(tol):
  error = TypeError if isinstance(tol, str) else ValueError
  with pytest.raises(error, match="tol"):
    hdm_optax.solve(optax.sgd(0.01), quadratic, jnp.ones(3), max_steps=5, tol=tol, fun_args=(A,))
  with pytest.raises(error, match="tol"):
    hdm_optax.sweep(make_best, GRID, quadratic, jnp.ones(3), max_steps=5, tol=tol, fun_args=(A,))
  with pytest.raises(error, match="rtol"):
    hdm_optax.solve(optax.sgd(0.01), quadratic, jnp.ones(3), max_steps=5, rtol=tol, fun_args=(A,))


@pytest.mark.parametrize(
  "kw",
  [dict(max_null_steps=0), dict(max_null_steps=2.5), dict(min_value=float("nan"))],
)
def test_bad_limits_are_refused(kw):
  with pytest.raises(ValueError, match=next(iter(kw))):
    hdm_optax.solve(optax.sgd(0.01), quadratic, jnp.ones(3), max_steps=5, fun_args=(A,), **kw)


@pytest.mark.parametrize(
  "params_dtype,data_dtype",
  [(jnp.float32, jnp.float64), (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32)],
)
def test_data_of_another_dtype_than_the_params_is_a_type_error(params_dtype, data_dtype):
  x = jnp.ones(3, params_dtype)
  # hdm_best refuses float16 params themselves; trial_lbfgs runs in float16.
  opt = hdm_optax.trial_lbfgs() if params_dtype == jnp.float16 else hdm_optax.hdm_best()
  with pytest.raises(
    TypeError, match=f"{jnp.dtype(data_dtype).name}.*{jnp.dtype(params_dtype).name}"
  ):
    hdm_optax.solve(opt, quadratic, x, max_steps=5, fun_args=(A.astype(data_dtype),))


def test_bfloat16_params_with_bfloat16_data_run_in_bfloat16():
  x = jnp.ones(3, jnp.bfloat16)
  res = hdm_optax.solve(
    hdm_optax.hdm_best(), quadratic, x, max_steps=100, tol=1e-2, fun_args=(A.astype(jnp.bfloat16),)
  )
  assert res.params.dtype == jnp.bfloat16 and res.value.dtype == jnp.bfloat16
  assert float(res.value) < 1.0


def test_has_aux_returns_aux_at_the_final_params():
  def fun(x, a):
    return quadratic(x, a), {"x": x, "twice": 2 * quadratic(x, a)}

  fun_counted, calls = counting(fun)
  res = hdm_optax.solve(
    hdm_optax.hdm_best(lipschitz=200.0),
    fun_counted,
    jnp.ones(3),
    max_steps=50,
    tol=0.0,
    fun_args=(A,),
    has_aux=True,
    **EVERY_STEP,
  )
  jax.effects_barrier()
  np.testing.assert_array_equal(res.aux["x"], res.params)
  np.testing.assert_allclose(float(res.aux["twice"]), 2 * float(res.value), rtol=1e-12)
  assert int(res.num_grad_evals) == 51 and int(res.num_value_evals) == 52 == len(calls)
  with pytest.raises(TypeError, match="has_aux=True"):
    hdm_optax.solve(hdm_optax.hdm_best(), fun, jnp.ones(3), max_steps=5, fun_args=(A,))
  out = hdm_optax.sweep(
    make_best, GRID, fun, jnp.ones(3), max_steps=30, fun_args=(A,), has_aux=True
  )
  np.testing.assert_array_equal(out.results.aux["x"], out.results.params)


# ---------------------------------------------------------------------------
# Statuses (issue 10.5)
# ---------------------------------------------------------------------------


def test_status_enum_documents_every_value_and_has_a_message():
  for status in hdm_optax.Status:
    assert f"{status.name}:" in hdm_optax.Status.__doc__
  assert len({s.message for s in hdm_optax.Status}) == len(hdm_optax.Status)


def test_a_run_of_null_steps_stalls():
  # f jumps up everywhere but at x0: every trial is rejected (a null step).
  x0 = jnp.ones(3)
  ball = lambda x, a: quadratic(x, a) + jnp.where(jnp.all(x == x0), 0.0, 1e3)
  opt = hdm_optax.hdm_best(lipschitz=200.0)
  res = hdm_optax.solve(opt, ball, x0, max_steps=500, fun_args=(A,), max_null_steps=40)
  assert int(res.status) == hdm_optax.Status.STALLED and "stalled" in res.message
  assert int(res.num_steps) == int(res.null_run) == 40
  assert not np.any(np.asarray(res.trace.accepted)[1:41])
  # By default a run is never cut short, but the message says what happened.
  never = hdm_optax.solve(opt, ball, x0, max_steps=300, fun_args=(A,))
  assert int(never.status) == hdm_optax.Status.MAX_STEPS and int(never.null_run) == 300
  assert "the last 300 updates were null steps" in never.message


def test_accepted_steps_below_the_rounding_of_x_are_named():
  """With L = 1e30 the steps are far below float64 resolution: every trial is x itself, the
  step rule accepts it (f did not increase), and f never changes: the message says so."""
  opt = hdm_optax.hdm_best(lipschitz=1e30)
  never = hdm_optax.solve(opt, quadratic, jnp.ones(3), max_steps=300, fun_args=(A,))
  assert int(never.status) == hdm_optax.Status.MAX_STEPS
  assert "f has not changed over the last 100 steps" in never.message
  assert "P has collapsed: 100% of its entries" in never.message  # P ~ 1e-28, its steps 0


def test_message_names_a_stall_that_is_not_a_trailing_null_run():
  """Most recent updates null, the last one accepted: the message says the run stalled."""
  accepted = np.ones(201, bool)
  accepted[101:] = np.arange(100) % 4 == 3  # 75 of the last 100 updates were null steps
  notes = "; ".join(
    results._stall_notes(hdm_optax.Status.MAX_STEPS, 0, accepted[101:], np.full(10, 1e-30))
  )
  assert "stalling: 75 of the last 100 updates were null steps" in notes
  assert "P has collapsed: 100% of its entries" in notes
  assert "the iterate did not move" not in notes  # no trailing run to report
  healthy = results._stall_notes(hdm_optax.Status.MAX_STEPS, 0, np.ones(100, bool), np.ones(10))
  assert healthy == []
  assert results._stall_notes(hdm_optax.Status.CONVERGED, 0, accepted, np.zeros(10)) == []


def test_rtol_stops_relative_to_the_initial_gradient():
  """tol=0, rtol=1e-3: the run stops once ||g||_inf <= 1e-3 ||g(x0)||_inf."""
  x0 = jnp.ones(3)
  g0 = float(jnp.max(jnp.abs(jax.grad(quadratic)(x0, A))))
  opt = hdm_optax.hdm_best(lipschitz=200.0)
  res = hdm_optax.solve(opt, quadratic, x0, max_steps=500, tol=0.0, rtol=1e-3, fun_args=(A,))
  assert bool(res.converged) and int(res.status) == hdm_optax.Status.CONVERGED
  assert (
    float(res.grad_norm) <= 1e-3 * g0 < float(np.asarray(res.trace.grad_norm)[res.num_steps - 1])
  )
  tight = hdm_optax.solve(opt, quadratic, x0, max_steps=500, tol=0.0, rtol=1e-6, fun_args=(A,))
  assert int(tight.num_steps) > int(res.num_steps)
  # max(tol, rtol g0): the larger one stops the run.
  loose = hdm_optax.solve(opt, quadratic, x0, max_steps=500, tol=1e-1, rtol=1e-6, fun_args=(A,))
  assert float(loose.grad_norm) <= 1e-1 and int(loose.num_steps) < int(tight.num_steps)
  # A run whose null steps are interrupted by moves does not stall.
  moving = hdm_optax.solve(
    make_best(1e-2, 3.0), quadratic, jnp.ones(3), max_steps=300, fun_args=(A,), max_null_steps=5
  )
  assert int(moving.status) == hdm_optax.Status.CONVERGED


def test_unbounded_objective_is_reported():
  res = hdm_optax.solve(optax.sgd(1e19), lambda x: -jnp.sum(x), jnp.ones(3), max_steps=100)
  assert int(res.status) == hdm_optax.Status.UNBOUNDED and not bool(res.converged)
  assert float(res.value) < -1e20 and int(res.num_steps) == 4
  res = hdm_optax.solve(
    optax.sgd(1e19), lambda x: -jnp.sum(x), jnp.ones(3), max_steps=10, min_value=None
  )
  assert int(res.status) == hdm_optax.Status.MAX_STEPS


# ---------------------------------------------------------------------------
# Sweep: grid dtypes, compilation, tracing
# ---------------------------------------------------------------------------


def test_integer_and_boolean_grid_values_keep_their_dtype():
  seen = {}

  def make(precond_lr, decay_every, lr_decay_on):
    seen.update(p=precond_lr.dtype, every=decay_every.dtype, on=lr_decay_on.dtype)
    lr = jnp.where(lr_decay_on, precond_lr, 0.5 * precond_lr)
    schedule = hdm_optax.pieces.decay.step_decay(every=decay_every)
    return hdm_optax.hdm_best(lipschitz=200.0, precond_lr=lr, schedule=schedule)

  grid = {"precond_lr": [1e-3, 1e-2], "decay_every": [5, 50], "lr_decay_on": [True, False]}
  x = jnp.ones(3, jnp.float32)
  out = hdm_optax.sweep(make, grid, quadratic, x, max_steps=60, fun_args=(A.astype(jnp.float32),))
  assert seen["p"] == jnp.float32 and seen["on"] == jnp.bool_
  assert jnp.issubdtype(seen["every"], jnp.integer)
  assert out.results.value.dtype == jnp.float32
  # Each point is the run of its own optimizer, integers and booleans included.
  for i, point in enumerate(out.points):
    lr = point["precond_lr"] * (1.0 if point["lr_decay_on"] else 0.5)
    schedule = hdm_optax.pieces.decay.step_decay(every=point["decay_every"])
    opt = hdm_optax.hdm_best(lipschitz=200.0, precond_lr=lr, schedule=schedule)
    res = hdm_optax.solve(opt, quadratic, x, max_steps=60, fun_args=(A.astype(jnp.float32),))
    assert int(res.num_steps) == int(out.results.num_steps[i])
    np.testing.assert_allclose(out.results.params[i], res.params, rtol=1e-5, atol=1e-6)


@pytest.mark.fused_program  # counts the programs the library's own choice builds
def test_no_recompilation_on_a_second_call():
  kw = dict(max_steps=30, fun_args=(A,))
  hdm_optax.clear_caches()  # an earlier test may have compiled this sweep
  before = programs.compiled_count()  # pylint: disable=protected-access
  hdm_optax.sweep(make_best, GRID, quadratic, jnp.ones(3), **kw)
  first = programs.compiled_count()  # pylint: disable=protected-access
  hdm_optax.sweep(make_best, GRID, quadratic, 2 * jnp.ones(3), tol=1e-7, **kw)
  assert first == before + 1 and programs.compiled_count() == first  # pylint: disable=protected-access
  opt = hdm_optax.hdm_best(lipschitz=200.0)
  hdm_optax.clear_caches()
  before = programs.compiled_count()  # pylint: disable=protected-access
  for x0, max_null in ((jnp.ones(3), 10), (3 * jnp.ones(3), 20), (jnp.zeros(3), 30)):
    hdm_optax.solve(opt, quadratic, x0, max_null_steps=max_null, min_value=-5.0, **kw)
  # the method's program, the objective's, and the fused one the second run compiles
  assert programs.compiled_count() == before + 3  # pylint: disable=protected-access


def test_solve_inside_jit_vmap_and_grad_without_private_jax():
  source = "".join(open(m.__file__).read() for m in (solving, engine, programs))
  assert "jax._src" not in source

  def final_value(lr):
    opt = hdm_optax.hdm_best(lipschitz=200.0, precond_lr=lr)
    return hdm_optax.solve(opt, quadratic, jnp.ones(3), max_steps=40, fun_args=(A,)).value

  lrs = jnp.array([1e-3, 1e-2])
  batched = jax.jit(jax.vmap(final_value))(lrs)
  singles = [float(final_value(lr)) for lr in lrs]
  # vmapped: another program. f = sum a x^2 (3 positive terms, minimum at 0) rounds relative
  # to itself; its rounding over the 40 steps (a's condition number is 100)
  rtol = backends.rounding_tol(3, 40, condition=100.0)
  np.testing.assert_allclose(batched, singles, rtol=rtol)
  np.testing.assert_allclose(jax.vmap(final_value)(lrs), singles, rtol=rtol)


_LOGISTIC = logistic_problem(7, 30, 5)[:2]

# (optimizer, fun, x0, fun_args, the rule's keywords): each run ends by another rule
CHECK_EVERY_RUNS = {
  "best_tol": (lambda: make_best(1e-2, 3.0), quadratic, jnp.ones(3), (A,), dict(tol=1e-6)),
  "auto_budget": (
    hdm_optax.hdm_auto,
    logistic,
    jnp.zeros(5),
    _LOGISTIC,
    dict(tol=0.0, max_grad_evals=23),
  ),
  "lbfgs_tol": (optax.lbfgs, logistic, jnp.zeros(5), _LOGISTIC, dict(tol=1e-8)),
  "adam_steps": (lambda: optax.adam(0.1), quadratic, jnp.ones(3), (A,), dict(tol=0.0)),
  "stalled": (
    lambda: make_best(1e-2, 3.0),  # f jumps up off x0: every trial is rejected
    lambda x, a: quadratic(x, a) + jnp.where(jnp.all(x == 1.0), 0.0, 1e3),
    jnp.ones(3),
    (A,),
    dict(max_null_steps=5),
  ),
  "non_finite": (
    lambda: optax.sgd(1.0),
    lambda x: jnp.sum(jnp.log(x)),  # x = 2, 1.5, 0.83, -0.37
    jnp.full(2, 2.0),
    (),
    dict(tol=1e-8),
  ),
}


@pytest.mark.parametrize("name", list(CHECK_EVERY_RUNS))
def test_stopping_rule_every_k_steps_gives_the_per_step_run(name):
  make, fun, x0, fun_args, rule = CHECK_EVERY_RUNS[name]
  opt = make()
  runs = {
    k: hdm_optax.solve(opt, fun, x0, max_steps=300, fun_args=fun_args, check_every=k, **rule)
    for k in (1, 3, 64)
  }
  status = int(runs[1].status)
  assert (
    status
    == {
      "best_tol": hdm_optax.Status.CONVERGED,
      "auto_budget": hdm_optax.Status.MAX_STEPS,
      "lbfgs_tol": hdm_optax.Status.CONVERGED,
      "adam_steps": hdm_optax.Status.MAX_STEPS,
      "stalled": hdm_optax.Status.STALLED,
      "non_finite": hdm_optax.Status.NON_FINITE,
    }[name]
  )
  g0 = float(jnp.max(jnp.abs(jax.grad(fun)(x0, *fun_args))))
  for res in runs.values():
    _assert_same_runs(res, runs[1], g0)  # bit for bit on the CPU, counts too


def _assert_same_runs(got, want, grad_scale):
  """Two runs' results, field by field (tests/backends.py); elsewhere than the CPU,
  gradients (and their norms) near a minimizer carry the rounding of terms of the size
  ``grad_scale`` (the gradient at x0)."""

  def same(path, a, b):
    scale = grad_scale if "grad" in jax.tree_util.keystr(path) else None
    assert_same_across_programs(a, b, want.value.dtype, scale=scale)

  jax.tree_util.tree_map_with_path(same, got, want)


def test_check_every_blocks_stop_short_of_max_steps():
  """A run that ends at ``max_steps`` makes no call past it: no block crosses the limit
  (the steps of the last, partial block are tested one by one), so the oracle sees the
  K + 1 calls of the per-step run, not those of a block past it and its replay."""
  fun, calls = counting(quadratic)
  opt = optax.sgd(1e-4)
  for k in (1, 8, 64):
    calls.clear()
    res = hdm_optax.solve(
      opt, fun, jnp.ones(3), max_steps=50, fun_args=(A,), tol=0.0, check_every=k
    )
    jax.effects_barrier()
    assert int(res.num_steps) == 50 and int(res.num_grad_evals) == 51
    assert len(calls) == 51, k


def test_check_every_must_be_a_positive_int():
  for bad in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="check_every must be an int >= 1"):
      hdm_optax.solve(
        optax.sgd(0.1), quadratic, jnp.ones(3), max_steps=5, fun_args=(A,), check_every=bad
      )


def test_check_every_under_vmap_gives_each_problem_its_per_step_run():
  """Problems that stop at different steps, solved together: each one's own run and counts."""
  opt = make_best(1e-2, 3.0)
  starts = jnp.stack([jnp.ones(3), 0.01 * jnp.ones(3), 5.0 * jnp.ones(3)])

  def run(x0, k):
    return hdm_optax.solve(
      opt, quadratic, x0, max_steps=300, fun_args=(A,), tol=1e-6, check_every=k
    )

  per_step = jax.vmap(lambda x0: run(x0, 1))(starts)
  assert len(set(np.asarray(per_step.num_steps).tolist())) == 3  # three different stops
  blocks = jax.vmap(lambda x0: run(x0, 8))(starts)
  g0 = float(jnp.max(jnp.abs(jax.grad(quadratic)(starts[2], A))))
  _assert_same_runs(blocks, per_step, g0)


def test_float32_products_at_default_precision_are_warned_of_on_a_gpu(monkeypatch):
  """On a GPU (the backend faked here), a float32 f with matrix products at JAX's default
  precision (TF32 on NVIDIA GPUs) gets a warning once per compiled program, with the fix;
  float32 products asked for at HIGHEST precision, float64 params and the CPU do not."""
  from hdm_optax.driver import engine as loop_lib

  # JAX's default precision (the experiments' entry points, run in-process by other tests,
  # set it to "highest")
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", None)
  try:
    _warned_of_on_a_gpu(monkeypatch, loop_lib)
  finally:
    jax.config.update("jax_default_matmul_precision", before)


def _warned_of_on_a_gpu(monkeypatch, loop_lib):
  a = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), jnp.float32)
  fun = lambda w, a: jnp.sum(jax.nn.softplus(a @ w)) + jnp.vdot(w, w)
  # A new configuration (seed) per call: the warning comes with a compilation, and equal
  # configurations share one program (the first call compiles it on the faked CPU).
  seeds = iter(range(100))
  run = lambda x0, **kw: hdm_optax.solve(
    hdm_optax.hdm_auto(seed=next(seeds)), fun, x0, fun_args=(a.astype(x0.dtype),), max_steps=4, **kw
  )
  x0 = jnp.full(3, 0.5, jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    monkeypatch.setattr(loop_lib, "backend", lambda: "cpu")
    run(x0)  # the CPU: no warning
    monkeypatch.setattr(loop_lib, "backend", lambda: "gpu")
    run(jnp.full(3, 0.5, jnp.float64))  # float64 params
    with jax.default_matmul_precision("highest"):
      run(x0 + 1)
  with pytest.warns(UserWarning, match=r"1 float32 matrix product.*TF32.*'highest'"):
    res = run(x0 + 2)
  with pytest.warns(UserWarning, match="TF32"):  # under vmap too
    batched = jax.vmap(lambda x: run(x))(jnp.stack([x0, x0 + 1]))
  assert int(res.num_steps) == 4 and batched.num_steps.shape == (2,)


# ---------------------------------------------------------------------------
# sweep: every grid point builds its optimizer with its own values, checked up front
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 0.0])
def test_sweep_refuses_a_grid_point_its_factory_refuses(bad):
  # The grid's values reach the program traced, where the factory's checks cannot see them:
  # such a point ran its whole budget stuck at x0 and reported MAX_STEPS.
  make = lambda precond_lr: hdm_optax.hdm_best(precond_lr=precond_lr)
  with pytest.raises(ValueError, match="precond_lr must be finite and > 0") as solo:
    make(bad)
  with pytest.raises(ValueError, match=r"grid point \{'precond_lr': (-1\.0|nan|0\.0)\}") as err:
    hdm_optax.sweep(make, {"precond_lr": [0.1, bad]}, quadratic, jnp.ones(3), fun_args=(A,))
  assert str(solo.value) in str(err.value)
  # A factory that reads its traced settings' dtype is checked as the program builds it.
  typed = lambda precond_lr: hdm_optax.hdm_best(precond_lr=precond_lr.astype(precond_lr.dtype))
  with pytest.raises(ValueError, match=r"grid point .*precond_lr must be finite and > 0"):
    hdm_optax.sweep(typed, {"precond_lr": [0.1, bad]}, quadratic, jnp.ones(3), fun_args=(A,))
  # A grid that differs in a static setting only (a program per value) still runs.
  out = hdm_optax.sweep(
    lambda memory_size, pair_tol: hdm_optax.trial_lbfgs(memory_size, pair_tol=pair_tol),
    {"memory_size": [3, 5], "pair_tol": [1e-10]},
    quadratic,
    jnp.ones(3),
    fun_args=(A,),
  )
  assert out.results.converged.tolist() == [True, True]


@pytest.mark.parametrize("traced_grid", [False, True])
def test_sweep_in_a_callers_jit_names_the_point_its_factory_refuses(traced_grid):
  """Inside a caller's jax.jit the point is named as outside it, for a grid of numbers or of
  the jit's traced values: a factory whose parameters are not the grid's keys."""
  make = lambda lr: optax.sgd(lr)  # noqa: E731  # the grid says learning_rate
  run = lambda rate: hdm_optax.sweep(
    make, {"learning_rate": [rate, 0.2]}, quadratic, jnp.ones(3), fun_args=(A,)
  )
  match = r"grid point \{'learning_rate': .*unexpected keyword argument 'learning_rate'"
  with pytest.raises(TypeError, match=match):
    run(0.1)
  with pytest.raises(TypeError, match=match):
    jax.jit(lambda rate: run(rate if traced_grid else 0.1).results.params)(0.1)


def test_sweep_holds_static_a_float_setting_a_trace_cannot_build():
  """optax.exponential_decay compares its decay_rate in Python as it is built: the setting
  gets a program per value, and each point is the solve of its own optimizer."""
  make = lambda decay_rate: optax.chain(
    optax.scale_by_schedule(optax.exponential_decay(1.0, 10, decay_rate)), hdm_optax.hdm_auto()
  )
  rates = [0.5, 0.9]
  out = hdm_optax.sweep(make, {"decay_rate": rates}, quadratic, jnp.ones(3), fun_args=(A,))
  for i, rate in enumerate(rates):
    solo = hdm_optax.solve(make(rate), quadratic, jnp.ones(3), fun_args=(A,))
    np.testing.assert_array_equal(out.results.params[i], solo.params)
    assert int(out.results.num_grad_evals[i]) == int(solo.num_grad_evals)


@pytest.mark.parametrize("values", [0.5, "adam", jnp.asarray(0.5)])
def test_sweep_grid_values_must_be_a_list(values):
  with pytest.raises(TypeError, match=r"grid\['precond_lr'\] must be a list of values.*\[") as err:
    hdm_optax.sweep(
      lambda precond_lr: hdm_optax.hdm_best(precond_lr=precond_lr),
      {"precond_lr": values},
      quadratic,
      jnp.ones(3),
      fun_args=(A,),
    )
  assert "not iterable" not in str(err.value)
