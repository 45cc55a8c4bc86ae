"""Trajectory tests: hdm_optax against the plain-NumPy reference (tests/reference.py).

Every configuration runs >= 30 float64 steps on two small problems and compares
x, P (and B / beta / z / A ...), the cached value and the accept flags step by step.

The tolerance follows from the computation's rounding, estimated from the reference
itself (:func:`backends.spread_tol`): the reference loop runs again, PERTURBED_RUNS
times, with f and grad f perturbed by the bound on their own rounding (``rounding_tol``
of their terms times the terms' size, noise that is a function of the point, so that
exact ties stay ties), and a field at step k may differ from the reference by 10 times
the largest distance of a perturbed run from it up to k, plus the rounding of its last
update. The accept flags, finiteness and oracle counts are compared exactly; where a
perturbed run takes another branch than the reference, the configuration sits within
rounding of a tie and the test fails saying so (``run_reference``).  One objective
family covers both problems,

    f(x) = 1/2 (x - s)^T A (x - s) + c * mean(log(1 + exp(-y * (M x))))
           (+inf if ||x - center||^2 > R2)

so that a single jit compilation per configuration serves the random strongly
convex quadratic (c = 0, minimum value 0 at s) and the logistic regression
(A = lam I, s = 0, c > 0); the problem data are traced arguments of the jitted
step.  Writing the quadratic around its minimiser keeps f(x) - f* well resolved:
HDM-AGD uses h = (f(x_P) - f(y)) / ||g||^2, whose rounding error grows like
|f| / ||g||^2, and with |f| >> f - f* the two implementations drift apart for purely
numerical reasons.
"""

import jax


import math  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import hdm_optax  # noqa: E402

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends  # noqa: E402
  import reference as ref  # noqa: E402
  from helpers import replace_fields  # noqa: E402
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends  # noqa: E402
  from tests import reference as ref  # noqa: E402
  from tests.helpers import replace_fields  # noqa: E402

# These tiny programs run a few dozen steps each: XLA's backend optimisations
# cost more compile time than they save (about 40% of each compilation).
FAST_COMPILE = {"xla_backend_optimization_level": 0}

N = 6  # dimension of both problems (one compile per configuration)
M_SAMPLES = 40
TERMS = N * N + N * M_SAMPLES  # the products f sums; each entry of grad f sums N + M_SAMPLES
PERTURBED_RUNS = 3  # reference runs with a perturbed oracle, for backends.spread_tol
# What may differ between the runs only at a tie: each is compared exactly.
DISCRETE = ("accepted", "finite", "finite_y", "finite_P", "calls", "looked")


# ---------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------


def make_problem(kind: str, seed: int, R2: float = math.inf, center=None):
  """Returns (data dict of float64 arrays, smoothness constant L)."""
  rng = np.random.default_rng(seed)
  M = rng.standard_normal((M_SAMPLES, N))
  y = np.where(rng.standard_normal(M_SAMPLES) > 0, 1.0, -1.0)
  if kind == "quadratic":
    Q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    eig = np.geomspace(1e-2, 1.0, N)  # mu = 0.01, L = 1
    A = (Q * eig) @ Q.T
    A = 0.5 * (A + A.T)
    s = np.linalg.solve(A, rng.standard_normal(N))  # minimiser, f(s) = 0
    c = 0.0
    L = float(np.max(np.linalg.eigvalsh(A)))
  elif kind == "logistic":
    lam = 1e-4
    M = M * np.geomspace(0.03, 1.0, N)  # badly scaled features
    c = 4.0 * M_SAMPLES / np.linalg.norm(M, 2) ** 2  # so that L ~ 1
    A = lam * np.eye(N)
    s = np.zeros(N)
    L = lam + c * np.linalg.norm(M, 2) ** 2 / (4 * M_SAMPLES)
  else:
    raise ValueError(kind)
  center = np.zeros(N) if center is None else np.asarray(center, dtype=np.float64)
  data = dict(A=A, s=s, M=M, y=y, c=np.float64(c), R2=np.float64(R2), center=center)
  return data, float(L)


def np_oracle(data, run: int = 0):
  """(f, grad f) in NumPy; ``run`` > 0 perturbs both at the size of their own rounding.

  The perturbed oracle adds :func:`backends.rounding_tol` of the terms times their size
  (:func:`value_size`, :func:`grad_size`) times :func:`backends.rounding_noise` of the
  point and ``run``: the same point gives the same values within a run (f(x - 0 g) = f(x)
  still ties), another run gives others.
  """
  A, s, M, y, c, R2, ctr = (data[k] for k in ("A", "s", "M", "y", "c", "R2", "center"))
  rel = backends.rounding_tol(TERMS)

  def noise(x):  # f's and grad f's, drawn together so that they differ
    return backends.rounding_noise(x, run, (1 + x.size,))

  def f(x):
    if (x - ctr) @ (x - ctr) > R2:
      return math.inf
    val = float(0.5 * (x - s) @ A @ (x - s) + c * np.mean(np.logaddexp(0.0, -y * (M @ x))))
    if run:
      val += rel * value_size(data, x) * float(noise(x)[0])
    return val

  def grad(x):
    z = -y * (M @ x)
    sig = 0.5 * (1.0 + np.tanh(0.5 * z))  # sigmoid(z)
    g = A @ (x - s) + c * (M.T @ (-y * sig)) / len(y)
    if run:
      g = g + rel * grad_size(data, x, sig) * noise(x)[1:]
    return g

  return f, grad


