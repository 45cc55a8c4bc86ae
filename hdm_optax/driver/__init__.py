"""The driver: runs any optax transformation on an objective.

The algorithm side (the HDM variants and their pieces) and this side meet only
in the optax transformation protocol: ``init``, ``update`` with ``value``,
``grad`` and ``value_fn``, and the cache contract of the state.

- :mod:`~hdm_optax.driver.results`: :class:`Status`, :class:`Trace`,
  :class:`SolveResult`, :class:`SweepResult`.
- :mod:`~hdm_optax.driver.cache`: the cache contract (where a state's cached f
  and grad f are, how many calls an ``update`` made).
- :mod:`~hdm_optax.driver.loops`: the public loop, :func:`loop` (``start``,
  ``step``, ``done``), and the stopping rule.
- :mod:`~hdm_optax.driver.compiled`: :func:`solve`, :func:`solve_batch` and :func:`sweep`, compiled
  runs of the loop (:mod:`~hdm_optax.driver.grid` lays out a sweep's points,
  problems and programs, :mod:`~hdm_optax.driver.staging` shrinks its batch;
  :mod:`~hdm_optax.driver.closure` passes the arrays an objective closes over
  to a compiled program as arguments).
- :mod:`~hdm_optax.driver.adjoint`: how ``jax.grad`` goes through a run: implicitly at
  the returned point (:class:`ImplicitAdjoint`) or through the iterations
  (:class:`UnrolledAdjoint`).
- :mod:`~hdm_optax.driver.scipy_api`: :func:`minimize`, SciPy's entry point (bounds as
  SciPy takes them) over :func:`solve`, one compiled program.
- :mod:`~hdm_optax.driver.minibatch`: :func:`minibatch_step`, one loop step
  per batch.
- :mod:`~hdm_optax.driver.optimistix`: the loop as an optimistix minimiser
  (optional, needs optimistix; not imported here).
"""

from hdm_optax.driver import adjoint
from hdm_optax.driver import cache
from hdm_optax.driver import closure
from hdm_optax.driver import compiled
from hdm_optax.driver import grid
from hdm_optax.driver import loops
from hdm_optax.driver import minibatch
from hdm_optax.driver import results
from hdm_optax.driver import scipy_api
from hdm_optax.driver import staging

__all__ = (
  "adjoint",
  "cache",
  "closure",
  "compiled",
  "grid",
  "loops",
  "minibatch",
  "results",
  "scipy_api",
  "staging",
)
