"""hdm_optax: hypergradient descent methods as optax transformations.

Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
with Hypergradient Descent*: vanilla HDM (Algorithm 1), HDM-HB (Algorithm 2),
HDM-AGD (Algorithm 3) and HDM-Best (Algorithm 4), plus a compiled solver
(arXiv:2502.11229, 2025), in ``driver``. The variants are composed of the pieces in
``candidates``, ``learners``, ``trial``, ``hypergradient``, ``acceptance``,
``curvature``, ``schedules`` and ``lookahead``; HDM-Best, hdm_auto and
OSGM-Best (Part II, arXiv:2509.11007) are configurations of one iteration,
``core.momentum_hdm``.
"""

from hdm_optax.methods import acceptance
from hdm_optax.methods import box
from hdm_optax.methods import candidates
from hdm_optax.methods import core
from hdm_optax.methods import curvature
from hdm_optax import driver
from hdm_optax.methods import hypergradient
from hdm_optax.methods import learners
from hdm_optax.methods import lookahead
from hdm_optax.methods import schedules
from hdm_optax.methods import secant
from hdm_optax.methods import trial
from hdm_optax._common import HDMInfo
from hdm_optax.methods.core import MomentumHDMState
from hdm_optax.methods.candidates import CandidateSet
from hdm_optax.methods._hdm import HDMState
from hdm_optax.methods._hdm import hdm
from hdm_optax.methods._hdm_agd import HDMAGDState
from hdm_optax.methods._hdm_agd import hdm_agd
from hdm_optax.methods._hdm_auto import HDMAutoState
from hdm_optax.methods._hdm_auto import hdm_auto
from hdm_optax.methods._hdm_best import DEFAULT_MOMENTUM_LR
from hdm_optax.methods._hdm_best import DEFAULT_PRECOND_LR_TIMES_L
from hdm_optax.methods._hdm_best import HDMBestState
from hdm_optax.methods._hdm_best import hdm_best
from hdm_optax.methods._hdm_hb import HDMHBState
from hdm_optax.methods._hdm_hb import hdm_hb
from hdm_optax.methods._osgm_best import OSGMBestState
from hdm_optax.methods._osgm_best import osgm_best
from hdm_optax.methods._trial_lbfgs import TrialLBFGSState
from hdm_optax.methods._trial_lbfgs import trial_lbfgs
from hdm_optax.methods.learners import OnlineLearner
from hdm_optax.driver.loop import Loop
from hdm_optax.driver.loop import LoopState
from hdm_optax.driver.minibatch import MinibatchStats
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import Status
from hdm_optax.driver.results import SweepResult
from hdm_optax.driver.results import Trace
from hdm_optax.driver.loop import loop
from hdm_optax.driver.minibatch import minibatch_step
from hdm_optax.driver.minimize import minimize
from hdm_optax.driver.solve import solve
from hdm_optax.driver.results import status_message
from hdm_optax.driver.solve import sweep
from hdm_optax.driver.cache import value_and_grad_from_state

__version__ = "0.1.0"

__all__ = (
  "DEFAULT_MOMENTUM_LR",
  "DEFAULT_PRECOND_LR_TIMES_L",
  "CandidateSet",
  "HDMAGDState",
  "HDMAutoState",
  "HDMBestState",
  "HDMHBState",
  "HDMInfo",
  "HDMState",
  "Loop",
  "LoopState",
  "MinibatchStats",
  "MomentumHDMState",
  "OSGMBestState",
  "OnlineLearner",
  "SolveResult",
  "Status",
  "SweepResult",
  "Trace",
  "TrialLBFGSState",
  "acceptance",
  "box",
  "candidates",
  "core",
  "curvature",
  "driver",
  "hdm",
  "hdm_agd",
  "hdm_auto",
  "hdm_best",
  "hdm_hb",
  "hypergradient",
  "learners",
  "lookahead",
  "loop",
  "minibatch_step",
  "minimize",
  "osgm_best",
  "schedules",
  "secant",
  "solve",
  "status_message",
  "sweep",
  "trial",
  "trial_lbfgs",
  "value_and_grad_from_state",
)
