"""hdm_optax.optimistix_adapter.HDMMinimiser: optimistix.minimise runs solve's iteration."""

import contextlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
import backends
from helpers import check_doctests, counting, logistic, logistic_problem, logistic_rtol, run_page

optx = pytest.importorskip("optimistix")
from hdm_optax.optimistix_adapter import HDMMinimiser  # noqa: E402

A, Y, LIP, X0 = logistic_problem(3)


OPTIMIZERS = {
  "hdm_best": lambda: hdm_optax.hdm_best(),  # probes L, then null steps at first
  "hdm_best_lip": lambda: hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP),
  "hdm": lambda: hdm_optax.hdm(candidate="scalar", learner="ogd", precond_lr=0.1 / LIP),
  "hdm_agd": lambda: hdm_optax.hdm_agd(lipschitz=LIP, precond_lr=0.5),
  # HDM not last: its cache is not at the params, f is evaluated again (counted)
  "chain": lambda: optax.chain(
    hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP), optax.scale(0.5)
  ),
  "adam": lambda: optax.adam(0.1),  # no cache: one call after each update
  "lbfgs": lambda: optax.lbfgs(),  # linesearch calls counted
}


def _same_point(sol, res):
  """optimistix's loop and solve's are two programs of one run: f's rounding over its steps
  (:func:`helpers.logistic_rtol`: 4e-11 at most, L/mu = 160)."""
  rtol = logistic_rtol(A, LIP, int(res.num_steps))
  np.testing.assert_allclose(sol.value, res.params, rtol=rtol, atol=rtol * np.max(np.abs(X0)))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_same_run_as_solve(name):
  opt = OPTIMIZERS[name]()
  tol = 1e-6
  counted, calls = counting(lambda w, args: logistic(w, *args))
  stale = pytest.warns(UserWarning, match="last in the chain")
  with stale if name == "chain" else contextlib.nullcontext():
    res = hdm_optax.solve(opt, logistic, X0, max_steps=1000, tol=tol, fun_args=(A, Y))
    sol = optx.minimise(counted, HDMMinimiser(opt, atol=tol), X0, (A, Y), max_steps=1000)
  assert bool(res.converged)
  jax.effects_barrier()
  assert sol.result == optx.RESULTS.successful
  assert int(sol.stats["num_steps"]) == int(res.num_steps)
  assert int(sol.stats["num_grad_evals"]) == int(res.num_grad_evals) == len(calls)
  assert int(sol.stats["num_value_evals"]) == int(res.num_value_evals)
  _same_point(sol, res)
  # f at one point (to the rtol above, times grad f <= tol) in another program: the rounding
  # of its m n + m terms, all positive but the products (f is their size)
  f_rtol = backends.rounding_tol(A.size + A.shape[0])
  np.testing.assert_allclose(sol.state.value, res.value, rtol=f_rtol)
  np.testing.assert_allclose(sol.state.value, logistic(sol.value, A, Y), rtol=f_rtol)
  assert float(sol.state.grad_norm) <= tol
  if name == "hdm_best":  # null steps do not stop it; one oracle call per iteration
    assert not np.all(np.asarray(res.trace.accepted)[1 : int(res.num_steps) + 1])
    assert len(calls) == int(sol.stats["num_steps"]) + 1


@pytest.mark.parametrize("name", ["hdm_best", "adam", "lbfgs"])
def test_gradient_call_budget_as_solve(name):
  """``max_grad_evals`` stops both before an update, at the same call."""
  opt = OPTIMIZERS[name]()
  for budget in (1, 17):
    counted, calls = counting(lambda w, args: logistic(w, *args))
    res = hdm_optax.solve(
      opt, logistic, X0, max_steps=1000, tol=1e-12, fun_args=(A, Y), max_grad_evals=budget
    )
    sol = optx.minimise(
      counted,
      HDMMinimiser(opt, atol=1e-12, max_grad_evals=budget),
      X0,
      (A, Y),
      max_steps=1000,
      throw=False,
    )
    jax.effects_barrier()
    assert int(res.status) == hdm_optax.Status.MAX_STEPS
    assert sol.result == optx.RESULTS.nonlinear_max_steps_reached
    assert int(sol.stats["num_grad_evals"]) == int(res.num_grad_evals) == len(calls)
    assert int(sol.stats["num_steps"]) == int(res.num_steps)
    assert int(sol.stats["num_value_evals"]) == int(res.num_value_evals)
    _same_point(sol, res)