def value_size(data, x) -> float:
  """S(x): the absolute values of the terms f sums at x (a softplus term moves by at most the
  rounding of its argument m_i^T x, about n eps |m_i|^T |x|)."""
  A, s, M, y, c = (data[k] for k in ("A", "s", "M", "y", "c"))
  r = np.abs(x - s)
  softplus = np.logaddexp(0.0, -y * (M @ x)) + np.abs(M) @ np.abs(x)
  return float(0.5 * r @ np.abs(A) @ r + c * np.mean(softplus))


def grad_size(data, x, sig) -> np.ndarray:
  """The absolute values of the terms each entry of grad f sums at x: |A| |x - s| +
  c |M|^T sigma / m, with sigma the logistic terms' weights."""
  A, s, M, c = (data[k] for k in ("A", "s", "M", "c"))
  return np.abs(A) @ np.abs(x - s) + c * (np.abs(M).T @ sig) / M.shape[0]


def value_atol(data, xs) -> float:
  """How far two float64 evaluations of f at the points ``xs`` may differ when they sum in
  another order: NumPy against XLA, or XLA on another CPU (its vector width, its fusion).

  f sums the products of 0.5 r^T A r (r = x - s) and the softplus terms of the logistic
  loss: k = n^2 + n m terms, whose absolute values add up to S(x) (:func:`value_size`).
  Near the quadratic's minimum f is a small difference of large terms (S is 1e5 times f at
  step 20 of the reference run), so a relative tolerance on f follows from no rounding:
  this absolute one, :func:`backends.rounding_tol` of k terms times max S over ``xs``, does.
  """
  return backends.rounding_tol(TERMS) * max(value_size(data, np.asarray(x)) for x in xs)


def jax_objective(data):
  def f(x):
    r = x - data["s"]
    val = 0.5 * r @ data["A"] @ r + data["c"] * jnp.mean(
      jnp.logaddexp(0.0, -data["y"] * (data["M"] @ x))
    )
    e = x - data["center"]
    return jnp.where(e @ e > data["R2"], jnp.inf, val)

  return f


def x_start(seed: int = 1):
  return np.random.default_rng(seed).standard_normal(N)


# ---------------------------------------------------------------------------
# running the package
# ---------------------------------------------------------------------------


def make_stepper(opt):
  """One jit compilation per optimizer; problem data are traced arguments.

  The cached (value, grad) of the state is passed in from the host, exactly
  as ``optax.value_and_grad_from_state`` would (recomputed only while the
  cached value is not finite, i.e. before the first update); keeping that
  ``lax.cond`` out of the compiled step makes each compilation cheaper.
  """

  def step(data, state, x, v, g):
    f = jax_objective(data)
    upd, state = opt.update(g, state, x, value=v, grad=g, value_fn=f)
    return optax.apply_updates(x, upd), state

  return jax.jit(step, compiler_options=FAST_COMPILE)


_COMPILED = {}


def compiled(factory, **kwargs):
  """(opt, jitted step) for ``factory(**kwargs)``, shared by tests that use the
  same configuration, so that each configuration is compiled once."""
  key = (factory.__name__, tuple(sorted(kwargs.items())))
  if key not in _COMPILED:
    opt = factory(**kwargs)
    _COMPILED[key] = (opt, make_stepper(opt))
  return _COMPILED[key]


def _value_and_grad(data, x):
  return jax.value_and_grad(jax_objective(data))(x)


# same compiler options as the steps, so that f(x) here and f(x - 0 * g) inside
# the first update round identically (the P_1 = 0 runs test that exact tie)
_value_and_grad = jax.jit(_value_and_grad, compiler_options=FAST_COMPILE)


def run_package(opt, stepper, data, x0, steps, extract, replace=None):
  """Runs ``steps`` updates from ``opt.init(x0)`` (optionally with some state
  fields replaced, e.g. ``precond``) and returns the per-step records."""
  x = jnp.asarray(x0)
  state = opt.init(x)
  if replace:
    state = replace_fields(state, **{k: jnp.asarray(v) for k, v in replace.items()})
  recs = []
  for _ in range(steps):
    v, g = state.value, state.grad
    if not np.isfinite(float(v)):
      v, g = _value_and_grad(data, x)
    x, state = stepper(data, state, x, v, g)
    recs.append(extract(np.asarray(x), state))
  return recs, state


