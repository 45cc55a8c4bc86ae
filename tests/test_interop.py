"""hdm_optax transformations inside the optax ecosystem: loops, wrappers, pytrees,
dtypes, compilation caching, sweeps and other optimizers in ``solve``."""

import jax


import chex  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import hdm_optax  # noqa: E402
from helpers import EVERY_STEP, counting, logistic, logistic_rtol, settled  # noqa: E402
from fast_jit import FAST_COMPILE, run_jit  # noqa: E402
from hdm_optax.driver import programs  # noqa: E402


# A small ridge-regularized logistic regression, data passed as arguments.
_RNG = np.random.default_rng(0)
M, N = 40, 6
X = jnp.asarray(_RNG.standard_normal((M, N)))
Y = jnp.asarray(np.where(_RNG.standard_normal(M) > 0, 1.0, -1.0))
LIP = float(0.25 * np.linalg.norm(np.asarray(X), 2) ** 2 + 0.1)
X0 = jnp.asarray(_RNG.standard_normal(N))


def vec_logistic(w):
  return logistic(w, X, Y)


def _manual_run(opt, fun, x0, steps):
  """The documented optax loop, with the update jitted once."""
  value_and_grad = optax.value_and_grad_from_state(fun)

  @jax.jit
  def step(x, state):
    value, grad = value_and_grad(x, state=state)
    updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    return optax.apply_updates(x, updates), state

  x, state = x0, opt.init(x0)
  values = [float(fun(x0))]
  for _ in range(steps):
    x, state = step(x, state)
    values.append(float(optax.tree.get(state, "value")))
  assert step._cache_size() == 1  # pylint: disable=protected-access
  return x, state, np.array(values)


@pytest.mark.parametrize("name", ["hdm_best", "hdm"])
def test_value_and_grad_from_state_loop_matches_solve(name):
  # (precond_lr 10/L: the default 100/L, tuned on the LIBSVM problems, spends
  # the first ~25 steps shrinking P on this small well-conditioned problem.)
  opt = (
    hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP)
    if name == "hdm_best"
    else hdm_optax.hdm(precond_lr=0.5)
  )
  steps = 25
  x, state, values = _manual_run(opt, vec_logistic, X0, steps)
  res = hdm_optax.solve(opt, logistic, X0, max_steps=steps, tol=0.0, fun_args=(X, Y))
  assert int(res.num_steps) == steps
  # Two programs of the same run: f's rounding over the steps (logistic_rtol: 6e-12)
  rtol = logistic_rtol(X, LIP, steps)
  np.testing.assert_allclose(np.asarray(res.trace.value), values, rtol=rtol)
  np.testing.assert_allclose(res.params, x, rtol=rtol, atol=rtol * np.max(np.abs(X0)))
  precond = [optax.tree.get(s, "precond") for s in (res.state, state)]
  np.testing.assert_allclose(*precond, rtol=rtol, atol=rtol * np.max(np.abs(precond[1])))
  # One oracle call per update: the loop above only calls value_and_grad once
  # (at the start, where the state's value is +inf).
  assert int(state.info.num_grad_evals) == steps
  assert values[-1] < 0.9 * values[0]


@pytest.mark.parametrize(
  "name,per_step", [("hdm", 1), ("hdm_hb", 1), ("hdm_best", 1), ("hdm_agd", 3)]
)
def test_solve_oracle_counts(name, per_step):
  make = {
    "hdm": lambda: hdm_optax.hdm(precond_lr=0.5),
    "hdm_hb": lambda: hdm_optax.hdm_hb(precond_lr=0.5),
    "hdm_best": lambda: hdm_optax.hdm_best(
      lipschitz=LIP, precond_lr=10.0 / LIP
    ),  # lipschitz probed: one extra update
    "hdm_agd": lambda: hdm_optax.hdm_agd(lipschitz=LIP, precond_lr=0.5),
  }[name]
  fun, calls = counting(logistic)
  opt = make()
  res = run_jit(
    lambda x0, X, y: hdm_optax.solve(
      opt, fun, x0, max_steps=40, tol=0.0, fun_args=(X, y), **EVERY_STEP
    ),
    X0,
    X,
    Y,
  )
  jax.effects_barrier()
  steps = int(res.num_steps)
  assert steps == 40
  assert int(res.num_grad_evals) == per_step * steps + 1
  assert int(res.num_value_evals) == per_step * steps + 1
  assert len(calls) == int(res.num_grad_evals)  # the counts are the real calls
  assert int(np.asarray(res.trace.grad_evals)[-1]) == int(res.num_grad_evals)


