"""trial_lbfgs: HDM's trial point and null step with an L-BFGS operator from every trial's secant pair."""

from __future__ import annotations

from typing import Any, Optional

import optax

from hdm_optax.driver import programs
from hdm_optax.pieces import shell
from hdm_optax.pieces.lbfgs import direction as direction_lib
from hdm_optax.pieces.lbfgs import memory as memory_lib
from hdm_optax.pieces.lbfgs import step_rule as step_rule_lib

__all__ = ("trial_lbfgs",)

# The default memory: more pairs where n is small (measured on the development lists:
# docs/research/trial_lbfgs.md, "The memory by the problem's size").
_SMALL_N, _MOST_PAIRS, _PAIRS = 1000, 30, 10


def memory_by_size(n: int) -> int:
  """``trial_lbfgs``'s default m: as many pairs as the params have entries, from 10 to 30,
  where they have at most 1000 entries; 10 above. Not more pairs than entries where n >= 10,
  which would switch off the pairs' diagonal."""
  return min(max(n, _PAIRS), _MOST_PAIRS) if n <= _SMALL_N else _PAIRS


@programs.configured
def trial_lbfgs(
  memory_size: Optional[int] = None,
  *,
  pair_tol: Any = 1e-10,
  step_rule: Optional[shell.StepRule] = None,
  lower: Any = None,
  upper: Any = None,
  diagonal: Any = memory_lib.pairs_diagonal(),
) -> optax.GradientTransformationExtraArgs:
  r"""L-BFGS directions at HDM's cost: one trial point, one oracle call, a null step.

  Each update evaluates f and grad f once, at the trial point

  .. math::
    x^+ = x - \alpha H_m u,

  with u the incoming updates (:math:`\nabla f(x)` when ``trial_lbfgs`` is first or alone in
  a chain) and :math:`H_m` the L-BFGS inverse-Hessian operator of the last m secant pairs
  :math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla f(x))`, one from every finite trial,
  accepted or not. The trial becomes the iterate when the step rule accepts it; otherwise x
  stays (HDM's null step). There is no line search and no argument to tune.

  The parts (:mod:`hdm_optax.pieces.lbfgs`):

  - the direction (:func:`~hdm_optax.pieces.lbfgs.direction.lbfgs_direction`): a pair is
    kept when :math:`\langle s, y\rangle > \epsilon_p \sum_i |s_i y_i|` and the step rule trusts
    it; :math:`H_0 = \gamma I` with :math:`\gamma = \langle s, y\rangle / \langle y,
    y\rangle` of the newest accepted kept pair (:math:`\min(1, 1/\|u\|)` before one exists,
    as ``optax.scale_by_lbfgs``), or the diagonal :math:`h_i = \sqrt{\sum_k s_{ki}^2 /
    \sum_k y_{ki}^2}` where the pairs show badly scaled coordinates and the older pairs'
    h predicts the newest pair better than their scalar (a full memory's h: the newest or
    the one before it; ``diagonal``). A step that moves no coordinate by more than
    :math:`1024\,\epsilon_{64}|x_i|`, or a rejected trial that leaves the gradient
    unchanged, carries no curvature: the memory restarts, and alpha is 1 again (an accepted
    one found f linear along s: no pair, and alpha goes on growing);
  - the step rule (``step_rule``, default
    :func:`~hdm_optax.pieces.lbfgs.step_rule.evidence_step`), from f, f+ and the slopes
    :math:`\langle \nabla f(x), s\rangle`, :math:`\langle \nabla f(x^+), s\rangle`: it
    accepts a trial that does not increase f, or increases it within rounding while the
    slope shrank, or, after two null steps in a row, within the noise those null steps
    showed (the part of f+ - f their slopes cannot explain where they say f is linear along
    s) while the slope shrank; it sets the next alpha (extrapolated while an accepted
    trial's slope stays steep, interpolated by the cubic along s after a null step,
    extrapolated after a null step too short for f's rounding (the slope unmoved, f up within
    the band), halved after a non-finite trial); it trusts a rejected trial's pair only where the cubic and the secant agree on
    where the minimum along s lies.

  From HDM (Algorithms 1 and 4 of Chu et al.) it keeps the trial point, the null step and
  one oracle call per iteration; HDM's learned preconditioner P becomes :math:`\alpha H_m`.
  From L-BFGS it keeps the operator; it takes pairs from rejected trials too, and accepts a
  trial on the value and its slope instead of the Wolfe conditions. A departure from both:
  where f's evaluation noise exceeds the decrease left (terms that cancel), it accepts an
  increase of f within the noise it measured on its own null steps; the value reported is
  still f at the reported point.

  Bounds (``lower=``, ``upper=``): the trial is projected onto the box,
  :math:`x^+ = P(x - \alpha d)`, with :math:`d = H_F u` on the free variables (not at a
  bound with u pushing outward) and :math:`\gamma u` on the binding ones
  (:func:`hdm_optax.pieces.lbfgs.bounded.two_metric_step`). The box is held in the state
  (its ``driver_box()``, :mod:`hdm_optax.driver.protocol`), where ``solve``, ``loop`` and ``minimize`` find
  it: they project an infeasible x0 and stop on the projected gradient (status
  ``CONVERGED_IN_BOX``). The transformation must then be last in a chain. Without bounds the
  program is the unbounded one.

  A transformation before it in a chain acts on u, while the pairs, the acceptance test and
  the reported values stay those of f: a clip (which scales u) is honoured, but a term f
  does not contain, such as ``optax.add_decayed_weights``'s, makes trials that go down u
  and up f, which are rejected (counted in ``info.num_uphill_trials``): put such a term in
  f. The state is 2m + 1 vectors
  of n (the pairs and the cached gradient) plus O(m^2) scalars. A non-finite trial changes
  nothing but alpha.

  Args:
    memory_size: m, the number of pairs kept; ``None``: n clipped to [10, 30] where the
      params have n <= 1000 entries, 10 above (a default that ``optax.inject_hyperparams``
      leaves as it is; the operator's work is about 7m passes over n per update). It sets
      the state's shapes: a number given
      to ``optax.inject_hyperparams(trial_lbfgs)`` is injected as an array, which an
      ``init`` under ``jax.jit`` (as in ``hdm_optax.solve``) cannot read; name it in
      ``static_args=("memory_size",)``.
    pair_tol: :math:`\epsilon_p`, the fraction of :math:`\sum_i |s_i y_i|` that
      :math:`\langle s, y\rangle` must exceed for the pair to be kept.
    step_rule: a :class:`hdm_optax.pieces.shell.StepRule` (default
      :func:`hdm_optax.pieces.lbfgs.step_rule.evidence_step` ``()``: its arguments set the
      factor after a non-finite trial, ``shrink``, and the models' agreement, ``agree``).
    lower: the box's lower bound l: ``None`` (none), a number, or a pytree shaped like the
      params (leaves: numbers, ``None`` or arrays of the params' dtype); -inf for an open side.
    upper: the upper bound u, like ``lower``.
    diagonal: :math:`H_0`'s diagonal where the pairs call for one: a rule with a method
      ``rule.apply(memory, gamma) -> (h, on)`` (default
      :func:`hdm_optax.pieces.lbfgs.memory.pairs_diagonal` ``()``) or a function
      ``diagonal(memory, gamma) -> (h, on)``; ``None``: :math:`H_0 = \gamma I` always. Not
      used in a box, nor where the params have fewer entries than ``memory_size``.
      ``optax.inject_hyperparams`` takes a function for a schedule: name a function of your
      own in ``static_args=("diagonal",)`` (a rule is not callable and passes through).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Raises:
    ValueError: an argument out of range (the message names it and the fix).

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> result = hdm_optax.solve(hdm_optax.trial_lbfgs(), fun, jnp.ones(3), max_steps=100, tol=1e-6)
    >>> bool(result.converged), int(result.num_grad_evals) < 30
    (True, True)
    >>> boxed = hdm_optax.trial_lbfgs(lower=0.5, upper=jnp.array([2.0, 2.0, jnp.inf]))
    >>> result = hdm_optax.solve(boxed, fun, jnp.ones(3), max_steps=100, tol=1e-6)
    >>> [float(v) for v in result.params], hdm_optax.Status(int(result.status)).name
    ([0.5, 0.5, 0.5], 'CONVERGED_IN_BOX')

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025 (the trial
    point and the null step, Algorithm 1 line 3); Liu and Nocedal, *On the
    limited memory BFGS method for large scale optimization*, Math.
    Programming 45, 1989 (the operator and the scaling of H_0); Nocedal and
    Wright, *Numerical Optimization*, 2nd ed., Algorithm 7.4 and Section 3.5; Bertsekas,
    SIAM J. Control Optim. 20(2), 1982 and Kim, Sra, Dhillon, SIAM J. Sci. Comput. 32(6),
    2010 (the bounded step).
  """
  if memory_size is None:
    memory_size = memory_by_size
  direction = direction_lib.lbfgs_direction(
    memory_size, pair_tol=pair_tol, lower=lower, upper=upper, diagonal=diagonal
  )
  if step_rule is None:
    step_rule = step_rule_lib.evidence_step()
  # Its direction packs the pairs itself, and its box keeps the params' layout.
  return shell.iteration("trial_lbfgs", direction, step_rule=step_rule, pack_params=False)
