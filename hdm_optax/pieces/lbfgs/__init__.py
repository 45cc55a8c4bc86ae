"""The parts of :func:`hdm_optax.trial_lbfgs`, together.

- :mod:`~hdm_optax.pieces.lbfgs.memory`: the last m secant pairs and the L-BFGS operator they
  define (:func:`~hdm_optax.pieces.lbfgs.memory.inverse_hessian_product`, in the compact form
  or by :func:`~hdm_optax.pieces.lbfgs.memory.two_loop_recursion`), and the pairs' diagonal
  :math:`H_0`;
- :mod:`~hdm_optax.pieces.lbfgs.direction`: the direction :math:`-\\alpha H_m u` that keeps a
  pair from every trial the step rule trusts;
- :mod:`~hdm_optax.pieces.lbfgs.step_rule`: the step rule, which reads f, f+ and the two
  slopes along the step and returns whether the trial is accepted, the next alpha and
  whether its pair may be kept;
- :mod:`~hdm_optax.pieces.lbfgs.bounded`: the step in a box (the box itself is
  :mod:`hdm_optax.pieces.box`).

They fill the slots of :func:`hdm_optax.pieces.shell.iteration`.
"""

from hdm_optax.pieces.lbfgs import bounded
from hdm_optax.pieces.lbfgs import direction
from hdm_optax.pieces.lbfgs import memory
from hdm_optax.pieces.lbfgs import step_rule

__all__ = (
  "bounded",
  "direction",
  "memory",
  "step_rule",
)