class Reference(dict):
  """A reference loop's records (a dict, as the loop returns them), and ``perturbed``: the
  same loop's records with :func:`np_oracle`'s perturbed oracles, for the tolerances."""

  perturbed: list


def run_reference(loop, data, *args, **kwargs) -> Reference:
  """``loop(f, grad, *args, **kwargs)`` with the exact NumPy oracle of ``data`` and with
  PERTURBED_RUNS perturbed ones.

  Every run must take the same branches (the records in DISCRETE): one that takes another
  sits within rounding of a tie there, where no implementation need reproduce the
  reference, and the test says so instead of comparing.
  """
  want = Reference(loop(*np_oracle(data), *args, **kwargs))
  want.perturbed = [
    loop(*np_oracle(data, run), *args, **kwargs) for run in range(1, 1 + PERTURBED_RUNS)
  ]
  for run, other in enumerate(want.perturbed, 1):
    for key in DISCRETE:
      k = next(
        (k for k, (a, b) in enumerate(zip(want.get(key, ()), other.get(key, ()))) if a != b), None
      )
      if k is not None:
        pytest.fail(
          f"rounding tie: with its oracle perturbed at the rounding level (run {run}), the "
          f"reference takes another branch at step {k + 1} ({key}: {other[key][k]} against "
          f"{want[key][k]}): no implementation need reproduce this configuration there; "
          "compare fewer steps or another configuration"
        )
  return want


def assert_traj(got, want: Reference, *names, tag=""):
  """The package's per-step records ``got`` against the reference's: the fields ``names``
  (record ``name``, reference ``name + "s"``) within :func:`backends.spread_tol` (the spread
  of the perturbed reference runs; the rounding of the N products of a last update), and
  the accept flags exactly."""
  for name in names:
    key = name + "s"
    tol = backends.spread_tol(want[key], [run[key] for run in want.perturbed], terms=N)
    ref_traj = backends.per_step(want[key])
    traj = backends.per_step([r[name] for r in got])
    assert traj.shape == ref_traj.shape, (tag + name, traj.shape, ref_traj.shape)
    for k in range(traj.shape[0]):
      np.testing.assert_allclose(
        traj[k], ref_traj[k], rtol=0, atol=tol[k], err_msg=f"{tag}{name} differs at step {k + 1}"
      )
  if "accepted" in want:
    assert [r["accepted"] for r in got] == want["accepted"], "accepted flags differ"


def assert_moves(name, traj, first, tol=1e-3):
  traj = np.asarray(traj, dtype=np.float64)
  assert np.max(np.abs(traj - np.asarray(first))) > tol, f"{name} never moved: test is vacuous"


def _np(a):
  return np.asarray(a, dtype=np.float64)


# ---------------------------------------------------------------------------
# HDM (Algorithm 1)
# ---------------------------------------------------------------------------

HDM_LR = {"ogd": 0.5, "ogd_sqrt": 1.0, "adagrad": 0.3}
HDM_STEPS = 35
# P_1 = 2.5 > 2/L: the first trials overshoot, so the null step matters.
HDM_P1 = 2.5


def _hdm_extract(x, state):
  return dict(
    x=x,
    P=_np(state.direction.precond),
    value=float(state.value),
    accepted=bool(state.info.accepted),
  )


def _check_hdm(opt, stepper, ref_kwargs, data, steps, candidate, P1, *, x0=None, replace=None):
  x0 = x_start() if x0 is None else x0
  want = run_reference(ref.hdm_reference, data, x0, steps, candidate=candidate, P1=P1, **ref_kwargs)
  got, _ = run_package(opt, stepper, data, x0, steps, _hdm_extract, replace=replace)
  assert_traj(got, want, "P", "x", "value")
  assert_moves("P", want["Ps"], ref.init_precond(candidate, N, P1))
  return want


