"""hdm_optax: hypergradient descent methods and trial_lbfgs as optax transformations.

Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate Adaptation
with Hypergradient Descent* (arXiv:2502.11229, 2025): HDM, HDM-HB, HDM-AGD and
HDM-Best (Algorithms 1-4); the authors' OSGM-Best (arXiv:2509.11007, 2025);
``hdm_auto``, an HDM-Best that needs no argument; ``trial_lbfgs``, HDM's trial
point and null step with the L-BFGS operator of every trial's secant pair.

At the top: the methods (``trial_lbfgs`` first), the drivers (``solve``,
``solve_batch``, ``sweep``, ``loop``, ``minibatch_step``, ``value_and_grad_from_state``) and
their result types. The parts the methods are configured from are in
:mod:`hdm_optax.pieces`.
"""

from hdm_optax import pieces
from hdm_optax._info import HDMInfo
from hdm_optax._stale import values_at_params
from hdm_optax.compilation_cache import enable_compilation_cache
from hdm_optax.driver.adjoint import ImplicitAdjoint
from hdm_optax.driver.adjoint import ImplicitGradientWarning
from hdm_optax.driver.adjoint import UnrolledAdjoint
from hdm_optax.driver.cache import value_and_grad_from_state
from hdm_optax.driver.compiled import cache_size
from hdm_optax.driver.compiled import clear_caches
from hdm_optax.driver.compiled import set_cache_size
from hdm_optax.driver.engine import Loop
from hdm_optax.driver.engine import LoopState
from hdm_optax.driver.engine import loop
from hdm_optax.adapters.minibatch import MinibatchStats
from hdm_optax.adapters.minibatch import minibatch_step
from hdm_optax.adapters.scipy_api import MinimizeResult
from hdm_optax.adapters.scipy_api import minimize
from hdm_optax.driver.results import SolveResult
from hdm_optax.driver.results import Status
from hdm_optax.driver.results import SweepResult
from hdm_optax.driver.results import Trace
from hdm_optax.driver.batching import solve_batch
from hdm_optax.driver.batching import sweep
from hdm_optax.driver.solving import solve
from hdm_optax.methods import HDMAGDState
from hdm_optax.methods import hdm
from hdm_optax.methods import hdm_agd
from hdm_optax.methods import hdm_auto
from hdm_optax.methods import hdm_best
from hdm_optax.methods import hdm_hb
from hdm_optax.methods import osgm_best
from hdm_optax.methods import trial_lbfgs
from hdm_optax.pieces.shell import IterationState

__version__ = "0.1.0"

__all__ = (
  "HDMAGDState",
  "HDMInfo",
  "ImplicitAdjoint",
  "ImplicitGradientWarning",
  "IterationState",
  "Loop",
  "LoopState",
  "MinibatchStats",
  "MinimizeResult",
  "SolveResult",
  "Status",
  "SweepResult",
  "Trace",
  "UnrolledAdjoint",
  "cache_size",
  "clear_caches",
  "hdm",
  "hdm_agd",
  "hdm_auto",
  "hdm_best",
  "hdm_hb",
  "loop",
  "minibatch_step",
  "minimize",
  "osgm_best",
  "pieces",
  "set_cache_size",
  "solve",
  "solve_batch",
  "sweep",
  "enable_compilation_cache",
  "trial_lbfgs",
  "value_and_grad_from_state",
  "values_at_params",
)
