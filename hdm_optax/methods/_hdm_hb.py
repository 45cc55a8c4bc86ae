"""HDM with heavy-ball momentum, HDM-HB (Algorithm 2) as an optax transformation."""

from __future__ import annotations

from typing import Any, Optional, Union

import optax

from hdm_optax import _checks
from hdm_optax.driver import programs
from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import candidates as candidates_lib
from hdm_optax.pieces import hypergradient as hypergradient_lib
from hdm_optax.pieces import directions as directions_lib
from hdm_optax.pieces import learners as learners_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces import step_control as step_control_lib


@programs.configured
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
  :func:`hdm_optax.pieces.step_control.kept_scale`). The null step accepts, by default, a
  strict decrease of psi or a tie at the dtype's resolution with a smaller
  gradient (:func:`hdm_optax.pieces.acceptance.tie_tolerant`, a departure;
  ``acceptance=hdm_optax.pieces.acceptance.strict_decrease()`` is the printed rule).
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
      (:mod:`hdm_optax.pieces.acceptance`; ``None``:
      :func:`~hdm_optax.pieces.acceptance.tie_tolerant`, a strict decrease or a tie at
      the dtype's resolution with a smaller gradient; pass
      :func:`~hdm_optax.pieces.acceptance.strict_decrease` for the paper's rule).

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
    _checks.check_positive(name, val)
  _checks.check_nonnegative("omega", omega)
  _checks.check_nonnegative("tau", tau)
  _checks.check_bounds("precond_min", precond_min, "precond_max", precond_max)
  _checks.check_momentum_bounds(momentum_min, momentum_max)
  _checks.check_init_momentum(init_momentum, momentum_min, momentum_max)
  _checks.check_finite("init_precond", init_precond)
  if acceptance is None:
    acceptance = acceptance_lib.tie_tolerant()

  direction = directions_lib.heavy_ball(
    directions_lib.Learnable(cand_p, learn, precond_lr, init_precond, precond_min, precond_max),
    directions_lib.Learnable(cand_b, learn, momentum_lr, init_momentum, momentum_min, momentum_max),
    omega=omega,
    denominator=hypergradient_lib.fixed_tau(tau),
  )
  return shell.iteration(
    "hdm_hb", direction, step_rule=step_control_lib.damping(acceptance), float16=False
  )
