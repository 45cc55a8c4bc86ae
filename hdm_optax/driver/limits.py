"""The numbers that stop a run: :class:`Limits`, with its one set of defaults, checked once.

Every front door takes the limits as keywords (``tol=``, ``max_steps=``, ...: the fields of
:class:`Limits`) or as one ``limits=Limits(...)``; :func:`takes_limits` gives a front door
those keywords and checks them once, so no front door lists them.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

__all__ = (
  "DEFAULT_MAX_STEPS",
  "Limits",
  "check_count",
  "check_fun_args",
  "check_tolerance",
  "takes_limits",
)

# The paper's budget (Table 1: 1000 gradient calls) and the benchmark's.
DEFAULT_MAX_STEPS = 1000

# What Limits.checked makes of a count of None (no limit).
NEVER = np.iinfo(np.int32).max


class Limits(NamedTuple):
  """The stopping rule's numbers (:func:`hdm_optax.driver.engine.judge`); each may be traced.

  The defaults are every front door's. :meth:`checked` checks them (once, at the front door)
  and puts them in the form a program takes: counts as int32 (``None``: no limit), and
  ``min_value`` as a float (``None``: never).

  Attributes:
    tol: stop (``CONVERGED``, ``CONVERGED_IN_BOX``) once ``||grad f||_inf <= max(tol, rtol
      ||grad f(x0)||_inf)`` (the projected gradient's where the optimizer holds a box;
      >= 0, 0 runs to the other limits).
    rtol: the relative part of that threshold (>= 0).
    ftol: stop (``CONVERGED_FTOL``) once an accepted update decreased f by
      ``0 < f_k - f_{k+1} <= ftol max(|f_k|, |f_{k+1}|, 1)`` (SciPy L-BFGS-B's test; 0: never).
    max_steps: stop (``MAX_STEPS``) after this many updates (default 1000, the paper's
      budget; ``None``: no limit).
    max_grad_evals: stop (``MAX_STEPS``) before an update once this many gradient calls
      were made (``None``: no limit).
    max_null_steps: stop (``STALLED``) after this many rejected updates in a row (``None``:
      never; HDM's null steps still adapt the method).
    min_value: stop (``UNBOUNDED``) once ``f < min_value`` (the objective looks unbounded
      below; ``None``: never).
    ftol_on: whether the run may stop on ``ftol``, a static switch (derived from ``ftol``
      where ``None``: on unless ``ftol`` is a Python 0); it is part of a program's key, not
      one of its values, and each step forms the slope the ``ftol`` test needs only where
      it is on.
  """

  tol: Any = 1e-4
  rtol: Any = 0.0
  ftol: Any = 0.0
  max_steps: Any = DEFAULT_MAX_STEPS
  max_grad_evals: Any = None
  max_null_steps: Any = None
  min_value: Any = -1e20
  ftol_on: Optional[bool] = None

  @property
  def uses_ftol(self) -> bool:
    """The static switch: ``ftol_on``, or on unless ``ftol`` is a Python 0."""
    if self.ftol_on is not None:
      return self.ftol_on
    return type(self.ftol) not in (int, float) or self.ftol != 0  # a NumPy 0 is a value

  def checked(self) -> "Limits":
    """These limits, each checked (traced values pass), in a program's form.

    Raises:
      TypeError: a tolerance that is not a number.
      ValueError: a number out of its range; the message names it and the fix.
    """
    typed = self.typed
    return self._checked() if typed is None else _checked_plain(typed)

  @property
  def typed(self) -> Optional[tuple]:
    """Each field's type and value (1 and 1.0 differ as a program's arguments) where every
    field is an immutable number, else ``None``: a key for what depends on the values."""
    return tuple((type(v), v) for v in self) if all(isinstance(v, _PLAIN) for v in self) else None

  def _checked(self) -> "Limits":
    for name, meaning, fix in _TOLERANCES:
      check_tolerance(name, getattr(self, name), meaning, fix)
    return self._replace(
      max_steps=check_count("max_steps", self.max_steps, 0, "no limit"),
      max_grad_evals=check_count("max_grad_evals", self.max_grad_evals, 1, "no limit"),
      max_null_steps=check_count("max_null_steps", self.max_null_steps, 1, "never stall"),
      min_value=_min_value(self.min_value),
      ftol_on=self.uses_ftol,
    )


# Types whose values are checked once per value (:func:`_checked_plain`): immutable ones.
_PLAIN = (int, float, type(None), np.generic)


@functools.lru_cache(maxsize=64)
def _checked_plain(typed: tuple) -> Limits:
  """:meth:`Limits.checked` of the limits whose :attr:`Limits.typed` is ``typed``."""
  return Limits(*(value for _, value in typed))._checked()


# The numbers are the program's values; the switch is static (in the tree's structure).
jax.tree_util.register_pytree_node(
  Limits,
  lambda limits: (tuple(limits[:-1]), limits.uses_ftol),
  lambda ftol_on, values: Limits(*values, ftol_on=ftol_on),
)

_FIELDS = Limits._fields[:-1]
_TOLERANCES = (
  ("tol", "the run stops once ||grad f||_inf <= tol", "pass e.g. tol=1e-6, or tol=0.0"),
  (
    "rtol",
    "the run stops once ||grad f||_inf <= rtol ||grad f(x0)||_inf",
    "pass e.g. rtol=1e-6, or rtol=0.0 for tol alone",
  ),
  ("ftol", "SciPy's relative decrease of f", "pass e.g. ftol=1e-9, or ftol=0.0 (off)"),
)


def _concrete(value) -> bool:
  if isinstance(value, (int, float, np.ndarray, np.generic)):
    return True
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
    return np.int32(NEVER)
  if not _concrete(value):
    return value
  v = np.asarray(value)
  number = v.ndim == 0 and v.dtype.kind in "iuf" and not isinstance(value, (bool, np.bool_))
  if not number or not v >= lower or (v.dtype.kind == "f" and v != math.inf and v != int(v)):
    raise ValueError(f"{name} must be an int >= {lower} or None ({fix}), got {value!r}")
  return np.int32(min(float(v), NEVER))


def _min_value(value) -> Any:
  if value is None:
    return -math.inf
  if not _concrete(value) or isinstance(value, jax.Array):
    return value
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
    raise ValueError(f"min_value must be a number or None, got {value!r}")
  return float(value)


def takes_limits(door: Callable[..., Any]) -> Callable[..., Any]:
  """``door(..., limits, ...)`` taking the limits as keywords too, checked once.

  The returned front door takes ``limits=`` (a :class:`Limits`, default ``Limits()``) and
  each field of :class:`Limits` as a keyword (``tol=1e-6``), which replaces that field;
  ``door`` receives ``limits`` checked (:meth:`Limits.checked`). Its signature lists the
  keywords with their defaults. Every front door that takes ``fun_args`` passes here, so
  ``fun_args`` is checked here too (:func:`check_fun_args`).
  """
  signature = inspect.signature(door)
  keyword = inspect.Parameter.KEYWORD_ONLY
  fields = [
    inspect.Parameter(name, keyword, default=Limits._field_defaults[name], annotation=Any)
    for name in _FIELDS
  ]
  parameters = []
  for parameter in signature.parameters.values():
    if parameter.name == "limits":
      parameters += [parameter.replace(default=None, annotation=Optional[Limits]), *fields]
    else:
      parameters.append(parameter)

  @functools.wraps(door)
  def front_door(*args, limits: Optional[Limits] = None, **kwargs):
    given = {name: kwargs.pop(name) for name in _FIELDS if name in kwargs}
    if "ftol" in given:  # the switch follows the ftol given
      given["ftol_on"] = None
    limits = (Limits() if limits is None else limits)._replace(**given)
    if "fun_args" in kwargs:
      check_fun_args(door.__name__, kwargs["fun_args"])
    return door(*args, limits=limits.checked(), **kwargs)

  front_door.__signature__ = signature.replace(parameters=parameters)
  return front_door


def check_fun_args(door: str, fun_args) -> None:
  """Refuses ``fun_args`` given as one array or number instead of a tuple of arguments.

  ``fun(params, *fun_args)`` would unpack an array row by row (``fun`` then gets as many
  arguments as ``A`` has rows); unlike ``minimize``'s ``args`` (SciPy's rule), a front door
  does not guess that one array is meant as one argument.

  Raises:
    TypeError: naming what was given and the fix, ``fun_args=(A,)``.
  """
  if isinstance(fun_args, (jax.Array, np.ndarray, np.generic)):
    kind = "a NumPy array" if isinstance(fun_args, (np.ndarray, np.generic)) else "a jax.Array"
    shown = f"{kind} of shape {np.shape(fun_args)} and dtype {fun_args.dtype}"
  elif isinstance(fun_args, numbers.Number):
    shown = f"the number {fun_args!r}"
  else:
    return
  raise TypeError(
    f"{door}: fun_args must be a tuple of fun's extra arguments, fun(params, *fun_args), "
    f"got {shown} (an array would be unpacked row by row); for one array argument A pass "
    "fun_args=(A,)."
  )
