"""OSGM-Best, the authors' tuning-free method (Part II), as a configuration of the core."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from hdm_optax import _checks
from hdm_optax.driver import programs
from hdm_optax.pieces import shell
from hdm_optax.pieces import momentum as momentum_lib
from hdm_optax.pieces import step_control as step_control_lib
from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import curvature as curvature_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import learners as learners_lib
from hdm_optax.pieces import backtracking as backtracking_lib
from hdm_optax.pieces import decay as decay_lib


@programs.configured
def osgm_best(
  *,
  seed: int = 0,
  horizon: int = 1000,
  probe_size: float = 1e-4,
  num_probes: int = 3,
) -> optax.GradientTransformationExtraArgs:
  r"""OSGM-Best: online-scaled gradient method with momentum, tuning-free.

  The authors' practical method of Part II, as their public implementation
  runs it (diagonal P, scalar beta, three random L probes). Each iteration:

  .. math::
    x^+ &= x - P \nabla f(x) + \beta (x - x^-), \\
    G_P &= -\frac{\nabla f(x^+) \circ \nabla f(x)}{den}, \qquad
    G_\beta = \frac{\langle \nabla f(x^+), x - x^-\rangle}{den}, \\
    P &\leftarrow \Pi_{[0, 10^5/L]}[P - \eta_P U^{-1/2} G_P], \qquad
    \beta \leftarrow \Pi_{[0, 0.9995]}[\beta - \eta_\beta v^{-1/2} G_\beta],

  AdaGrad accumulators U, v from 0 (1e-12 added to their square roots),
  :math:`den = \|\nabla f(x)\|^2 + 10^{-12}` while L is being estimated and
  :math:`\|\nabla f(x)\|^2 + \frac{\hat L^2}{4}\|x - x^-\|^2` after,
  :math:`\eta_P = 1/L`, :math:`\eta_\beta = \min(1, L)`; x^+ is accepted when
  :math:`f(x^+) < f(x)` where f resolves the difference and when the
  gradients' estimate of the decrease is negative where it does not
  (:func:`hdm_optax.pieces.acceptance.resolved_decrease`; the authors' code accepts
  :math:`f(x^+) \le f(x)`, which in float32 decides by rounding near a
  minimizer), and x^- <- x after every iteration.

  - L_0 (the first ``num_probes`` updates, which leave x in place): the largest of
    :math:`\|\nabla f(x_0 + \delta d_i) - \nabla f(x_0)\| / \delta` over
    ``num_probes`` random unit directions d_i
    (:func:`hdm_optax.pieces.curvature.random_probe`, the directions of
    :func:`hdm_optax.pieces.curvature.probe_direction` from ``jax.random.key(seed)``),
    delta = ``probe_size``; 1e-5 if that is not finite or 0. One gradient
    call per direction, one direction per update (the authors' code probes
    all three before its first iteration: the same calls, and the same run up
    to the rounding of L_0, counted in updates as hdm_auto counts its
    probes). Probe and iteration share one traced body, so under
    ``jax.vmap`` an update costs the iteration's calls (one, and the
    lookahead's), not the probes' as well.
  - While L is being estimated: every 50 iterations
    :math:`\eta_P \leftarrow \max(0.8\,\eta_P, 10^{-3}/L)`; a counter goes up
    by 1 per accepted step and down by 2 (floor 0) per null step; once it
    exceeds :math:`\max(\min(K/4, 200), 20)` (K = ``horizon``), L <- L_hat, the
    mean of :math:`\|\nabla f(x^+) - \nabla f(x)\| / \|x^+ - x\|` over the
    accepted steps longer than 1e-3, :math:`\eta_P` and :math:`\eta_\beta` are
    reset from it, U <- 0, and the lookahead is switched on
    (:func:`hdm_optax.pieces.curvature.running_mean`).
  - Lookahead: when :math:`\|\nabla f(x^+)\| > 2 \|\nabla f(x)\|`, Armijo
    backtracking from x^+ along :math:`-P \nabla f(x^+)` (the P just
    updated; eta = 1, 0.8, ... down to 1e-6, sufficient decrease 0.5;
    :func:`hdm_optax.pieces.backtracking.gated_lookahead`) replaces x^+ by the point
    it finds before the acceptance test.

  A configuration of :func:`hdm_optax.pieces.momentum.momentum_direction`.

  Departures from the authors' code:

  - Each point of the backtracking costs one value-and-gradient call (theirs
    evaluates f there and then the gradient at the point found once more): one
    call less per successful lookahead, and every call is a full oracle call
    in ``info``.
  - Their optional stepsize-space regularisation (omega) is left out; their
    runs use omega = 0.
  - A trial whose value or gradient is not finite is a null step that leaves
    P, beta and the learners untouched, and the next trial step is halved;
    once a damped trial is finite, P, beta and the decay of lr_P continue from
    sP, s beta and s (as in :func:`hdm_optax.hdm_best`; a safeguard that finite
    runs never reach).
  - The trial step acts on the incoming ``updates`` u in place of
    :math:`\nabla f(x)` (the same when ``osgm_best`` is first or alone in a
    chain), so a transformation before it is honoured (``docs/pitfalls.md``).
  - Their stop at f < -1e20 is :func:`hdm_optax.solve`'s ``min_value``.

  Args:
    seed: seed of the probe directions.
    horizon: K, the step budget, used by the curvature threshold.
    probe_size: delta of the L probe.
    num_probes: number of probe directions.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate (0 on a
    null step and on a probe).

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> result = hdm_optax.solve(hdm_optax.osgm_best(), fun, jnp.ones(3), max_steps=500, tol=1e-4)
    >>> bool(result.converged)
    True

  References:
    Chu, Gao, Ye, Udell, *Gradient Methods with Online Scaling Part II.
    Practical Aspects*, arXiv:2509.11007, 2025; Part I, arXiv:2505.23081, 2025.
  """
  _checks.check_positive("horizon", horizon)
  _checks.check_positive("probe_size", probe_size)
  _checks.check_positive("num_probes", num_probes)

  def precond_rule(lip, curvature, factor):
    """lr_P = factor / L while L is being estimated, then 1/L_hat; P in [0, 1e5/L]."""
    return jnp.where(curvature.active, factor, 1) / lip, 0.0, 1e5 / lip

  direction = momentum_lib.momentum_direction(
    learner=momentum_lib.additive(learners_lib.adagrad(1e-12)),
    precond_rule=precond_rule,
    momentum_lr=lambda lip: jnp.minimum(1, lip),
    denominator=hypergradient_lib.curvature_tau(1e-12),
    curvature_estimate=curvature_lib.running_mean(horizon, 1e-3),
    schedule=decay_lib.step_decay(50, 0.8, 1e-3),
    probe=curvature_lib.random_probe(num_probes, seed, probe_size),
    lookahead=backtracking_lib.gated_lookahead(2.0),
  )
  return shell.iteration(
    "osgm_best",
    direction,
    step_rule=step_control_lib.damping(acceptance_lib.resolved_decrease()),
    float16=False,
  )