@pytest.mark.parametrize("null_step", [True, False])
@pytest.mark.parametrize("learner", ref.LEARNERS)
@pytest.mark.parametrize("candidate", ref.CANDIDATES)
def test_hdm_matches_reference(candidate, learner, null_step):
  """Four runs per configuration (one compilation):

  * quadratic from init_precond = 2.5 > 2/L;
  * logistic regression from P_1 = 0 (set in the state): the first trial
    equals x, a tie that the null step rejects;
  * logistic regression from init_precond = 2.5: the first trial increases f
    (rejected with the null step, taken without);
  * 3 steps from the minimiser of the quadratic (grad f = 0 exactly).

  (With P_1 = 0 on the ill-conditioned quadratic, the scalar P grows well past
  2/L and the trajectory amplifies rounding errors so much that two correct
  float64 implementations disagree at the 1e-8 level; hence that pairing.)
  """
  opt, stepper, kw = _hdm_config(candidate, learner, null_step)
  x0 = x_start()

  # quadratic, P_1 = 2.5
  data, _ = make_problem("quadratic", 0)
  _check_hdm(opt, stepper, kw, data, HDM_STEPS, candidate, HDM_P1)

  # logistic regression, P_1 = 0
  data, _ = make_problem("logistic", 0)
  P0 = ref.init_precond(candidate, N, 0.0)
  want = _check_hdm(opt, stepper, kw, data, HDM_STEPS, candidate, 0.0, replace=dict(precond=P0))
  assert want["accepted"][0] is (not null_step)  # f(x - 0 g) == f(x)

  # logistic regression, P_1 = 2.5
  f, _ = np_oracle(data)
  want = _check_hdm(opt, stepper, kw, data, HDM_STEPS, candidate, HDM_P1)
  if null_step:
    assert not want["accepted"][0]
    assert all(v <= f(x0) for v in want["values"])
  else:
    assert all(want["accepted"])
    assert want["values"][0] > f(x0)  # vanilla HDM really moved uphill

  # started at the minimiser (grad f = 0 exactly): the hypergradient is 0/0,
  # taken as 0, so nothing may move (and nothing may become NaN)
  data, _ = make_problem("quadratic", 0)
  f, grad = np_oracle(data)
  assert not np.any(grad(data["s"]))
  want = ref.hdm_reference(f, grad, data["s"], 3, candidate=candidate, P1=HDM_P1, **kw)
  got, _ = run_package(opt, stepper, data, data["s"], 3, _hdm_extract)
  for r in got:
    np.testing.assert_array_equal(r["P"], ref.init_precond(candidate, N, HDM_P1))
    np.testing.assert_array_equal(r["x"], data["s"])
  assert [r["accepted"] for r in got] == want["accepted"] == [not null_step] * 3


@pytest.mark.parametrize("null_step", [True, False])
@pytest.mark.parametrize("learner", ref.LEARNERS)
@pytest.mark.parametrize("candidate", ref.CANDIDATES)
def test_hdm_nonfinite_trials_match_reference(candidate, learner, null_step):
  """Logistic regression with f = +inf outside a ball, from init_precond = 2.5:
  later trials leave the ball.  A non-finite trial must be rejected and leave
  x, P and the learner untouched, with or without the null step, and halve
  the next trial step (s <- s/2; s <- 1 after a finite trial), so the run
  alternates between rejected and (damped) finite trials instead of stalling.
  (Same compilations as test_hdm_matches_reference.)"""
  opt, stepper, kw = _hdm_config(candidate, learner, null_step)
  x0 = x_start()
  data, _ = make_problem("logistic", 0, R2=2.0 * float(x0 @ x0))
  want = _check_hdm(opt, stepper, kw, data, HDM_STEPS, candidate, HDM_P1)
  assert not all(want["finite"]), "no non-finite trial: test is vacuous"
  Ps = np.asarray(want["Ps"])
  for k in range(1, HDM_STEPS):
    if not want["finite"][k]:
      assert not want["accepted"][k]
      np.testing.assert_array_equal(Ps[k], Ps[k - 1])
    elif not null_step:
      assert want["accepted"][k]


def _hdm_config(candidate, learner, null_step):
  lr = HDM_LR[learner]
  opt, stepper = compiled(
    hdm_optax.hdm,
    candidate=candidate,
    learner=learner,
    precond_lr=lr,
    null_step=null_step,
    init_precond=HDM_P1,
  )
  return opt, stepper, dict(learner=learner, lr=lr, null_step=null_step)


@pytest.mark.parametrize(
  "candidate,learner,precond_min,precond_max",
  [
    ("scalar", "ogd", 0.0, 1.5),
    ("diagonal", "adagrad", 0.2, 3.0),
    ("full", "ogd_sqrt", -0.3, 2.0),
  ],
)
def test_hdm_projection_matches_reference(candidate, learner, precond_min, precond_max):
  lr = HDM_LR[learner]
  opt, stepper = compiled(
    hdm_optax.hdm,
    candidate=candidate,
    learner=learner,
    precond_lr=lr,
    null_step=True,
    init_precond=0.5,
    precond_min=precond_min,
    precond_max=precond_max,
  )
  data, _ = make_problem("quadratic", 3)
  want = _check_hdm(
    opt,
    stepper,
    dict(learner=learner, lr=lr, null_step=True, precond_min=precond_min, precond_max=precond_max),
    data,
    30,
    candidate,
    0.5,
  )
  Ps = np.asarray(want["Ps"])
  assert np.any(Ps == precond_max), "upper bound never active: test is vacuous"
  assert np.all(Ps >= precond_min) and np.all(Ps <= precond_max)