def test_inject_hyperparams_matches_plain():
  kw = dict(lipschitz=LIP, precond_lr=2.0 / LIP, momentum_lr=2.0)
  plain = hdm_optax.hdm_best(**kw)
  injected = optax.inject_hyperparams(hdm_optax.hdm_best)(**kw)
  steps = 30
  x_p, _, v_p = _manual_run(plain, vec_logistic, X0, steps)
  x_i, s_i, v_i = _manual_run(injected, vec_logistic, X0, steps)
  # hyper-parameters as arrays, not constants: another program (rule: logistic_rtol)
  rtol = logistic_rtol(X, LIP, steps)
  np.testing.assert_allclose(v_i, v_p, rtol=rtol)
  np.testing.assert_allclose(x_i, x_p, rtol=rtol, atol=rtol * np.max(np.abs(X0)))
  assert {"lipschitz", "precond_lr", "momentum_lr"} <= set(s_i.hyperparams)

  # Changing an injected hyper-parameter in the state changes the run.
  def changed(key, value):
    value_and_grad = optax.value_and_grad_from_state(vec_logistic)

    @jax.jit
    def run(x):
      state = injected.init(x)
      state.hyperparams[key] = jnp.asarray(value, state.hyperparams[key].dtype)

      def body(carry, _):
        x, state = carry
        v, g = value_and_grad(x, state=state)
        u, state = injected.update(g, state, x, value=v, grad=g, value_fn=vec_logistic)
        return (optax.apply_updates(x, u), state), None

      (x, state), _ = jax.lax.scan(body, (x, state), None, length=steps)
      return x

    return run(X0)

  x_m = changed("momentum_lr", 0.1)
  assert float(jnp.max(jnp.abs(x_m - x_p))) > 1e-6


def _badly_scaled(x):
  """A quadratic of 12 coordinates scaled over four decades: trial_lbfgs's pairs diagonal
  takes over H_0 on it."""
  return jnp.sum(jnp.logspace(0.0, 4.0, x.size) * (x - 1.0) ** 2)


def test_inject_hyperparams_trial_lbfgs_needs_no_static_args():
  # optax takes a callable argument for a schedule and injects numbers as arrays: the
  # default diagonal rule passes through as it is, and the default memory_size is no number.
  injected = optax.inject_hyperparams(hdm_optax.trial_lbfgs)()
  x0 = jnp.zeros(12)
  got = hdm_optax.solve(injected, _badly_scaled, x0, max_steps=200)
  want = hdm_optax.solve(hdm_optax.trial_lbfgs(), _badly_scaled, x0, max_steps=200)
  assert bool(want.converged)
  np.testing.assert_array_equal(got.params, want.params)
  np.testing.assert_array_equal(got.value, want.value)
  assert int(got.num_grad_evals) == int(want.num_grad_evals)
  assert int(got.status) == int(want.status)
  assert set(got.state.hyperparams) == {"pair_tol"}
  pair_tol = got.state.hyperparams["pair_tol"]
  assert pair_tol.dtype == x0.dtype and float(pair_tol) == float(jnp.asarray(1e-10, x0.dtype))
  assert hdm_optax.trial_lbfgs() == hdm_optax.trial_lbfgs(memory_size=None)
  assert hdm_optax.trial_lbfgs() != hdm_optax.trial_lbfgs(memory_size=10)  # m follows n


def test_inject_hyperparams_trial_lbfgs_memory_size():
  # A number given is injected: an init under jit (solve's) cannot read it as a shape and
  # says which static_args to pass; an init outside jit reads it, and the jitted update
  # takes m from the state's pairs.
  fun, x0 = _badly_scaled, jnp.zeros(12)
  injected = optax.inject_hyperparams(hdm_optax.trial_lbfgs)(memory_size=5)
  with pytest.raises(ValueError, match=r'static_args=\("memory_size",\)'):
    hdm_optax.solve(injected, fun, x0, max_steps=5)
  static = optax.inject_hyperparams(hdm_optax.trial_lbfgs, static_args=("memory_size",))
  got = hdm_optax.solve(static(memory_size=5), fun, x0, max_steps=200)
  want = hdm_optax.solve(hdm_optax.trial_lbfgs(memory_size=5), fun, x0, max_steps=200)
  np.testing.assert_array_equal(got.params, want.params)

  state = injected.init(x0)
  assert int(state.hyperparams["memory_size"]) == 5
  assert state.inner_state.direction.memory.rho.shape == (5,)
  value, grad = jax.value_and_grad(fun)(x0)
  update = jax.jit(injected.update, static_argnames="value_fn")
  _, state = update(grad, state, x0, value=value, grad=grad, value_fn=fun)
  assert state.inner_state.direction.memory.rho.shape == (5,)
  state.hyperparams["memory_size"] = jnp.asarray(4)
  with pytest.raises(ValueError, match="memory_size=4, but the state holds 5 pairs"):
    injected.update(grad, state, x0, value=value, grad=grad, value_fn=fun)


