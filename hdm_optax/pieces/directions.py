r"""Directions of the one-call iteration: HDM's, HDM-HB's and the secant pairs' L-BFGS operator.

A :class:`hdm_optax.pieces.shell.Direction` proposes the trial step and
learns from the trial. This module holds

- :func:`preconditioned`: HDM's :math:`-P u` with P learned online from the
  hypergradient (Algorithm 1);
- :func:`heavy_ball`: HDM-HB's :math:`-P u + B (x - x^-)` with (P, B) learned
  from the heavy-ball feedback (Algorithm 2);
- :func:`secant`: :math:`-\alpha H_m u` with :math:`H_m` the L-BFGS operator
  of the trials' secant pairs (:func:`hdm_optax.trial_lbfgs`).

Algorithm 4's direction, with its curvature estimate, probes and decay, is
:func:`hdm_optax.pieces.momentum.momentum_direction`.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithms 1 and 2,
  Appendix D.1; Liu and Nocedal, *On the limited memory BFGS method for large
  scale optimization*, Math. Programming 45, 1989.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _common
from hdm_optax.pieces import box as box_lib
from hdm_optax.pieces import candidates as candidates_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces import learners as learners_lib
from hdm_optax.pieces import secant as secant_lib
from hdm_optax.pieces import step_control as step_control_lib

__all__ = (
  "HeavyBallState",
  "Learnable",
  "PrecondState",
  "SecantState",
  "heavy_ball",
  "preconditioned",
  "secant",
)


class Learnable(NamedTuple):
  """A quantity learned online (P or B): its candidate set, learner, step, start and bounds.

  Attributes:
    candidate: the :class:`~hdm_optax.pieces.candidates.CandidateSet` (its shape).
    learner: the :class:`~hdm_optax.pieces.learners.OnlineLearner`.
    lr: the learner's step size.
    init: the start value, times the identity of the candidate set.
    lower: lower bound of every entry (``None``: unbounded).
    upper: upper bound of every entry (``None``: unbounded).
  """

  candidate: candidates_lib.CandidateSet
  learner: learners_lib.OnlineLearner
  lr: Any
  init: Any = 0.0
  lower: Optional[Any] = None
  upper: Optional[Any] = None

  def start(self, params) -> tuple[Any, Any]:
    """The projected start value and its learner's state."""
    value = self.candidate.project(self.candidate.init(params, self.init), self.lower, self.upper)
    return value, self.learner.init(value)

  def learn(self, value, hypergrad, learner_state, kept, dtype) -> tuple[Any, Any]:
    """One round from ``kept`` times the value (the damped trial's), projected."""
    return learners_lib.learn(
      self.candidate,
      self.learner,
      optax.tree.scale(kept, value),
      hypergrad,
      learner_state,
      _common.cast(self.lr, dtype),
      self.lower,
      self.upper,
    )


class PrecondState(NamedTuple):
  """State of :func:`preconditioned`.

  Attributes:
    precond: P_k, the stepsize (its shape depends on the candidate set).
    learner_state: the online learner's state for P (AdaGrad: U_k).
  """

  precond: Any
  learner_state: Any


