"""HDM-Best (Algorithm 4, Appendix A) as an optax transformation, composed of pieces."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax.numpy as jnp
import optax

from hdm_optax import _checks
from hdm_optax import _numerics
from hdm_optax.driver import programs
from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import curvature as curvature_lib
from hdm_optax.pieces import decay as decay_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import learners as learners_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces import momentum as momentum_lib
from hdm_optax.pieces import step_control as step_control_lib

# The default eta_p = DEFAULT_PRECOND_LR_TIMES_L / L and eta_b = DEFAULT_MOMENTUM_LR: the
# point of the paper's grid (eta_p L in {0.1, 1, 10, 100}, eta_b in {1, 3, 5, 10, 100})
# chosen on Table 1's instances (docs/fidelity.md, "Choosing the defaults").
DEFAULT_PRECOND_LR_TIMES_L = 100.0
DEFAULT_MOMENTUM_LR = 1.0
# AdaGrad's eps of P and beta, as the authors' code.
_ADAGRAD_EPS = 1e-12


@programs.configured
def hdm_best(
  *,
  lipschitz: Optional[Any] = None,
  precond_lr: Optional[Any] = None,
  momentum_lr: Optional[Any] = None,
  init_precond: Any = 0.0,
  init_momentum: Any = 0.95,
  momentum_bounds: tuple[Any, Any] = (0.0, 0.9995),
  precond_max_times_lipschitz: Optional[Any] = 1e10,
  acceptance: Optional[acceptance_lib.AcceptanceRule] = None,
  denominator: Optional[hypergradient_lib.Denominator] = None,
  schedule: Optional[decay_lib.Schedule] = None,
  curvature_estimate: Optional[curvature_lib.CurvatureEstimate] = None,
  probe: Optional[curvature_lib.Probe] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""HDM-Best: diagonal HDM with heavy-ball momentum and AdaGrad (Algorithm 4).

  .. math::
    x^{k+1/2} &= x^k - P_k \nabla f(x^k) + \beta_k (x^k - x^{k-1}) \\
    \nabla_P h &= -\frac{\nabla f(x^{k+1/2}) \circ \nabla f(x^k)}{den_k},
    \qquad \nabla_\beta h = \frac{\langle \nabla f(x^{k+1/2}),
      x^k - x^{k-1}\rangle}{den_k} \\
    P_{k+1} &= \Pi_{[0, p_{max}]}[P_k - \eta_p U_{k+1}^{-1/2} \nabla_P h], \quad
    \beta_{k+1} = \Pi_{[0, 0.9995]}[\beta_k - \eta_b v_{k+1}^{-1/2}
      \nabla_\beta h] \\
    x^{k+1} &= \operatorname{argmin}_{x \in \{x^k, x^{k+1/2}\}} f(x),

  with AdaGrad accumulators :math:`U_{k+1} = U_k + (\nabla_P h)^2` and
  :math:`v_{k+1} = v_k + (\nabla_\beta h)^2` (the shared
  :func:`hdm_optax.pieces.learners.adagrad`, eps 1e-12). Departures from the
  printed algorithm:

  - Sign: Algorithm 4 prints :math:`\nabla_P h` without the minus sign; the
    gradient of h (Section 1, Appendix D.1) has it, and it is used here.
  - The refinements of the authors' published implementation, each a piece
    or an argument with their value as its default: P_1 = 0
    (``init_precond``), beta_1 = 0.95 (``init_momentum``), U_1 = v_1 = 0;
    den = ||g||^2 + 1e-12 until a curvature estimate L_hat exists, then
    den = ||g||^2 + (L_hat^2/4) ||x - x^-||^2 (``denominator``:
    :func:`~hdm_optax.pieces.hypergradient.curvature_tau`;
    :func:`~hdm_optax.pieces.hypergradient.fixed_tau` for a fixed tau); until
    L_hat exists, at iterations k = 50, 100, ... eta_p <- eta_p0 d with
    d <- max(0.8 d, 1e-3) before P is updated (``schedule``:
    :func:`~hdm_optax.pieces.decay.step_decay`;
    :func:`~hdm_optax.pieces.decay.constant` switches it off); the curvature
    estimate (``curvature_estimate``:
    :func:`~hdm_optax.pieces.curvature.running_mean`, whose ``horizon`` is
    the step budget K): on each accepted step with ||x+ - x|| > 1e-3
    record ||grad f(x+) - grad f(x)|| / ||x+ - x||; a counter goes up by 1
    per accepted step and down by 2 (floor 0) per null step; once it exceeds
    max(min(K/4, 200), 20), L_hat is the mean of the records, eta_p <-
    1/L_hat, U <- 0, and estimation and decay stop; P is clipped to
    [0, ``precond_max_times_lipschitz``/L] (L_hat once it exists; ``None``:
    [0, inf)). x^{k-1} <- x^k after every iteration, accepted or not, so
    after a null step the momentum term is 0.
  - Null step on f (Appendix A), not on the heavy-ball potential, accepting
    by default a decrease of f where f resolves it and a decrease of the
    gradients' estimate 0.5 <g + g+, x+ - x> where f's difference is below
    its rounding (:func:`hdm_optax.pieces.acceptance.resolved_decrease`: in
    float32 a comparison of values near a minimizer is decided by rounding;
    in float64 the paper's runs are unchanged;
    ``acceptance=hdm_optax.pieces.acceptance.strict_decrease()`` is the
    printed rule).
  - The trial step acts on the incoming ``updates`` u (grad f(x) when
    ``hdm_best`` is first or alone in a chain; ``docs/pitfalls.md``). A
    non-finite trial value or gradient is a null step that leaves P, beta and
    the accumulators untouched; the next trial step is then halved (x^+ = x +
    s(-P u + beta d), s <- s/2) until a trial is finite. That trial is the one
    of (sP, s beta): its hypergradients are taken there, P and beta continue
    from sP and s beta, and eta_p0's decay factor is multiplied by s (s back
    to 1), so the too-long trial does not return after every finite one (a
    safeguard, not in the paper; :func:`hdm_optax.pieces.step_control.kept_scale`).
  - Without ``lipschitz``, the first update is a probe (``probe``:
    :func:`hdm_optax.pieces.curvature.gradient_probe`): it evaluates f at
    x - delta g/||g||, delta = 1e-4 max(1, ||x||), takes L = ||grad f(probe)
    - g|| / delta (1 if that is 0 or not finite), and leaves x, P and beta
    unchanged (one extra oracle call per run). With P_1 = 0 and x^0 = x^1 the
    first iteration would otherwise evaluate f at x^1 itself.

  Each update costs one value-and-gradient call. A configuration of
  :func:`hdm_optax.pieces.momentum.momentum_direction` (the additive AdaGrad
  learner, the L-relative bound, null steps that keep P).

  Args:
    lipschitz: L, a smoothness estimate (``None``: measured by ``probe``).
    precond_lr: eta_p (``None``: ``DEFAULT_PRECOND_LR_TIMES_L`` / L).
    momentum_lr: eta_b (``None``: ``DEFAULT_MOMENTUM_LR``).
    init_precond: P_1 = init_precond * I.
    init_momentum: beta_1.
    momentum_bounds: the interval (lo, hi) of beta, within [-1, 1).
    precond_max_times_lipschitz: the L-relative bound of P:
      P <= precond_max_times_lipschitz / L (L_hat once it exists; ``None``: no
      bound).
    acceptance: the null-step rule (``None``:
      :func:`~hdm_optax.pieces.acceptance.resolved_decrease`).
    denominator: the feedback's denominator (``None``:
      :func:`~hdm_optax.pieces.hypergradient.curvature_tau`).
    schedule: the decay of eta_p until L_hat exists (``None``:
      :func:`~hdm_optax.pieces.decay.step_decay`).
    curvature_estimate: the L_hat estimator (``None``:
      :func:`~hdm_optax.pieces.curvature.running_mean`).
    probe: how L is measured when ``lipschitz`` is not given (``None``:
      :func:`~hdm_optax.pieces.curvature.gradient_probe`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``value``,
    ``grad`` and ``value_fn`` and returns ``x^{k+1} - x^k``.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> from hdm_optax.pieces import curvature, hypergradient
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0, 100.0]) * x ** 2)
    >>> opt = hdm_optax.hdm_best(lipschitz=200.0)
    >>> bool(hdm_optax.solve(opt, fun, jnp.ones(3), max_steps=500, tol=1e-4).converged)
    True
    >>> opt = hdm_optax.hdm_best(  # a budget of 300 steps, a fixed tau
    ...   curvature_estimate=curvature.running_mean(horizon=300),
    ...   denominator=hypergradient.fixed_tau(1.0))
    >>> bool(hdm_optax.solve(opt, fun, jnp.ones(3), max_steps=300, tol=1e-4).converged)
    True

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025:
    Algorithm 4, Appendix A and Section 5.1.
  """
  momentum_lo, momentum_hi = _momentum_bounds(momentum_bounds)
  for name, val in (
    ("lipschitz", lipschitz),
    ("precond_lr", precond_lr),
    ("momentum_lr", momentum_lr),
    ("precond_max_times_lipschitz", precond_max_times_lipschitz),
  ):
    if val is not None:
      _checks.check_positive(name, val)
  _checks.check_nonnegative("init_precond", init_precond)
  _checks.check_init_momentum(init_momentum, momentum_lo, momentum_hi)
  if lipschitz is not None and probe is not None:
    raise TypeError(
      "hdm_best: probe= measures L when lipschitz= is not given; pass one of them, not both."
    )
  if lipschitz is None and probe is None:
    probe = curvature_lib.gradient_probe()

  momentum_lr = DEFAULT_MOMENTUM_LR if momentum_lr is None else momentum_lr
  direction = momentum_lib.momentum_direction(
    learner=momentum_lib.additive(learners_lib.adagrad(_ADAGRAD_EPS)),
    precond_rule=functools.partial(_precond_rule, precond_lr, precond_max_times_lipschitz),
    momentum_lr=lambda lip: _numerics.cast(momentum_lr, lip.dtype),
    denominator=hypergradient_lib.curvature_tau() if denominator is None else denominator,
    curvature_estimate=(
      curvature_lib.running_mean() if curvature_estimate is None else curvature_estimate
    ),
    schedule=decay_lib.step_decay() if schedule is None else schedule,
    probe=probe,
    lipschitz=lipschitz,
    init_precond=init_precond,
    init_momentum=init_momentum,
    momentum_bounds=(momentum_lo, momentum_hi),
    adagrad_eps=_ADAGRAD_EPS,
  )
  return shell.iteration(
    "hdm_best",
    direction,
    step_rule=step_control_lib.damping(
      acceptance_lib.resolved_decrease() if acceptance is None else acceptance
    ),
    float16=False,
  )


def _precond_rule(precond_lr, precond_max_times_lipschitz, lip, curvature, factor):
  """eta_p0 times the decay's factor until L_hat exists, then 1/L; P in [0, p_max/L].

  ``lip`` is the L the direction resolved: the caller's (or L_0), L_hat once formed.
  """
  has_l_hat = curvature.l_hat > 0
  if precond_lr is None:
    base = DEFAULT_PRECOND_LR_TIMES_L / lip
  else:
    base = _numerics.cast(precond_lr, lip.dtype)
  eta_p = jnp.where(has_l_hat, _numerics.safe_div(1, lip), base * factor)
  if precond_max_times_lipschitz is None:
    return eta_p, 0.0, None
  return eta_p, 0.0, _numerics.cast(precond_max_times_lipschitz, lip.dtype) / lip


def _momentum_bounds(bounds):
  """``(lo, hi)`` of beta, checked."""
  if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2):
    raise ValueError(
      f"momentum_bounds must be a pair (lo, hi), got {bounds!r}; pass e.g. (0.0, 0.9995)."
    )
  _checks.check_momentum_bounds(*bounds, names=("momentum_bounds[0]", "momentum_bounds[1]"))
  return tuple(bounds)