def test_inject_hyperparams_precond_lr_change_changes_run():
  # hdm_best reads eta_p0 = precond_lr at every update (the state keeps only
  # the decay factor), so changing the injected value after init takes effect.
  kw = dict(lipschitz=LIP, precond_lr=2.0 / LIP, momentum_lr=2.0)
  injected = optax.inject_hyperparams(hdm_optax.hdm_best)(**kw)
  value_and_grad = optax.value_and_grad_from_state(vec_logistic)

  @jax.jit
  def run(x, precond_lr):
    state = injected.init(x)
    state.hyperparams["precond_lr"] = precond_lr

    def body(carry, _):
      x, state = carry
      v, g = value_and_grad(x, state=state)
      u, state = injected.update(g, state, x, value=v, grad=g, value_fn=vec_logistic)
      return (optax.apply_updates(x, u), state), None

    (x, _), _ = jax.lax.scan(body, (x, state), None, length=30)
    return x

  a = run(X0, jnp.asarray(2.0 / LIP))
  b = run(X0, jnp.asarray(0.02 / LIP))
  assert float(jnp.max(jnp.abs(a - b))) > 1e-6


def test_wrappers_chain_and_apply_if_finite():
  """Wrappers that leave the update alone give the same run.

  HDM-Best's cached f and grad f are at the new params only when HDM-Best is
  the last transformation (or wrapped by apply_if_finite); after another
  transformation ``solve`` evaluates them again: same run, one more call a step.
  """
  base = hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP)
  cached = [
    base,
    optax.chain(optax.identity(), base),
    optax.apply_if_finite(base, max_consecutive_errors=3),
  ]
  evaluated = [optax.chain(base, optax.identity()), optax.chain(base, optax.scale(1.0))]

  def run(x0, X, y):
    opts = cached + evaluated
    return [hdm_optax.solve(o, logistic, x0, max_steps=60, tol=0.0, fun_args=(X, y)) for o in opts]

  with pytest.warns(UserWarning, match="last in the chain"):
    results = run_jit(run, X0, X, Y)
  ref = results[0]
  assert float(ref.value) < 0.5 * float(logistic(X0, X, Y))
  rtol = logistic_rtol(X, LIP, 60)  # the wrappers fuse f and the step otherwise
  for i, res in enumerate(results[1:], 1):
    np.testing.assert_allclose(res.trace.value, ref.trace.value, rtol=rtol)
    np.testing.assert_allclose(res.params, ref.params, rtol=rtol, atol=rtol * np.max(np.abs(X0)))
    assert int(res.num_grad_evals) == (61 if i < len(cached) else 121)


# The incoming updates: the direction the preconditioner acts on, or refused.
HONOURING = {
  "hdm": lambda: hdm_optax.hdm(precond_lr=0.5),
  "hdm_hb": lambda: hdm_optax.hdm_hb(precond_lr=0.5, momentum_lr=0.5),
  "hdm_best": lambda: hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP),
  "hdm_auto": lambda: hdm_optax.hdm_auto(),
  "osgm_best": lambda: hdm_optax.osgm_best(),
}


