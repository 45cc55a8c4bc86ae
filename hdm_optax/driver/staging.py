"""Staging of a vmapped lockstep loop, so that finished points stop costing work.

:func:`hdm_optax.sweep` runs all grid points in lockstep. With ``compact=True``
the batch shrinks as points finish: once at most a quarter of the batch is
still active, the active points are gathered into a batch a quarter the size
(B, ceil(B/4), ..., down to 1, or to 16 for more than 64 points), each stage one
more compiled loop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


# Below this many points a stage costs about as much per step as a smaller one would (the
# step's fixed cost dominates), and every stage is one more loop to compile.
_SMALLEST = 16


def stage_sizes(size: int, compact: bool) -> tuple[int, ...]:
  """Batch sizes of the stages: ``(size,)``, or to compact ``(size, ceil(size/4), ...)``
  down to 1, or, for a batch of more than 64 points, down to 16."""
  smallest = 1 if size <= 4 * _SMALLEST else _SMALLEST
  sizes = [size]
  while compact and sizes[-1] > smallest:
    sizes.append(-(-sizes[-1] // 4))
  return tuple(sizes)


def run_in_stages(
  sizes: tuple[int, ...],
  fixed: Any,
  batch: Any,
  *,
  active: Callable[[Any, Any], jax.Array],
  advance: Callable[[Any, Any, jax.Array], Any],
  stop: Callable[[Any, Any], jax.Array],
) -> Any:
  """Advances the active points of ``batch`` until none is left or ``stop`` holds.

  Args:
    sizes: the stage sizes, from :func:`stage_sizes`; ``sizes[0]`` is the
      leading axis of every leaf of ``fixed`` and ``batch``.
    fixed: a pytree whose leaves have one row per point, read and never
      changed (each point's problem data): a stage gathers its points' rows
      and writes nothing back.
    batch: a pytree whose leaves have one row per point, the points' state.
    active: ``active(fixed, batch) -> bool[B]``, the points still running.
    advance: ``advance(fixed, batch, t) -> batch``, one lockstep iteration
      (the ``t``-th, counted from 1 over all stages); it must leave the
      inactive points as they are.
    stop: ``stop(fixed, batch) -> bool``, ends every point (e.g. one converged).

  Returns:
    ``batch`` after the last stage.
  """

  def run_stage(rows, part, t, later, stopped):
    """Runs ``part`` while more than ``later`` of its points are active."""

    def go(carry):
      part, _ = carry
      return (jnp.sum(active(rows, part)) > later) & ~stop(rows, part) & ~stopped

    def body(carry):
      part, t = carry
      return advance(rows, part, t + 1), t + 1

    return jax.lax.while_loop(go, body, (part, t))

  t = jnp.zeros([], jnp.int32)
  later_sizes = sizes[1:] + (0,)
  batch, t = run_stage(fixed, batch, t, later_sizes[0], jnp.asarray(False))
  for size, later in zip(sizes[1:], later_sizes[1:]):
    # Continue with the (at most ``size``) active points in a smaller batch;
    # ``stop`` is judged on the whole batch, where the point that met it is.
    stopped = stop(fixed, batch)
    ids = jnp.argsort(~active(fixed, batch), stable=True)[:size]
    take = lambda tree: jax.tree.map(lambda x: x[ids], tree)
    part, t = run_stage(take(fixed), take(batch), t, later, stopped)
    batch = jax.tree.map(lambda full, x: full.at[ids].set(x), batch, part)
  return batch
