"""The driver: one engine that runs any optax transformation on an objective, and its doors.

The algorithm side (the methods and their pieces) and this side meet only in the optax
transformation protocol: ``init``, ``update`` with ``value``, ``grad`` and ``value_fn``,
what the driver reads of a state (its cache, verdict, box and preconditioner:
:mod:`~hdm_optax.driver.protocol`, with defaults for any optax transformation), and a
factory's configuration (:func:`~hdm_optax.driver.programs.configured`), on which the cache
policy keys a transformation.

- :mod:`~hdm_optax.driver.engine`: the one loop (``start``, ``step``, the stop rule
  :func:`~hdm_optax.driver.engine.judge`).
- :mod:`~hdm_optax.driver.runs`: that loop run to its end, with the trace and the hook,
  under a primitive (a ``while_loop``, blocks of steps, a ``scan`` for reverse mode, the
  staged batch that retires members).
- :mod:`~hdm_optax.driver.limits`: the numbers that stop a run.
- :mod:`~hdm_optax.driver.hooks`: the callback and the progress line, one host dispatcher.
- :mod:`~hdm_optax.driver.interrupts`: Ctrl-C during a compiled run (chunks of steps with a
  host check between them).
- :mod:`~hdm_optax.driver.resuming`: where a run starts (fresh, warm, resumed from a result).
- :mod:`~hdm_optax.driver.programs`: the one cache policy (what a program is keyed on, what
  enters it as arguments); :mod:`~hdm_optax.driver.compiled`: the bounded cache of compiled
  programs; :mod:`~hdm_optax.driver.store`: the method's programs on disk.
- :mod:`~hdm_optax.driver.separate` and :mod:`~hdm_optax.driver.oracle`: the separate path,
  the method's program compiled once per shapes and settings, the objective on its own.
- :mod:`~hdm_optax.driver.adjoint`: how ``jax.grad`` goes through a run; the adjoint picks
  the run's primitive.
- The front doors: :mod:`~hdm_optax.driver.solving` (:func:`solve`),
  :mod:`~hdm_optax.driver.batching` (:func:`solve_batch`, :func:`sweep`, with
  :mod:`~hdm_optax.driver.members` for the problems and the grid of a batch), and
  :func:`~hdm_optax.driver.engine.loop` for a loop of one's own.
- :mod:`~hdm_optax.driver.results`: :class:`Status`, :class:`Trace`, :class:`SolveResult`.

The adapters (``minimize``, ``minibatch_step``, the optimistix minimiser) are clients of
these front doors and live beside the driver: :mod:`hdm_optax.adapters`.
"""

from hdm_optax.driver import adjoint
from hdm_optax.driver import batching
from hdm_optax.driver import cache
from hdm_optax.driver import compiled
from hdm_optax.driver import engine
from hdm_optax.driver import hooks
from hdm_optax.driver import interrupts
from hdm_optax.driver import limits
from hdm_optax.driver import members
from hdm_optax.driver import oracle
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver import results
from hdm_optax.driver import resuming
from hdm_optax.driver import runs
from hdm_optax.driver import separate
from hdm_optax.driver import solving
from hdm_optax.driver import store

__all__ = (
  "adjoint",
  "batching",
  "cache",
  "compiled",
  "engine",
  "hooks",
  "interrupts",
  "limits",
  "members",
  "oracle",
  "programs",
  "protocol",
  "results",
  "resuming",
  "runs",
  "separate",
  "solving",
  "store",
)
