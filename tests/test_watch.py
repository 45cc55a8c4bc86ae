"""Watching a long solve: solve/minimize(callback=, progress=) from the compiled program,
under jit and vmap; without them the program is unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hdm_optax
from hdm_optax.driver import hooks

A = jnp.geomspace(1.0, 100.0, 5)


def fun(x, a):
  return jnp.sum(a * (x - 1.0) ** 2) + jnp.sum(x**4)


def _solve(a=A, **kwargs):
  return hdm_optax.solve(
    hdm_optax.trial_lbfgs(), fun, jnp.zeros(5), max_steps=100, fun_args=(a,), **kwargs
  )


class Recorder:
  """A callback that keeps every snapshot and stops after ``stop_at`` steps."""

  def __init__(self, stop_at=None, how="raise"):
    self.snapshots, self.stop_at, self.how = [], stop_at, how

  def __call__(self, snapshot):
    self.snapshots.append(snapshot)
    if self.stop_at is not None and np.all(snapshot.num_steps >= self.stop_at):
      if self.how == "raise":
        raise StopIteration
      return True
    return None


def test_callback_sees_every_step():
  rec = Recorder()
  res = _solve(callback=rec)
  plain = _solve()
  assert len(rec.snapshots) == int(res.num_steps) == int(plain.num_steps)
  last = rec.snapshots[-1]
  np.testing.assert_array_equal(last.params, np.asarray(res.params))
  assert float(last.value) == float(res.value) and int(last.num_grad_evals) == int(
    res.num_grad_evals
  )
  assert [int(s.num_steps) for s in rec.snapshots] == list(range(1, len(rec.snapshots) + 1))
  assert float(last.grad_norm) == float(res.grad_norm)
  assert int(last.status) == int(res.status)  # the snapshot after the last step says why


@pytest.mark.parametrize("how", ["raise", "return"])
def test_callback_stops_the_run(how):
  res = _solve(callback=Recorder(stop_at=3, how=how))
  assert int(res.num_steps) == 3 and int(res.status) == hdm_optax.Status.STOPPED
  assert not bool(res.converged)
  assert float(res.value) == pytest.approx(float(fun(res.params, A)))


@pytest.fixture
def terminal(monkeypatch):
  """stderr as a terminal (the progress line is redrawn in place)."""
  monkeypatch.setattr(hooks, "_terminal", lambda: True)


def test_progress_line(capfd, terminal):
  del terminal
  res = _solve(progress=True)
  err = capfd.readouterr().err
  assert err.startswith("\rhdm_optax: steps ") and err.endswith("CONVERGED\n")
  summary = err.rsplit("\r", 1)[-1]
  assert (
    f"steps {int(res.num_steps)} |" in summary and f"calls {int(res.num_grad_evals)}" in summary
  )
  assert "null steps" in summary and " s |" in summary
  # redrawn at most every REFRESH_SECONDS: far fewer lines than steps on a fast run
  assert err.count("\r") < int(res.num_steps)


def test_progress_in_a_log_has_no_carriage_returns(capfd):
  """Where stderr is not a terminal, each drawn line ends with a newline (no redraws)."""
  res = _solve(progress=True)
  err = capfd.readouterr().err
  assert "\r" not in err and err.endswith("CONVERGED\n") and res.converged
  assert err.count("\n") <= 2  # the first step's line and the summary on a fast run


def test_under_jit_and_vmap(capfd, terminal):
  """Under jit the callback and line work as outside; under vmap the line reports the batch
  (one line, how many converged) and the callback gets the batch."""
  del terminal
  rec = Recorder()
  jitted = jax.jit(lambda a: _solve(a, callback=rec, progress=True))(A)
  assert len(rec.snapshots) == int(jitted.num_steps)
  assert capfd.readouterr().err.endswith("CONVERGED\n")
  batch = jnp.stack([A, 2 * A, 3 * A])
  rec = Recorder()
  out = jax.jit(jax.vmap(lambda a: _solve(a, callback=rec, progress=True)))(batch)
  err = capfd.readouterr().err
  summary = err.rsplit("\r", 1)[-1]
  assert err.count("\n") == 1 and "batch 3: 3 converged, 3 done" in summary
  assert "(median)" in summary
  assert rec.snapshots[0].params.shape == (3, 5)  # one call per step, with the batch
  assert len(rec.snapshots) == int(jnp.max(out.num_steps))


def _lowered(**watch):
  return jax.jit(lambda a: _solve(a, **watch).params).lower(A).as_text()


def test_off_the_program_is_unchanged():
  """callback=None, progress=False: the program solve compiles has no host call; on, it
  calls the host."""
  assert hooks.check_hook(None, False) is None
  off = _lowered()
  assert off == _lowered(callback=None, progress=False)
  assert "callback" not in off
  assert "callback" in _lowered(progress=True)


def test_minimize_progress_and_callback(capfd):
  seen = []

  def callback(intermediate_result):
    seen.append(float(intermediate_result.fun))

  res = hdm_optax.minimize(fun, np.zeros(5), args=(A,), callback=callback, progress=True)
  assert len(seen) == res.nit and seen[-1] == res.fun
  assert capfd.readouterr().err.endswith("\n") and res.success
