"""Staging of a vmapped lockstep loop, so that finished points stop costing work.

:func:`hdm_optax.sweep` runs all grid points in lockstep. With ``compact=True``
the batch shrinks as points finish: once at most a quarter of the batch is
still active, the active points are gathered into a batch a quarter the size
(B, ceil(B/4), ..., 1), each stage one more compiled loop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def stage_sizes(size: int, compact: bool) -> tuple[int, ...]:
  """Batch sizes of the stages: ``(size,)``, or ``(size, ceil(size/4), ..., 1)`` to compact."""
  sizes = [size]
  while compact and sizes[-1] > 1:
    sizes.append(-(-sizes[-1] // 4))
  return tuple(sizes)


def run_in_stages(
  sizes: tuple[int, ...],
  batch: Any,
  *,
  active: Callable[[Any], jax.Array],
  advance: Callable[[Any, jax.Array], Any],
  stop: Callable[[Any], jax.Array],
) -> Any:
  """Advances the active points of ``batch`` until none is left or ``stop`` holds.

  Args:
    sizes: the stage sizes, from :func:`stage_sizes`; ``sizes[0]`` is the
      leading axis of every leaf of ``batch``.
    batch: a pytree whose leaves have one row per point.
    active: ``active(batch) -> bool[B]``, the points still running.
    advance: ``advance(batch, t) -> batch``, one lockstep iteration (the
      ``t``-th, counted from 1 over all stages); it must leave the inactive
      points as they are.
    stop: ``stop(batch) -> bool``, ends every point (e.g. one converged).

  Returns:
    ``batch`` after the last stage.
  """

  def run_stage(part, t, later, stopped):
    """Runs ``part`` while more than ``later`` of its points are active."""

    def go(carry):
      part, _ = carry
      return (jnp.sum(active(part)) > later) & ~stop(part) & ~stopped

    def body(carry):
      part, t = carry
      return advance(part, t + 1), t + 1

    return jax.lax.while_loop(go, body, (part, t))

  t = jnp.zeros([], jnp.int32)
  later_sizes = sizes[1:] + (0,)
  batch, t = run_stage(batch, t, later_sizes[0], jnp.asarray(False))
  for size, later in zip(sizes[1:], later_sizes[1:]):
    # Continue with the (at most ``size``) active points in a smaller batch;
    # ``stop`` is judged on the whole batch, where the point that met it is.
    stopped = stop(batch)
    ids = jnp.argsort(~active(batch), stable=True)[:size]
    part, t = run_stage(jax.tree.map(lambda x: x[ids], batch), t, later, stopped)
    batch = jax.tree.map(lambda full, x: full.at[ids].set(x), batch, part)
  return batch
