"""trial_lbfgs: HDM's trial point and null step with an L-BFGS operator from every trial's secant pair."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax import acceptance as acceptance_lib

__all__ = (
  "SecantMemory",
  "TrialLBFGSState",
  "curvature_checked",
  "secant_memory",
  "secant_record",
  "trial_lbfgs",
  "two_loop",
)


class SecantMemory(NamedTuple):
  """The last m secant pairs, a circular buffer (the L-BFGS memory).

  Attributes:
    s: the steps :math:`s_i = x_i^+ - x_i`, each leaf with a leading axis of size m.
    y: the gradient changes :math:`y_i = \\nabla f(x_i^+) - \\nabla f(x_i)`, like ``s``.
    rho: (m,) :math:`1 / \\langle s_i, y_i \\rangle`; 0 marks an empty slot.
    head: the slot the next pair is written to (the newest pair is in ``head - 1``).
  """

  s: Any
  y: Any
  rho: jax.Array
  head: jax.Array


def _stacked_vdot(stacked, tree) -> jax.Array:
  """(m,) inner products of each stacked entry with ``tree``."""
  parts = jax.tree.leaves(
    jax.tree.map(lambda a, b: jnp.sum((a * b[None]).reshape(a.shape[0], -1), axis=1), stacked, tree)
  )
  return sum(parts[1:], parts[0])


def secant_memory(params, size: int) -> SecantMemory:
  """An empty memory of ``size`` pairs shaped like ``params``."""
  zeros = jax.tree.map(lambda p: jnp.zeros((size,) + jnp.shape(p), jnp.result_type(p)), params)
  dtype = _common.params_dtype(params)
  return SecantMemory(
    s=zeros,
    y=jax.tree.map(jnp.copy, zeros),
    rho=jnp.zeros([size], dtype),
    head=jnp.zeros([], jnp.int32),
  )


def secant_record(memory: SecantMemory, s, y, keep) -> SecantMemory:
  """The memory with the pair (s, y) written over its oldest one where ``keep``."""
  size = memory.rho.shape[0]
  sy = optax.tree.vdot(s, y)
  rho = jnp.where(keep, 1 / jnp.where(keep, sy, 1), 0).astype(memory.rho.dtype)
  put = lambda stacked, new: jax.tree.map(
    lambda a, b: a.at[memory.head].set(jnp.where(keep, b, a[memory.head])), stacked, new
  )
  return SecantMemory(
    s=put(memory.s, s),
    y=put(memory.y, y),
    rho=memory.rho.at[memory.head].set(jnp.where(keep, rho, memory.rho[memory.head])),
    head=jnp.where(keep, (memory.head + 1) % size, memory.head).astype(jnp.int32),
  )


def two_loop(memory: SecantMemory, gamma, vector):
  r"""The L-BFGS inverse-Hessian operator applied to ``vector``: :math:`H_m v`.

  The two-loop recursion (Nocedal and Wright, Algorithm 7.4) over the pairs
  of ``memory``, newest first, with :math:`H_0 = \gamma I`; empty slots
  (:math:`\rho_i = 0`) contribute nothing. O(mn) work, no n x n matrix. With
  no pair it is :math:`\gamma v`; with pairs, :math:`H_m y_i = s_i` for the
  newest pair :math:`(s_i, y_i)`.

  Args:
    memory: the pairs (:class:`SecantMemory`).
    gamma: the scalar of :math:`H_0`.
    vector: v, shaped like the params.

  Returns:
    :math:`H_m v`, shaped like ``vector``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import _trial_lbfgs as tl
    >>> mem = tl.secant_memory(jnp.zeros(2), 3)
    >>> mem = tl.secant_record(mem, jnp.array([1.0, 0.0]), jnp.array([4.0, 0.0]), True)
    >>> [float(v) for v in tl.two_loop(mem, 0.5, jnp.array([4.0, 2.0]))]
    [1.0, 1.0]
  """
  size = memory.rho.shape[0]
  dtype = memory.rho.dtype
  at = lambda stacked, i: jax.tree.map(lambda a: a[i], stacked)

  def first(k, carry):
    q, alphas = carry
    i = (memory.head - 1 - k.astype(jnp.int32)) % size  # newest to oldest
    alpha = memory.rho[i] * optax.tree.vdot(at(memory.s, i), q)
    q = optax.tree.add_scale(q, -alpha, at(memory.y, i))
    return q, alphas.at[i].set(alpha)

  q, alphas = jax.lax.fori_loop(0, size, first, (vector, jnp.zeros([size], dtype)))
  r = optax.tree.scale(jnp.asarray(gamma, dtype), q)

  def second(k, r):
    i = (memory.head + k.astype(jnp.int32)) % size  # oldest to newest
    beta = memory.rho[i] * optax.tree.vdot(at(memory.y, i), r)
    return optax.tree.add_scale(r, alphas[i] - beta, at(memory.s, i))

  return jax.lax.fori_loop(0, size, second, r)


def curvature_checked(
  band: float = 1e-10, curvature: float = 0.9, ulps: float = 1024.0
) -> acceptance_lib.AcceptanceRule:
  r"""No increase, or an increase within rounding along which the slope shrank.

  .. math::
    f(x^+) \le f(x) \quad\text{or}\quad
    \bigl(f(x^+) \le f(x) + \max(b, u\epsilon)\,|f(x)| \ \text{and}\
    |\langle \nabla f(x^+), s\rangle| \le c\,|\langle \nabla f(x), s\rangle|\bigr),

  s = x+ - x, b = ``band``, c = ``curvature`` (the strong Wolfe constant),
  u = ``ulps`` and :math:`\epsilon` the dtype's machine epsilon. Where f's
  change is below its rounding, the values cannot rank the two points, but
  the directional derivative can: a trial whose slope along the step fell by
  the Wolfe factor has passed the minimum along the step or come close to it.

  Args:
    band: b, the relative increase of f still treated as rounding (float64).
    curvature: c, in (0, 1).
    ulps: u, the band in units of the dtype's eps (float32's b).

  Returns:
    An :class:`hdm_optax.acceptance.AcceptanceRule` (it needs ``step=``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax import _trial_lbfgs as tl
    >>> rule = tl.curvature_checked()
    >>> f = jnp.asarray(1.0)
    >>> g, s = jnp.array([-1.0]), jnp.array([1.0])
    >>> bool(rule.accept(f + 1e-12, f, jnp.array([0.1]), g, step=s))
    True
    >>> bool(rule.accept(f + 1e-12, f, jnp.array([-0.95]), g, step=s))
    False
  """

  def accept(trial_value, value, trial_grad, grad, step=None):
    eps = jnp.finfo(jnp.result_type(value)).eps
    width = jnp.maximum(jnp.asarray(band, value.dtype), ulps * eps) * jnp.abs(value)
    near = trial_value <= value + width
    slope, trial_slope = optax.tree.vdot(grad, step), optax.tree.vdot(trial_grad, step)
    flat = jnp.abs(trial_slope) <= curvature * jnp.abs(slope)
    return (trial_value <= value) | (near & flat)

  return acceptance_lib.AcceptanceRule(accept=accept)


class TrialLBFGSState(NamedTuple):
  """State of :func:`trial_lbfgs`.

  Attributes:
    count: updates made.
    memory: the last m secant pairs (:class:`SecantMemory`), from every finite trial.
    gamma: the scalar of :math:`H_0 = \\gamma I`, from the newest accepted pair
      (0 before the first: then :math:`\\min(1, 1/\\|g\\|)`).
    step_size: alpha, the factor of the quasi-Newton step.
    value: f(x) (+inf before the first update).
    grad: grad f(x).
    info: :class:`hdm_optax.HDMInfo` diagnostics (``hypergrad_norm`` is 0:
      nothing is learned by a hypergradient).
  """

  count: jax.Array
  memory: SecantMemory
  gamma: jax.Array
  step_size: jax.Array
  value: jax.Array
  grad: Any
  info: _common.HDMInfo


def trial_lbfgs(
  memory_size: int = 10,
  *,
  shrink: Any = 0.5,
  grow: Any = 1.5,
  pair_tol: Any = 1e-10,
) -> optax.GradientTransformationExtraArgs:
  r"""L-BFGS directions at HDM's cost: one trial point, one oracle call, a null step.

  Each update evaluates f and grad f once, at the trial point

  .. math::
    x^+ = x - \alpha H_m \nabla f(x),

  where :math:`H_m` is the L-BFGS inverse-Hessian operator (:func:`two_loop`)
  of the last m secant pairs :math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla
  f(x))`, one from every finite trial, accepted or not, kept when
  :math:`\langle s, y\rangle > \epsilon_p \|s\|\|y\|` (nonconvex problems give
  pairs of negative curvature). :math:`H_0 = \gamma I` with
  :math:`\gamma = \langle s, y\rangle / \langle y, y\rangle` of the newest
  *accepted* kept pair (a long rejected trial in a direction of high
  curvature would otherwise shrink every step outside the pairs' span), and
  :math:`\gamma = \min(1, 1/\|\nabla f(x_0)\|)` before one exists (as
  ``optax.scale_by_lbfgs``). The trial becomes the iterate when
  :func:`curvature_checked` accepts it; otherwise x stays (HDM's null step).
  alpha starts at 1, halves after a null step or a non-finite trial and grows
  by ``grow`` (up to 1) after an accepted one.

  How it relates to HDM and L-BFGS. From HDM (Algorithm 1 and 4 of Chu et
  al.) it keeps the trial point, the null step and the single oracle call
  per iteration; it learns nothing by a hypergradient: the preconditioner P
  of HDM is replaced by :math:`\alpha H_m`, which the secant pairs determine.
  Learning alpha or a diagonal :math:`H_0` by HDM's hypergradient made it
  worse on the development problems (``docs/secant.md``). From L-BFGS it
  keeps the two-loop operator; it has no line search (L-BFGS spends extra
  calls on it), takes pairs from rejected trials too (each is exact
  curvature information along an explored direction), and accepts a trial on
  the value and its slope instead of the Wolfe conditions.

  The state is 2m + 1 vectors of n (the pairs and the cached gradient) plus
  O(m) scalars. A non-finite trial changes nothing but alpha.

  Args:
    memory_size: m, the number of pairs kept.
    shrink: the factor of alpha after a null step, in (0, 1).
    grow: the factor of alpha after an accepted step (alpha stays <= 1), >= 1.
    pair_tol: :math:`\epsilon_p`, the cosine below which a pair is not kept.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> result = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.ones(3), max_steps=100, tol=1e-6)
    >>> bool(result.converged), int(result.num_grad_evals) < 30
    (True, True)

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial
    point and the null step, Algorithm 1 line 3); Liu and Nocedal, *On the
    limited memory BFGS method for large scale optimization*, Math.
    Programming 45, 1989 (the operator and the scaling of H_0); Nocedal and
    Wright, *Numerical Optimization*, 2nd ed., Algorithm 7.4.
  """
  if not isinstance(memory_size, int) or isinstance(memory_size, bool) or memory_size < 1:
    raise ValueError(
      f"memory_size must be an int >= 1, got {memory_size!r}; pass e.g. memory_size=10."
    )
  _common.check_interval("shrink", shrink, 0, 1, lo_open=True, hi_open=True)
  _common.check_at_least("grow", grow, 1)
  _common.check_finite("grow", grow)
  _common.check_interval("pair_tol", pair_tol, 0, 1, hi_open=True)
  acceptance = curvature_checked()

  def init_fn(params):
    dtype = _common.params_dtype(params)
    return TrialLBFGSState(
      count=jnp.zeros([], jnp.int32),
      memory=secant_memory(params, memory_size),
      gamma=jnp.zeros([], dtype),
      step_size=jnp.ones([], dtype),
      value=jnp.asarray(jnp.inf, dtype),
      grad=optax.tree.zeros_like(params),
      info=_common.init_info(dtype),
    )

  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      "trial_lbfgs", value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    dtype = state.value.dtype
    c = lambda x: _common.cast(x, dtype)
    value = jnp.asarray(value, dtype)
    grad_norm = optax.tree.norm(grad)
    first_gamma = jnp.minimum(1, _common.safe_div(jnp.ones([], dtype), grad_norm))
    first_gamma = jnp.where(grad_norm > 0, first_gamma, 1).astype(dtype)
    gamma = jnp.where(state.gamma > 0, state.gamma, first_gamma)
    # x+ = x - alpha H_m g.
    step = optax.tree.scale(-state.step_size, two_loop(state.memory, gamma, grad))
    trial_value, trial_grad = _common.value_and_grad(value_fn, optax.tree.add(params, step))
    trial_value = jnp.asarray(trial_value, dtype)
    change = optax.tree.sub(trial_grad, grad)
    sy = optax.tree.vdot(step, change)
    finite = jnp.isfinite(trial_value) & jnp.isfinite(sy) & _common.all_finite(trial_grad)
    accepted = finite & acceptance.accept(trial_value, value, trial_grad, grad, step=step)
    # Every finite trial's pair with enough positive curvature enters the memory.
    keep = finite & (sy > c(pair_tol) * optax.tree.norm(step) * optax.tree.norm(change))
    safe = lambda tree: optax.tree.where(finite, tree, optax.tree.zeros_like(tree))
    memory = secant_record(state.memory, safe(step), safe(change), keep)
    yy = optax.tree.vdot(change, change)
    new_gamma = jnp.where(keep & accepted, _common.safe_div(sy, yy), state.gamma)
    step_size = jnp.where(
      accepted, jnp.minimum(1, state.step_size * c(grow)), state.step_size * c(shrink)
    )
    new_state = TrialLBFGSState(
      count=state.count + 1,
      memory=memory,
      gamma=new_gamma.astype(dtype),
      step_size=step_size.astype(dtype),
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      info=_common.next_info(
        state.info, accepted=accepted, hypergrad_norm=jnp.zeros([], dtype), calls=1
      ),
    )
    return _common.keep_if(accepted, step, optax.tree.zeros_like(params)), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
