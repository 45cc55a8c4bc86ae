"""hdm_optax.minibatch_step: one compiled step, value, gradient and trial on the current batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hdm_optax
from helpers import check_doctests, counting, run_page

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends

_RNG = np.random.default_rng(1)
M, N, B = 256, 8, 32
X = _RNG.standard_normal((M, N))
Y = np.where(X @ _RNG.standard_normal(N) + 0.3 * _RNG.standard_normal(M) > 0, 1.0, -1.0)


def loss(w, batch):
  x, y = batch
  return jnp.mean(jax.nn.softplus(-y * (x @ w["w"] + w["b"]))) + 1e-3 * w["w"] @ w["w"]


def batches(epochs, dtype=np.float64):
  for e in range(epochs):
    order = np.random.default_rng(e).permutation(M)
    for i in range(0, M, B):
      idx = order[i : i + B]
      yield jnp.asarray(X[idx], dtype), jnp.asarray(Y[idx], dtype)


def params0(dtype=np.float64):
  return {"w": jnp.zeros(N, dtype), "b": jnp.zeros([], dtype)}


@pytest.mark.parametrize(
  "make,per_step",
  [(lambda: hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1), 2), (lambda: optax.adam(1e-2), 1)],
  ids=["hdm_best", "adam"],
)
def test_compiles_once_and_counts_every_call(make, per_step):
  opt = make()
  counted, calls = counting(loss)
  step = hdm_optax.minibatch_step(opt, counted)
  p, state = params0(), opt.init(params0())
  total = 0
  for batch in batches(2):
    p_in = p
    p, state, stats = step(p, state, batch)
    total += int(stats.grad_evals)
    # The reported loss is the current batch's loss at the params passed in.
    np.testing.assert_allclose(float(stats.loss), float(loss(p_in, batch)), rtol=1e-12)
  jax.effects_barrier()
  assert step._cache_size() == 1  # pylint: disable=protected-access
  assert total == len(calls)
  assert total == per_step * 2 * M // B
  assert float(loss(p, (X, Y))) < 0.9 * float(loss(params0(), (X, Y)))


def test_trial_on_the_current_batch():
  """One step equals ``update`` called with the batch's own value, gradient and value_fn.

  The jitted step and eager ``update`` are two programs: where the CPU has FMA, XLA
  contracts the step's multiply-adds in the one and not in the other (tests/backends.py),
  so they agree to the rounding of the gradient's B (N + 1) products, relative to the
  largest entry. The first step (P = 0) tries x itself, in both programs (0 g and x - 0
  are exact, fused or not): on the CPU f(x) and f(x - 0 g) then differ by less than the
  acceptance's 64 eps |f|, its gradient test decides, and the flags agree; elsewhere
  rounding may decide the tie either way, and the next point is x whichever way.
  """
  opt = hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1)
  step = hdm_optax.minibatch_step(opt, loss)
  p, state = params0(), opt.init(params0())
  for batch in list(batches(1))[:3]:
    trial_is_x = all(bool(jnp.all(leaf == 0)) for leaf in jax.tree.leaves(state.direction.precond))
    value_fn = lambda q, b=batch: loss(q, b)
    value, grad = jax.value_and_grad(value_fn)(p)
    updates, want_state = opt.update(grad, state, p, value=value, grad=grad, value_fn=value_fn)
    want = optax.apply_updates(p, updates)
    p, state, _ = step(p, state, batch)
    for got, ref in (
      (p["w"], want["w"]),
      (state.direction.precond["w"], want_state.direction.precond["w"]),
    ):
      atol = backends.rounding_tol(B * (N + 1)) * float(np.max(np.abs(ref)))
      np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    if backends.is_cpu() or not trial_is_x:
      assert bool(state.info.accepted) == bool(want_state.info.accepted)


def test_fewer_null_steps_than_the_stale_cache_loop():
  """Reusing the previous batch's cached value compares f on two batches."""
  opt = hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1)
  step = hdm_optax.minibatch_step(opt, loss)

  @jax.jit
  def stale_step(p, state, batch):
    value_fn = lambda q: loss(q, batch)
    value, grad = optax.value_and_grad_from_state(value_fn)(p, state=state)
    updates, state = opt.update(grad, state, p, value=value, grad=grad, value_fn=value_fn)
    return optax.apply_updates(p, updates), state

  p, state = params0(), opt.init(params0())
  q, stale = p, state
  for batch in batches(4):
    p, state, _ = step(p, state, batch)
    q, stale = stale_step(q, stale, batch)
  steps = 4 * M // B
  assert int(state.info.num_null_steps) < steps // 4
  assert int(stale.info.num_null_steps) > int(state.info.num_null_steps)