@pytest.mark.parametrize("name", list(HONOURING))
def test_transformation_before_hdm_is_honoured(name):
  """A transformation before the variant changes the direction P acts on.

  ``scale(0.0)`` leaves a zero direction: x never moves (the probes of L use
  the gradient and leave x in place). ``scale(0.5)`` changes the run, and a
  clip of a large gradient changes it as well.
  """

  def run(x0, X, y):
    opts = (
      HONOURING[name](),
      optax.chain(optax.scale(0.0), HONOURING[name]()),
      optax.chain(optax.scale(0.5), HONOURING[name]()),
      optax.chain(optax.clip_by_global_norm(1e-2), HONOURING[name]()),
    )
    return [hdm_optax.solve(o, logistic, x0, max_steps=30, tol=0.0, fun_args=(X, y)) for o in opts]

  plain, zero, half, clipped = run_jit(run, X0, X, Y)
  np.testing.assert_array_equal(zero.params, X0)
  assert float(plain.value) < float(logistic(X0, X, Y))
  for other in (half, clipped):
    assert not np.allclose(other.trace.value, plain.trace.value, rtol=1e-6)


FULL = {
  "hdm": lambda lip: hdm_optax.hdm(candidate="full", learner="ogd", precond_lr=1.0 / lip),
  "hdm_hb": lambda lip: hdm_optax.hdm_hb(candidate="full"),
}


@pytest.mark.parametrize("name", list(FULL))
def test_a_leaf_a_mask_before_a_full_precond_holds_stays_where_it_is(name):
  """optax.masked(optax.set_to_zero(), mask) before the variant zeroes the update of the
  masked leaf; a full P mixes the coordinates, so P u would move it anyway. The step keeps
  it (as trial_lbfgs's does), and the other leaf reaches f's minimiser with it fixed."""
  rng = np.random.default_rng(0)
  a, b = jnp.asarray(rng.standard_normal((30, 4))), jnp.asarray(rng.standard_normal(30))
  fun = lambda p: 0.5 * jnp.sum((a[:, :2] @ p["w"] + a[:, 2:] @ p["v"] - b) ** 2)
  x0 = {"w": jnp.ones(2), "v": jnp.ones(2)}
  held = optax.masked(optax.set_to_zero(), {"w": True, "v": False})
  opt = optax.chain(held, FULL[name](float(np.linalg.norm(np.asarray(a), 2) ** 2)))
  res = hdm_optax.solve(opt, fun, x0, max_steps=200, tol=1e-9)
  np.testing.assert_array_equal(np.asarray(res.params["w"]), [1.0, 1.0])
  w_part = np.asarray(b - a[:, :2] @ x0["w"])
  expected = np.linalg.lstsq(np.asarray(a[:, 2:]), w_part, rcond=None)[0]
  np.testing.assert_allclose(np.asarray(res.params["v"]), expected, rtol=1e-6, atol=1e-8)


def test_transformation_before_hdm_agd_is_refused():
  """hdm_agd takes its gradients at its extrapolated point: it refuses transformed updates."""
  fun = lambda w: logistic(w, X, Y)
  opt = optax.chain(optax.clip_by_global_norm(1.0), hdm_optax.hdm_agd(lipschitz=LIP))
  with pytest.raises(ValueError, match="hdm_agd.*first"):
    hdm_optax.solve(opt, fun, X0, max_steps=3)
  opt = optax.chain(optax.identity(), hdm_optax.hdm_agd(lipschitz=LIP))
  assert np.isfinite(float(hdm_optax.solve(opt, fun, X0, max_steps=3).value))


def test_hdm_agd_runs_in_a_jitted_update_given_the_gradient_twice():
  """``jax.jit(opt.update)`` called with the gradient as updates and as ``grad=`` (the
  guide's loop) gets two tracers, which identity cannot tell from a chain's output: the
  values are compared when the program runs. The loop converges as the unjitted one does;
  updates that differ from ``grad=`` are refused when the program runs."""
  fun = lambda w: logistic(w, X, Y)
  opt = hdm_optax.hdm_agd(lipschitz=LIP)
  value_and_grad = hdm_optax.value_and_grad_from_state(fun)
  update = jax.jit(opt.update, static_argnames="value_fn")

  def run(update, steps=30):
    x, state = X0, opt.init(X0)
    for _ in range(steps):
      value, grad = value_and_grad(x, state=state)
      updates, state = update(grad, state, x, value=value, grad=grad, value_fn=fun)
      x = optax.apply_updates(x, updates)
    return x

  jitted, plain = run(update), run(opt.update)
  # One program against op-by-op dispatch: XLA fuses multiply-adds, an eps of x per step,
  # which 30 steps of the extrapolation grow to ~1e-8 here.
  np.testing.assert_allclose(jitted, plain, rtol=1e-6)
  assert float(fun(jitted)) < float(fun(X0))
  state = opt.init(X0)
  value, grad = value_and_grad(X0, state=state)
  with pytest.raises(Exception, match="hdm_agd cannot honour it"):
    clipped = jax.tree.map(lambda g: 0.5 * g, grad)
    out, _ = update(clipped, state, X0, value=value, grad=grad, value_fn=fun)
    jax.block_until_ready(out)