def preconditioned(precond: Learnable) -> shell.Direction:
  r"""HDM's direction: :math:`-P u`, P learned online from the hypergradient (Algorithm 1).

  The trial step is :math:`-P (s u)` with s the step control's damping; after
  the trial, P learns from

  .. math::
    \nabla h_x(P) = -\frac{\nabla f(x^+) u^\top}{\|\nabla f(x)\|^2},

  taken at the damped sP of the trial, where the learner continues from
  (:func:`hdm_optax.pieces.step_control.kept_scale`). A non-finite trial
  leaves P and the learner as they are.

  Args:
    precond: P as a :class:`Learnable`.

  Returns:
    A :class:`hdm_optax.pieces.shell.Direction` (its state a :class:`PrecondState`).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates, directions, learners
    >>> d = directions.preconditioned(
    ...   directions.Learnable(candidates.scalar(), learners.adagrad(), lr=0.1, init=0.5))
    >>> float(d.init(jnp.zeros(3)).precond)
    0.5
  """

  def init(params):
    value, learner_state = precond.start(params)
    return PrecondState(precond=value, learner_state=learner_state)

  def propose(state, ctx):
    # Algorithm 1, line 3: the trial point x^k - P_k grad f(x^k), damped by s.
    direction = optax.tree.scale(ctx.scale, ctx.updates)
    return candidates_lib.trial_step(precond.candidate, state.precond, direction), None

  def learn(state, trial, accepted, ctx):
    del accepted
    # Line 4: grad h_{x^k}(P_k) = -grad f(x^+) grad f(x^k)^T / ||grad f(x^k)||^2, at sP.
    den = optax.tree.vdot(ctx.grad, ctx.grad)
    hypergrad = hypergradient_lib.hypergradient(precond.candidate, trial.grad, ctx.updates, den=den)
    kept = step_control_lib.kept_scale(ctx.scale, trial.finite)
    new = precond.learn(state.precond, hypergrad, state.learner_state, kept, ctx.value.dtype)
    learned = _common.keep_if(trial.finite, new, (state.precond, state.learner_state))
    return shell.Learned(PrecondState(*learned), jnp.asarray(False), optax.tree.norm(hypergrad))

  return shell.Direction(init=init, propose=propose, learn=learn)


class HeavyBallState(NamedTuple):
  """State of :func:`heavy_ball`.

  Attributes:
    precond: P_k, the learned stepsize.
    momentum: B_k, the learned momentum (0-d for scalar, like params for diagonal).
    precond_learner_state: online learner state for P (AdaGrad: its U).
    momentum_learner_state: online learner state for B.
    prev_params: x^{k-1} (x^0 = x^1 at init).
  """

  precond: Any
  momentum: Any
  precond_learner_state: Any
  momentum_learner_state: Any
  prev_params: Any