def test_gradient_call_budget_does_not_stop_a_converged_run():
  opt = OPTIMIZERS["hdm_best_lip"]()
  res = hdm_optax.solve(opt, logistic, X0, max_steps=1000, tol=1e-6, fun_args=(A, Y))
  calls = int(res.num_grad_evals)
  fn = lambda w, args: logistic(w, *args)
  sol = optx.minimise(fn, HDMMinimiser(opt, atol=1e-6, max_grad_evals=calls), X0, (A, Y))
  assert sol.result == optx.RESULTS.successful
  assert int(sol.stats["num_grad_evals"]) == calls


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_gradient_call_budget(bad):
  with pytest.raises(ValueError, match="max_grad_evals must be an int >= 1"):
    HDMMinimiser(hdm_optax.hdm_best(), max_grad_evals=bad)


def test_args_with_a_function_leaf():
  """optimistix passes ``args`` through as a pytree; a leaf may be a function."""

  def fn(w, args):
    activation, (a, y) = args
    return jnp.sum(activation(-y * (a @ w))) + 0.05 * w @ w

  args = (jax.nn.softplus, (A, Y))
  opt = hdm_optax.hdm_auto()
  res = hdm_optax.solve(opt, logistic, X0, max_steps=1000, tol=1e-6, fun_args=(A, Y))
  sol = optx.minimise(fn, HDMMinimiser(opt, atol=1e-6), X0, args, max_steps=1000)
  bfgs = optx.minimise(fn, optx.BFGS(rtol=1e-8, atol=1e-8), X0, args, max_steps=1000)
  assert int(sol.stats["num_grad_evals"]) == int(res.num_grad_evals)
  _same_point(sol, res)
  np.testing.assert_allclose(sol.value, bfgs.value, atol=1e-5)


def test_relative_tolerance():
  opt = hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP)
  g0 = float(jnp.max(jnp.abs(jax.grad(logistic)(X0, A, Y))))
  res = hdm_optax.solve(opt, logistic, X0, max_steps=1000, tol=1e-3 * g0, fun_args=(A, Y))
  sol = optx.minimise(
    lambda w, args: logistic(w, *args),
    HDMMinimiser(opt, rtol=1e-3, atol=0.0),
    X0,
    (A, Y),
    max_steps=1000,
  )
  assert int(sol.stats["num_steps"]) == int(res.num_steps)
  np.testing.assert_allclose(float(sol.state.tol), 1e-3 * g0, rtol=1e-12)


def test_status_is_the_stop_rules_with_a_box():
  """The minimiser maps the loop's status: with a box it stops on the projected gradient
  (CONVERGED_IN_BOX), as solve does, where the gradient at the bound never vanishes."""
  opt = hdm_optax.trial_lbfgs(lower=0.0)
  fn = lambda x, a: jnp.sum(a * (x + 1.0) ** 2)  # minimiser -1, box x >= 0: x* = 0
  a = jnp.asarray([1.0, 10.0, 100.0])
  res = hdm_optax.solve(opt, fn, jnp.ones(3), fun_args=(a,), tol=1e-6)
  sol = optx.minimise(fn, HDMMinimiser(opt, atol=1e-6), jnp.ones(3), a, max_steps=1000)
  assert int(res.status) == hdm_optax.Status.CONVERGED_IN_BOX
  assert int(sol.state.loop.status) == hdm_optax.Status.CONVERGED_IN_BOX
  assert sol.result == optx.RESULTS.successful
  assert int(sol.stats["num_steps"]) == int(res.num_steps)
  np.testing.assert_array_equal(sol.value, res.params)