# ---------------------------------------------------------------------------
# Pytree params
# ---------------------------------------------------------------------------

_Z = jnp.asarray(_RNG.standard_normal((M, 2, 3)))
TREE0 = {"w": jnp.asarray(_RNG.standard_normal(4)), "b": jnp.asarray(_RNG.standard_normal((2, 3)))}
_XW = jnp.asarray(_RNG.standard_normal((M, 4)))
LIP_TREE = float(
  0.25 * np.linalg.norm(np.concatenate([np.asarray(_XW), np.asarray(_Z).reshape(M, -1)], 1), 2) ** 2
  + 0.1
)


def tree_logistic(p, Xw, Z, y):
  margin = Xw @ p["w"] + jnp.einsum("mij,ij->m", Z, p["b"])
  reg = 0.05 * (p["w"] @ p["w"] + jnp.sum(p["b"] ** 2))
  return jnp.sum(jax.nn.softplus(-y * margin)) + reg


PYTREE_OPTS = {
  "hdm_diagonal": lambda: hdm_optax.hdm(candidate="diagonal", precond_lr=0.5),
  "hdm_full": lambda: hdm_optax.hdm(candidate="full", learner="ogd", precond_lr=0.5 / LIP),
  "hdm_hb": lambda: hdm_optax.hdm_hb(precond_lr=0.5, momentum_lr=0.5),
  "hdm_agd": lambda: hdm_optax.hdm_agd(lipschitz=LIP_TREE, precond_lr=0.5),
  "hdm_best": lambda: hdm_optax.hdm_best(lipschitz=LIP_TREE, precond_lr=10.0 / LIP_TREE),
}
# Also run on the flattened vector and compare (the others only run on the tree,
# to save compile time; they share the same tree code paths).
COMPARE_FLAT = ("hdm_full", "hdm_best", "hdm_hb")


@pytest.mark.parametrize("name", list(PYTREE_OPTS))
def test_pytree_params(name):
  """A dict of a vector and a matrix runs like the same problem on the flat vector."""
  flat0, unravel = ravel_pytree(TREE0)
  opt = PYTREE_OPTS[name]()
  steps = 60

  def flat_fun(v, Xw, Z, y):
    return tree_logistic(unravel(v), Xw, Z, y)

  def run(tree0, flat0, Xw, Z, y):
    args = (Xw, Z, y)
    tree = hdm_optax.solve(opt, tree_logistic, tree0, max_steps=steps, tol=0.0, fun_args=args)
    if name not in COMPARE_FLAT:
      return tree, None
    return tree, hdm_optax.solve(opt, flat_fun, flat0, max_steps=steps, tol=0.0, fun_args=args)

  tree_res, flat_res = run_jit(run, TREE0, flat0, _XW, _Z, Y)
  chex.assert_trees_all_equal_structs(tree_res.params, TREE0)
  chex.assert_trees_all_equal_shapes(tree_res.params, TREE0)
  chex.assert_trees_all_equal_shapes(tree_res.state.grad, TREE0)
  f0 = float(tree_logistic(TREE0, _XW, _Z, Y))
  assert float(tree_res.value) < 0.5 * f0
  assert int(tree_res.state.info.num_null_steps) < steps // 2
  if flat_res is not None:
    np.testing.assert_allclose(tree_res.trace.value, flat_res.trace.value, rtol=1e-8)
    np.testing.assert_allclose(
      ravel_pytree(tree_res.params)[0], flat_res.params, rtol=1e-7, atol=1e-10
    )


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------

DTYPE_OPTS = {
  "hdm_scalar": lambda: hdm_optax.hdm(candidate="scalar"),
  "hdm_full": lambda: hdm_optax.hdm(candidate="full", learner="ogd_sqrt"),
  "hdm_hb": lambda: hdm_optax.hdm_hb(momentum_candidate="diagonal"),
  "hdm_agd": lambda: hdm_optax.hdm_agd(lipschitz=10.0),
  "hdm_best": lambda: hdm_optax.hdm_best(lipschitz=LIP, precond_lr=10.0 / LIP),
  "hdm_best_lip": lambda: hdm_optax.hdm_best(
    lipschitz=10.0, denominator=hdm_optax.pieces.hypergradient.fixed_tau(1.0)
  ),
}