def heavy_ball(
  precond: Learnable,
  momentum: Learnable,
  *,
  omega: Any = 0.0,
  denominator: Optional[hypergradient_lib.Denominator] = None,
) -> shell.Direction:
  r"""HDM-HB's direction: :math:`-P u + B (x - x^-)`, (P, B) learned jointly (Algorithm 2).

  With :math:`r = \nabla f(x^+) + \omega (x^+ - x)` and den the
  ``denominator`` of :math:`\|\nabla f(x)\|^2` and :math:`\|x - x^-\|^2`, the
  learners see (Appendix D.1)

  .. math::
    \nabla_P h = -\frac{r\, u^\top}{den}, \qquad \nabla_B h = \frac{r\,(x - x^-)^\top}{den},

  at the damped (sP, sB) of the trial. The acceptance test compares the
  potential :math:`\psi(x, x^-) = f(x) + \frac{\omega}{2}\|x - x^-\|^2`
  (line 6), and x^- moves only with an accepted trial.

  Args:
    precond: P as a :class:`Learnable`.
    momentum: B as a :class:`Learnable`.
    omega: omega >= 0 of the potential.
    denominator: the feedback's denominator (``None``: ``fixed_tau(0)``).

  Returns:
    A :class:`hdm_optax.pieces.shell.Direction` (its state a :class:`HeavyBallState`).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import candidates, directions, learners
    >>> d = directions.heavy_ball(
    ...   directions.Learnable(candidates.diagonal(), learners.adagrad(), lr=0.1),
    ...   directions.Learnable(candidates.scalar(), learners.adagrad(), lr=1.0, init=0.5))
    >>> state = d.init(jnp.zeros(3))
    >>> state.precond.shape, float(state.momentum)
    ((3,), 0.5)
  """
  denominator = hypergradient_lib.fixed_tau(0.0) if denominator is None else denominator

  def init(params):
    p, p_state = precond.start(params)
    b, b_state = momentum.start(params)
    return HeavyBallState(p, b, p_state, b_state, _common.copy_tree(params))

  def propose(state, ctx):
    diff = optax.tree.sub(ctx.params, state.prev_params)  # x^k - x^{k-1}
    direction, s_diff = optax.tree.scale(ctx.scale, ctx.updates), optax.tree.scale(ctx.scale, diff)
    # Algorithm 2, line 3: x^{k+1/2} = x^k - P_k grad f(x^k) + B_k (x^k - x^{k-1}).
    step = candidates_lib.trial_step(
      precond.candidate, state.precond, direction, momentum.candidate, state.momentum, s_diff
    )
    return step, None

  def merit(state, trial, ctx):
    # Line 6: the null step on the potential psi, which is not f (no step for the rule).
    om = _common.cast(omega, ctx.value.dtype)
    diff = optax.tree.sub(ctx.params, state.prev_params)
    psi_new = trial.value + 0.5 * om * optax.tree.vdot(trial.step, trial.step)
    return psi_new, ctx.value + 0.5 * om * optax.tree.vdot(diff, diff), None

  def learn(state, trial, accepted, ctx):
    dtype = ctx.value.dtype
    diff = optax.tree.sub(ctx.params, state.prev_params)
    # Lines 4-5, with the gradients of Appendix D.1, at the damped (sP, sB).
    den = denominator(optax.tree.vdot(ctx.grad, ctx.grad), optax.tree.vdot(diff, diff), None)
    resid = optax.tree.add_scale(trial.grad, _common.cast(omega, dtype), trial.step)
    grad_p = hypergradient_lib.hypergradient(precond.candidate, resid, ctx.updates, den=den)
    grad_b = hypergradient_lib.hypergradient(momentum.candidate, resid, diff, den=den, negate=False)
    kept = step_control_lib.kept_scale(ctx.scale, trial.finite)
    new_p, new_lp = precond.learn(state.precond, grad_p, state.precond_learner_state, kept, dtype)
    new_b, new_lb = momentum.learn(
      state.momentum, grad_b, state.momentum_learner_state, kept, dtype
    )
    learned = _common.keep_if(
      trial.finite,
      (new_p, new_b, new_lp, new_lb),
      (state.precond, state.momentum, state.precond_learner_state, state.momentum_learner_state),
    )
    prev_params = _common.keep_if(accepted, ctx.params, state.prev_params)
    hypergrad_norm = jnp.sqrt(optax.tree.vdot(grad_p, grad_p) + optax.tree.vdot(grad_b, grad_b))
    return shell.Learned(HeavyBallState(*learned, prev_params), jnp.asarray(False), hypergrad_norm)

  return shell.Direction(init=init, propose=propose, learn=learn, merit=merit)


class SecantState(NamedTuple):
  """State of :func:`secant`.

  Attributes:
    memory: the last m secant pairs (:class:`hdm_optax.pieces.secant.SecantMemory`),
      from every finite trial.
    gamma: the scalar of :math:`H_0 = \\gamma I`, from the newest accepted pair
      (0 before the first: then :math:`\\min(1, 1/\\|u\\|)`).
    box: the :class:`hdm_optax.pieces.box.Box` of ``lower=`` / ``upper=`` (``None``
      without bounds); ``solve`` finds it here.
  """

  memory: secant_lib.SecantMemory
  gamma: jax.Array
  box: Optional[box_lib.Box] = None


# A step shorter than this, relative to x, is below x's resolution in float64 (1024 eps);
# in float32, whose eps is 5e8 times larger, a step that leaves x (and so the gradient)
# unchanged shows it by the gradient's change alone.
_RESOLUTION = 1024 * float(np.finfo(np.float64).eps)


