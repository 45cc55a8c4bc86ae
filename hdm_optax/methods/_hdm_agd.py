"""HDM with Nesterov momentum, HDM-AGD (Algorithm 3) as an optax transformation."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _blocks
from hdm_optax import _checks
from hdm_optax import _info
from hdm_optax import _numerics
from hdm_optax import _oracle
from hdm_optax import _stale
from hdm_optax.driver import programs
from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import candidates as candidates_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import learners as learners_lib


class HDMAGDState(NamedTuple):
  """State of :func:`hdm_agd`.

  Attributes:
    count: number of updates taken so far.
    precond: P_k, the learned stepsize.
    precond_learner_state: the online learner's state for P.
    z: z^k, the aggregated (dual) sequence, z^1 = x^1.
    weight_sum: A_k, the sum of the weights a_i = A_{i+1} - A_i, defined by
      A_{k+1} = (A_{k+1} - A_k)^2 with A_1 = 1 (A_0 = 0).
    value: f(x^k) (+inf before the first update).
    grad: grad f(x^k).
    info: :class:`hdm_optax.HDMInfo` diagnostics (three value-and-gradient
      calls per update).
  """

  count: jax.Array
  precond: Any
  precond_learner_state: Any
  z: Any
  weight_sum: jax.Array
  value: jax.Array
  grad: Any
  info: _info.HDMInfo

  def driver_verdict(self) -> jax.Array:
    """Whether the last trial became the iterate (``info.accepted``; what a driver reads:
    :class:`hdm_optax.driver.protocol.OptimizerState`)."""
    return self.info.accepted


@programs.configured
def hdm_agd(
  *,
  lipschitz: Any,
  theta: Any = 1.0,
  candidate: Union[str, candidates_lib.CandidateSet] = "diagonal",
  learner: Union[str, learners_lib.OnlineLearner] = "adagrad",
  precond_lr: Any = 0.1,
  init_precond: Any = 0.0,
  precond_min: Optional[Any] = None,
  precond_max: Optional[Any] = None,
  adagrad_eps: float = 1e-12,
  acceptance: Optional[acceptance_lib.AcceptanceRule] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""HDM with Nesterov momentum (Algorithm 3 of Chu et al.).

  With :math:`a_k = A_{k+1} - A_k = (1 + \sqrt{1 + 4A_k})/2`,

  .. math::
    y^k &= x^k + (1 - A_k / A_{k+1}) (z^k - x^k) \\
    x^{k+1} &= \operatorname{argmin}_{x \in \{y^k - \nabla f(y^k)/L,\;
      y^k - P_k \nabla f(y^k),\; x^k\}} f(x) \\
    P_{k+1} &= \Pi_{\mathcal P}[P_k - \eta \nabla h_{y^k}(P_k)] \\
    v_k &= \max\{1 / (2\max\{-h_{y^k}(P_k), 1/(2L)\}),\; L/(2\theta)\} \\
    z^{k+1} &= z^k - \frac{A_{k+1} - A_k}{v_k} \nabla f(y^k).

  The printed algorithm has ``z^k + ...`` in the last line; its proof
  (Appendix D.2) expands :math:`z^{k+1} = z^k - (A_{k+1}-A_k)/v_k \nabla
  f(y^k)`, the descent sign used here. Ties in the argmin go to the first
  candidate in the order above; non-finite candidates count as +inf, and a
  non-finite value or gradient at y^k rejects the whole update and restarts
  the momentum (z^{k+1} = x^k, A_{k+1} = 1, so the next y is x^k; P and the
  learner are untouched); a non-finite value or gradient at the trial
  y - P g alone halves P (P <- Pi(P/2), the learner untouched), so the same
  too-long trial does not return (both safeguards are not in the paper). Every
  gradient is taken at y^k, so a transformation before ``hdm_agd`` in a chain
  cannot act on it: ``update`` raises a ``ValueError`` when the incoming
  ``updates`` are not ``grad=`` itself (``docs/pitfalls.md``).

  Oracle cost: three value-and-gradient calls per update (at y^k and at the
  two trial points; the gradient of the kept point is cached in the state so
  ``optax.value_and_grad_from_state`` costs nothing).
  That is why HDM-AGD keeps its own update rather than the one-call shell
  of the other methods (:func:`hdm_optax.pieces.shell.iteration`): its
  trial is an argmin over two points taken from an extrapolated y^k, not one
  point from x^k.

  Args:
    lipschitz: L, the smoothness constant (required).
    theta: theta in [1/2, L D) (D the diameter of the candidate set); 1/2
      recovers AGD's rate, larger values trust the learned P more.
    candidate: ``"scalar"``, ``"diagonal"`` or ``"full"``.
    learner: ``"ogd"``, ``"ogd_sqrt"`` or ``"adagrad"``.
    precond_lr: eta, the learner's step.
    init_precond: P_1 = init_precond * I.
    precond_min: lower bound of the entries of P (``None``: unbounded).
    precond_max: upper bound of the entries of P (``None``: unbounded).
    adagrad_eps: added to sqrt(U) in AdaGrad.
    acceptance: whether the better trial point replaces x^k
      (:mod:`hdm_optax.pieces.acceptance`; ``None``:
      :func:`~hdm_optax.pieces.acceptance.resolved_decrease`: the argmin of line 4
      by f where f resolves the difference, by the gradients' estimate of
      the decrease where it does not).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``
    and ``value_fn`` and returns ``x^{k+1} - x^k``.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> opt = hdm_optax.hdm_agd(lipschitz=20.0, precond_lr=0.05)
    >>> result = hdm_optax.solve(opt, fun, jnp.array([1.0, 1.0]), max_steps=200)
    >>> bool(result.converged)
    True

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025:
    Algorithm 3, Section 4.2 and Appendix D.2.
  """
  cand = candidates_lib.get(candidate)
  learn = learners_lib.get(learner, eps=adagrad_eps)
  if lipschitz is None:
    raise TypeError("hdm_agd needs lipschitz=L, the smoothness constant (a number > 0).")
  _checks.check_positive("lipschitz", lipschitz)
  _checks.check_positive("precond_lr", precond_lr)
  _checks.check_positive("adagrad_eps", adagrad_eps)
  _checks.check_finite("init_precond", init_precond)
  _checks.check_at_least("theta", theta, 0.5)
  _checks.check_bounds("precond_min", precond_min, "precond_max", precond_max)
  c = _AGD(
    cand=cand,
    learn=learn,
    lipschitz=lipschitz,
    theta=theta,
    precond_lr=precond_lr,
    init_precond=init_precond,
    precond_min=precond_min,
    precond_max=precond_max,
    acceptance=acceptance_lib.resolved_decrease() if acceptance is None else acceptance,
  )
  update_fn = _stale.track_point(
    "hdm_agd", untransformed_only="it takes every gradient at its extrapolated point y^k"
  )(functools.partial(_update, c))
  return optax.GradientTransformationExtraArgs(functools.partial(_init, c), update_fn)