def _float_dtypes(tree):
  return {
    jnp.dtype(leaf.dtype)
    for leaf in jax.tree.leaves(tree)
    if jnp.issubdtype(leaf.dtype, jnp.floating)
  }


def _check_dtypes(make, dtype):
  opt = make()
  params = jax.tree.map(lambda x: x.astype(dtype), TREE0)

  def fun(p):
    return tree_logistic(p, _XW.astype(dtype), _Z.astype(dtype), Y.astype(dtype))

  def one_step(p):
    state = opt.init(p)
    v, g = optax.value_and_grad_from_state(fun)(p, state=state)
    updates, state = opt.update(g, state, p, value=v, grad=g, value_fn=fun)
    v, g = optax.value_and_grad_from_state(fun)(p, state=state)
    updates, state = opt.update(g, state, p, value=v, grad=g, value_fn=fun)
    return opt.init(p), updates, state

  init_state, updates, state = jax.eval_shape(one_step, params)
  chex.assert_trees_all_equal_dtypes(updates, params)
  for tree in (init_state, state):
    assert _float_dtypes(tree) == {jnp.dtype(dtype)}, _float_dtypes(tree)
    for leaf in jax.tree.leaves(tree):  # integer counters stay 32-bit
      assert jnp.dtype(leaf.dtype).itemsize <= jnp.dtype(dtype).itemsize, leaf


@pytest.mark.parametrize("name", list(DTYPE_OPTS))
def test_dtypes_preserved(name):
  _check_dtypes(DTYPE_OPTS[name], jnp.float32)  # float32 params under x64
  _check_dtypes(DTYPE_OPTS[name], jnp.float64)
  with jax.enable_x64(False):  # and without x64
    _check_dtypes(DTYPE_OPTS[name], jnp.float32)


def test_float32_solve_runs_in_float32():
  x0 = X0.astype(jnp.float32)
  # float32 resolution of f (~23 here) limits the reachable gradient to ~1e-2.
  res = run_jit(
    lambda x0, X, y: hdm_optax.solve(
      hdm_optax.hdm_best(precond_lr=0.5), logistic, x0, max_steps=300, tol=1e-2, fun_args=(X, y)
    ),
    x0,
    X.astype(jnp.float32),
    Y.astype(jnp.float32),
  )
  assert res.params.dtype == jnp.float32 and res.value.dtype == jnp.float32
  assert _float_dtypes(res.state) == {jnp.dtype(jnp.float32)}
  assert bool(res.converged)


FLOAT16_REFUSED = {
  "hdm": lambda: hdm_optax.hdm(),
  "hdm_hb": lambda: hdm_optax.hdm_hb(),
  "hdm_auto": lambda: hdm_optax.hdm_auto(),
  "hdm_best": lambda: hdm_optax.hdm_best(lipschitz=2.0),
  "osgm_best": lambda: hdm_optax.osgm_best(),
}


@pytest.mark.parametrize("name", list(FLOAT16_REFUSED))
def test_float16_params_are_refused_where_the_constants_underflow(name):
  # Their constants (AdaGrad's eps 1e-12, P's bounds 1e-30 and 1e10) round to 0 or inf in
  # float16: the state went inf, then NaN, and the run never left x0.
  opt = FLOAT16_REFUSED[name]()
  x0 = jnp.zeros(3, jnp.float16)
  message = rf"{name} cannot run on params of dtype float16.*float32 or bfloat16"
  with pytest.raises(ValueError, match=message):
    opt.init(x0)
  fun = lambda x: jnp.sum((x - 1.0) ** 2)
  with pytest.raises(ValueError, match=message):
    hdm_optax.solve(opt, fun, x0, max_steps=5)
  # bfloat16 resolves 1 to 2^-7, so a tol of 5e-2 on 2 (x - 1)
  result = hdm_optax.solve(opt, fun, x0.astype(jnp.bfloat16), max_steps=200, tol=5e-2)
  assert result.params.dtype == jnp.bfloat16 and bool(result.converged)


