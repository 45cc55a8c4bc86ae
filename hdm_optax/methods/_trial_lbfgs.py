"""trial_lbfgs: HDM's trial point and null step with an L-BFGS operator from every trial's secant pair."""

from __future__ import annotations

from typing import Any, Callable, Optional

import optax

from hdm_optax import _common
from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import secant as secant_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces import directions as directions_lib
from hdm_optax.pieces import step_control as step_control_lib

__all__ = ("trial_lbfgs",)


@_common.configured
def trial_lbfgs(
  memory_size: int = 10,
  *,
  shrink: Any = 0.5,
  pair_tol: Any = 1e-10,
  agree: Any = 3.0,
  step_control: Optional[shell.StepControl] = None,
  lower: Any = None,
  upper: Any = None,
  diagonal: Optional[Callable[..., tuple[Any, Any]]] = secant_lib.pairs_diagonal(),
) -> optax.GradientTransformationExtraArgs:
  r"""L-BFGS directions at HDM's cost: one trial point, one oracle call, a null step.

  Each update evaluates f and grad f once, at the trial point

  .. math::
    x^+ = x - \alpha H_m \nabla f(x),

  where :math:`H_m` is the L-BFGS inverse-Hessian operator (:func:`hdm_optax.pieces.secant.two_loop`)
  of the last m secant pairs :math:`(s, y) = (x^+ - x, \nabla f(x^+) - \nabla
  f(x))`, one from every finite trial, kept when
  :math:`\langle s, y\rangle > \epsilon_p \|s\|\|y\|` (nonconvex problems give
  pairs of negative curvature) and the trial was accepted or, rejected, its values and
  slopes agree on where the minimum along s lies (within a factor ``agree``:
  :func:`hdm_optax.pieces.step_control.models_agree`; the pair of a step into an
  exponential wall says the minimum is 1e-11 of the way, and kept, it collapsed every later
  step). :math:`H_0 = \gamma I` with
  :math:`\gamma = \langle s, y\rangle / \langle y, y\rangle` of the newest
  *accepted* kept pair (a long rejected trial in a direction of high
  curvature would otherwise shrink every step outside the pairs' span), and
  :math:`\gamma = \min(1, 1/\|\nabla f(x_0)\|)` before one exists (as
  ``optax.scale_by_lbfgs``). Where the kept pairs show badly scaled coordinates,
  :math:`H_0` is instead the diagonal :math:`h_i = \sqrt{\sum_k s_{ki}^2 / \sum_k y_{ki}^2}`
  (``diagonal``, default :func:`hdm_optax.pieces.secant.pairs_diagonal`: two or more pairs
  and :math:`\max h / \min h > 10^3`; only where n >= m: with more pairs than dimensions
  the pairs determine the operator, and there the diagonal lost runs); it moves as the inverse Hessian does under
  :math:`x \to f(D x)`, and solves Rosenbrock-10 rescaled by D over 1e-2..1e2 in 128 calls,
  which neither :math:`\gamma I` nor ``optax.lbfgs()`` solves in 1000 (``docs/secant.md``).
  The trial becomes the iterate when
  :func:`hdm_optax.pieces.acceptance.curvature_checked` accepts it; otherwise x stays (HDM's null step).
  alpha, the step control (``step_control``, default
  :func:`hdm_optax.pieces.step_control.evidence_step`), is updated from what the trial
  revealed: x4 while an accepted trial's slope along s is still steep
  (:math:`\langle \nabla f(x^+), s\rangle < 0.9 \langle \nabla f(x), s\rangle`, up to
  1e6), back to 1 after other accepted trials (or kept above 1, falling by the secant's
  minimiser where the trial passed the minimum), and after a null step scaled by the
  cubic's minimiser along s (relative to the secant's, which the new pair already
  applies), safeguarded to [0.1, 0.5]; halved after a non-finite trial.
  :func:`hdm_optax.pieces.step_control.capped_step` is the former rule (halve, grow x1.5
  up to 1). A step shorter than
  :math:`1024\,\epsilon_{64}\|x\|` (float64's eps, in every dtype) or a
  trial whose gradient equals :math:`\nabla f(x)` carries no curvature: the
  memory restarts (:math:`\gamma` from the gradient again, alpha = 1). With
  the dtype's own eps, float32's threshold (1.2e-4 relative) caught the short
  steps of ordinary convergence near a large x, and every restart ended in
  null steps.

  How it relates to HDM and L-BFGS. From HDM (Algorithm 1 and 4 of Chu et
  al.) it keeps the trial point, the null step and the single oracle call
  per iteration; it learns nothing by a hypergradient: the preconditioner P
  of HDM is replaced by :math:`\alpha H_m`, which the secant pairs determine.
  Learning alpha or a diagonal :math:`H_0` by HDM's hypergradient made it
  worse on the development problems, or, gated as the pairs' diagonal is, slower than
  it (``docs/secant.md``). From L-BFGS it
  keeps the two-loop operator; it has no line search (L-BFGS spends extra
  calls on it), takes pairs from rejected trials too (each is exact
  curvature information along an explored direction), and accepts a trial on
  the value and its slope instead of the Wolfe conditions.

  Bounds (``lower=``, ``upper=``; ``docs/bounds.md``): the trial is projected onto the box,
  :math:`x^+ = P(x - \alpha d)`, with :math:`d = H_F u` on the free variables (those not at a
  bound with u pushing outward; :math:`H_F` the operator of the pairs restricted to them) and
  :math:`\gamma u` on the binding ones (:func:`hdm_optax.pieces.box.two_metric_step`); the
  pair's s is the projected step taken, gamma that of the newest accepted kept pair restricted
  to the variables free when it was proposed (:func:`hdm_optax.pieces.box.free_scaling`: the
  binding variables' gradient change made the free steps too short); one oracle call and the
  null step are kept; after an accepted trial of non-positive curvature whose moving
  variables all have a finite bound ahead, the former rule's alpha may grow past 1 (:func:`hdm_optax.pieces.box.step_cap`;
  the default step control extrapolates there on its own). The box is held in the
  state, where ``solve`` finds it: it projects an infeasible x0 and stops on the projected
  gradient (status ``CONVERGED_IN_BOX``); the transformation must be last in a chain. Without
  bounds the program is the unbounded one.

  The operator acts on the incoming ``updates`` u (grad f(x) when
  ``trial_lbfgs`` is first or alone in a chain): :math:`x^+ = x - \alpha H_m
  u`, so a clip or weight decay before it is honoured, while the pairs, the
  acceptance test and the reported values stay those of f
  (``docs/pitfalls.md``). The state is 2m + 1 vectors of n (the pairs and the cached gradient) plus
  O(m^2) scalars (the pairs' inner products); the diagonal is formed from the pairs in each
  update (one more pass over them), not stored. A non-finite trial changes nothing but alpha.

  Args:
    memory_size: m, the number of pairs kept.
    shrink: the factor of alpha after a non-finite trial (or a null step whose cubic has
      no minimiser), in (0, 1).
    pair_tol: :math:`\epsilon_p`, the cosine below which a pair is not kept.
    agree: the factor within which a rejected trial's cubic and secant minimisers along s
      must agree for its pair to be kept (also the step control's, by default), >= 1.
    step_control: a :class:`hdm_optax.pieces.shell.StepControl` (default
      ``evidence_step(shrink=shrink, agree=agree)``;
      :func:`~hdm_optax.pieces.step_control.capped_step` is the former rule).
    lower: the box's lower bound l: ``None`` (none), a number, or a pytree shaped like the
      params (leaves: numbers, ``None`` or arrays of the params' dtype); -inf for an open side.
    upper: the upper bound u, like ``lower``. With either, the iterates stay in the box
      (see Bounds above and ``docs/bounds.md``).
    diagonal: :math:`H_0`'s diagonal where the pairs call for one,
      ``diagonal(memory, gamma) -> (h, on)`` (default
      :func:`hdm_optax.pieces.secant.pairs_diagonal` with its gate 1e3); ``None``:
      :math:`H_0 = \gamma I` always. Not used in a box, nor where the params have fewer
      entries than ``memory_size``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

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
    Wright, *Numerical Optimization*, 2nd ed., Algorithm 7.4; Bertsekas, SIAM J.
    Control Optim. 20(2), 1982 and Kim, Sra, Dhillon, SIAM J. Sci. Comput. 32(6), 2010
    (the bounded step, :mod:`hdm_optax.pieces.box`).
  """
  if step_control is None:
    step_control = step_control_lib.evidence_step(shrink=shrink, agree=agree)
  return shell.iteration(
    "trial_lbfgs",
    directions_lib.secant(
      memory_size, pair_tol=pair_tol, agree=agree, lower=lower, upper=upper, diagonal=diagonal
    ),
    acceptance=acceptance_lib.curvature_checked(),
    step_control=step_control,
  )
