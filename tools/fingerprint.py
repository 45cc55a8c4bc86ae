"""Digests of what the front doors return and of the programs they compile, to show that a
refactoring changed no result bit.

``python -m tools.fingerprint > before.json`` on one checkout, ``> after.json`` on the other,
then ``python -m tools.fingerprint --compare before.json after.json``. Each entry is an md5:
``result/...`` of every array a scenario returns (its bytes, shapes and dtypes), ``update/...``
of the jaxpr of one ``update`` of a method, ``program/...`` of the jaxpr of a front door's
program (inner jaxprs' names left out). Only the public API is used, so that any two
checkouts compare.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import re
import sys
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import hdm_optax  # noqa: E402


def _digest(tree) -> str:
  h = hashlib.md5()
  leaves, treedef = jax.tree.flatten(tree)
  h.update(str(treedef).encode())
  for leaf in leaves:
    a = np.asarray(leaf)
    h.update(f"{a.shape}{a.dtype}".encode())
    h.update(np.ascontiguousarray(a).tobytes() if a.dtype != object else repr(a).encode())
  return h.hexdigest()


def _jaxpr_digest(jaxpr) -> str:
  text = re.sub(r"name=\w+", "name=_", str(jaxpr))
  return hashlib.md5(text.encode()).hexdigest()


def rosen(x, a):
  return jnp.sum(a * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def quad(x, d):
  return jnp.sum(d * (x - 1.0) ** 2)


def logistic(w, A, y):
  return jnp.mean(jnp.logaddexp(0.0, -y * (A @ w))) + 1e-3 * jnp.sum(w**2)


A = jax.random.normal(jax.random.key(0), (60, 8))
Y = jnp.sign(A @ jnp.linspace(-1.0, 1.0, 8) + 0.1)
X0 = jnp.zeros(6) - 0.5
METHODS = {
  "trial_lbfgs": lambda: hdm_optax.trial_lbfgs(),
  "trial_lbfgs_box": lambda: hdm_optax.trial_lbfgs(lower=-0.3, upper=0.9),
  "hdm": lambda: hdm_optax.hdm(precond_lr=0.01),
  "hdm_hb": lambda: hdm_optax.hdm_hb(precond_lr=0.01),
  "hdm_agd": lambda: hdm_optax.hdm_agd(lipschitz=800.0),
  "hdm_best": lambda: hdm_optax.hdm_best(lipschitz=800.0),
  "hdm_auto": lambda: hdm_optax.hdm_auto(),
  "osgm_best": lambda: hdm_optax.osgm_best(),
  "optax_lbfgs": lambda: optax.lbfgs(),
  "adam": lambda: optax.adam(1e-2),
  "chain_clip": lambda: optax.chain(optax.clip_by_global_norm(5.0), hdm_optax.hdm_best()),
}


def updates() -> dict:
  out = {}
  for name, make in METHODS.items():
    opt = make()
    x = X0
    state = opt.init(x)
    value, grad = jax.value_and_grad(rosen)(x, 10.0)
    fun = lambda p: rosen(p, 10.0)
    for at in (False, True):

      def step(g, s, p, at=at):
        kw = dict(value=value, grad=g, value_fn=fun)
        if at:
          with hdm_optax.values_at_params():
            return opt.update(g, s, p, **kw)
        return opt.update(g, s, p, **kw)

      try:
        out[f"update/{name}/{'at' if at else 'checked'}"] = _jaxpr_digest(
          jax.make_jaxpr(step)(grad, state, x)
        )
      except Exception as err:  # noqa: BLE001
        out[f"update/{name}/{'at' if at else 'checked'}"] = f"error {type(err).__name__}"
  return out


def _solve(name, **kw):
  kw.setdefault("max_steps", 300)
  kw.setdefault("tol", 1e-8)
  return hdm_optax.solve(METHODS[name](), rosen, X0, fun_args=(10.0,), **kw)


_LOOP_FIELDS = ("params", "opt_state", "value", "grad", "grad_norm", "num_steps")
_LOOP_FIELDS += ("num_value_evals", "num_grad_evals", "accepted", "null_run", "status", "tol")


def _loop_fields(s):
  """The fields a LoopState has had since the engine landed."""
  return {name: getattr(s, name) for name in _LOOP_FIELDS}


class _Halt:
  def __init__(self, at):
    self.at, self.seen = at, []

  def __call__(self, snap):
    self.seen.append(
      tuple(np.asarray(f).tolist() for f in (snap.num_steps, snap.value, snap.num_null_steps))
    )
    return int(np.max(snap.num_steps)) >= self.at


def scenarios() -> dict:
  s = {}
  for name in METHODS:
    s[f"solve/{name}"] = lambda name=name: _solve(name)
  s["solve/ftol"] = lambda: _solve("trial_lbfgs", ftol=1e-6)
  s["solve/ftol_traced0"] = lambda: _solve("trial_lbfgs", ftol=jnp.float64(0.0))
  s["solve/rtol"] = lambda: _solve("hdm_best", rtol=1e-3, tol=0.0)
  s["solve/check_every"] = lambda: _solve("hdm_auto", check_every=7)
  s["solve/max_grad_evals"] = lambda: _solve("optax_lbfgs", max_grad_evals=40)
  s["solve/min_value"] = lambda: _solve("hdm_best", min_value=5.0)
  s["solve/max_null_steps"] = lambda: _solve("hdm", max_null_steps=2)
  s["solve/min_value_none"] = lambda: _solve("trial_lbfgs", min_value=None)
  s["solve/trace"] = lambda: _solve("trial_lbfgs", trace=16)

  def halted():
    cb = _Halt(5)
    r = _solve("hdm_best", callback=cb)
    return r, cb.seen

  s["solve/callback_halt"] = halted

  def watched():
    cb = _Halt(10**9)
    with contextlib.redirect_stderr(io.StringIO()):
      r = _solve("hdm", callback=cb, progress=True, max_null_steps=50)
    return r, cb.seen

  s["solve/callback_progress"] = watched
  s["solve/has_aux"] = lambda: hdm_optax.solve(
    hdm_optax.trial_lbfgs(),
    lambda x: (quad(x, jnp.arange(1.0, 4.0)), x * 2),
    jnp.zeros(3),
    has_aux=True,
    tol=1e-9,
  )

  def resumed():
    r = _solve("trial_lbfgs", max_steps=5)
    return hdm_optax.solve(
      hdm_optax.trial_lbfgs(), rosen, r.params, fun_args=(10.0,), init_state=r.state, tol=1e-8
    )

  s["solve/init_state"] = resumed
  s["solve/logistic_f32"] = lambda: hdm_optax.solve(
    hdm_optax.trial_lbfgs(),
    logistic,
    jnp.zeros(8, jnp.float32),
    fun_args=(A.astype(jnp.float32), Y.astype(jnp.float32)),
    tol=1e-5,
  )
  s["solve/vmap"] = lambda: jax.vmap(
    lambda d: hdm_optax.solve(hdm_optax.hdm_auto(), quad, jnp.zeros(3), fun_args=(d,), tol=1e-9)
  )(jnp.asarray([[1.0, 10.0, 100.0], [1.0, 2.0, 3.0]]))
  D = jnp.asarray([[1.0, 10.0, 100.0], [1.0, 2.0, 3.0], [1.0, 1e3, 1e4], [5.0, 5.0, 5.0]])
  s["batch/compact"] = lambda: hdm_optax.solve_batch(
    hdm_optax.trial_lbfgs(), quad, jnp.zeros(3), fun_args=(D,), in_axes=(None, 0), tol=1e-9
  )
  s["batch/lockstep_trace"] = lambda: hdm_optax.solve_batch(
    hdm_optax.hdm_best(),
    quad,
    jnp.zeros(3),
    fun_args=(D,),
    in_axes=(None, 0),
    compact=False,
    tol=1e-9,
    trace=8,
    ftol=1e-12,
  )

  def batch_cb():
    cb = _Halt(4)
    r = hdm_optax.solve_batch(
      hdm_optax.hdm_best(),
      quad,
      jnp.zeros(3),
      fun_args=(D,),
      in_axes=(None, 0),
      tol=1e-9,
      callback=cb,
    )
    return r, cb.seen

  s["batch/callback_halt"] = batch_cb
  grid = {"precond_lr": [0.05, 0.5, 5.0], "momentum_lr": [1.0, 3.0]}
  make = lambda precond_lr, momentum_lr: hdm_optax.hdm_best(
    lipschitz=800.0, precond_lr=precond_lr, momentum_lr=momentum_lr
  )
  s["sweep/grid"] = lambda: hdm_optax.sweep(make, grid, rosen, X0, fun_args=(10.0,), max_steps=200)
  s["sweep/first"] = lambda: hdm_optax.sweep(
    make, grid, rosen, X0, fun_args=(10.0,), max_steps=200, stop_at_first_converged=True, tol=1e-3
  )
  s["sweep/first_compact"] = lambda: hdm_optax.sweep(
    make,
    grid,
    rosen,
    X0,
    fun_args=(10.0,),
    max_steps=200,
    stop_at_first_converged=True,
    tol=1e-3,
    compact=True,
  )
  s["sweep/static"] = lambda: hdm_optax.sweep(
    lambda memory_size: hdm_optax.trial_lbfgs(memory_size=memory_size),
    {"memory_size": [3, 7]},
    rosen,
    X0,
    fun_args=(10.0,),
    tol=1e-9,
  )
  s["minimize/bounds"] = lambda: tuple(
    hdm_optax.minimize(rosen, np.full(6, 0.5), args=(10.0,), bounds=(0.0, 0.8))
  )
  s["minimize/plain"] = lambda: tuple(hdm_optax.minimize(rosen, np.full(6, -0.5), args=(10.0,)))
  s["minimize/host"] = lambda: tuple(
    hdm_optax.minimize(
      lambda x: float(np.sum((np.asarray(x) - 1.0) ** 2 * np.arange(1, 4))), np.zeros(3)
    )
  )

  def grads():
    d = jnp.asarray([1.0, 10.0, 100.0])
    total = lambda d, adj: jnp.sum(
      hdm_optax.solve(
        hdm_optax.trial_lbfgs(),
        quad,
        jnp.zeros(3),
        fun_args=(d,),
        tol=1e-10,
        adjoint=adj,
        max_steps=60,
      ).params
      * jnp.arange(1.0, 4.0)
    )
    out = [jax.grad(total)(d, hdm_optax.ImplicitAdjoint())]
    out.append(jax.grad(total)(d, hdm_optax.UnrolledAdjoint()))
    batch = lambda D: jnp.sum(
      hdm_optax.solve_batch(
        hdm_optax.trial_lbfgs(), quad, jnp.zeros(3), fun_args=(D,), in_axes=(None, 0), tol=1e-10
      ).params
    )
    out.append(jax.grad(batch)(D))
    unrolled = lambda D: jnp.sum(
      hdm_optax.solve_batch(
        hdm_optax.trial_lbfgs(),
        quad,
        jnp.zeros(3),
        fun_args=(D,),
        in_axes=(None, 0),
        tol=1e-10,
        compact=False,
        max_steps=40,
        adjoint=hdm_optax.UnrolledAdjoint(),
      ).params
    )
    out.append(jax.grad(unrolled)(D))
    return out

  s["adjoint/grads"] = grads
  s["batch/unrolled"] = lambda: hdm_optax.solve_batch(
    hdm_optax.hdm_best(),
    quad,
    jnp.zeros(3),
    fun_args=(D,),
    in_axes=(None, 0),
    compact=False,
    tol=1e-9,
    max_steps=60,
    adjoint=hdm_optax.UnrolledAdjoint(),
    trace=70,
  )
  s["solve/unrolled"] = lambda: _solve("hdm_best", adjoint=hdm_optax.UnrolledAdjoint(), trace=40)

  def own_loop():
    run = hdm_optax.loop(
      hdm_optax.hdm_best(lipschitz=800.0),
      rosen,
      fun_args=(10.0,),
      tol=1e-6,
      max_steps=200,
      ftol=1e-9,
    )
    st = run.start(X0)
    while not run.done(st):
      st = run.step(st)
    return _loop_fields(st), run.status(st)

  s["loop/python"] = own_loop

  def minibatch():
    step = hdm_optax.minibatch_step(
      hdm_optax.hdm_best(precond_lr=0.1), lambda w, b: logistic(w, *b)
    )
    w, opt = jnp.zeros(8), hdm_optax.hdm_best(precond_lr=0.1)
    st = opt.init(w)
    out = []
    for i in range(0, 60, 20):
      w, st, stats = step(w, st, (A[i : i + 20], Y[i : i + 20]))
      out.append(stats)
    return w, st, out

  s["minibatch"] = minibatch

  def optimistix():
    try:
      import optimistix as optx
      from hdm_optax.optimistix_adapter import HDMMinimiser
    except ImportError:
      return "absent"
    sol = optx.minimise(
      lambda x, a: rosen(x, a),
      HDMMinimiser(hdm_optax.hdm_best(lipschitz=800.0), atol=1e-6),
      X0,
      10.0,
      max_steps=400,
      throw=False,
    )
    return sol.value, sol.result._value, sol.stats, _loop_fields(sol.state.loop)

  s["optimistix"] = optimistix
  return s


def programs() -> dict:
  out = {}
  for name in ("trial_lbfgs", "trial_lbfgs_box", "hdm_auto", "adam"):
    fn = lambda x, name=name: _solve(name, ftol=1e-9 if name == "trial_lbfgs_box" else 0.0)
    # inside a trace: the front door's program appears as one inner jaxpr
    fn = lambda x, name=name: hdm_optax.solve(
      METHODS[name](), rosen, x, fun_args=(10.0,), max_steps=300, tol=1e-8
    )
    out[f"program/solve/{name}"] = _jaxpr_digest(jax.make_jaxpr(fn)(X0))
  out["program/solve/check_every"] = _jaxpr_digest(
    jax.make_jaxpr(
      lambda x: hdm_optax.solve(
        METHODS["hdm_best"](), rosen, x, fun_args=(10.0,), check_every=4, ftol=1e-9
      )
    )(X0)
  )
  return out


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--compare", nargs=2)
  p.add_argument("--only", default="")
  args = p.parse_args(argv)
  if args.compare:
    a, b = (json.load(open(f)) for f in args.compare)
    same = sum(a.get(k) == v for k, v in b.items())
    print(f"{same} of {len(set(a) | set(b))} entries equal")
    for k in sorted(set(a) | set(b)):
      if a.get(k) != b.get(k):
        print(f"  differs: {k}: {a.get(k)} -> {b.get(k)}")
    return
  warnings.simplefilter("ignore")
  out = {}
  if "update" in args.only or not args.only:
    out.update(updates())
  if "program" in args.only or not args.only:
    out.update(programs())
  for name, run in scenarios().items():
    if args.only and not name.startswith(args.only):
      continue
    try:
      out[f"result/{name}"] = _digest(run())
    except Exception as err:  # noqa: BLE001
      out[f"result/{name}"] = f"error {type(err).__name__}: {err}"[:200]
  json.dump(out, sys.stdout, indent=1, sort_keys=True)
  print()


if __name__ == "__main__":
  main()