@pytest.mark.parametrize(
  "make",
  [hdm_optax.trial_lbfgs, lambda: hdm_optax.hdm_agd(lipschitz=2.0)],
  ids=["trial_lbfgs", "hdm_agd"],
)
def test_float16_params_run_where_the_constants_fit(make):
  fun = lambda x: jnp.sum((x - 1.0) ** 2)
  result = hdm_optax.solve(make(), fun, jnp.zeros(3, jnp.float16), max_steps=200, tol=1e-2)
  assert result.params.dtype == jnp.float16 and bool(result.converged)
  np.testing.assert_allclose(np.asarray(result.params, np.float32), 1.0, atol=1e-2)


# ---------------------------------------------------------------------------
# Compilation caching
# ---------------------------------------------------------------------------


def test_jitted_update_compiles_once():
  opt = hdm_optax.hdm(precond_lr=0.5)
  traces = []

  @jax.jit
  def step(x, state, X, y):
    traces.append(1)
    fun = lambda w: logistic(w, X, y)
    v, g = optax.value_and_grad_from_state(fun)(x, state=state)
    u, state = opt.update(g, state, x, value=v, grad=g, value_fn=fun)
    return optax.apply_updates(x, u), state

  state = opt.init(X0)
  x, state = step(X0, state, X, Y)
  x, state = step(x, state, X, Y)
  x, state = step(x + 1.0, state, 2 * X, Y)  # new values, same shapes
  assert len(traces) == 1 and step._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.fused_program  # counts the programs the library's own choice builds
def test_solve_does_not_recompile_for_new_values():
  opt = hdm_optax.hdm(precond_lr=0.5125)  # a configuration no other test compiles
  cache = programs.compiled_count
  before = cache()
  r1 = settled(lambda: hdm_optax.solve(opt, logistic, X0, max_steps=20, fun_args=(X, Y)))
  after_first = cache()
  r2 = hdm_optax.solve(opt, logistic, 2 * X0 + 1, max_steps=20, fun_args=(X, -Y), tol=1e-6)
  assert after_first >= before + 2  # the method's program and the fused one (and the objective's)
  assert cache() == after_first
  assert not np.allclose(r1.params, r2.params)


# ---------------------------------------------------------------------------
# sweep and vmap
# ---------------------------------------------------------------------------

PRECOND_LRS = [0.3 / LIP, 1.0 / LIP, 3.0 / LIP, 10.0 / LIP]
MOMENTUM_LRS = [0.3, 1.0, 3.0, 10.0, 30.0]


def _make_best(precond_lr, momentum_lr):
  return hdm_optax.hdm_best(lipschitz=LIP, precond_lr=precond_lr, momentum_lr=momentum_lr)


def test_sweep_equals_separate_solves():
  kw = dict(max_steps=150, tol=1e-5, fun_args=(X, Y))
  out = hdm_optax.sweep(
    _make_best, {"precond_lr": PRECOND_LRS, "momentum_lr": MOMENTUM_LRS}, logistic, X0, **kw
  )
  assert len(out.points) == 20
  assert out.points[7] == {"precond_lr": PRECOND_LRS[1], "momentum_lr": MOMENTUM_LRS[2]}

  # 20 separate (unbatched) solves; the hyper-parameters are arguments, so
  # this compiles once.
  def single(p_lr, m_lr, x0, X, y):
    return hdm_optax.solve(
      _make_best(p_lr, m_lr), logistic, x0, max_steps=150, tol=1e-5, fun_args=(X, y)
    )

  single = jax.jit(single).lower(1.0, 1.0, X0, X, Y).compile(FAST_COMPILE)
  steps, values, conv = [], [], []
  for i, point in enumerate(out.points):
    res = single(point["precond_lr"], point["momentum_lr"], X0, X, Y)
    batched = jax.tree.map(lambda leaf, i=i: leaf[i], out.results)
    assert int(res.num_steps) == int(batched.num_steps), point
    rtol = logistic_rtol(X, LIP, int(res.num_steps))  # vmapped: another program
    np.testing.assert_allclose(
      batched.params, res.params, rtol=rtol, atol=rtol * np.max(np.abs(X0))
    )
    steps.append(int(res.num_steps))
    values.append(float(res.value))
    conv.append(bool(res.converged))
  steps, values, conv = np.array(steps), np.array(values), np.array(conv)
  assert conv.any() and len(set(steps)) > 3  # the grid matters
  fewest = np.where(conv, steps, 10**9)
  candidates = np.flatnonzero(fewest == fewest.min())
  best = candidates[np.argmin(values[candidates])]
  assert out.best == best