@pytest.mark.parametrize("perturbed", ["x0", "P1", "data"])
def test_the_tolerance_rejects_a_run_perturbed_by_1e6(perturbed):
  """The rule is not vacuous: a package run from x0, P_1 or the data 1e-6 (relative)
  away from the reference's fails the comparison. (Same compilation as
  test_hdm_matches_reference.)"""
  opt, stepper, kw = _hdm_config("diagonal", "adagrad", True)
  data, _ = make_problem("quadratic", 0)
  x0 = x_start()
  want = run_reference(
    ref.hdm_reference, data, x0, HDM_STEPS, candidate="diagonal", P1=HDM_P1, **kw
  )
  P1 = ref.init_precond("diagonal", N, HDM_P1)
  if perturbed == "x0":
    x0 = x0 * (1 + 1e-6)
  elif perturbed == "P1":
    P1 = P1 * (1 + 1e-6)
  else:
    data = dict(data, A=data["A"] * (1 + 1e-6))
  got, _ = run_package(opt, stepper, data, x0, HDM_STEPS, _hdm_extract, replace=dict(precond=P1))
  with pytest.raises(AssertionError, match="differs at step"):
    assert_traj(got, want, "P", "x", "value")


# ---------------------------------------------------------------------------
# HDM-HB (Algorithm 2)
# ---------------------------------------------------------------------------

HB_STEPS = 35


def _hb_extract(x, state):
  return dict(
    x=x,
    P=_np(state.direction.precond),
    B=_np(state.direction.momentum),
    x_prev=_np(state.direction.prev_params),
    value=float(state.value),
    accepted=bool(state.info.accepted),
  )


def _check_hb(config, data, x0):
  candidate, momentum_candidate, learner, omega, tau, P1 = config
  lr = HDM_LR[learner]
  mlr = {"ogd": 0.2, "ogd_sqrt": 0.3, "adagrad": 0.1}[learner]
  B1 = 0.5
  opt, stepper = compiled(
    hdm_optax.hdm_hb,
    candidate=candidate,
    momentum_candidate=momentum_candidate,
    learner=learner,
    precond_lr=lr,
    momentum_lr=mlr,
    omega=omega,
    tau=tau,
    init_precond=P1,
    init_momentum=B1,
  )
  want = run_reference(
    ref.hdm_hb_reference,
    data,
    x0,
    HB_STEPS,
    candidate=candidate,
    momentum_candidate=momentum_candidate,
    learner=learner,
    lr=lr,
    momentum_lr=mlr,
    omega=omega,
    tau=tau,
    P1=P1,
    B1=B1,
  )
  assert_moves("P", want["Ps"], ref.init_precond(candidate, N, P1))
  assert_moves("B", want["Bs"], ref.init_precond(momentum_candidate, N, B1))
  got, _ = run_package(opt, stepper, data, x0, HB_STEPS, _hb_extract)
  assert_traj(got, want, "P", "B", "x", "x_prev", "value")
  return want


# (candidate, momentum_candidate, learner, omega, tau, P_1).  P_1 > 2/L so that
# the first trials overshoot and the potential-based null step is exercised in
# every configuration.
HB_CONFIGS = [
  ("scalar", "scalar", "adagrad", 0.0, 0.0, 2.5),
  ("scalar", "diagonal", "adagrad", 0.5, 1.0, 2.5),
  ("diagonal", "scalar", "adagrad", 0.5, 1.0, 2.5),
  ("diagonal", "diagonal", "ogd", 0.0, 0.0, 2.5),
  ("full", "scalar", "ogd_sqrt", 0.3, 2.0, 3.0),
  ("full", "diagonal", "adagrad", 0.5, 1.0, 2.5),
]