def test_two_norm_and_float32():
  opt = hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP)
  x0 = X0.astype(jnp.float32)
  args = (A.astype(jnp.float32), Y.astype(jnp.float32))
  sol = optx.minimise(
    lambda w, args: logistic(w, *args),
    HDMMinimiser(opt, atol=1e-2, norm=optx.two_norm),
    x0,
    args,
    max_steps=1000,
  )
  assert sol.value.dtype == jnp.float32 and sol.state.value.dtype == jnp.float32
  assert float(jnp.linalg.norm(jax.grad(logistic)(sol.value, *args))) <= 1e-2


def test_aux_is_at_the_solution():
  def fn(w, args):
    return logistic(w, *args), {"w_norm": jnp.linalg.norm(w)}

  opt = hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP)
  sol = optx.minimise(fn, HDMMinimiser(opt, atol=1e-6), X0, (A, Y), has_aux=True, max_steps=1000)
  np.testing.assert_allclose(sol.aux["w_norm"], jnp.linalg.norm(sol.value), rtol=1e-12)
  assert int(sol.stats["num_value_evals"]) == int(sol.stats["num_grad_evals"]) + 1


def test_max_steps_and_non_finite_results():
  opt = hdm_optax.hdm_best(lipschitz=LIP)
  fn = lambda w, args: logistic(w, *args)
  sol = optx.minimise(fn, HDMMinimiser(opt, atol=0.0), X0, (A, Y), max_steps=5, throw=False)
  assert sol.result == optx.RESULTS.nonlinear_max_steps_reached
  assert int(sol.stats["num_steps"]) == 5
  bad = lambda w, args: jnp.sum(w - jnp.log(w))
  sol = optx.minimise(bad, HDMMinimiser(opt), -jnp.ones(3), None, max_steps=5, throw=False)
  assert sol.result == optx.RESULTS.nonfinite
  assert int(sol.stats["num_steps"]) == 0


_H = jnp.array([[3.0, 0.5, 0.0], [0.5, 2.0, 0.3], [0.0, 0.3, 1.5]])


def _boxed(x, th):
  """Strongly convex; with x >= 0 and th = (1, -0.5, 2) its minimiser has x1 = 0 on the bound
  (gradient 0.5 + 0.3 x2 > 0 there) and x0, x2 free."""
  return 0.5 * x @ _H @ x - th @ x + 0.25 * jnp.sum(x**4) * th[0] ** 2


def _boxed_jacobians(lower, adjoint):
  """The Jacobian of x*(th) by optimistix with ``adjoint``, and by solve (the reference)."""
  th, x0 = jnp.array([1.0, -0.5, 2.0]), jnp.zeros(3)
  opt = hdm_optax.trial_lbfgs(lower=lower)

  def by_optx(th):
    minimiser = HDMMinimiser(opt, atol=1e-12)
    return optx.minimise(_boxed, minimiser, x0, th, max_steps=300, adjoint=adjoint).value

  def by_solve(th):
    return hdm_optax.solve(opt, _boxed, x0, fun_args=(th,), max_steps=300, tol=1e-12).params

  return by_optx, jax.jacrev(by_optx)(th), jax.jacrev(by_solve)(th), th