def test_jit_vmap_solve_over_precond_lr():
  lrs = jnp.asarray(PRECOND_LRS)

  def run(lrs, x0, X, y):
    return jax.vmap(
      lambda lr: hdm_optax.solve(
        hdm_optax.hdm_best(lipschitz=LIP, precond_lr=lr),
        logistic,
        x0,
        max_steps=150,
        fun_args=(X, y),
      )
    )(lrs)

  res = run_jit(run, lrs, X0, X, Y)  # jax.jit(run)(lrs, X0, X, Y)
  assert res.params.shape == (4, N)
  assert np.all(np.isfinite(np.asarray(res.value)))
  assert np.asarray(res.converged).any()
  assert len(set(np.asarray(res.num_steps).tolist())) > 1


# ---------------------------------------------------------------------------
# Other optax optimizers in solve
# ---------------------------------------------------------------------------


def test_solve_with_adam_and_lbfgs():
  fun, calls = counting(logistic)
  adam = hdm_optax.solve(
    optax.adam(0.05), fun, X0, max_steps=400, tol=1e-4, fun_args=(X, Y), **EVERY_STEP
  )
  jax.effects_barrier()
  assert int(adam.num_grad_evals) == int(adam.num_steps) + 1 == len(calls)
  assert float(adam.value) < float(logistic(X0, X, Y))

  calls.clear()
  lbfgs = hdm_optax.solve(
    optax.lbfgs(), fun, X0, max_steps=100, tol=1e-8, fun_args=(X, Y), **EVERY_STEP
  )
  jax.effects_barrier()
  assert bool(lbfgs.converged)
  steps = int(lbfgs.num_steps)
  assert int(lbfgs.num_grad_evals) >= steps + 1
  assert int(lbfgs.num_grad_evals) <= 3 * steps + 1
  assert len(calls) == int(lbfgs.num_grad_evals)  # the count is the real one


def _plain_sgd(rate):
  """A plain optax.GradientTransformation, written as optax documents it (no extra args)."""

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda g: -rate * g, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_a_transformation_without_extra_args_runs_at_every_door():
  # update() got an unexpected keyword argument 'value'
  fun, calls = counting(logistic)
  res = hdm_optax.solve(
    _plain_sgd(0.5 / LIP), fun, X0, max_steps=40, tol=0.0, fun_args=(X, Y), **EVERY_STEP
  )
  jax.effects_barrier()
  ref = hdm_optax.solve(optax.sgd(0.5 / LIP), logistic, X0, max_steps=40, tol=0.0, fun_args=(X, Y))
  np.testing.assert_allclose(res.params, ref.params, rtol=1e-6)
  assert int(res.num_grad_evals) == 41 == len(calls)
  run = hdm_optax.loop(_plain_sgd(0.5 / LIP), logistic, fun_args=(X, Y), max_steps=40, tol=0.0)
  s = jax.jit(lambda x: jax.lax.while_loop(lambda s: ~run.done(s), run.step, run.start(x)))(X0)
  np.testing.assert_allclose(s.params, ref.params, rtol=1e-6)
  batch = hdm_optax.solve_batch(
    _plain_sgd(0.5 / LIP), logistic, jnp.stack([X0, X0]), fun_args=(X, Y), in_axes=(0, None)
  )
  out = hdm_optax.sweep(_plain_sgd, {"rate": [0.5 / LIP]}, logistic, X0, fun_args=(X, Y))
  assert float(batch.value[0]) == pytest.approx(float(out.results.value[0]), rel=1e-6)


@pytest.mark.parametrize("fast", [lambda: optax.sgd(0.1), hdm_optax.hdm_auto], ids=["sgd", "hdm"])
@pytest.mark.parametrize("door", ["solve", "loop"])
def test_lookahead_is_refused_naming_why(door, fast):
  # its params must be optax.LookaheadParams: update_fn() got an unexpected keyword 'value'
  opt = optax.lookahead(fast(), sync_period=5, slow_step_size=0.5)
  with pytest.raises(TypeError, match=r"optax.lookahead.*LookaheadParams.*fast optimizer alone"):
    if door == "solve":
      hdm_optax.solve(opt, logistic, X0, fun_args=(X, Y))
    else:
      hdm_optax.loop(opt, logistic, fun_args=(X, Y)).start(X0)
