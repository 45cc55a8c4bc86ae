"""The pieces the variants are composed of, each on its own, and how a variant takes them."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import hdm_optax
from hdm_optax.pieces import acceptance, candidates, curvature, decay, hypergradient, learners
from hdm_optax.pieces import step_control


RNG = np.random.default_rng(0)
U, W, P = (RNG.standard_normal(4) for _ in range(3))


# ---------------------------------------------------------------------------
# Candidate sets and learners: one registry style, no unused fields.
# ---------------------------------------------------------------------------


def test_registries_resolve_names_and_pass_objects_through():
  for name, factory in candidates.CANDIDATE_SETS.items():
    assert candidates.get(name)._fields == ("init", "apply", "outer", "project")
    assert isinstance(factory(), candidates.CandidateSet)
  for name in learners.LEARNERS:
    assert learners.get(name)._fields == ("init", "step")
  cand, learner = candidates.diagonal(), learners.ogd()
  assert candidates.get(cand) is cand and learners.get(learner) is learner


@pytest.mark.parametrize(
  "name,want",
  [
    ("scalar", lambda u, w: np.dot(u, w)),
    ("diagonal", lambda u, w: u * w),
    ("full", np.outer),
  ],
)
def test_hypergradient_is_minus_outer_over_den(name, want):
  cand = candidates.get(name)
  den = 2.5
  got = hypergradient.hypergradient(cand, jnp.asarray(U), jnp.asarray(W), den=den)
  np.testing.assert_allclose(got, -want(U, W) / den, rtol=1e-14)
  got_b = hypergradient.hypergradient(cand, jnp.asarray(U), jnp.asarray(W), den=den, negate=False)
  np.testing.assert_allclose(got_b, want(U, W) / den, rtol=1e-14)
  got_inv = hypergradient.hypergradient(cand, jnp.asarray(U), jnp.asarray(W), inv_den=1 / den)
  np.testing.assert_allclose(got_inv, -want(U, W) / den, rtol=1e-14)
  zero = hypergradient.hypergradient(cand, jnp.asarray(U), jnp.asarray(W), den=0.0)
  assert not np.any(np.asarray(zero))
  with pytest.raises(TypeError, match="exactly one"):
    hypergradient.hypergradient(cand, U, W)


def test_hypergradient_is_the_gradient_of_the_feedback():
  """For f(x) = 1/2 x^T A x, d/dP f(x - P g) = -grad f(x - P g) g^T, reduced per set."""
  A = np.diag([1.0, 3.0, 7.0, 2.0])
  f = lambda x: 0.5 * x @ (A @ x)
  x = jnp.asarray(W)
  g = jnp.asarray(A @ W)
  for name in ("scalar", "diagonal", "full"):
    cand = candidates.get(name)
    p = cand.init(x, 0.1)
    h = lambda p: f(x + candidates.trial_step(cand, p, g))
    trial_grad = A @ np.asarray(x + candidates.trial_step(cand, p, g))
    got = hypergradient.hypergradient(cand, jnp.asarray(trial_grad), g, den=1.0)
    np.testing.assert_allclose(got, jax.grad(h)(p), rtol=1e-12)


def test_denominators():
  g2, d2 = jnp.asarray(2.0), jnp.asarray(3.0)
  assert float(hypergradient.fixed_tau(4.0)(g2, d2, None)) == 2.0 + 0.5 * 4.0 * 3.0
  den = hypergradient.curvature_tau(1e-3)
  assert float(den(g2, d2, jnp.asarray(0.0))) == 2.0 + 1e-3
  assert float(den(g2, d2, jnp.asarray(2.0))) == 2.0 + 0.25 * 4.0 * 3.0
  assert float(hypergradient.reciprocal(jnp.asarray(0.0), jnp.asarray(True))) == 0.0
  assert float(hypergradient.reciprocal(jnp.asarray(2.0), jnp.asarray(False))) == 0.0


def test_trial_step_with_and_without_momentum():
  d = jnp.asarray(W)
  step = candidates.trial_step(candidates.diagonal(), jnp.asarray(P), jnp.asarray(U))
  np.testing.assert_array_equal(step, -(P * U))
  step = candidates.trial_step(
    candidates.diagonal(), jnp.asarray(P), jnp.asarray(U), candidates.scalar(), 0.5, d
  )
  np.testing.assert_allclose(step, -(P * U) + 0.5 * W, rtol=1e-15)
  assert float(step_control.next_trial_scale(jnp.asarray(0.25), jnp.asarray(True))) == 1.0
  assert float(step_control.next_trial_scale(jnp.asarray(0.25), jnp.asarray(False))) == 0.125


# ---------------------------------------------------------------------------
# Acceptance rules.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_acceptance_rules_on_decrease_tie_and_increase(dtype):
  f = jnp.asarray(1.5, dtype)
  up1 = jnp.nextafter(f, jnp.asarray(2, dtype))  # one ulp above
  far = f * (1 + 1e-3)
  small, large = jnp.asarray([0.1], dtype), jnp.asarray([1.0], dtype)
  strict, weak, tie = (
    acceptance.strict_decrease(),
    acceptance.no_increase(),
    acceptance.tie_tolerant(),
  )
  lower = jnp.nextafter(f, jnp.asarray(0, dtype))
  for rule in (strict, weak, tie):
    assert bool(rule.accept(lower, f, large, small))  # a decrease is always accepted
    assert not bool(rule.accept(far, f, small, large))  # a real increase never is
  assert not bool(strict.accept(f, f, small, large))
  assert bool(weak.accept(f, f, large, small))
  assert bool(tie.accept(up1, f, small, large))  # a tie with a smaller gradient
  assert not bool(tie.accept(up1, f, large, small))  # a tie with a larger gradient
  assert not bool(tie.accept(f * (1 + 100 * jnp.finfo(dtype).eps), f, small, large))


# ---------------------------------------------------------------------------
# Curvature estimate, probe, decay.
# ---------------------------------------------------------------------------


def _record(est, state, accepted, step_norm=0.5, grad_change=1.0, frozen=False):
  return est.record(
    state,
    accepted=jnp.asarray(accepted),
    step_norm=jnp.asarray(step_norm),
    grad_change=jnp.asarray(grad_change),
    frozen=jnp.asarray(frozen),
  )


def test_curvature_counter_records_and_fires_at_the_threshold():
  est = curvature.running_mean(horizon=40, min_step=1e-3)  # threshold max(min(10, 200), 20) = 20
  state = est.init(jnp.float64)
  state = _record(est, state, True, grad_change=3.0)  # ratio 6
  state = _record(est, state, True, step_norm=1e-4)  # too short to record
  assert int(state.counter) == 2 and int(state.ratio_count) == 1
  state = _record(est, state, False, frozen=True)  # the probe does not count
  assert int(state.counter) == 2
  state = _record(est, state, False)
  assert int(state.counter) == 0  # -2
  state = _record(est, state, False)
  assert int(state.counter) == 0  # floor 0
  for k in range(21):
    state, fired = est.fire(_record(est, state, True, grad_change=1.0))  # ratio 2
    assert bool(fired) == (k == 20)  # counter 21 > threshold 20
  assert not bool(state.active)
  np.testing.assert_allclose(state.l_hat, (6.0 + 21 * 2.0) / 22)
  l_hat = float(state.l_hat)
  state, fired = est.fire(_record(est, state, True, grad_change=100.0))
  assert not bool(fired) and float(state.l_hat) == l_hat and int(state.ratio_count) == 22


def test_curvature_disabled_never_fires():
  est = curvature.running_mean(horizon=40, enabled=False)
  state = est.init(jnp.float64)
  for _ in range(30):
    state, fired = est.fire(_record(est, state, True))
    assert not bool(fired)
  assert float(state.l_hat) == 0.0


def test_gradient_probe_measures_the_curvature_along_the_gradient():
  A = jnp.diag(jnp.array([1.0, 4.0, 9.0]))
  x = jnp.array([1.0, 1.0, 1.0])
  g = A @ x
  probe = curvature.gradient_probe(1e-4)
  offset, delta = probe.offset(0, x, g, jnp.asarray(True))
  np.testing.assert_allclose(jnp.linalg.norm(offset), delta, rtol=1e-12)
  lip = probe.finish(jnp.linalg.norm(A @ offset) / delta)
  want = jnp.linalg.norm(A @ g) / jnp.linalg.norm(g)
  np.testing.assert_allclose(lip, want, rtol=1e-10)
  assert float(probe.finish(jnp.asarray(jnp.nan))) == 1.0
  assert float(probe.finish(jnp.asarray(0.0))) == 1.0


def test_probe_directions_do_not_depend_on_the_leaves():
  """The same direction for {'w', 'b'} as for the flattened vector."""
  key = jax.random.key(7)
  tree = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(())}
  flat, _ = jax.flatten_util.ravel_pytree(tree)
  for i in range(3):
    d_tree, _ = jax.flatten_util.ravel_pytree(curvature.probe_direction(key, i, tree))
    np.testing.assert_array_equal(d_tree, curvature.probe_direction(key, i, flat))
  probe = curvature.random_probe(num=2, size=0.5)
  off, _ = probe.offset(jnp.asarray(1), tree, tree, jnp.asarray(False))
  assert all(float(jnp.max(jnp.abs(v))) == 0.0 for v in jax.tree.leaves(off))


@pytest.mark.parametrize("name", ["hdm_auto", "osgm_best"])
def test_random_probes_give_the_same_run_for_any_leaf_layout(name):
  """A Poisson regression as {"w", "b"} and as one flattened vector: the same directions,
  so the same calls and the same point (up to the rounding of sums over leaves)."""
  rng = np.random.default_rng(0)
  X = jnp.asarray(rng.standard_normal((30, 4)) * 0.3)
  y = jnp.asarray(rng.poisson(2.0, 30).astype(float))

  def loss(p):
    eta = X @ p["w"] + p["b"]
    return jnp.mean(jnp.exp(eta) - y * eta)

  tree0 = {"w": jnp.zeros(4), "b": jnp.zeros(())}
  flat0, unravel = jax.flatten_util.ravel_pytree(tree0)
  opt = getattr(hdm_optax, name)()
  tree_run = hdm_optax.solve(opt, loss, tree0, max_steps=40, tol=0.0)
  flat_run = hdm_optax.solve(opt, lambda v: loss(unravel(v)), flat0, max_steps=40, tol=0.0)
  assert int(tree_run.num_grad_evals) == int(flat_run.num_grad_evals)
  np.testing.assert_allclose(
    jax.flatten_util.ravel_pytree(tree_run.params)[0], flat_run.params, rtol=1e-6, atol=1e-9
  )


@pytest.mark.parametrize("name, most", [("hdm_auto", 1), ("osgm_best", 2)])
def test_probe_and_iteration_share_one_body(name, most):
  """An update evaluates the oracle at most once (plus osgm_best's lookahead point) in its
  traced program, probe or iteration alike: under jax.vmap, where a lax.cond runs both
  branches, a batched update then costs one call, not the probes' and the iteration's.
  ``value_at_params=True`` (what the drivers say) leaves out the stale-cache check, whose
  evaluation at the params is one more traced call, run under vmap by every update."""
  traced = []

  def fun(x):
    traced.append(1)  # runs once per evaluation in the traced program
    return jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x**2)

  opt = getattr(hdm_optax, name)()

  def count(at_params):
    def update(state, x):
      v, g = jax.value_and_grad(fun)(x)
      return opt.update(g, state, x, value=v, grad=g, value_fn=fun, value_at_params=at_params)

    traced.clear()
    jax.make_jaxpr(jax.vmap(update))(jax.vmap(opt.init)(jnp.ones((2, 3))), jnp.ones((2, 3)))
    return len(traced) - 1  # minus the value_and_grad at x above

  assert 1 <= count(True) <= most
  assert count(False) == count(True) + 1


def test_step_decay_schedule():
  sched = decay.step_decay(every=2, rate=0.5, floor=0.2)
  state = sched.init(jnp.float64)
  factors = []
  for k in range(1, 9):
    state = sched.update(state, jnp.asarray(k), jnp.asarray(k < 7))
    factors.append(float(state.factor))
  assert factors == [1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2, 0.2]
  const = decay.constant()
  assert float(const.update(const.init(jnp.float32), 50, True).factor) == 1.0


def test_hdm_best_takes_pieces_in_place_of_their_knobs():
  """A piece replaces the one its knobs build: an always-accepting rule moves on every step."""
  always = acceptance.AcceptanceRule(accept=lambda tv, v, tg, g, step=None: jnp.asarray(True))
  fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x**2)
  opt = hdm_optax.hdm_best(
    lipschitz=20.0,
    acceptance=always,
    denominator=hypergradient.fixed_tau(1.0),
    schedule=decay.constant(),
    curvature_estimate=curvature.running_mean(enabled=False),
  )
  res = hdm_optax.solve(opt, fun, jnp.array([1.0, 1.0]), max_steps=50)
  assert int(res.state.info.num_null_steps) == 0
  assert (
    float(res.state.direction.schedule.factor) == 1.0
    and float(res.state.direction.curvature.l_hat) == 0.0
  )


def test_hdm_best_refuses_a_probe_beside_a_given_lipschitz():
  with pytest.raises(TypeError, match="probe= measures L when lipschitz= is not given"):
    hdm_optax.hdm_best(lipschitz=1.0, probe=curvature.gradient_probe())
