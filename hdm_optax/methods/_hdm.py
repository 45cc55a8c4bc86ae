"""Vanilla HDM (Algorithm 1) as an optax transformation."""

from __future__ import annotations

from typing import Any, Optional, Union

import optax

from hdm_optax import _checks
from hdm_optax.driver import programs
from hdm_optax.pieces import acceptance as acceptance_lib
from hdm_optax.pieces import candidates as candidates_lib
from hdm_optax.pieces import directions as directions_lib
from hdm_optax.pieces import learners as learners_lib
from hdm_optax.pieces import shell
from hdm_optax.pieces import step_control as step_control_lib


@programs.configured
def hdm(
  *,
  candidate: Union[str, candidates_lib.CandidateSet] = "diagonal",
  learner: Union[str, learners_lib.OnlineLearner] = "adagrad",
  precond_lr: Any = 0.1,
  null_step: bool = True,
  init_precond: Any = 0.0,
  precond_min: Optional[Any] = None,
  precond_max: Optional[Any] = None,
  adagrad_eps: float = 1e-12,
  acceptance: Optional[acceptance_lib.AcceptanceRule] = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Hypergradient descent method (Algorithm 1 of Chu et al.).

  Each update takes a trial step with the learned stepsize P and feeds the
  hypergradient of

  .. math::
    h_x(P) = \frac{f(x - P \nabla f(x)) - f(x)}{\|\nabla f(x)\|^2}, \qquad
    \nabla h_x(P) = -\frac{\nabla f(x^+) \nabla f(x)^\top}{\|\nabla f(x)\|^2}

  to an online learner, then keeps the better of x and the trial point:

  .. math::
    x^{k+1} = \operatorname{argmin}_{x \in \{x^k, x^k - P_k \nabla f(x^k)\}} f(x),
    \qquad P_{k+1} = \Pi_{\mathcal P}[P_k - \eta_k \nabla h_{x^k}(P_k)].

  With ``null_step=False`` the iterate always moves: that is vanilla HDM,
  eqs. (1)-(2), which may blow up before it converges (Figure 1a). A trial
  point with a non-finite value or gradient is always rejected and leaves P
  and the learner untouched; the next trial step is then halved (s <- s/2,
  x^+ = x - s P g) until a trial is finite. That trial was the one of sP: its
  hypergradient is taken there and the learner continues from sP (s back
  to 1), so the too-long trial does not return after every finite one (a
  safeguard that is not in the paper; :func:`hdm_optax.pieces.step_control.kept_scale`).
  When ``grad f(x) = 0`` the hypergradient is 0.

  The null step accepts, by default, a decrease of f where f resolves it and
  a decrease of the gradients' estimate 0.5 <g + g+, x+ - x> where f's
  difference is below its rounding
  (:func:`hdm_optax.pieces.acceptance.resolved_decrease`; a departure that keeps
  float32 runs from stalling on rounding;
  ``acceptance=hdm_optax.pieces.acceptance.strict_decrease()`` is the printed rule).

  Each update costs one value-and-gradient call (at the trial point); f and
  grad f at the accepted point are kept in the state, so with
  ``optax.value_and_grad_from_state`` an iteration costs one oracle call.

  Args:
    candidate: ``"scalar"``, ``"diagonal"`` or ``"full"`` (an n x n matrix
      over the flattened params; for small n), see :mod:`hdm_optax.pieces.candidates`.
    learner: ``"ogd"`` (constant step), ``"ogd_sqrt"`` (step eta/sqrt(k)) or
      ``"adagrad"``, see :mod:`hdm_optax.pieces.learners`.
    precond_lr: eta, the online learner's step size.
    null_step: take the argmin of Algorithm 1, line 3 (``True``) or always
      move (``False``, vanilla HDM).
    init_precond: P_1 = init_precond * I.
    precond_min: lower bound of every entry of P (``None``: unbounded).
    precond_max: upper bound of every entry of P (``None``: unbounded).
    adagrad_eps: added to sqrt(U) in AdaGrad.
    acceptance: the rule of the null step (:mod:`hdm_optax.pieces.acceptance`;
      ``None``:
      :func:`~hdm_optax.pieces.acceptance.resolved_decrease`, a decrease of f where
      f resolves it, of the gradients' estimate where it does not; pass
      :func:`~hdm_optax.pieces.acceptance.strict_decrease` for the paper's rule).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs the
    keyword arguments ``value``, ``grad`` and ``value_fn`` and returns
    ``x^{k+1} - x^k``.

  Examples:
    >>> import jax.numpy as jnp, optax, hdm_optax
    >>> fun = lambda x: jnp.sum(jnp.array([1.0, 10.0]) * x ** 2)
    >>> opt = hdm_optax.hdm(precond_lr=0.05)
    >>> x = jnp.array([1.0, 1.0])
    >>> state = opt.init(x)
    >>> value_and_grad = optax.value_and_grad_from_state(fun)
    >>> for _ in range(50):
    ...   value, grad = value_and_grad(x, state=state)
    ...   updates, state = opt.update(grad, state, x, value=value, grad=grad,
    ...                               value_fn=fun)
    ...   x = optax.apply_updates(x, updates)
    >>> bool(fun(x) < 1e-6)
    True

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229, 2025:
    Algorithm 1 and Section 3.2.
  """
  cand = candidates_lib.get(candidate)
  learn = learners_lib.get(learner, eps=adagrad_eps)
  _checks.check_positive("precond_lr", precond_lr)
  _checks.check_positive("adagrad_eps", adagrad_eps)
  _checks.check_finite("init_precond", init_precond)
  _checks.check_bounds("precond_min", precond_min, "precond_max", precond_max)
  if acceptance is None:
    acceptance = acceptance_lib.resolved_decrease()

  direction = directions_lib.preconditioned(
    directions_lib.Learnable(cand, learn, precond_lr, init_precond, precond_min, precond_max)
  )
  return shell.iteration(
    "hdm",
    direction,
    step_rule=step_control_lib.damping(acceptance if null_step else acceptance_lib.always()),
    float16=False,
  )
