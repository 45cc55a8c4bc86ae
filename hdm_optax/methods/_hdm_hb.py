"""HDM with heavy-ball momentum, HDM-HB (Algorithm 2) as an optax transformation."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from hdm_optax import _common
from hdm_optax.methods import acceptance as acceptance_lib
from hdm_optax.methods import candidates as candidates_lib
from hdm_optax.methods import hypergradient as hypergradient_lib
from hdm_optax.methods import learners as learners_lib
from hdm_optax.methods import trial as trial_lib


class HDMHBState(NamedTuple):
  """State of :func:`hdm_hb`.

  Attributes:
    count: number of updates taken so far.
    precond: P_k, the learned stepsize.
    momentum: B_k, the learned momentum (0-d for scalar, like params for diagonal).
    precond_learner_state: online learner state for P (AdaGrad: its U).
    momentum_learner_state: online learner state for B.
    prev_params: x^{k-1} (x^0 = x^1 at init).
    value: f(x^k) (+inf before the first update).
    grad: grad f(x^k).
    trial_scale: s, the damping of the trial step (see :func:`hdm_hb`).
    info: :class:`hdm_optax.HDMInfo` diagnostics.
  """

  count: jax.Array
  precond: Any
  momentum: Any
  precond_learner_state: Any
  momentum_learner_state: Any
  prev_params: Any
  value: jax.Array
  grad: Any
  trial_scale: jax.Array
  info: _common.HDMInfo


@_common.configured
def hdm_hb(
  *,
  candidate: Union[str, candidates_lib.CandidateSet] = "diagonal",
  momentum_candidate: Union[str, candidates_lib.CandidateSet] = "scalar",
  learner: Union[str, learners_lib.OnlineLearner] = "adagrad",
  precond_lr: Any = 0.1,
  momentum_lr: Any = 1.0,
  omega: Any = 0.0,
  tau: Any = 0.0,
  init_precond: Any = 0.0,
  init_momentum: Any = 0.0,
  precond_min: Optional[Any] = None,
  precond_max: Optional[Any] = None,
  momentum_min: Any = 0.0,
  momentum_max: Any = 0.9995,
  adagrad_eps: float = 1e-12,
  acceptance: Optional[acceptance_lib.AcceptanceRule] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""HDM with heavy-ball momentum (Algorithm 2 of Chu et al.).

  The trial point is :math:`x^+ = x - P\nabla f(x) + B(x - x^-)` and (P, B)
  are learned jointly from the heavy-ball feedback (eq. (4)) with potential
  :math:`\psi(x, x^-) = f(x) + \frac{\omega}{2}\|x - x^-\|^2`:

  .. math::
    h_{x,x^-}(P, B) = \frac{\psi(x^+, x) - \psi(x, x^-)}
      {\|\nabla f(x)\|^2 + \frac{\tau}{2}\|x - x^-\|^2},

  whose gradients (Appendix D.1) are, with
  :math:`r = \nabla f(x^+) + \omega (x^+ - x)` and den the denominator,
  :math:`\nabla_P h = -r\nabla f(x)^\top / den` and
  :math:`\nabla_B h = r (x - x^-)^\top / den`. The null step (line 6)
  keeps :math:`(x^k, x^{k-1})` unless the potential decreases. A non-finite
  trial value or gradient is rejected and leaves P, B and the learners
  untouched; the next trial step is then halved (x^+ = x + s(-P g + B d),
  s <- s/2) until a trial is finite; that trial's hypergradient is taken at
  (sP, sB) and the learners continue from there (s back to 1), so the
  too-long trial does not return (a safeguard that is not in the paper;
  :func:`hdm_optax.trial.kept_scale`). The null step accepts, by default, a
  strict decrease of psi or a tie at the dtype's resolution with a smaller
  gradient (:func:`hdm_optax.acceptance.tie_tolerant`, a departure;
  ``acceptance=hdm_optax.acceptance.strict_decrease()`` is the printed rule).
  One value-and-gradient call per update.

  Args:
    candidate: candidate set of P: ``"scalar"``, ``"diagonal"`` or ``"full"``.
    momentum_candidate: candidate set of B: ``"scalar"`` or ``"diagonal"``.
    learner: ``"ogd"``, ``"ogd_sqrt"`` or ``"adagrad"`` (same kind for P and B,
      separate accumulators).
    precond_lr: eta_p, the learner's step for P.
    momentum_lr: eta_b, the learner's step for B.
    omega: omega >= 0 of the potential psi (the theory takes 3L).
    tau: tau >= 0 of the denominator (the theory takes 16 L^2).
    init_precond: P_1 = init_precond * I.
    init_momentum: B_1 = init_momentum * I.
    precond_min: lower bound of the entries of P (``None``: unbounded).
    precond_max: upper bound of the entries of P (``None``: unbounded).
    momentum_min: lower bound of the entries of B, in [-1, 1).
    momentum_max: upper bound of the entries of B, in [-1, 1).
    adagrad_eps: added to sqrt(U) in AdaGrad.
    acceptance: the rule of the null step, applied to the potential psi
      (:mod:`hdm_optax.acceptance`; ``None``:
      :func:`~hdm_optax.acceptance.tie_tolerant`, a strict decrease or a tie at
      the dtype's resolution with a smaller gradient; pass
      :func:`~hdm_optax.acceptance.strict_decrease` for the paper's rule).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns ``x^{k+1} - x^k``.

  Examples:
    >>> import jax.numpy as jnp, optax, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> opt = hdm_optax.hdm_hb(precond_lr=0.05, momentum_lr=0.1)
    >>> result = hdm_optax.solve(opt, fun, jnp.array([1.0, 1.0]), max_steps=200)
    >>> bool(result.converged)
    True

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025:
    Algorithm 2, Section 4.1 and Appendix D.1.
  """
  cand_p = candidates_lib.get(candidate)
  cand_b = candidates_lib.get(momentum_candidate, allowed=("scalar", "diagonal"))
  learn = learners_lib.get(learner, eps=adagrad_eps)
  for name, val in (
    ("precond_lr", precond_lr),
    ("momentum_lr", momentum_lr),
    ("adagrad_eps", adagrad_eps),
  ):
    _common.check_positive(name, val)
  _common.check_nonnegative("omega", omega)
  _common.check_nonnegative("tau", tau)
  _common.check_bounds("precond_min", precond_min, "precond_max", precond_max)
  _common.check_momentum_bounds(momentum_min, momentum_max)
  _common.check_init_momentum(init_momentum, momentum_min, momentum_max)
  _common.check_finite("init_precond", init_precond)
  if acceptance is None:
    acceptance = acceptance_lib.tie_tolerant()
  denominator = hypergradient_lib.fixed_tau(tau)

  def init_fn(params):
    dtype = _common.params_dtype(params)
    precond = cand_p.project(cand_p.init(params, init_precond), precond_min, precond_max)
    momentum = cand_b.project(cand_b.init(params, init_momentum), momentum_min, momentum_max)
    return HDMHBState(
      **_common.oracle_fields(params, dtype),
      precond=precond,
      momentum=momentum,
      precond_learner_state=learn.init(precond),
      momentum_learner_state=learn.init(momentum),
      prev_params=_common.copy_tree(params),
      trial_scale=jnp.ones([], dtype),
    )

  @_common.track_point("hdm_hb")
  def update_fn(updates, state, params, *, value=None, grad=None, value_fn=None, **extra_args):
    del extra_args
    value, grad = _common.require_oracle(
      "hdm_hb", value, grad, value_fn, updates, params=params, state_grad=state.grad
    )
    dtype = state.value.dtype
    om = _common.cast(omega, dtype)
    diff = optax.tree.sub(params, state.prev_params)  # x^k - x^{k-1}
    s = state.trial_scale
    direction, s_diff = optax.tree.scale(s, updates), optax.tree.scale(s, diff)
    # Algorithm 2, line 3: x^{k+1/2} = x^k - P_k grad f(x^k) + B_k (x^k - x^{k-1}).
    step = trial_lib.trial_step(cand_p, state.precond, direction, cand_b, state.momentum, s_diff)
    trial = optax.tree.add(params, step)
    trial_value, trial_grad = _common.value_and_grad(value_fn, trial)
    finite = _common.all_finite(trial_value, trial_grad)
    # Lines 4-5, with the gradients of Appendix D.1.
    diff_sq = optax.tree.vdot(diff, diff)
    den = denominator(optax.tree.vdot(grad, grad), diff_sq, None)
    resid = optax.tree.add_scale(trial_grad, om, step)  # grad f(x^+) + omega (x^+ - x)
    # At the damped (sP, sB) of this trial, where the learners continue from
    # (trial.kept_scale).
    grad_p = hypergradient_lib.hypergradient(cand_p, resid, updates, den=den)
    grad_b = hypergradient_lib.hypergradient(cand_b, resid, diff, den=den, negate=False)
    kept = trial_lib.kept_scale(s, finite)
    new_p, new_lp = learners_lib.learn(
      cand_p,
      learn,
      optax.tree.scale(kept, state.precond),
      grad_p,
      state.precond_learner_state,
      _common.cast(precond_lr, dtype),
      precond_min,
      precond_max,
    )
    new_b, new_lb = learners_lib.learn(
      cand_b,
      learn,
      optax.tree.scale(kept, state.momentum),
      grad_b,
      state.momentum_learner_state,
      _common.cast(momentum_lr, dtype),
      momentum_min,
      momentum_max,
    )
    precond, momentum, lp, lb = _common.keep_if(
      finite,
      (new_p, new_b, new_lp, new_lb),
      (state.precond, state.momentum, state.precond_learner_state, state.momentum_learner_state),
    )
    # Line 6: the null step on the potential psi.
    psi_new = trial_value + 0.5 * om * optax.tree.vdot(step, step)
    psi_old = value + 0.5 * om * diff_sq
    # psi is not f, so the rule gets no step to estimate f's decrease from.
    accepted = finite & acceptance.accept(psi_new, psi_old, trial_grad, grad, step=None)
    new_state = HDMHBState(
      count=state.count + 1,
      precond=precond,
      momentum=momentum,
      precond_learner_state=lp,
      momentum_learner_state=lb,
      prev_params=_common.keep_if(accepted, params, state.prev_params),
      value=jnp.where(accepted, trial_value, value).astype(dtype),
      grad=_common.keep_if(accepted, trial_grad, grad),
      trial_scale=trial_lib.next_trial_scale(s, finite),
      info=_common.next_info(
        state.info,
        accepted=accepted,
        hypergrad_norm=jnp.sqrt(optax.tree.vdot(grad_p, grad_p) + optax.tree.vdot(grad_b, grad_b)),
        calls=1,
      ),
    )
    out = _common.keep_if(accepted, step, optax.tree.zeros_like(params))
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
