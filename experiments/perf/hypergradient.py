"""The cost of a hypergradient through a solve: hdm_optax against optimistix's BFGS and LBFGS.

The hypergradient of docs/gradients.md: d/d log(lambda) of the mean held-out logistic loss of
a ridge logistic regression over K folds, the folds vmapped in one program. Each row is a
jitted ``jax.value_and_grad`` of that function, timed after compilation (median of
``--repeats`` calls, the rows interleaved); the gradients are compared with one computed from
the dense Hessian at a tight solution (``jnp.linalg.solve`` of H x' = -d grad / d lambda,
per fold). The last line times one fold's reverse-mode linear solve alone (conjugate
gradients on Hessian-vector products), with and without the run's secant pairs as the
preconditioner: its iterations and milliseconds.

    python -m experiments.perf.hypergradient [--rows 2000] [--dim 100] [--folds 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax
from hdm_optax.driver import adjoint as adjoint_lib
from hdm_optax.pieces.lbfgs import memory as memory_lib

jax.config.update("jax_enable_x64", True)

TOL = 1e-8


def _terms(w, X, y):
  return jnp.logaddexp(0.0, -y * (X @ w))


def _train_loss(w, X, y, train, log_lam):
  return jnp.sum(train * _terms(w, X, y)) / jnp.sum(train) + 0.5 * jnp.exp(log_lam) * w @ w


def _problem(rows, dim, folds, seed=0):
  X = jax.random.normal(jax.random.key(seed), (rows, dim))
  noise = 2.0 * jax.random.normal(jax.random.key(seed + 1), (rows,))
  y = jnp.sign(X[:, : max(1, dim // 6)].sum(axis=1) + noise)
  masks = jnp.arange(rows) % folds != jnp.arange(folds)[:, None]
  return X, y, masks


def _held_out(w, X, y, train):
  return jnp.sum(~train * _terms(w, X, y)) / jnp.sum(~train)


def _hdm(adjoint):
  def fit(train, log_lam, X, y):
    return hdm_optax.solve(
      hdm_optax.trial_lbfgs(),
      _train_loss,
      jnp.zeros(X.shape[1]),
      max_steps=2000,
      tol=TOL,
      fun_args=(X, y, train, log_lam),
      adjoint=adjoint,
    ).params

  return fit


def _optimistix(solver_name):
  import optimistix as optx  # pylint: disable=import-outside-toplevel

  solver = getattr(optx, solver_name)(rtol=TOL, atol=TOL)

  def fit(train, log_lam, X, y):
    sol = optx.minimise(
      lambda w, a: _train_loss(w, *a),
      solver,
      jnp.zeros(X.shape[1]),
      args=(X, y, train, log_lam),
      adjoint=optx.ImplicitAdjoint(),
      max_steps=2000,
      throw=False,
    )
    return sol.value

  return fit


def _hypergradient(fit):
  def cv(log_lam, X, y, masks):
    return jnp.mean(jax.vmap(lambda m: _held_out(fit(m, log_lam, X, y), X, y, m))(masks))

  return jax.jit(jax.value_and_grad(cv))


def _reference(X, y, masks, log_lam):
  """The hypergradient from dense Hessians at tight solutions."""
  fit = jax.jit(_hdm(None))
  total = 0.0
  for m in masks:
    w = fit(m, log_lam, X, y)
    hess = jax.hessian(_train_loss)(w, X, y, m, log_lam)
    cross = jax.jacfwd(jax.grad(_train_loss), argnums=4)(w, X, y, m, log_lam)
    w_dot = -jnp.linalg.solve(hess, cross)
    total += jnp.vdot(jax.grad(_held_out)(w, X, y, m), w_dot)
  return float(total) / len(masks)


def _cg_solver(on):
  @jax.jit
  def solve(w, X, y, m, log_lam, memory):
    grad = jax.grad(_train_loss)
    hvp = lambda v: jax.jvp(lambda u: grad(u, X, y, m, log_lam), (w,), (v,))[1]
    b = jax.grad(_held_out)(w, X, y, m)
    precond = memory_lib.preconditioner(memory) if on else None
    return adjoint_lib.conjugate_gradient(hvp, b, precond, rtol=1e-10)

  return solve


def _cg_steps(X, y, masks, log_lam, repeats):
  """Per fold's reverse-mode solve alone: CG iterations and ms, without and with the pairs."""
  solvers = {on: _cg_solver(on) for on in (False, True)}
  steps, times = {False: [], True: []}, {False: [], True: []}
  for m in masks:
    res = hdm_optax.solve(
      hdm_optax.trial_lbfgs(),
      _train_loss,
      jnp.zeros(X.shape[1]),
      max_steps=2000,
      tol=TOL,
      fun_args=(X, y, m, log_lam),
    )
    memory = res.state.direction.memory  # the pairs the run left
    call = lambda on: jax.block_until_ready(solvers[on](res.params, X, y, m, log_lam, memory))
    for on in solvers:
      steps[on].append(int(call(on)[1]))
    for _ in range(repeats):
      for on in solvers:
        start = time.perf_counter()
        call(on)
        times[on].append(time.perf_counter() - start)
  return {on: (float(np.mean(steps[on])), 1e3 * float(np.median(times[on]))) for on in solvers}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=2000)
  parser.add_argument("--dim", type=int, default=100)
  parser.add_argument("--folds", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--log-lam", type=float, default=float(np.log(1e-2)))
  args = parser.parse_args()
  X, y, masks = _problem(args.rows, args.dim, args.folds)
  log_lam = jnp.asarray(args.log_lam)
  rows = {
    "hdm_optax trial_lbfgs, ImplicitAdjoint()": _hdm(hdm_optax.ImplicitAdjoint()),
    "hdm_optax trial_lbfgs, ImplicitAdjoint(precondition=False)": _hdm(
      hdm_optax.ImplicitAdjoint(precondition=False)
    ),
    "optimistix BFGS, ImplicitAdjoint()": _optimistix("BFGS"),
    "optimistix LBFGS, ImplicitAdjoint()": _optimistix("LBFGS"),
  }
  fns = {name: _hypergradient(fit) for name, fit in rows.items()}
  data = (X, y, masks)
  compile_s, grads, times = {}, {}, {name: [] for name in fns}
  for name, fn in fns.items():
    start = time.perf_counter()
    grads[name] = float(jax.block_until_ready(fn(log_lam, *data))[1])
    compile_s[name] = time.perf_counter() - start
  for _ in range(args.repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(log_lam, *data))
      times[name].append(time.perf_counter() - start)
  reference = _reference(X, y, masks, log_lam)
  cg = _cg_steps(X, y, masks, log_lam, args.repeats)
  print(
    f"{args.folds} folds vmapped, {args.rows} rows x {args.dim}, lambda = "
    f"{float(np.exp(args.log_lam)):.3g}, solver tol {TOL:g}, {jax.devices()[0].platform}; "
    f"reference hypergradient {reference:.10g} (dense Hessians)"
  )
  print("| solver, adjoint | ms per hypergradient | first call (s) | rel. error |")
  print("|---|---|---|---|")
  for name in fns:
    error = abs(grads[name] - reference) / abs(reference)
    print(f"| {name} | {1e3 * np.median(times[name]):.2f} | {compile_s[name]:.1f} | {error:.1e} |")
  print(
    f"one fold's reverse-mode linear solve alone (CG to rtol 1e-10, n = {args.dim}): "
    f"{cg[False][0]:.1f} iterations in {cg[False][1]:.2f} ms plain, {cg[True][0]:.1f} in "
    f"{cg[True][1]:.2f} ms preconditioned by the run's secant pairs"
  )


if __name__ == "__main__":
  main()
