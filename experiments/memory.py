"""Keeping a long run of many compilations under the kernel's limit of memory maps."""

from __future__ import annotations

from typing import Callable, Optional

import jax

MAX_MEMORY_MAPS = 30_000  # Linux allows 65530 per process (vm.max_map_count)


def memory_maps() -> Optional[int]:
  """The number of memory maps of this process (None where /proc is not available)."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return None


def release_compiled_programs(
  limit: int = MAX_MEMORY_MAPS, also: Optional[Callable[[], None]] = None
) -> bool:
  """Drops JAX's compiled programs once they hold more than ``limit`` memory maps.

  Every compiled XLA:CPU program keeps its code in memory maps (about 150 for a
  ``solve`` loop); JAX's caches keep every program, so a run that compiles
  hundreds (Table 1's datasets and grids, the benchmark's 66 CUTEst objectives
  times its solvers) reaches the kernel's limit: "LLVM compilation error: Cannot
  allocate memory", then a segmentation fault. Keeping them until then lets
  problems of one padded shape share them.

  Args:
    limit: the number of maps above which the caches are cleared.
    also: called before ``jax.clear_caches()`` to drop the caller's own references
      to compiled programs.

  Returns:
    Whether the caches were cleared.
  """
  maps = memory_maps()
  if maps is None or maps <= limit:
    return False
  if also is not None:
    also()
  jax.clear_caches()
  return True