@pytest.mark.parametrize("config", HB_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_hdm_hb_matches_reference(config):
  n_rejected = 0
  x0 = x_start(2)
  for kind in ("quadratic", "logistic"):
    data, _ = make_problem(kind, 1)
    want = _check_hb(config, data, x0)
    assert sum(want["accepted"]) >= HB_STEPS // 3
    n_rejected += sum(not a for a in want["accepted"])
    assert want["values"][-1] < np_oracle(data)[0](x0)
  assert n_rejected >= 1, "no null step in either problem: null-step path untested"


@pytest.mark.parametrize(
  "config", [HB_CONFIGS[0], HB_CONFIGS[3]], ids=lambda c: "-".join(map(str, c))
)
def test_hdm_hb_nonfinite_trials_match_reference(config):
  """Logistic regression with f = +inf outside a ball: later trials leave it.
  A non-finite trial leaves x, x^-, P, B and the learners untouched and halves
  the next trial step, so the run does not stall on the same point.  (Same
  compilations as test_hdm_hb_matches_reference.)"""
  x0 = x_start(2)
  data, _ = make_problem("logistic", 1, R2=1.1 * float(x0 @ x0))
  want = _check_hb(config, data, x0)
  assert not all(want["finite"]), "no non-finite trial: test is vacuous"
  k0 = want["finite"].index(False)
  assert k0 > 0 and any(want["finite"][k0:]), "the damping never recovered a finite trial"
  for k in range(k0, len(want["finite"])):
    if not want["finite"][k]:  # a rejected trial changes nothing
      for key in ("Ps", "Bs", "xs", "x_prevs"):
        np.testing.assert_array_equal(want[key][k], want[key][k - 1])


# ---------------------------------------------------------------------------
# HDM-AGD (Algorithm 3)
# ---------------------------------------------------------------------------

AGD_STEPS = 35


def _agd_extract(x, state):
  return dict(
    x=x, P=_np(state.precond), z=_np(state.z), A=float(state.weight_sum), value=float(state.value)
  )


# Configurations are chosen so that the reference trajectory itself is well
# conditioned: a relative perturbation of 1e-15 of x_1 changes the 35-step
# reference trajectory by < 1e-11.  (A scalar P well above 2/L makes HDM-AGD
# amplify rounding errors by ~5x per step along the stiff direction, so two
# correct float64 implementations legitimately disagree at the 1e-8 level; the
# scalar case therefore uses a small learning rate and the bound precond_max < 2/L.)
@pytest.mark.parametrize(
  "candidate,learner,lr,theta,precond_max",
  [
    ("scalar", "ogd", 0.1, 0.5, 1.9),
    ("diagonal", "adagrad", 0.3, 1.0, None),
    ("diagonal", "ogd", 0.5, 0.6, None),
    ("full", "ogd_sqrt", 0.5, 0.5, None),
  ],
)
def test_hdm_agd_matches_reference(candidate, learner, lr, theta, precond_max):
  x0 = x_start(3)
  problems = [make_problem(kind, 2) for kind in ("quadratic", "logistic")]
  # one valid (upper) smoothness constant for both problems -> a single compile
  L = max(Lp for _, Lp in problems)
  runs = [(kind, data, 0.0) for kind, (data, _) in zip(("quadratic", "logistic"), problems)]
  _check_agd(candidate, learner, lr, theta, precond_max, L, x0, runs)


@pytest.mark.parametrize(
  "learner,lr,theta",
  [("adagrad", 0.3, 1.0), ("ogd_sqrt", 0.5, 0.6)],
)
def test_hdm_agd_nonfinite_trials_match_reference(learner, lr, theta):
  """The quadratic restricted to a ball around its minimiser (f = +inf outside),
  from P_1 = 30 I (set in the state): the first trials y - P g leave the ball,
  so P is not updated, h counts as +inf (v = max(L, L/(2 theta))) and x_P as
  f = +inf in the argmin; then P learns again.  With ogd_sqrt the step is
  eta / sqrt(k) with k the learner round (the skipped trials are not rounds)."""
  x0 = x_start(3)
  data, L = make_problem("quadratic", 2)
  L = max(L, make_problem("logistic", 2)[1])  # same constant as above
  centre = data["s"]  # minimiser of the quadratic
  R2 = (1.05 * np.linalg.norm(x0 - centre)) ** 2
  ball = make_problem("quadratic", 2, R2=R2, center=centre)[0]
  wants = _check_agd("diagonal", learner, lr, theta, None, L, x0, [("ball", ball, 30.0)])
  finite_P = wants[0]["finite_P"]
  assert not all(finite_P[:2]), "no non-finite trial: test is vacuous"
  assert all(finite_P[5:])


def _check_agd(candidate, learner, lr, theta, precond_max, L, x0, runs):
  opt, stepper = compiled(
    hdm_optax.hdm_agd,
    lipschitz=L,
    theta=theta,
    candidate=candidate,
    learner=learner,
    precond_lr=lr,
    init_precond=0.0,
    precond_max=precond_max,
  )
  wants = []
  for kind, data, P1 in runs:
    f, _ = np_oracle(data)
    want = run_reference(
      ref.hdm_agd_reference,
      data,
      x0,
      AGD_STEPS,
      lipschitz=L,
      theta=theta,
      candidate=candidate,
      learner=learner,
      lr=lr,
      P1=P1,
      precond_max=precond_max,
    )
    assert all(want["finite_y"])  # the spec leaves a non-finite f(y) undefined
    assert_moves(kind + ":P", want["Ps"], ref.init_precond(candidate, N, P1))
    assert want["values"][-1] < f(x0)
    replace = None if P1 == 0.0 else dict(precond=ref.init_precond(candidate, N, P1))
    got, _ = run_package(opt, stepper, data, x0, AGD_STEPS, _agd_extract, replace=replace)
    assert_traj(got, want, "P", "x", "z", "A", "value", tag=f"{kind}:")
    wants.append(want)
  return wants


# ---------------------------------------------------------------------------
# HDM-Best (Algorithm 4 + refinements)
# ---------------------------------------------------------------------------


def _best_extract(x, state):
  return dict(
    x=x,
    P=_np(state.direction.precond),
    beta=float(state.direction.momentum),
    x_prev=_np(state.direction.prev_params),
    U=_np(state.direction.precond_learner_state.sum_sq),  # AdaGrad state of P: U_k
    v=float(state.direction.momentum_learner_state.sum_sq),  # AdaGrad state of beta: v_k
    eta_p=float(state.direction.precond_lr),
    L_hat=float(state.direction.curvature.l_hat),  # 0 until the estimate exists
    value=float(state.value),
    accepted=bool(state.info.accepted),
  )


def _check_best(kind, seed, steps, horizon, R2=math.inf, vacuity=True):
  data, L = make_problem(kind, seed)
  data, _ = make_problem(kind, seed, R2=R2)
  f, _ = np_oracle(data)
  x0 = x_start(5)
  kw = dict(lipschitz=L, precond_lr=0.5 / L, momentum_lr=1.0)
  estimate = hdm_optax.pieces.curvature.running_mean(horizon)
  opt, stepper = compiled(hdm_optax.hdm_best, curvature_estimate=estimate, **kw)
  want = run_reference(ref.hdm_best_reference, data, x0, steps, horizon=horizon, **kw)
  # vacuity checks on the reference run first (they do not depend on the package)
  if vacuity:
    k_set = next((k for k, Lh in enumerate(want["L_hats"]) if Lh is not None), None)
    assert k_set is not None and k_set < steps - 10, "L_hat never set: estimator untested"
    assert not all(want["accepted"])
  assert_moves("P", want["Ps"], np.zeros(N))
  assert_moves("beta", want["betas"], 0.95)
  assert want["values"][-1] < f(x0)
  got, _ = run_package(opt, stepper, data, x0, steps, _best_extract)
  assert_traj(got, want, "P", "eta_p", "x", "x_prev", "beta", "U", "v", "value", "L_hat")
  return want


# horizon 40: threshold 20, L_hat is formed early (step ~22-34) and then used in
# the denominator (tau = L_hat^2 / 2) and in the bound for the rest of the run.
@pytest.mark.parametrize("kind,seed,steps", [("quadratic", 5, 60), ("logistic", 4, 70)])
def test_hdm_best_matches_reference(kind, seed, steps):
  _check_best(kind, seed, steps, horizon=40)


def test_hdm_best_nonfinite_trials_match_reference():
  """Logistic regression with f = +inf outside a ball (same compilation as the
  logistic case above).  On a non-finite trial P, beta, U, v stay, the counter
  drops by 2, k still advances, x stays and x^- <- x, and the next trial step
  is halved, so it is s (x - P g) without momentum."""
  x0 = x_start(5)
  R2 = 1.5 * float(x0 @ x0)
  want = _check_best("logistic", 4, 40, horizon=40, R2=R2, vacuity=False)
  finite = want["finite"]
  assert not all(finite), "no non-finite trial: test is vacuous"
  k0 = finite.index(False)
  assert any(finite[k0:]), "no finite trial after a non-finite one"
  for k in range(1, len(finite)):
    if not finite[k]:
      np.testing.assert_array_equal(want["Ps"][k], want["Ps"][k - 1])
      np.testing.assert_array_equal(want["x_prevs"][k], want["xs"][k])


def test_hdm_best_precond_lr_decay_matches_reference():
  """horizon 240: threshold 60, so the run is still estimating at k = 50, where
  eta_p = 0.8 eta_p0 is first used by the P update of iteration 50 itself (the
  order that reproduces the published HDM-Best counts); L_hat is then formed
  at step ~68."""
  want = _check_best("logistic", 5, 80, horizon=240)
  assert want["eta_ps"][49] < want["eta_ps"][48], "eta_p never decayed: decay untested"


# ---------------------------------------------------------------------------
# OSGM-Best (Part II): same problems, the probe directions passed to NumPy
# ---------------------------------------------------------------------------


def _osgm_extract(x, state):
  return dict(
    x=x,
    P=_np(state.direction.precond),
    beta=float(state.direction.momentum),
    value=float(state.value),
    L=float(state.direction.lipschitz),
    accepted=bool(state.info.accepted),
    calls=int(state.info.num_grad_evals),
  )


def _check_tuning_free(
  make, reference, directions, extract, fields, kind, seed, steps, horizon, R2=math.inf
):
  """The package's ``make`` against its NumPy ``reference`` on one problem.

  ``directions(x0)`` gives the probe directions the package draws (passed to
  NumPy); ``fields`` are compared as trajectories. probe_size 0.1: with 1e-4
  the probe's gradient difference cancels to 1e-12 relative, which the two
  implementations round differently. P feeds back into itself through the
  trial point (AdaGrad divides by a running sum): on the quadratic the oracle's
  rounding grows by a factor of about 1e8 in P over 50 steps (the perturbed
  reference runs measure it) while every flag and count agrees.
  """
  data, _ = make_problem(kind, seed, R2=R2)
  f, _ = np_oracle(data)
  x0 = x_start(5)
  opt, stepper = compiled(make, horizon=horizon, seed=3, probe_size=0.1)
  want = run_reference(
    reference,
    data,
    x0,
    steps,
    directions=[np.asarray(d) for d in directions(jnp.asarray(x0))],
    horizon=horizon,
    probe_size=0.1,
  )
  got, _ = run_package(opt, stepper, data, x0, steps, extract)
  assert_traj(got, want, *fields)
  assert [r["calls"] for r in got] == want["calls"], "oracle counts differ"
  assert want["values"][-1] < f(x0)
  return want


def _check_osgm(kind, seed, steps, horizon, R2=math.inf):
  want = _check_tuning_free(
    hdm_optax.osgm_best,
    ref.osgm_best_reference,
    lambda x0: [
      hdm_optax.pieces.curvature.probe_direction(jax.random.key(3), i, x0) for i in range(3)
    ],
    _osgm_extract,
    ("x", "P", "beta", "value", "L"),
    kind,
    seed,
    steps,
    horizon,
    R2,
  )
  assert_moves("P", want["Ps"], np.zeros(N))
  return want


@pytest.mark.parametrize("kind,seed,steps", [("quadratic", 5, 50), ("logistic", 4, 80)])
def test_osgm_best_matches_reference(kind, seed, steps):
  """horizon 40: threshold 20, so L_hat replaces the probe's L early and the
  lookahead (Armijo backtracking) runs for the rest of the run."""
  want = _check_osgm(kind, seed, steps, horizon=40)
  assert len(set(want["Ls"][3:])) > 1, "L_hat never formed: estimator untested"
  assert not all(want["accepted"][3:]), "no null step: acceptance untested"
  assert any(want["looked"]), "no lookahead step: lookahead untested"


def test_osgm_best_decay_matches_reference():
  """horizon 240 (threshold 60): lr_P decays at k = 50 while estimating; L_hat forms at
  step 73 and the lookahead runs from step 76. (From step 84 on, an Armijo comparison sits
  within rounding of its threshold: reference runs with a perturbed oracle take another
  branch there, so the run stops at 80.)"""
  want = _check_osgm("logistic", 5, 80, horizon=240)
  assert len(set(want["Ls"][3:])) > 1


def test_osgm_best_nonfinite_trials_match_reference():
  """f = +inf outside a ball: a non-finite trial leaves P, beta and the
  learners as they are, and the next trial step is halved."""
  x0 = x_start(5)
  want = _check_osgm("logistic", 4, 40, horizon=40, R2=1.5 * float(x0 @ x0))
  finite = want["finite"]
  assert not all(finite), "no non-finite trial: test is vacuous"
  assert any(finite[finite.index(False) :]), "no finite trial after a non-finite one"
  for k in range(1, len(finite)):
    if not finite[k]:
      np.testing.assert_array_equal(want["Ps"][k], want["Ps"][k - 1])


# ---------------------------------------------------------------------------
# hdm_auto: same problems and probe directions
# ---------------------------------------------------------------------------


def _check_auto(kind, seed, steps, horizon, R2=math.inf):
  return _check_tuning_free(
    hdm_optax.hdm_auto,
    ref.hdm_auto_reference,
    lambda x0: [
      hdm_optax.pieces.curvature.probe_direction(jax.random.key(3), i, x0) for i in range(3)
    ],
    _auto_extract,
    ("x", "P", "beta", "value", "L", "U"),
    kind,
    seed,
    steps,
    horizon,
    R2,
  )


def _auto_extract(x, state):
  return dict(
    x=x,
    P=_np(state.direction.precond),
    beta=float(state.direction.momentum),
    value=float(state.value),
    L=float(state.direction.lipschitz),
    U=_np(state.direction.precond_learner_state.sum_sq),
    accepted=bool(state.info.accepted),
    calls=int(state.info.num_grad_evals),
  )


@pytest.mark.parametrize("kind,seed,steps", [("quadratic", 5, 80), ("logistic", 4, 70)])
def test_hdm_auto_matches_reference(kind, seed, steps):
  """horizon 40: L_hat forms early; the run has null steps (P shrinks). (The logistic run
  stops at 70: from step 79 on, reference runs with a perturbed oracle take another branch
  at a null step's comparison.)"""
  want = _check_auto(kind, seed, steps, horizon=40)
  assert len(set(want["Ls"][3:])) > 1, "L_hat never formed: estimator untested"
  assert not all(want["accepted"][3:]), "no null step: the shrink is untested"
  assert len({float(p[0]) for p in want["Ps"]}) > 10, "P hardly moved"


def test_hdm_auto_nonfinite_trials_match_reference():
  """f = +inf outside a ball: a non-finite trial leaves U and beta, shrinks P."""
  x0 = x_start(5)
  want = _check_auto("logistic", 4, 40, horizon=40, R2=1.5 * float(x0 @ x0))
  finite = want["finite"]
  assert not all(finite), "no non-finite trial: test is vacuous"
  for k in range(1, len(finite)):
    if not finite[k]:
      np.testing.assert_array_equal(want["Us"][k], want["Us"][k - 1])
