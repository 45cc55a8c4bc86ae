"""The numbers that stop a run, checked once at the front door: :class:`Limits`."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

__all__ = ("DEFAULT_MAX_STEPS", "Limits", "check_count", "check_limits", "check_tolerance")

# The paper's budget (Table 1: 1000 gradient calls) and the benchmark's.
DEFAULT_MAX_STEPS = 1000

_NEVER = np.iinfo(np.int32).max


class Limits(NamedTuple):
  """The stopping rule's numbers (every one may be a traced value).

  Attributes:
    tol: stop once ``||grad f||_inf <= max(tol, rtol ||grad f(x0)||_inf)`` (the projected
      gradient's where the optimizer holds a box).
    rtol: the relative part of that threshold.
    ftol: stop once an accepted update decreased f by
      ``0 < f_k - f_{k+1} <= ftol max(|f_k|, |f_{k+1}|, 1)`` (SciPy L-BFGS-B's test; 0: never).
    max_steps: stop after this many updates.
    max_grad_evals: stop before an update once this many gradient calls were made.
    max_null_steps: stop after this many consecutive rejected updates.
    min_value: stop once ``f < min_value``.
  """

  tol: Any = 1e-4
  rtol: Any = 0.0
  ftol: Any = 0.0
  max_steps: Any = _NEVER
  max_grad_evals: Any = _NEVER
  max_null_steps: Any = _NEVER
  min_value: Any = -math.inf


def _concrete(value) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value))


def check_tolerance(name: str, value: Any, meaning: str, fix: str) -> Any:
  """A tolerance: a scalar >= 0 (traced values pass); a clear error naming ``name`` otherwise."""
  if isinstance(value, (str, bytes, bool)) or value is None:
    raise TypeError(f"{name} must be a number >= 0 ({meaning}), got {value!r}; {fix}.")
  if _concrete(value):
    try:
      t = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
      raise TypeError(f"{name} must be a number >= 0 ({meaning}), got {value!r}; {fix}.") from None
    if t.ndim != 0 or not t >= 0:
      raise ValueError(f"{name} must be a scalar >= 0 ({meaning}), got {value!r}; {fix}.")
  return value


def check_count(name: str, value: Any, lower: int, fix: str) -> Any:
  """A count >= ``lower`` as an int32 scalar; ``None`` and ``inf`` mean no limit.

  Counts above the int32 range (``2**31``, ``np.inf``) mean no limit too: no run makes that
  many steps.
  """
  if value is None:
    return np.int32(_NEVER)
  if not _concrete(value):
    return value
  v = np.asarray(value)
  number = v.ndim == 0 and v.dtype.kind in "iuf" and not isinstance(value, (bool, np.bool_))
  if not number or not v >= lower or (v.dtype.kind == "f" and v != math.inf and v != int(v)):
    raise ValueError(f"{name} must be an int >= {lower} or None ({fix}), got {value!r}")
  return np.int32(min(float(v), _NEVER))


def _min_value(value) -> Any:
  if value is None:
    return -math.inf
  if not _concrete(value) or isinstance(value, jax.Array):
    return value
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
    raise ValueError(f"min_value must be a number or None, got {value!r}")
  return float(value)


def check_limits(
  *,
  tol: Any = 1e-4,
  rtol: Any = 0.0,
  ftol: Any = 0.0,
  max_steps: Optional[int] = None,
  max_grad_evals: Optional[int] = None,
  max_null_steps: Optional[int] = None,
  min_value: Optional[float] = None,
) -> Limits:
  """:class:`Limits` from a front door's arguments, each checked (traced values pass).

  Raises:
    TypeError: a tolerance that is not a number.
    ValueError: a number out of its range; the message names it and the fix.
  """
  check_tolerance(
    "tol", tol, "the run stops once ||grad f||_inf <= tol", "pass e.g. tol=1e-6, or tol=0.0"
  )
  check_tolerance(
    "rtol",
    rtol,
    "the run stops once ||grad f||_inf <= rtol ||grad f(x0)||_inf",
    "pass e.g. rtol=1e-6, or rtol=0.0 for tol alone",
  )
  check_tolerance(
    "ftol", ftol, "SciPy's relative decrease of f", "pass e.g. ftol=1e-9, or ftol=0.0 (off)"
  )
  return Limits(
    tol=tol,
    rtol=rtol,
    ftol=ftol,
    max_steps=check_count("max_steps", max_steps, 0, "no limit"),
    max_grad_evals=check_count("max_grad_evals", max_grad_evals, 1, "no limit"),
    max_null_steps=check_count("max_null_steps", max_null_steps, 1, "never stall"),
    min_value=_min_value(min_value),
  )
