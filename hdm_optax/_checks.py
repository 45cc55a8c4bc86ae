"""Construction-time checks of the methods' arguments: a clear error naming the argument, the
value and the fix (Python numbers and concrete arrays; traced values pass)."""

from __future__ import annotations

import math
from typing import Optional

import jax
import numpy as np


def _concrete(value) -> Optional[np.ndarray]:
  """``value`` as a float64 NumPy array, or ``None`` if it is traced or not numeric."""
  if value is None:
    return None
  try:
    arr = np.asarray(value)
  except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None
  if arr.dtype == object or not np.issubdtype(arr.dtype, np.number):
    return None
  if np.iscomplexobj(arr):
    return None
  return arr.astype(np.float64)


def _show(arr: np.ndarray) -> str:
  return repr(float(arr)) if arr.size == 1 else np.array2string(arr)


def _check_type(name: str, value):
  if isinstance(value, (str, bytes, bool, np.bool_)):
    raise TypeError(f"{name} must be a number or an array, got {value!r}; pass a number.")


def _require(name: str, value, ok, rule: str, fix: str):
  """Raises ``ValueError`` unless ``ok(arr)`` holds for the concrete ``value``."""
  _check_type(name, value)
  arr = _concrete(value)
  if arr is not None and not np.all(ok(arr)):
    raise ValueError(f"{name} must be {rule}, got {_show(arr)}; {fix}.")


def check_positive(name: str, value, fix: Optional[str] = None):
  _require(
    name, value, lambda a: (0 < a) & (a < math.inf), "finite and > 0", fix or "pass a number > 0"
  )


def check_nonnegative(name: str, value, fix: Optional[str] = None):
  _require(
    name, value, lambda a: (0 <= a) & (a < math.inf), "finite and >= 0", fix or "pass 0 or more"
  )


def check_finite(name: str, value, fix: Optional[str] = None):
  _require(name, value, np.isfinite, "finite", fix or "pass a finite number")


def check_interval(name: str, value, lo, hi, *, lo_open=False, hi_open=False):
  """``value`` in the interval (lo or [lo, hi] or hi) or ``)``."""
  above = (lambda a: a > lo) if lo_open else (lambda a: a >= lo)
  below = (lambda a: a < hi) if hi_open else (lambda a: a <= hi)
  text = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
  _require(name, value, lambda a: above(a) & below(a), f"in {text}", f"pass a value in {text}")


def check_bounds(lo_name: str, lo, hi_name: str, hi):
  for n, v in ((lo_name, lo), (hi_name, hi)):
    _require(n, v, lambda a: ~np.isnan(a), "a number or None", "pass a number or None")
  lo_arr, hi_arr = _concrete(lo), _concrete(hi)
  if lo_arr is not None and hi_arr is not None and np.any(lo_arr > hi_arr):
    raise ValueError(
      f"{lo_name} must be <= {hi_name}, got {_show(lo_arr)} > {_show(hi_arr)}; "
      f"pass {lo_name} <= {hi_name}."
    )


def check_at_least(name: str, value, lower):
  _require(name, value, lambda a: a >= lower, f">= {lower}", f"pass a value >= {lower}")


def check_momentum_bounds(lo, hi, names=("momentum_min", "momentum_max")):
  for name, val in zip(names, (lo, hi)):
    check_interval(name, val, -1, 1, hi_open=True)
  check_bounds(names[0], lo, names[1], hi)


def check_init_momentum(value, lo, hi):
  """The initial momentum lies in [lo, hi] (it used to be clipped silently)."""
  check_finite("init_momentum", value)
  arr, lo_arr, hi_arr = _concrete(value), _concrete(lo), _concrete(hi)
  if arr is None or lo_arr is None or hi_arr is None:
    return
  if np.any(arr < lo_arr) or np.any(arr > hi_arr):
    raise ValueError(
      f"init_momentum must lie in [momentum_min, momentum_max] = [{_show(lo_arr)}, "
      f"{_show(hi_arr)}], got {_show(arr)}; pass a value in that interval or widen the bounds."
    )


def lookup(kind: str, name, registry: dict, allowed=None):
  """``registry[name]``, or a ``ValueError`` listing the valid names."""
  allowed = tuple(registry) if allowed is None else allowed
  if name not in allowed:
    raise ValueError(f"unknown {kind} {name!r}; valid: " + ", ".join(repr(n) for n in allowed))
  return registry[name]
