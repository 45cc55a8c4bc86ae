"""The paper's first-order baselines as optax transformations (Section 5.3).

GD, GD-HB, AGD-CVX and AGD-SCVX are one family with traced parameters, so a
single compiled, vmapped ``hdm_optax.sweep`` runs all of them:

.. math::
  x^{k+1} = y^k - \\alpha \\nabla f(y^k) + (1-\\nu)\\beta_k (x^k - x^{k-1}),
  \\qquad y^{k+1} = x^{k+1} + \\nu \\beta_{k+1} (x^{k+1} - x^k),

where the params are y^k (the point whose gradient is taken, so one gradient
per iteration and the stopping test is on that gradient). nu = 0 is heavy
ball (y = x; beta = 0 is GD), nu = 1 is Nesterov. beta_k is the constant
``momentum`` or, with ``lambda_schedule = 1``, Nesterov's
beta_k = (lambda_{k-1} - 1) / lambda_k with lambda_1 = 1,
lambda_{k+1} = (1 + sqrt(1 + 4 lambda_k^2)) / 2 (AGD-CVX).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class FirstOrderState(NamedTuple):
  """x: x^k; x_prev: x^{k-1}; lam: lambda_k; lam_prev: lambda_{k-1}."""

  x: Any
  x_prev: Any
  lam: jax.Array
  lam_prev: jax.Array


def first_order_family(lr, momentum, nesterov, lambda_schedule):
  """GD / GD-HB / AGD-CVX / AGD-SCVX; every argument may be traced."""

  def init_fn(params):
    dtype = jax.tree.leaves(params)[0].dtype
    one = jnp.ones([], dtype)
    return FirstOrderState(x=params, x_prev=params, lam=one, lam_prev=one)

  def beta(lam_prev, lam, dtype):
    nesterov_beta = (lam_prev - 1) / lam
    return jnp.where(
      jnp.asarray(lambda_schedule) > 0, nesterov_beta, jnp.asarray(momentum, dtype)
    ).astype(dtype)

  def update_fn(updates, state, params, **extra_args):
    del extra_args
    dtype = state.lam.dtype
    nu = jnp.asarray(nesterov, dtype)
    b_k = beta(state.lam_prev, state.lam, dtype)
    x_next = jax.tree.map(
      lambda y, g, x, xp: y - jnp.asarray(lr, dtype) * g + (1 - nu) * b_k * (x - xp),
      params,
      updates,
      state.x,
      state.x_prev,
    )
    lam_next = 0.5 * (1 + jnp.sqrt(1 + 4 * state.lam**2))
    b_next = beta(state.lam, lam_next, dtype)
    y_next = jax.tree.map(lambda xn, x: xn + nu * b_next * (xn - x), x_next, state.x)
    step = jax.tree.map(jnp.subtract, y_next, params)
    return step, FirstOrderState(x=x_next, x_prev=state.x, lam=lam_next, lam_prev=state.lam)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def first_order_grid(lipschitz: float, mu: float = 1e-4):
  """The GD/GD-HB/AGD grid of the paper: (algorithm name, hyper-parameters)."""
  lr = 1.0 / lipschitz
  scvx = (jnp.sqrt(lipschitz) - jnp.sqrt(mu)) / (jnp.sqrt(lipschitz) + jnp.sqrt(mu))
  rows = [("GD", dict(lr=lr, momentum=0.0, nesterov=0.0, lambda_schedule=0.0))]
  for m in (0.1, 0.5, 0.9, 0.99):
    rows.append(("GD-HB", dict(lr=lr, momentum=m, nesterov=0.0, lambda_schedule=0.0)))
  rows.append(("AGD-CVX", dict(lr=lr, momentum=0.0, nesterov=1.0, lambda_schedule=1.0)))
  rows.append(("AGD-SCVX", dict(lr=lr, momentum=float(scvx), nesterov=1.0, lambda_schedule=0.0)))
  return rows
