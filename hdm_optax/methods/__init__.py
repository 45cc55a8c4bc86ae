"""The methods: short configurations of the pieces (``hdm_optax.pieces``).

Every public name is importable as ``hdm_optax.<name>``; the modules are private.
"""

from hdm_optax.methods._hdm import hdm
from hdm_optax.methods._hdm_agd import HDMAGDState
from hdm_optax.methods._hdm_agd import hdm_agd
from hdm_optax.methods._hdm_auto import hdm_auto
from hdm_optax.methods._hdm_best import DEFAULT_MOMENTUM_LR
from hdm_optax.methods._hdm_best import DEFAULT_PRECOND_LR_TIMES_L
from hdm_optax.methods._hdm_best import hdm_best
from hdm_optax.methods._hdm_hb import hdm_hb
from hdm_optax.methods._osgm_best import osgm_best
from hdm_optax.methods._trial_lbfgs import trial_lbfgs

__all__ = (
  "DEFAULT_MOMENTUM_LR",
  "DEFAULT_PRECOND_LR_TIMES_L",
  "HDMAGDState",
  "hdm",
  "hdm_agd",
  "hdm_auto",
  "hdm_best",
  "hdm_hb",
  "osgm_best",
  "trial_lbfgs",
)
