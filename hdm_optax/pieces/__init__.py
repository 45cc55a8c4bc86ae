"""The parts of the one-call iteration, for building and configuring variants.

:mod:`~hdm_optax.pieces.shell` is the shell every one-call method runs
(:func:`~hdm_optax.pieces.shell.iteration`): a *direction* proposes the
trial and learns from it; a *step rule* sets the factor of each proposal and decides the
null step from what the trial showed. The other modules are the pieces that fill the slots:

- :mod:`~hdm_optax.pieces.lbfgs`: the parts of :func:`hdm_optax.trial_lbfgs` (the secant
  pairs and their operator, its direction, its step rule, its step in a box);
- the HDM directions: :mod:`~hdm_optax.pieces.directions` (HDM's, HDM-HB's) and
  :mod:`~hdm_optax.pieces.momentum` (Algorithm 4's, with HDM-Best, hdm_auto and OSGM-Best as
  configurations);
- what directions are made of: :mod:`~hdm_optax.pieces.candidates` (the
  shape of P), :mod:`~hdm_optax.pieces.learners` (online learners),
  :mod:`~hdm_optax.pieces.hypergradient` (feedback and its denominator),
  :mod:`~hdm_optax.pieces.curvature` (L_hat, L_0 probes),
  :mod:`~hdm_optax.pieces.decay` (eta_p's decay), :mod:`~hdm_optax.pieces.backtracking`
  (OSGM-Best's lookahead);
- :mod:`~hdm_optax.pieces.acceptance` (HDM's null-step tests) and
  :mod:`~hdm_optax.pieces.step_control` (HDM's step rule, the damping);
- :mod:`~hdm_optax.pieces.box`: bounds (projection, free variables, the projected
  gradient, how a driver finds the box).
"""

from hdm_optax.pieces import acceptance
from hdm_optax.pieces import backtracking
from hdm_optax.pieces import box
from hdm_optax.pieces import candidates
from hdm_optax.pieces import curvature
from hdm_optax.pieces import decay
from hdm_optax.pieces import directions
from hdm_optax.pieces import hypergradient
from hdm_optax.pieces import lbfgs
from hdm_optax.pieces import learners
from hdm_optax.pieces import momentum
from hdm_optax.pieces import shell
from hdm_optax.pieces import step_control

__all__ = (
  "acceptance",
  "backtracking",
  "box",
  "candidates",
  "curvature",
  "decay",
  "directions",
  "hypergradient",
  "lbfgs",
  "learners",
  "momentum",
  "shell",
  "step_control",
)
