"""hdm_auto: Algorithm 4 in a configuration that needs no argument, as a core configuration."""

from __future__ import annotations

from typing import Any

import optax

from hdm_optax import _checks
from hdm_optax import _numerics
from hdm_optax.driver import programs
from hdm_optax.pieces import shell
from hdm_optax.pieces import momentum as momentum_lib
from hdm_optax.pieces import step_control as step_control_lib
from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import curvature as curvature_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import learners as learners_lib

# The smallest entry of P, so that log P stays finite.
_MIN_PRECOND = 1e-30


@programs.configured
def hdm_auto(
  *,
  precond_lr: Any = 0.5,
  precond_decay: Any = 0.9,
  momentum_lr: Any = 1.0,
  null_shrink: Any = 0.5,
  seed: int = 0,
  horizon: int = 1000,
  num_probes: int = 3,
  probe_size: Any = 1e-4,
) -> optax.GradientTransformationExtraArgs:
  r"""HDM-Best that needs no argument: the tuning-free method built of HDM's own pieces.

  Algorithm 4's iteration (diagonal P, scalar beta, hypergradient feedback,
  null step), with the refinements of :func:`hdm_optax.hdm_best` (P_1 from L,
  beta_1 = 0.95, the curvature estimate L_hat and its denominator
  :math:`\|g\|^2 + \frac{\hat L^2}{4}\|x - x^-\|^2`, x^- <- x after every
  iteration), and four departures, each chosen on the development problems
  (``docs/research/hdm_auto.md``). Where a quasi-Newton model is welcome,
  :func:`hdm_optax.trial_lbfgs` (also without arguments) solves more.

  - P is learned in log space (:func:`hdm_optax.pieces.learners.learn_log`): the
    learner sees :math:`P \circ G_P` and P moves by factors,

    .. math::
      U \leftarrow \rho U + (P \circ G_P)^2, \qquad
      P \leftarrow \Pi_{[10^{-30}, 10^{10}/L]}\bigl[P \exp(-\eta\,
        (P \circ G_P) / \sqrt{U})\bigr],

    :math:`\eta` = ``precond_lr``, :math:`\rho` = ``precond_decay``
    (:func:`hdm_optax.pieces.learners.decayed_adagrad`). The step of log P does not
    depend on the scale of f or on L, so no eta_p has to be chosen and no
    decay schedule is needed; P_1 = 1/L_0.
  - On a null step (or a non-finite trial) P <- ``null_shrink`` P: a null
    step says P is too long, and the additive AdaGrad step of the paper
    shrinks P by at most eta_p per step.
  - L_0 from ``num_probes`` random unit directions (as OSGM-Best:
    :func:`hdm_optax.pieces.curvature.random_probe`, one counted gradient call each)
    instead of one probe along -grad f, which sees the curvature of one
    direction only.
  - Where f's difference is below its rounding, the decrease is the
    gradients' estimate 0.5 <g + g+, x+ - x>
    (:func:`hdm_optax.pieces.acceptance.resolved_decrease`): at float32 resolution
    the values of distinct points near a minimizer coincide, or differ by
    the rounding of the sum that computes f, and a test on f alone then
    rejects trials at random; every rejection shrinks P, and P collapses
    (``docs/pitfalls.md``; ``docs/research/hdm_auto.md``, *float32*).

  The trial step acts on the incoming ``updates`` u (grad f(x) when
  ``hdm_auto`` is first or alone in a chain): :math:`x^+ = x - P u + \beta
  (x - x^-)`, so a clip before it is honoured, while a term f does not contain (a weight
  decay) stalls the run: put it in f (``docs/pitfalls.md``). A non-finite trial leaves the learners untouched and
  the next trial step is halved; once a damped trial is finite, P and beta
  continue from sP and s beta (as in :func:`hdm_optax.hdm_best`). The state
  is 4 vectors of n (P, U, x^-, the cached gradient) plus scalars;
  every update is one value-and-gradient call: the first ``num_probes``
  updates are the probes (each evaluates the oracle at :math:`x + \delta d_i`
  and leaves x in place; the last sets P_1), every later one an iteration.
  Probe and iteration share one traced body (no ``lax.cond`` over the state).
  A configuration of :func:`hdm_optax.pieces.momentum.momentum_direction`.

  Args:
    precond_lr: eta, the step of log P.
    precond_decay: rho, the forgetting factor of U, in (0, 1] (1: AdaGrad).
    momentum_lr: eta_b, AdaGrad's step for beta.
    null_shrink: the factor of P after a null step, in (0, 1] (1: off).
    seed: seed of the probe directions.
    horizon: K, the step budget, used by the curvature threshold.
    num_probes: number of probe directions.
    probe_size: the probe's step delta.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns the step to the new iterate.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> result = hdm_optax.solve(hdm_optax.hdm_auto(), fun, jnp.ones(3), max_steps=500, tol=1e-4)
    >>> bool(result.converged)
    True

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025
    (Algorithm 4, Appendix A); *Gradient Methods with Online Scaling Part II*,
    arXiv:2509.11007, 2025 (the random probe).
  """
  for name, val in (
    ("precond_lr", precond_lr),
    ("precond_decay", precond_decay),
    ("momentum_lr", momentum_lr),
    ("null_shrink", null_shrink),
    ("horizon", horizon),
    ("num_probes", num_probes),
    ("probe_size", probe_size),
  ):
    _checks.check_positive(name, val)
  for name, val in (("precond_decay", precond_decay), ("null_shrink", null_shrink)):
    _checks.check_bounds(name, val, "1 (which switches it off)", 1.0)

  def precond_rule(lip, curvature, factor):
    """The step of log P is eta; P in [1e-30, 1e10/L]."""
    del curvature, factor
    c = lambda x: _numerics.cast(x, lip.dtype)
    return c(precond_lr), c(_MIN_PRECOND), c(1e10) / lip

  direction = momentum_lib.momentum_direction(
    learner=momentum_lib.log_space(learners_lib.decayed_adagrad(precond_decay, _MIN_PRECOND)),
    precond_rule=precond_rule,
    momentum_lr=lambda lip: _numerics.cast(momentum_lr, lip.dtype),
    denominator=hypergradient_lib.curvature_tau(1e-12),
    curvature_estimate=curvature_lib.running_mean(horizon, 1e-3),
    null_action=momentum_lib.shrink(null_shrink, _MIN_PRECOND),
    probe=curvature_lib.random_probe(num_probes, seed, probe_size),
    precond_from_probe=True,
  )
  return shell.iteration(
    "hdm_auto",
    direction,
    step_rule=step_control_lib.damping(acceptance_lib.resolved_decrease()),
    float16=False,
  )
