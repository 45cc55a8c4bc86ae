"""The one timing helper of the measurement scripts.

Timings on a shared machine drift by 20-40% over seconds, so every script
takes the best of several runs after a warm-up (compilation excluded) and
times what it compares in interleaved rounds, exposing all of it to the same
drift.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax

__all__ = ["best_time", "best_times"]


def best_times(
  fns: dict[str, Callable[[], Any]], repeats: int = 5, warmup: bool = True
) -> tuple[dict[str, float], dict[str, Any]]:
  """Best wall time of each ``fn()`` of ``fns``, measured in ``repeats`` interleaved rounds.

  Every call is timed until its output is ready (``jax.block_until_ready``).

  Args:
    fns: name -> function of no argument.
    repeats: rounds; each calls every function once, in order.
    warmup: call each function once, untimed, first (compiles it).

  Returns:
    ``(seconds, outputs)``: name -> best time, name -> the function's last output.
  """
  outputs = {k: jax.block_until_ready(fn()) for k, fn in fns.items()} if warmup else {}
  best = dict.fromkeys(fns, math.inf)
  for _ in range(repeats):
    for k, fn in fns.items():
      start = time.perf_counter()
      outputs[k] = jax.block_until_ready(fn())
      best[k] = min(best[k], time.perf_counter() - start)
  return best, outputs


def best_time(fn: Callable[[], Any], repeats: int = 5, warmup: bool = True) -> float:
  """Best wall time of ``fn()`` over ``repeats`` runs (see :func:`best_times`)."""
  return best_times({"fn": fn}, repeats, warmup)[0]["fn"]
