"""Every feature composes with every driver (issue 44, part 2; the table in docs/guide.md).

Drivers: ``solve``, ``minimize``, ``sweep``, ``solve_batch`` and ``loop`` (the user's own).
Features: callback, progress, ftol, bounds, init_state, has_aux, the implicit and the unrolled
adjoint, ``jax.jit``, ``jax.vmap``, float32. A cell offered gives the answer of the plain call
(a callback or progress line does not change the result, jit equals eager, vmap equals a
Python loop of single calls, has_aux returns the aux at the final point, init_state continues
a run, ftol stops earlier than the plain run with CONVERGED_FTOL, float32 converges on a
float32 problem, gradients match finite differences); a cell not offered raises a
``ValueError`` that names the combination.

The problem: f(x, a) = sum d (exp(x) - a x), minimiser x = log a, run by
``optax.sgd(0.1, momentum=0.5)`` (cheap to compile, a state to continue from) where the
driver takes an optimizer; ``minimize`` runs trial_lbfgs, and bounds are trial_lbfgs's.
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends

D = np.array([1.0, 2.0, 4.0])
A = np.array([1.5, 2.0, 3.0])
X0 = np.zeros(3)
TOL, STEPS = 1e-8, 600
OPT = optax.sgd(0.1, momentum=0.5)
GRID = {"learning_rate": [0.1, 0.05]}
DRIVERS = ["solve", "minimize", "sweep", "solve_batch", "loop"]
S = hdm_optax.Status
# Two programs of one run (jitted or not, vmapped or not, continued or whole, with a callback
# or without) round f's 3 terms differently, exp's within a few ulp (amplification 4); the
# heavy ball's iteration contracts a difference by |z| = sqrt(0.5) a step on every
# coordinate (Hessian 1.5, 4, 12 at x*: z^2 - (1.5 - 0.1 h) z + 0.5 has complex roots), so
# at most 1 / (1 - sqrt(0.5)) < 4 steps' differences remain (trial_lbfgs's last steps, for
# minimize, are Newton-like and contract faster).
PROGRAMS_RTOL = backends.rounding_tol(3, STEPS, condition=4.0, amplification=4.0)


def fun(x, a):
  return jnp.sum(jnp.asarray(D, x.dtype) * (jnp.exp(x) - a * x))


def fun_aux(x, a):
  return fun(x, a), {"residual": jnp.exp(x) - a}


def _sgd(learning_rate):
  return optax.sgd(learning_rate, momentum=0.5)


def _run(driver, *, a=A, x0=X0, opt=OPT, fn=fun, steps=STEPS, tol=TOL, **kw):
  """One call of ``driver``; its result as (params, status, num_steps, aux, state, value)."""
  a, x0 = jnp.asarray(a), jnp.asarray(x0)
  if driver == "solve":
    res = hdm_optax.solve(opt, fn, x0, fun_args=(a,), max_steps=steps, tol=tol, **kw)
  elif driver == "minimize":
    options = {"maxiter": steps, "gtol": tol, "ftol": kw.pop("ftol", 0.0)}
    res = hdm_optax.minimize(fn, x0, args=(a,), options=options, **kw)
  elif driver == "sweep":
    make = kw.pop("make", _sgd)
    grid = kw.pop("grid", GRID)
    res = hdm_optax.sweep(make, grid, fn, x0, fun_args=(a,), max_steps=steps, tol=tol, **kw)
    res = res.results
  elif driver == "solve_batch":
    batch = jnp.stack([a, 1.25 * a])
    x0s = jnp.stack([x0, x0]) if x0.ndim == 1 else x0
    res = hdm_optax.solve_batch(opt, fn, x0s, fun_args=(batch,), max_steps=steps, tol=tol, **kw)
  else:
    start_state = kw.pop("opt_state", None)
    run = hdm_optax.loop(opt, fn, fun_args=(a,), tol=tol, max_steps=steps, **kw)
    s = jax.lax.while_loop(lambda s: ~run.done(s), run.step, run.start(x0, start_state))
    return SimpleNamespace(
      params=s.params,
      status=run.status(s),
      num_steps=s.num_steps,
      aux=None,
      state=s.opt_state,
      value=s.value,
    )
  return SimpleNamespace(
    params=res.params,
    status=res.status,
    num_steps=res.num_steps,
    aux=res.aux,
    state=res.state,
    value=res.value,
  )


def _same(got, plain):
  np.testing.assert_allclose(got.params, plain.params, rtol=PROGRAMS_RTOL)
  np.testing.assert_array_equal(got.num_steps, plain.num_steps)
  np.testing.assert_array_equal(got.status, plain.status)


# --- callback and progress: the result of the plain call -------------------------------------


@pytest.mark.parametrize("driver", ["solve", "minimize", "sweep", "solve_batch"])
def test_callback_does_not_change_the_result(driver):
  calls = []
  got = _run(driver, callback=lambda snapshot: calls.append(1))
  assert len(calls) >= 2
  _same(got, _run(driver))


@pytest.mark.parametrize("driver", ["solve", "minimize", "sweep", "solve_batch"])
def test_progress_does_not_change_the_result(driver, capfd):
  got = _run(driver, progress=True)
  assert capfd.readouterr().err
  _same(got, _run(driver))


# --- ftol: SciPy's relative decrease stops a run the plain call takes further ---------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_ftol_stops_with_converged_ftol_before_the_plain_run(driver):
  plain, got = _run(driver), _run(driver, ftol=1e-4)
  assert np.all(np.asarray(got.status) == S.CONVERGED_FTOL), got.status
  assert np.all(np.asarray(got.num_steps) < np.asarray(plain.num_steps))


# --- bounds: the optimizer's box (minimize: bounds=) gives the box's minimiser --------------

LOWER = np.array([0.5, 1.0, 0.0])  # log a = (0.41, 0.69, 1.10): the first two end on the bound


@pytest.mark.parametrize("driver", DRIVERS)
def test_bounds_give_the_box_minimiser(driver):
  boxed = hdm_optax.trial_lbfgs(lower=LOWER)
  if driver == "minimize":
    got = _run(driver, bounds=(LOWER, None))
  elif driver == "sweep":
    make = lambda pair_tol: hdm_optax.trial_lbfgs(lower=LOWER, pair_tol=pair_tol)
    got = _run(driver, make=make, grid={"pair_tol": [1e-10, 1e-8]})
  else:
    got = _run(driver, opt=boxed)
  expected = np.maximum(np.log(A), LOWER)
  if driver == "solve_batch":
    expected = np.stack([expected, np.maximum(np.log(1.25 * A), LOWER)])
  np.testing.assert_allclose(got.params, np.broadcast_to(expected, np.shape(got.params)), atol=1e-6)
  assert np.all(np.asarray(got.status) == S.CONVERGED_IN_BOX)


# --- init_state: a run from a previous run's state continues it -----------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_init_state_continues_a_run(driver):
  """k steps, then k more from (params, state), reach the point of 2k steps."""
  k, tol = 6, 0.0
  whole = _run(driver, steps=2 * k, tol=tol)
  half = _run(driver, steps=k, tol=tol)
  if driver == "loop":
    rest = _run(driver, steps=k, tol=tol, x0=half.params, opt_state=half.state)
  elif driver == "sweep":  # one grid point, so the leading axis is the points' and the problems'
    one = {"grid": {"learning_rate": [0.1]}}
    whole = _run(driver, steps=2 * k, tol=tol, **one)
    half = _run(driver, steps=k, tol=tol, **one)
    rest = _run(
      driver, steps=k, tol=tol, x0=half.params, init_state=half.state, in_axes=(0, None), **one
    )
  else:
    rest = _run(driver, steps=k, tol=tol, x0=half.params, init_state=half.state)
  np.testing.assert_allclose(rest.params, whole.params, rtol=PROGRAMS_RTOL)


# --- has_aux: the aux at the final point ------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_has_aux_returns_the_aux_at_the_final_point(driver):
  got = _run(driver, fn=fun_aux, has_aux=True)
  _same(got, _run(driver))
  if driver == "loop":  # the loop's state holds no aux (the user calls fun where wanted)
    return
  a = np.stack([A, 1.25 * A]) if driver == "solve_batch" else A
  # exp(x) - a at x = log a: a difference of terms of size a, rounded by exp and NumPy's exp
  aux_atol = backends.rounding_tol(2, amplification=4.0) * np.max(a)
  np.testing.assert_allclose(got.aux["residual"], np.exp(got.params) - a, rtol=0, atol=aux_atol)


# --- adjoints: gradients through a run match finite differences -----------------------------


def _total(driver, adjoint, steps, tol, **kw):
  def total(a):
    return jnp.sum(_run(driver, a=a, steps=steps, tol=tol, adjoint=adjoint, **kw).params)

  return total


def _check_gradient(total, rtol):
  grad = np.asarray(jax.grad(total)(jnp.asarray(A)))
  h = 1e-5
  for i in range(3):
    e = np.zeros(3)
    e[i] = h
    central = (float(total(jnp.asarray(A + e))) - float(total(jnp.asarray(A - e)))) / (2 * h)
    assert grad[i] == pytest.approx(central, rel=rtol, abs=1e-7), (i, grad, central)


@pytest.mark.parametrize("driver", ["solve", "minimize", "sweep", "solve_batch"])
def test_implicit_adjoint_matches_finite_differences(driver):
  """At the solution x = log a: d(sum x)/da_i = 1/a_i (times the points or members)."""
  total = _total(driver, hdm_optax.ImplicitAdjoint(), STEPS, 1e-10)
  _check_gradient(total, rtol=1e-4)


@pytest.mark.parametrize(
  "driver, extra",
  [
    ("solve", {}),
    ("minimize", {}),
    ("sweep", {"compact": False}),
    ("solve_batch", {"compact": False}),
  ],
)
def test_unrolled_adjoint_matches_finite_differences(driver, extra):
  """Through 10 iterations (not converged): the derivative of the truncated run."""
  total = _total(driver, hdm_optax.UnrolledAdjoint(), 10, 0.0, **extra)
  _check_gradient(total, rtol=1e-5)


@pytest.mark.parametrize("driver", ["sweep", "solve_batch"])
def test_unrolled_adjoint_with_compact_is_refused_by_name(driver):
  with pytest.raises(ValueError) as error:
    _run(driver, adjoint=hdm_optax.UnrolledAdjoint(), compact=True)
  assert "UnrolledAdjoint" in str(error.value) and "compact" in str(error.value)


# --- jit and vmap ---------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_jit_equals_eager(driver):
  jitted = jax.jit(lambda a: _run(driver, a=a).params)(jnp.asarray(A))
  np.testing.assert_allclose(jitted, _run(driver).params, rtol=PROGRAMS_RTOL)


@pytest.mark.parametrize("driver", ["solve", "minimize", "loop"])
def test_vmap_equals_a_loop_of_single_calls(driver):
  batch = np.stack([A, 1.5 * A, 1.25 * A])
  vmapped = jax.vmap(lambda a: _run(driver, a=a).params)(jnp.asarray(batch))
  for row, a in zip(vmapped, batch):
    np.testing.assert_allclose(row, _run(driver, a=a).params, rtol=PROGRAMS_RTOL)


@pytest.mark.parametrize("driver", ["sweep", "solve_batch"])
def test_vmap_of_a_batched_driver_is_refused_by_name(driver):
  with pytest.raises(ValueError, match="vmap"):
    jax.vmap(lambda a: _run(driver, a=a).params)(jnp.stack([jnp.asarray(A)] * 2))


# --- float32 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
def test_float32_converges_on_a_float32_problem(driver):
  a = jnp.asarray(A, jnp.float32)
  got = _run(driver, a=a, x0=jnp.zeros(3, jnp.float32), tol=1e-4)
  assert got.params.dtype == jnp.float32
  assert np.all(np.asarray(got.status) == S.CONVERGED), got.status
  expected = np.log(A) if driver != "solve_batch" else np.log(np.stack([A, 1.25 * A]))
  np.testing.assert_allclose(got.params, np.broadcast_to(expected, np.shape(got.params)), atol=1e-4)