def test_implicit_derivative_on_an_active_bound_warns():
  """optimistix's ImplicitAdjoint differentiates grad f = 0, false on an active bound: its
  derivative (row 1 = [-0.018, 0.526, -0.041], solve's and finite differences' 0) is warned
  about where it is taken, not on a forward solve; RecursiveCheckpointAdjoint's is right."""
  with pytest.warns(hdm_optax.ImplicitGradientWarning, match="active bound") as seen:
    by_optx, jac, _, th = _boxed_jacobians(0.0, optx.ImplicitAdjoint())
  assert {type(w.message).__name__ for w in seen} == {"ActiveBoundAdjointWarning"}
  assert float(jnp.max(jnp.abs(jac[1]))) > 0.1  # the wrong derivative the warning is about
  with warnings.catch_warnings():
    warnings.simplefilter("error", hdm_optax.ImplicitGradientWarning)
    assert float(by_optx(th)[1]) == 0.0
    _, jac, ref, _ = _boxed_jacobians(0.0, optx.RecursiveCheckpointAdjoint())
  np.testing.assert_allclose(jac, ref, atol=1e-8)
  np.testing.assert_array_equal(ref[1], 0.0)


def test_without_optimistix_rule_every_solve_on_a_bound_warns(monkeypatch):
  """Where the installed optimistix has not the tangent rule the adapter looks for, it
  cannot tell a differentiated solve from a forward one: it warns on both, never on none."""
  from hdm_optax.adapters import optimistix as adapter

  monkeypatch.setattr(adapter, "_rule_is_known", lambda: False)
  fn = lambda x, a: jnp.sum(a * (x + 1.0) ** 2)  # x >= 0: x* = 0, every variable bound
  minimiser = HDMMinimiser(hdm_optax.trial_lbfgs(lower=0.0), atol=1e-6)
  with pytest.warns(adapter.ActiveBoundAdjointWarning, match="3 variable"):
    optx.minimise(fn, minimiser, jnp.ones(3), jnp.ones(3), max_steps=100)


def test_implicit_derivative_without_an_active_bound_is_right_and_quiet():
  with warnings.catch_warnings():
    warnings.simplefilter("error", hdm_optax.ImplicitGradientWarning)
    _, jac, ref, _ = _boxed_jacobians(-10.0, optx.ImplicitAdjoint())
  np.testing.assert_allclose(jac, ref, atol=1e-8)


@pytest.mark.parametrize(
  "kw",
  [
    dict(atol=-1.0),
    dict(rtol=float("nan")),
    dict(atol=jnp.asarray(-1.0)),
    dict(rtol=np.float32("nan")),
    dict(atol=jnp.asarray(jnp.inf)),
    dict(atol=jnp.ones(2)),
  ],
)
def test_bad_tolerances(kw):
  (name,) = kw
  with pytest.raises(ValueError, match=f"{name} must be finite and >= 0.*pass a number"):
    HDMMinimiser(hdm_optax.hdm_best(), **kw)


def test_tolerance_that_is_no_number():
  with pytest.raises(TypeError, match="atol must be a number, got '1e-3'; pass a number"):
    HDMMinimiser(hdm_optax.hdm_best(), atol="1e-3")


def test_traced_tolerances_are_left_to_the_run():
  fn = lambda x, a: jnp.sum(a * x**2)
  solve = lambda atol: (
    optx.minimise(
      fn, HDMMinimiser(hdm_optax.hdm_best(), atol=atol), jnp.ones(3), jnp.ones(3), max_steps=100
    ).value
  )
  np.testing.assert_array_equal(jax.jit(solve)(1e-6), solve(1e-6))


def test_hdm_optax_imports_without_optimistix():
  code = textwrap.dedent(
    """
    import sys
    class Block:
      def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("optimistix", "equinox"):
          raise ImportError(f"blocked {name}")
    sys.meta_path.insert(0, Block())
    import jax.numpy as jnp, hdm_optax
    res = hdm_optax.solve(hdm_optax.hdm_best(), lambda x: jnp.sum(x ** 2), jnp.ones(2), max_steps=50)
    assert bool(res.converged)
    try:
      import hdm_optax.optimistix_adapter
    except ImportError as err:
      assert "optimistix" in str(err), err
    else:
      raise AssertionError("the adapter imported without optimistix")
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1]
  )
  assert out.returncode == 0, out.stderr


def test_docs_and_docstring_examples_run():
  from hdm_optax.adapters import optimistix

  check_doctests(optimistix)
  run_page("docs/optimistix.md")
