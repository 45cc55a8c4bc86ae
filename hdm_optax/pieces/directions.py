r"""Directions of the one-call iteration: HDM's and HDM-HB's.

A :class:`hdm_optax.pieces.shell.Direction` proposes the trial step and
learns from the trial. This module holds

- :func:`preconditioned`: HDM's :math:`-P u` with P learned online from the
  hypergradient (Algorithm 1);
- :func:`heavy_ball`: HDM-HB's :math:`-P u + B (x - x^-)` with (P, B) learned
  from the heavy-ball feedback (Algorithm 2).

Algorithm 4's direction, with its curvature estimate, probes and decay, is
:func:`hdm_optax.pieces.momentum.momentum_direction`; trial_lbfgs's is
:func:`hdm_optax.pieces.lbfgs.direction.lbfgs_direction`.

References:
  Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
  with Hypergradient Descent*, arXiv:2502.11229, 2025: Algorithms 1 and 2,
  Appendix D.1.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import optax

from hdm_optax import _blocks
from hdm_optax import _numerics
from hdm_optax import _oracle
from hdm_optax.pieces import candidates as candidates_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces import learners as learners_lib
from hdm_optax.pieces import step_control as step_control_lib

__all__ = (
  "HeavyBallState",
  "Learnable",
  "PrecondState",
  "heavy_ball",
  "preconditioned",
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
      _numerics.cast(self.lr, dtype),
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

  A coordinate that a transformation before the method held (:math:`u_i = 0` while
  :math:`\nabla f(x)_i \neq 0`, e.g. ``optax.masked(optax.set_to_zero(), mask)``) takes
  no step, also with a ``full`` P, which mixes the coordinates
  (:func:`hdm_optax.pieces.candidates.trial_step`). P learns from the hypergradient
  along u as it is: the rows of a full P at the held coordinates learn but step nothing
  (the learners act entry by entry, so the other entries learn as without them).

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
    direction = optax.tree.scale(ctx.step_size, ctx.updates)
    held = _oracle.held_coordinates(ctx.updates, ctx.grad)
    return candidates_lib.trial_step(precond.candidate, state.precond, direction, held=held), None

  def learn(state, trial, verdict, ctx):
    del verdict
    # Line 4: grad h_{x^k}(P_k) = -grad f(x^+) grad f(x^k)^T / ||grad f(x^k)||^2, at sP.
    den = _blocks.vdot(ctx.grad, ctx.grad)
    hypergrad = hypergradient_lib.hypergradient(precond.candidate, trial.grad, ctx.updates, den=den)
    kept = step_control_lib.kept_scale(ctx.step_size, trial.finite)
    new = precond.learn(state.precond, hypergrad, state.learner_state, kept, ctx.value.dtype)
    learned = _numerics.keep_if(trial.finite, new, (state.precond, state.learner_state))
    return shell.Learned(PrecondState(*learned), jnp.asarray(False), _numerics.norm(hypergrad))

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
  (line 6), and x^- moves only with an accepted trial. A coordinate held before the
  method takes no step along :math:`P u` (and none along :math:`B (x - x^-)` while it has
  not moved), as in :func:`preconditioned`, which says how P learns there.

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
    return HeavyBallState(p, b, p_state, b_state, _numerics.copy_tree(params))

  def propose(state, ctx):
    diff = optax.tree.sub(ctx.params, state.prev_params)  # x^k - x^{k-1}
    direction, s_diff = (
      optax.tree.scale(ctx.step_size, ctx.updates),
      optax.tree.scale(ctx.step_size, diff),
    )
    # Algorithm 2, line 3: x^{k+1/2} = x^k - P_k grad f(x^k) + B_k (x^k - x^{k-1}).
    held = _oracle.held_coordinates(ctx.updates, ctx.grad)
    step = candidates_lib.trial_step(
      precond.candidate,
      state.precond,
      direction,
      momentum.candidate,
      state.momentum,
      s_diff,
      held=held,
    )
    return step, None

  def merit(state, trial, ctx):
    # Line 6: the null step on the potential psi, which is not f (no step for the rule).
    om = _numerics.cast(omega, ctx.value.dtype)
    diff = optax.tree.sub(ctx.params, state.prev_params)
    psi_new = trial.value + 0.5 * om * _blocks.vdot(trial.step, trial.step)
    return psi_new, ctx.value + 0.5 * om * _blocks.vdot(diff, diff), None

  def learn(state, trial, verdict, ctx):
    dtype = ctx.value.dtype
    diff = optax.tree.sub(ctx.params, state.prev_params)
    # Lines 4-5, with the gradients of Appendix D.1, at the damped (sP, sB).
    den = denominator(_blocks.vdot(ctx.grad, ctx.grad), _blocks.vdot(diff, diff), None)
    resid = optax.tree.add_scale(trial.grad, _numerics.cast(omega, dtype), trial.step)
    grad_p = hypergradient_lib.hypergradient(precond.candidate, resid, ctx.updates, den=den)
    grad_b = hypergradient_lib.hypergradient(momentum.candidate, resid, diff, den=den, negate=False)
    kept = step_control_lib.kept_scale(ctx.step_size, trial.finite)
    new_p, new_lp = precond.learn(state.precond, grad_p, state.precond_learner_state, kept, dtype)
    new_b, new_lb = momentum.learn(
      state.momentum, grad_b, state.momentum_learner_state, kept, dtype
    )
    learned = _numerics.keep_if(
      trial.finite,
      (new_p, new_b, new_lp, new_lb),
      (state.precond, state.momentum, state.precond_learner_state, state.momentum_learner_state),
    )
    prev_params = _numerics.keep_if(verdict.accepted, ctx.params, state.prev_params)
    hypergrad_norm = _numerics.sqrt(_blocks.vdot(grad_p, grad_p) + _blocks.vdot(grad_b, grad_b))
    return shell.Learned(HeavyBallState(*learned, prev_params), jnp.asarray(False), hypergrad_norm)

  return shell.Direction(init=init, propose=propose, learn=learn, merit=merit)