def test_float32_stays_float32():
  opt = hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1)
  step = hdm_optax.minibatch_step(opt, loss)
  p, state = params0(np.float32), opt.init(params0(np.float32))
  for batch in batches(1, np.float32):
    p, state, stats = step(p, state, batch)
  assert p["w"].dtype == jnp.float32 and stats.loss.dtype == jnp.float32
  assert state.direction.precond["w"].dtype == jnp.float32


def test_unjitted_step_inside_scan():
  opt = hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1)
  step = hdm_optax.minibatch_step(opt, loss, jit=False)
  xs = jnp.asarray(X).reshape(M // B, B, N)
  ys = jnp.asarray(Y).reshape(M // B, B)

  def body(carry, batch):
    p, state = carry
    p, state, stats = step(p, state, batch)
    return (p, state), stats

  (p, _), stats = jax.jit(lambda c: jax.lax.scan(body, c, (xs, ys)))(
    (params0(), opt.init(params0()))
  )
  assert stats.loss.shape == (M // B,) and int(stats.grad_evals.sum()) == 2 * M // B
  assert float(loss(p, (X, Y))) < float(loss(params0(), (X, Y)))


def test_loss_fn_must_be_callable():
  with pytest.raises(TypeError, match="^minibatch_step: loss_fn must be callable"):
    hdm_optax.minibatch_step(hdm_optax.hdm_best(), "loss")


@pytest.mark.parametrize(
  "optimizer,message",
  [
    ("adam", r"got 'adam' \(str\); pass one"),
    (optax.adam, r"got 'adam', a callable .*: minibatch_step\(optax\.adam\(\.\.\.\), \.\.\.\)"),
  ],
  ids=["str", "factory"],
)
def test_a_bad_optimizer_is_refused_when_minibatch_step_is_called(optimizer, message):
  """Before any step, in minibatch_step's own words (not loop's)."""
  with pytest.raises(TypeError, match=f"^minibatch_step: optimizer must be .*{message}"):
    hdm_optax.minibatch_step(optimizer, loss)


def _step_error(opt, params, state, batch, loss_fn=loss):
  with pytest.raises((TypeError, ValueError)) as caught:
    hdm_optax.minibatch_step(opt, loss_fn)(params, state, batch)
  assert "Tracer" not in str(caught.value)
  return str(caught.value)


def test_state_none_is_refused_with_the_first_state_to_pass():
  """docs/minibatch.md starts from opt.init(w); None would start HDM afresh at every step."""
  opt = hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1)
  message = _step_error(opt, params0(), None, next(batches(1)))
  assert message.startswith("minibatch_step's step: state is None; pass optimizer.init(params)")


def test_a_foreign_state_is_named_as_step_s_state():
  opt = hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1)
  batch = next(batches(1))
  message = _step_error(opt, params0(), optax.adam(0.1).init(params0()), batch)
  assert message.startswith("minibatch_step's step: state is not a state of this optimizer")
  assert "\n  optimizer.init(params): " in message and "\n  state: " in message
  assert "init_state" not in message and "result.state" not in message
  short = {"w": jnp.zeros(N - 1), "b": jnp.zeros([])}
  message = _step_error(opt, params0(), opt.init(short), batch)
  assert message.startswith("minibatch_step's step: state is not a state of this optimizer")
  assert "optimizer.init(params) gives shape (8,)" in message and "init_" not in message


def test_params_and_loss_fn_errors_name_step_and_loss_fn():
  opt = hdm_optax.hdm_best(lipschitz=1.0, precond_lr=0.1)
  batch = next(batches(1))
  ints = {"w": jnp.zeros(N, jnp.int32), "b": jnp.zeros([], jnp.int32)}
  message = _step_error(opt, ints, opt.init(params0()), batch)
  assert message.startswith("minibatch_step's step: params: params must be real floating-point")
  message = _step_error(opt, params0(), opt.init(params0()), batch, lambda w, b: jnp.int32(1))
  assert message.startswith("minibatch_step's step: loss_fn's value has dtype int32")
  pair = lambda w, b: (loss(w, b), 0.0)
  message = _step_error(opt, params0(), opt.init(params0()), batch, pair)
  assert message.startswith("minibatch_step's step: loss_fn returned a tuple of length 2")
  assert "return the value alone" in message
  p32 = params0(np.float32)
  message = _step_error(opt, p32, opt.init(p32), batch)
  assert message.startswith("minibatch_step's step: loss_fn returns a float64 value")
  assert (
    "cast the data in batch (e.g. jax.tree.map(lambda a: a.astype(jnp.float32), batch))" in message
  )
  assert "fun_args" not in message


def test_docs_and_docstring_examples_run():
  from hdm_optax.adapters import minibatch

  check_doctests(minibatch)
  run_page("docs/minibatch.md")