def secant(
  memory_size: int = 10,
  *,
  pair_tol: Any = 1e-10,
  agree: Any = 3.0,
  lower: Any = None,
  upper: Any = None,
  diagonal: Optional[Callable[..., tuple[Any, jax.Array]]] = None,
) -> shell.Direction:
  r"""The L-BFGS operator of the trials' secant pairs: :math:`-\alpha H_m u`.

  :math:`H_m` is the two-loop operator (:func:`hdm_optax.pieces.secant.two_loop`)
  of the last m pairs :math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla f(x))`
  of finite trials, kept when :math:`\langle s, y\rangle > \epsilon_p \|s\|\|y\|`
  (nonconvex problems give pairs of negative curvature) and the trial was accepted or,
  rejected, its values and slopes agree on where the minimum along s lies (the cubic
  through f, f+ and the two slopes and the secant of the slopes, within a factor
  ``agree``: :func:`hdm_optax.pieces.step_control.models_agree`; the pair of a step into
  an exponential wall says the minimum is 1e-11 of the way, and kept, it collapsed every
  later step); :math:`H_0 = \gamma I` with :math:`\gamma =
  \langle s, y\rangle / \langle y, y\rangle` of the newest accepted kept pair
  (:math:`\min(1, 1/\|u\|)` before one exists), or, with ``diagonal``, the diagonal it
  returns where it says so (:func:`hdm_optax.pieces.secant.pairs_diagonal`: where the
  pairs show badly scaled coordinates); alpha is the step control's
  factor. A step shorter than :math:`1024\,\epsilon_{64}\|x\|` or a trial
  whose gradient equals :math:`\nabla f(x)` carries no curvature: the memory
  empties, gamma comes from the gradient again and the step control restarts.

  In a box (``lower=``, ``upper=``; ``docs/bounds.md``) the trial is projected,
  :math:`x^+ = P(x - \alpha d)`, with :math:`d = H_F u` on the free variables
  (those not at a bound with u pushing outward; :math:`H_F` the operator of the
  pairs restricted to them, by the recursion) and :math:`\gamma u` on the binding
  ones (:func:`hdm_optax.pieces.box.two_metric_step`); the pair's s is the
  projected step taken; gamma is that of the pair restricted to the variables free
  when it was proposed (:func:`hdm_optax.pieces.box.free_scaling`); after an accepted trial of non-positive curvature whose
  moving variables all have a finite bound ahead, the step control's cap is
  lifted (:func:`hdm_optax.pieces.box.step_cap`). Without bounds the program is
  the unbounded one.

  Args:
    memory_size: m, the number of pairs kept.
    pair_tol: :math:`\epsilon_p`, the cosine below which a pair is not kept.
    agree: the factor within which a rejected trial's cubic and secant minimisers along s
      must agree for its pair to be kept, >= 1.
    lower: the box's lower bound: ``None`` (none), a number, or a pytree shaped like
      the params; -inf for an open side.
    upper: the upper bound, like ``lower``.
    diagonal: ``None`` (:math:`H_0 = \gamma I`) or ``diagonal(memory, gamma) -> (h, on)``
      (:func:`hdm_optax.pieces.secant.pairs_diagonal`): :math:`H_0 = \operatorname{diag}(h)`
      where ``on``. Not used in a box, nor where the params have fewer entries than
      ``memory_size`` (there :math:`H_0 = \gamma I`: with more pairs than dimensions the
      pairs determine the operator, and on the development lists the diagonal lost runs
      only at n <= 8).

  Returns:
    A :class:`hdm_optax.pieces.shell.Direction` (its state a :class:`SecantState`).

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.pieces import directions
    >>> state = directions.secant(5).init(jnp.zeros(3))
    >>> state.memory.s.shape, float(state.gamma)
    ((5, 3), 0.0)
  """
  if not isinstance(memory_size, int) or isinstance(memory_size, bool) or memory_size < 1:
    raise ValueError(
      f"memory_size must be an int >= 1, got {memory_size!r}; pass e.g. memory_size=10."
    )
  _common.check_interval("pair_tol", pair_tol, 0, 1, hi_open=True)
  _common.check_at_least("agree", agree, 1)
  _common.check_finite("agree", agree)
  if diagonal is not None and not callable(diagonal):
    raise ValueError(
      f"diagonal must be None or a function (memory, gamma) -> (h, on), got {diagonal!r}; "
      "pass e.g. diagonal=hdm_optax.pieces.secant.pairs_diagonal()."
    )
  box_lib.check_order(lower, upper)

  def init(params):
    memory = secant_lib.secant_memory(params, memory_size)
    dtype = _common.params_dtype(params)
    box = box_lib.make_box(params, lower, upper)
    return SecantState(memory=memory, gamma=jnp.zeros([], dtype), box=box)

  def propose(state, ctx):
    dtype = ctx.value.dtype
    # The operator acts on the incoming updates u (grad f(x) when alone or first in a chain).
    grad_norm = optax.tree.norm(box_lib.free_part(state.box, ctx.params, ctx.updates))
    first_gamma = jnp.minimum(1, _common.safe_div(jnp.ones([], dtype), grad_norm))
    first_gamma = jnp.where(grad_norm > 0, first_gamma, 1).astype(dtype)
    gamma = jnp.where(state.gamma > 0, state.gamma, first_gamma)
    if state.box is None:  # x+ = x - alpha H_m u.
      return optax.tree.scale(-ctx.scale, _operator(state.memory, gamma, ctx.updates)), None
    # In a box: P(x - alpha d), H acting on the free variables.
    tol = _common.cast(pair_tol, dtype)
    operator = lambda v, free: secant_lib.recursion(
      box_lib.restricted_memory(state.memory, free, tol), gamma, v
    )
    step, _ = box_lib.two_metric_step(
      state.box, ctx.params, ctx.updates, ctx.scale, gamma, operator
    )
    return step, None

  def _operator(memory, gamma, updates):
    n = sum(jnp.size(leaf) for leaf in jax.tree.leaves(updates))
    if diagonal is None or n < memory_size:  # fewer dimensions than pairs: gamma I
      return secant_lib.two_loop(memory, gamma, updates)
    # H_0 = diag(h) where the rule says so, gamma I elsewhere: one program, no branch (a
    # lax.cond over the pairs made XLA copy them at every update).
    h0, on = diagonal(memory, gamma)
    h0 = jax.tree.map(lambda h: jnp.where(on, h, gamma).astype(h.dtype), h0)
    return secant_lib.two_loop(memory, h0, updates)

  def observe(state, trial, ctx):
    change = optax.tree.sub(trial.grad, ctx.grad)
    products = secant_lib.pair_products(trial.step, change)
    # A finite <s, y> needs every y_i = g+_i - g_i finite (s_i * inf is inf or NaN), so every
    # g+_i finite: no separate pass over grad f(x+).
    finite = trial.finite & jnp.isfinite(products.sy)
    return state, trial._replace(finite=finite, aux=products)

  def learn(state, trial, accepted, ctx):
    c = lambda x: _common.cast(x, ctx.value.dtype)
    step, finite = trial.step, trial.finite
    change = optax.tree.sub(trial.grad, ctx.grad)
    products = trial.aux
    sy = products.sy
    step_norm, change_norm = jnp.sqrt(products.ss), jnp.sqrt(products.yy)
    # A step below the resolution of x (or one that left the gradient as it was) carries
    # no curvature: H has collapsed along g; the memory restarts from H_0 = gamma_0 I.
    short = step_norm <= c(_RESOLUTION) * optax.tree.norm(ctx.params)
    lost = finite & (short | (change_norm == 0))
    # A finite trial's pair with enough positive curvature enters the memory: an accepted
    # trial's, or a rejected one's whose values agree with its slopes.
    slope, trial_slope = step_control_lib.slopes(trial, ctx)
    agreed = step_control_lib.models_agree(ctx.value, trial.value, slope, trial_slope, c(agree))
    curved = sy > c(pair_tol) * step_norm * change_norm
    keep = finite & curved & ~lost & (accepted | agreed)
    memory = secant_lib.secant_record(state.memory, step, change, keep, sy=sy)
    memory = secant_lib.reset(memory, lost)
    scales = keep & accepted
    scaling = _common.safe_div(sy, products.yy)
    if state.box is not None:  # the scale of H on the free variables the step was taken on
      scaling = box_lib.free_scaling(state.box, ctx.params, ctx.updates, step, change, scaling)
    gamma = jnp.where(scales, scaling, state.gamma)
    gamma = jnp.where(lost, 0, gamma).astype(state.gamma.dtype)
    return shell.Learned(
      SecantState(memory, gamma, state.box),
      lost,
      jnp.zeros([], ctx.value.dtype),
      box_lib.step_cap(state.box, sy, step),
    )

  return shell.Direction(init=init, propose=propose, learn=learn, observe=observe)
