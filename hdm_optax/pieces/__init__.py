"""The parts of the one-call iteration, for building and configuring variants.

:mod:`~hdm_optax.pieces.shell` is the shell every one-call method runs
(:func:`~hdm_optax.pieces.shell.iteration`): a *direction* proposes the
trial and learns from it, an *acceptance* rule decides the null step, a *step
control* scales the next proposal. The other modules are the pieces that fill
the slots:

- directions: :mod:`~hdm_optax.pieces.directions` (HDM's, HDM-HB's, the
  secant pairs' L-BFGS operator) and :mod:`~hdm_optax.pieces.momentum`
  (Algorithm 4's, with HDM-Best, hdm_auto and OSGM-Best as configurations);
- what directions are made of: :mod:`~hdm_optax.pieces.candidates` (the
  shape of P), :mod:`~hdm_optax.pieces.learners` (online learners),
  :mod:`~hdm_optax.pieces.hypergradient` (feedback and its denominator),
  :mod:`~hdm_optax.pieces.curvature` (L_hat, L_0 probes),
  :mod:`~hdm_optax.pieces.decay` (eta_p's decay), :mod:`~hdm_optax.pieces.backtracking`
  (OSGM-Best's lookahead), :mod:`~hdm_optax.pieces.secant` (the pairs and the
  two-loop operator);
- :mod:`~hdm_optax.pieces.acceptance` and :mod:`~hdm_optax.pieces.step_control`;
- :mod:`~hdm_optax.pieces.box`: bounds (projection, free variables, the projected
  gradient).
"""

from hdm_optax.pieces import acceptance
from hdm_optax.pieces import backtracking
from hdm_optax.pieces import box
from hdm_optax.pieces import candidates
from hdm_optax.pieces import curvature
from hdm_optax.pieces import decay
from hdm_optax.pieces import directions
from hdm_optax.pieces import hypergradient
from hdm_optax.pieces import learners
from hdm_optax.pieces import momentum
from hdm_optax.pieces import secant
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
  "learners",
  "momentum",
  "secant",
  "shell",
  "step_control",
)
