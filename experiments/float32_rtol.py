"""What ``rtol`` does in float32: the threshold it sets and the point a run stops at.

    python -m experiments.float32_rtol [--samples 2000 20000]

A float32 logistic regression (20 features, labels of a random linear model with
noise, x0 = 0) solved by ``trial_lbfgs()`` and ``hdm_auto()`` with the default
``tol = 1e-4`` and ``rtol`` = 0, 1e-6 and 1e-5. Each row prints
``||grad f(x0)||_inf``, the threshold max(tol, rtol ||grad f(x0)||_inf) the run
used (``SolveResult.tol``), its status and gradient calls, and ``||grad f||_inf``
at the final point in float32 and in float64. ``||grad f(x0)||_inf`` grows with
the number of samples, and so does the threshold of a given ``rtol``
(``docs/pitfalls.md``).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import hdm_optax

FEATURES = 20


def logistic(w, a, y):
  return jnp.sum(jnp.logaddexp(0.0, -y * (a @ w)))


def problem(samples: int, seed: int = 0):
  """``(a, y)`` in float64 (NumPy)."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(samples, FEATURES))
  y = np.sign(a @ rng.normal(size=FEATURES) + 0.5 * rng.normal(size=samples))
  return a, y


def rows(samples: int):
  """One line per (solver, rtol) on the problem of ``samples`` samples."""
  a, y = problem(samples)
  a32, y32 = jnp.asarray(a, jnp.float32), jnp.asarray(y, jnp.float32)
  w0 = jnp.zeros(FEATURES, jnp.float32)
  g0 = float(jnp.max(jnp.abs(jax.grad(logistic)(w0, a32, y32))))
  grad64 = jax.jit(jax.grad(logistic))
  for name, opt in (
    ("trial_lbfgs()", hdm_optax.trial_lbfgs()),
    ("hdm_auto()", hdm_optax.hdm_auto()),
  ):
    for rtol in (0.0, 1e-6, 1e-5):
      res = hdm_optax.solve(opt, logistic, w0, max_steps=1000, rtol=rtol, fun_args=(a32, y32))
      w = jnp.asarray(res.params, jnp.float64)
      g = float(jnp.max(jnp.abs(grad64(w, jnp.asarray(a), jnp.asarray(y)))))
      status = hdm_optax.Status(int(res.status)).name
      yield (
        f"m={samples:6d} ||g0||={g0:9.4g} {name:14s} rtol={rtol:<6g} threshold {float(res.tol):8.2g}"
        f"  {status:9s} calls {int(res.num_grad_evals):4d}  ||g||_inf float32 "
        f"{float(res.grad_norm):8.2g}, float64 {g:8.2g}"
      )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--samples", type=int, nargs="+", default=[2000, 20000])
  args = p.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  for samples in args.samples:
    for line in rows(samples):
      print(line, flush=True)


if __name__ == "__main__":
  main()