class _AGD(NamedTuple):
  """:func:`hdm_agd`'s arguments, as its update reads them."""

  cand: candidates_lib.CandidateSet
  learn: learners_lib.OnlineLearner
  lipschitz: Any
  theta: Any
  precond_lr: Any
  init_precond: Any
  precond_min: Optional[Any]
  precond_max: Optional[Any]
  acceptance: acceptance_lib.AcceptanceRule


def _init(c: _AGD, params) -> HDMAGDState:
  dtype = _numerics.params_dtype(params)
  precond = c.cand.project(c.cand.init(params, c.init_precond), c.precond_min, c.precond_max)
  return HDMAGDState(
    **_info.oracle_fields(params, dtype),
    precond=precond,
    precond_learner_state=c.learn.init(precond),
    z=_numerics.copy_tree(params),
    weight_sum=jnp.ones([], dtype),
  )


def _learn_precond(c: _AGD, state, pre_grad, y_grad, y_ok, pre_ok):
  """Line 5: P_{k+1} from grad h_{y^k}(P_k) = -grad f(x_P) grad f(y)^T / ||grad f(y)||^2.

  A non-finite trial y - P g (y finite) halves P, so that the same too-long
  trial does not return (a safeguard, not in the paper).
  """
  dtype = state.value.dtype
  den = _blocks.vdot(y_grad, y_grad)
  hypergrad = hypergradient_lib.hypergradient(c.cand, pre_grad, y_grad, den=den)
  new_p, new_l = learners_lib.learn(
    c.cand,
    c.learn,
    state.precond,
    hypergrad,
    state.precond_learner_state,
    _numerics.cast(c.precond_lr, dtype),
    c.precond_min,
    c.precond_max,
  )
  halved = c.cand.project(optax.tree.scale(0.5, state.precond), c.precond_min, c.precond_max)
  precond, learner_state = _numerics.keep_if(
    pre_ok,
    (new_p, new_l),
    (_numerics.keep_if(y_ok, halved, state.precond), state.precond_learner_state),
  )
  return precond, learner_state, hypergrad


def _update(c: _AGD, updates, state, params, *, value=None, grad=None, value_fn=None, **extra):
  del extra
  value, grad = _oracle.require_oracle(
    "hdm_agd", value, grad, value_fn, updates, params=params, state_grad=state.grad
  )
  # The work on packed vectors (once per block, not per leaf); the state keeps its layout.
  packing = _blocks.Packing(params)
  user_state = state
  params, grad, state = packing.pack(params), packing.pack(grad), packing.pack(state)
  oracle = packing.oracle(lambda point: _oracle.value_and_grad(value_fn, point))
  step, new_state = _step(c, state, params, value, grad, oracle)
  return packing.unpack(step), packing.unpack_as(new_state, user_state)


def _step(c: _AGD, state, params, value, grad, oracle):
  """Algorithm 3's iteration on the packed vectors: ``(step, state)``."""
  dtype = state.value.dtype
  lip = _numerics.cast(c.lipschitz, dtype)
  # Algorithm 3, line 2: A_{k+1} = (A_{k+1} - A_k)^2 gives a_k = A_{k+1} - A_k
  # = (1 + sqrt(1 + 4 A_k)) / 2.
  big_a = state.weight_sum  # A_k
  a = 0.5 * (1 + jnp.sqrt(1 + 4 * big_a))  # a_k
  big_a_next = big_a + a  # A_{k+1}
  # Line 3: y^k = x^k + (1 - A_k/A_{k+1}) (z^k - x^k).
  y = optax.tree.add_scale(params, 1 - big_a / big_a_next, optax.tree.sub(state.z, params))
  y_value, y_grad = oracle(y)
  y_ok = _numerics.all_finite(y_value, y_grad)
  # Line 4: the three candidates.
  x_lip = optax.tree.add_scale(y, -1 / lip, y_grad)
  lip_value, lip_grad = oracle(x_lip)
  x_pre = optax.tree.add(y, candidates_lib.trial_step(c.cand, state.precond, y_grad))
  pre_value, pre_grad = oracle(x_pre)
  pre_ok = y_ok & _numerics.all_finite(pre_value, pre_grad)
  precond, learner_state, hypergrad = _learn_precond(c, state, pre_grad, y_grad, y_ok, pre_ok)
  # Line 4: x^{k+1} = argmin f over the candidates (non-finite count as +inf):
  # the better trial point (ties go to the first), then the acceptance rule
  # against x^k.
  inf = jnp.asarray(jnp.inf, dtype)
  lip_v = jnp.where(y_ok & _numerics.all_finite(lip_value, lip_grad), lip_value, inf)
  pre_v = jnp.where(pre_ok, pre_value, inf)
  use_pre = pre_v < lip_v
  best_value = jnp.where(use_pre, pre_v, lip_v)
  best_grad, best = _numerics.keep_if(use_pre, (pre_grad, x_pre), (lip_grad, x_lip))
  accepted = y_ok & c.acceptance.accept(
    best_value, jnp.asarray(value, dtype), best_grad, grad, step=optax.tree.sub(best, params)
  )
  new_params = _numerics.keep_if(accepted, best, params)
  new_grad = _numerics.keep_if(accepted, best_grad, grad)
  z = _dual_step(c, state, a, lip, y_value, y_grad, pre_value, pre_ok)
  keep = lambda new, old: _numerics.keep_if(y_ok, new, old)
  new_state = HDMAGDState(
    count=state.count + 1,
    precond=precond,
    precond_learner_state=learner_state,
    z=keep(z, params),
    weight_sum=keep(big_a_next, jnp.ones_like(big_a)).astype(dtype),
    value=jnp.where(accepted, best_value, value).astype(dtype),
    grad=new_grad,
    info=_info.next_info(
      state.info,
      accepted=accepted,
      hypergrad_norm=_numerics.norm(hypergrad),
      calls=3,
      finite=pre_ok & _numerics.all_finite(lip_value, lip_grad),
    ),
  )
  step = _numerics.keep_if(
    accepted, optax.tree.sub(new_params, params), optax.tree.zeros_like(params)
  )
  return step, new_state


def _dual_step(c: _AGD, state, a, lip, y_value, y_grad, pre_value, pre_ok):
  """Lines 6-7: z^{k+1}, with v_k from h_{y^k}(P_k) = (f(x_P) - f(y)) / ||grad f(y)||^2."""
  dtype = state.value.dtype
  inf = jnp.asarray(jnp.inf, dtype)
  den = _blocks.vdot(y_grad, y_grad)
  h = jnp.where(pre_ok, _numerics.safe_div(pre_value - y_value, den), inf)
  v = jnp.maximum(
    1 / (2 * jnp.maximum(-h, 1 / (2 * lip))), lip / (2 * _numerics.cast(c.theta, dtype))
  )
  # Line 7, with the descent sign of Appendix D.2.
  return optax.tree.add_scale(state.z, -a / v, y_grad)
