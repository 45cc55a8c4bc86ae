"""``minimize``: the entry point a SciPy user recognises, with bounds, as one compiled program."""

from __future__ import annotations

import collections.abc
import functools
import inspect
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax import _numerics
from hdm_optax.adapters import objective as objective_lib
from hdm_optax.driver import programs
from hdm_optax.driver import protocol
from hdm_optax.driver import solving
from hdm_optax.driver.limits import check_tolerance
from hdm_optax.driver.results import SolveResult
from hdm_optax.pieces import box as box_lib
from hdm_optax.pieces.lbfgs import memory as memory_lib
from hdm_optax.methods._trial_lbfgs import trial_lbfgs

__all__ = (
  "METHODS",
  "SCIPY_DEFAULTS",
  "IntermediateResult",
  "MinimizeResult",
  "bounds_to_box",
  "minimize",
)

# The methods ``minimize`` runs by name; each takes ``lower=``, ``upper=`` and ``memory_size``.
# SciPy's "L-BFGS-B" (any case) is read as trial_lbfgs: one call per iteration, no line search.
METHODS = {"trial_lbfgs": trial_lbfgs, "l-bfgs-b": trial_lbfgs}

# SciPy's L-BFGS-B defaults (scipy.optimize._lbfgsb_py._minimize_lbfgsb).
SCIPY_DEFAULTS = {
  "maxcor": 10,
  "ftol": 2.2204460492503131e-09,
  "gtol": 1e-5,
  "maxfun": 15000,
  "maxiter": 15000,
}
# L-BFGS-B's options this method has no counterpart of.
_REFUSED = {
  "maxls": "the method makes no line search (one oracle call per iteration)",
  "finite_diff_rel_step": "finite differences here take SciPy's absolute step eps only",
  "workers": "the program evaluates fun itself (no parallel finite differences)",
}


# SolveResult's fields, then SciPy's (one list: MinimizeResult extends SolveResult's).
_MinimizeFields = NamedTuple(
  "_MinimizeFields",
  [
    *((name, Any) for name in SolveResult._fields),
    *((name, Any) for name in ("x", "fun", "jac", "success", "nit", "nfev", "njev")),
  ],
)


class MinimizeResult(_MinimizeFields):
  """Result of :func:`hdm_optax.minimize`: :class:`SolveResult`'s fields, then SciPy's.

  The first fields are :class:`SolveResult`'s (``params``, ``state``, ``value``, ...,
  ``status`` a :class:`Status` code: 0 converged, 1 an iteration or call limit, as SciPy's
  L-BFGS-B's 0 and 1; :attr:`message` says what a code means). Then those of
  ``scipy.optimize.OptimizeResult`` for L-BFGS-B, host values (NumPy arrays, Python
  numbers) outside ``jit``/``vmap`` as SciPy returns them, arrays inside. As on SciPy's
  result (a dict), every attribute is a key: ``res["x"]`` reads one by name, ``"x" in res``
  asks for one, ``keys``, ``items``, ``get`` and ``dict(res)`` read them, and
  ``print(res)`` shows SciPy's fields. The keys are the fields, then :attr:`message` and
  :attr:`hess_inv`, both computed when read (``"hess_inv" in res`` and ``keys()`` compute
  neither); inside a trace ``message`` has no value and is not a key. Iterating (``for v in
  res``, ``*res``) gives the field values, as for any ``NamedTuple``: iterate ``keys()``
  for the names.

  Attributes:
    x: the solution (``params``).
    fun: f(x) (``value``).
    jac: grad f(x).
    success: whether the run converged (``converged``).
    nit: iterations (``num_steps``; each one oracle call, a null step included).
    nfev: evaluations of ``fun`` (``num_value_evals``; with forward differences
      ``n + 1`` per gradient, as SciPy counts them).
    njev: evaluations of the gradient (``num_grad_evals``).
  """

  message = SolveResult.message

  def __getitem__(self, key):
    if isinstance(key, str):
      if key not in self.keys():
        raise KeyError(key)
      return getattr(self, key)
    return tuple.__getitem__(self, key)

  def keys(self) -> tuple:
    """The names of the fields, then ``message`` and ``hess_inv``: every attribute of
    ``OptimizeResult`` for L-BFGS-B (``message`` only outside a trace, where it has a value)."""
    traced = isinstance(self.status, jax.core.Tracer)
    return self._fields + (("hess_inv",) if traced else ("message", "hess_inv"))

  def items(self) -> tuple:
    """``(name, value)`` of each key, as ``OptimizeResult.items()``."""
    return tuple((name, getattr(self, name)) for name in self.keys())

  def get(self, key, default=None):
    """The value of ``key``, else ``default``, as ``OptimizeResult.get``."""
    return getattr(self, key) if key in self.keys() else default

  def __contains__(self, key) -> bool:
    """``"x" in res``: whether ``key`` is a key, as for SciPy's result (a dict)."""
    return key in self.keys()

  def __repr__(self) -> str:
    """SciPy's fields a line each, arrays summarised as SciPy prints them, then the names of
    :class:`SolveResult`'s fields (``res.state`` and the others)."""
    width = max(map(len, _SCIPY_SHOWN))
    try:
      message = self.message
    except (TypeError, jax.errors.ConcretizationTypeError):  # status traced, in jit/vmap
      message = "(known outside jit)"
    shown = {"message": message, **{name: getattr(self, name) for name in _SCIPY_SHOWN[1:]}}
    with np.printoptions(threshold=6, edgeitems=3):
      lines = [f"{name:>{width}}: {_summary(value, width + 2)}" for name, value in shown.items()]
    lines.append(f"{'also':>{width}}: {', '.join(SolveResult._fields)}")
    return "\n".join(lines)

  @property
  def hess_inv(self):
    """SciPy's ``hess_inv`` for an x0 of one flat array, outside ``jit``:
    ``scipy.optimize.LbfgsInvHessProduct`` of the method's secant pairs, oldest first, as
    L-BFGS-B builds it from its own (the recursion from the identity; the method's own
    steps scale it by their ``gamma``). ``None`` for a pytree x0, a method without pairs,
    or inside a trace.
    """
    return _inverse_hessian(self.state, self.x)


# The fields :meth:`MinimizeResult.__repr__` shows, in SciPy's order.
_SCIPY_SHOWN = ("message", "success", "status", "fun", "x", "nit", "jac", "nfev", "njev")


def _summary(value, indent: int) -> str:
  """A field's value as SciPy's result prints it: a string as it is, an array as NumPy
  prints it (its lines after the first indented by ``indent``), anything else its repr."""
  if isinstance(value, str):
    return value
  concrete = not isinstance(value, jax.core.Tracer)
  if concrete and isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return np.array2string(np.asarray(value), separator=", ", prefix=" " * indent)
  return repr(value)


def _inverse_hessian(state, x):
  """``LbfgsInvHessProduct`` of the one :class:`SecantMemory` in ``state`` (``None`` where
  x is not one flat array, the state holds no single memory, or either is traced)."""
  is_memory = lambda node: isinstance(node, memory_lib.SecantMemory)
  memories = [node for node in jax.tree.leaves(state, is_leaf=is_memory) if is_memory(node)]
  if len(memories) != 1 or not _one_array(x) or np.ndim(x) != 1:
    return None
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((memories, x))):
    return None  # inside jit/vmap: the pairs are not known yet
  (memory,) = memories
  rho = np.asarray(memory.rho)
  slots = [(int(memory.head) + k) % rho.size for k in range(rho.size)]  # the oldest first
  kept = [slot for slot in slots if rho[slot] != 0]  # 0 marks an empty slot
  pairs = [
    np.concatenate([np.asarray(b).reshape(rho.size, -1) for b in jax.tree.leaves(side)], 1)
    for side in (memory.s, memory.y)
  ]
  from scipy.optimize import LbfgsInvHessProduct  # pylint: disable=import-outside-toplevel

  return LbfgsInvHessProduct(pairs[0][kept], pairs[1][kept])


def _is_number_or_none(value) -> bool:
  return value is None or (
    isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  )


def _one_array(x0) -> bool:
  return isinstance(x0, (jax.Array, np.ndarray))


def _one_value(value):
  """A side of a SciPy pair as SciPy reads it: a NumPy array of one entry is that entry."""
  return value.item() if isinstance(value, np.ndarray) and value.size == 1 else value


def _as_pair(entry, arrays: bool):
  """``entry`` as SciPy's ``(min, max)``: two numbers or ``None``; ``None`` if it is not one.

  A list or tuple of two, or (``arrays``) a NumPy array of two entries (a row of an
  ``(n, 2)`` array, or ``np.array([lo, hi])``)."""
  if arrays and isinstance(entry, np.ndarray) and entry.shape == (2,):
    entry = tuple(entry)
  if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
    return None
  pair = tuple(map(_one_value, entry))
  return pair if all(map(_is_number_or_none, pair)) else None


def _scipy_pairs(bounds, x0) -> Optional[list]:
  """``bounds`` as SciPy's n ``(min, max)`` pairs for a flat x0 of n entries, else ``None``.

  SciPy reads a sequence of pairs with ``zip(*bounds)``: a list or tuple of n pairs (lists,
  tuples or NumPy arrays of two entries), or an ``(n, 2)`` NumPy array, one row a pair. For
  n = 2 a list or tuple of two arrays is ``(lower, upper)``, the reading of a pair of arrays
  for any n; an ``(n, 2)`` array has no other reading, so its rows are pairs for n = 2 too.
  """
  if not (_one_array(x0) and np.ndim(x0) == 1):
    return None
  if isinstance(bounds, np.ndarray):
    if bounds.ndim != 2 or bounds.shape != (np.size(x0), 2):
      return None
    rows, arrays = list(bounds), True
  elif isinstance(bounds, (list, tuple)) and len(bounds) == np.size(x0):
    rows, arrays = bounds, len(bounds) != 2
  else:
    return None
  pairs = [_as_pair(row, arrays) for row in rows]
  return None if any(pair is None for pair in pairs) else pairs


def _is_pair_list(bounds, x0) -> bool:
  """SciPy's sequence of (min, max) pairs, one per entry of a flat x0."""
  return _scipy_pairs(bounds, x0) is not None


def _once(bounds):
  """An iterator (``zip(lo, hi)``, a generator), which SciPy accepts as a sequence of pairs,
  as a list: read once, then read again by the checks."""
  return list(bounds) if isinstance(bounds, collections.abc.Iterator) else bounds


def _pairs_to_box(pairs, dtype):
  side = lambda i, empty: np.array(
    [empty if pair[i] is None else pair[i] for pair in pairs], dtype=dtype
  )
  return side(0, -np.inf), side(1, np.inf)


def _bounds_sides(bounds, x0, dtype) -> tuple[Any, Any]:
  """``scipy.optimize.Bounds``'s ``lb`` and ``ub`` broadcast to x0's shape, as SciPy does
  (``Bounds(0, 1)`` holds them as arrays of one entry)."""
  sides = []
  for side in (bounds.lb, bounds.ub):
    try:
      sides.append(np.broadcast_to(np.asarray(side, np.float64), np.shape(x0)))
    except ValueError:
      raise ValueError(
        f"bounds (scipy.optimize.Bounds) of shape {np.shape(side)} for x0 of shape "
        f"{np.shape(x0)}: The number of bounds is not compatible with the length of `x0`. "
        "Give lb and ub one entry each, or one per entry of x0."
      ) from None
  return jnp.asarray(sides[0], dtype), jnp.asarray(sides[1], dtype)


def _check_sequence_sides(bounds, x0) -> None:
  """Refuse a list or tuple as a side of ``(lower, upper)`` for an x0 of one array.

  Such a side is a pytree of several leaves, never one like x0, so the box's check would
  refuse it with pytree structures. Users of ``least_squares`` write ``([0, 0, 0], [1, 1, 1])``
  and users of ``minimize`` one pair short of n (``[(0, 1), (0, 1)]`` for three entries);
  say which side, how many entries it has against x0's, and both ways to write it.
  """
  if not _one_array(x0):
    return
  for name, side in zip(("lower", "upper"), bounds):
    if isinstance(side, (list, tuple)):
      shown = repr(side) if len(repr(side)) <= 60 else repr(side)[:57] + "..."
      what = (
        "is a Python sequence, where an array like x0 is needed"
        if len(side) == np.size(x0)
        else f"has {len(side)} entries for x0's {np.size(x0)} (The number of bounds is not "
        "compatible with the length of `x0`.)"
      )
      raise ValueError(
        f"bounds was read as a pair (lower, upper), not as SciPy's (min, max) pairs (x0 has "
        f"{np.size(x0)} entries, bounds {len(bounds)}); its {name}, the "
        f"{type(side).__name__} {shown}, {what}. Pass SciPy's {np.size(x0)} (min, max) "
        "pairs, one per entry of x0, or lower and upper as arrays (np.asarray(...)) or "
        "scipy.optimize.Bounds(lower, upper)."
      )


def bounds_to_box(bounds, x0) -> tuple[Any, Any]:
  """``(lower, upper)`` of what ``minimize(bounds=...)`` accepts (``(None, None)`` for None).

  Accepted: ``None``; a pair ``(lower, upper)`` of numbers, ``None`` or pytrees shaped like
  x0; ``scipy.optimize.Bounds`` (its ``lb``, ``ub``, cast to x0's dtype); and, for a flat x0
  of n entries, SciPy's n ``(min, max)`` pairs with ``None`` for an open side: a list or
  tuple of n pairs (lists, tuples or NumPy arrays of two entries), an iterator of them
  (``zip(lo, hi)``, read once), or an ``(n, 2)`` NumPy array such as
  ``np.column_stack([lo, hi])``, one row a pair. A sequence of n pairs of numbers is read as
  SciPy's pairs (so for n = 2, ``[[0, 0], [1, 1]]`` means x_0 in [0, 0] and x_1 in [1, 1],
  as in SciPy); for n = 2 a sequence of two arrays is (lower, upper), as is a pair of
  arrays for any n; ``scipy.optimize.Bounds`` is (lower, upper) without ambiguity.

  Args:
    bounds: one of the forms above.
    x0: the start, as :func:`minimize` reads it.

  Returns:
    ``(lower, upper)``: numbers, ``None``, NumPy arrays of x0's dtype (SciPy's forms) or the
    pytrees given.

  Raises:
    TypeError: ``bounds`` of none of these forms (a sequence of another length, an array of
      another shape), with what it got.
    ValueError: a pair whose lower or upper is a list or tuple for an x0 of one array
      (``([0, 0, 0], [1, 1, 1])``, or two SciPy pairs for three entries), naming the side.
  """
  if bounds is None:
    return None, None
  bounds = _once(bounds)
  dtype = _numerics.params_dtype(x0)
  if hasattr(bounds, "lb") and hasattr(bounds, "ub"):  # scipy.optimize.Bounds
    return _bounds_sides(bounds, x0, dtype)
  pairs = _scipy_pairs(bounds, x0)
  if pairs is not None:
    return _pairs_to_box(pairs, dtype)
  if isinstance(bounds, (list, tuple)) and len(bounds) == 2:
    _check_sequence_sides(bounds, x0)
    return bounds[0], bounds[1]
  if isinstance(bounds, (np.ndarray, jax.Array)):
    flat = _one_array(x0) and np.ndim(x0) == 1
    need = f"shape ({np.size(x0)}, 2)" if flat else "x0 as one flat array"
    got = (
      f"ndarray of shape {np.shape(bounds)} (SciPy's (min, max) rows need {need}; for arrays "
      "lower and upper pass the tuple (lower, upper))"
    )
  else:
    length = f" of length {len(bounds)}" if hasattr(bounds, "__len__") else ""
    got = (
      f"{type(bounds).__name__}{length} (not a pair, and not "
      f"{np.size(x0) if _one_array(x0) else 'SciPy'} (min, max) pairs"
      f"{'' if _one_array(x0) else ', which need x0 as one flat array'})"
    )
  raise TypeError(
    f"bounds must be None, a pair (lower, upper), scipy.optimize.Bounds, or for a flat x0 of "
    f"{np.size(x0)} entries a sequence of {np.size(x0)} (min, max) pairs or an "
    f"({np.size(x0)}, 2) array; got {got}. Pass e.g. bounds=(0.0, None) for x >= 0."
  )


def _strong(x0, lower, upper, *tols):
  """x0 and the box's numbers as arrays of x0's dtype that are not weakly typed, and the
  tolerances ``tols`` as NumPy scalars of that dtype (immutable: checked once per value).

  ``jnp.full(3, 2.0)`` or a Python float is weakly typed, another abstract value than
  ``jnp.zeros(3)`` for ``jit``: without this a second call would compile again (weakly
  typed arrays in ``args`` keep their dtype and lose the weak type). An array of another
  dtype is left for the box's check to refuse.
  """
  dtype = jax.dtypes.canonicalize_dtype(_numerics.params_dtype(x0))

  def strong(b):
    if isinstance(b, (int, float)):  # a number: no transfer needed to make it an array
      return np.asarray(b, dtype)
    return jnp.asarray(b, dtype) if getattr(b, "weak_type", False) else b

  cast = lambda tree: jax.tree.map(strong, tree)
  scalar = lambda t: dtype.type(t) if isinstance(t, (int, float)) else cast(t)  # immutable
  if isinstance(x0, np.ndarray) and lower is None and upper is None:  # no tree to walk
    return (x0, None, None, *map(scalar, tols))
  return (cast(x0), cast(lower), cast(upper), *map(scalar, tols))


def _method(method) -> str:
  if method is None:
    return "trial_lbfgs"
  if not isinstance(method, str) or method.lower() not in METHODS:
    raise ValueError(
      f"unknown method {method!r}: minimize runs {sorted(METHODS)} ('L-BFGS-B' in any case "
      "is trial_lbfgs); for SciPy's other methods call scipy.optimize.minimize."
    )
  return method.lower()


def _unused(hess, hessp, constraints) -> None:
  """SciPy's warnings for what L-BFGS-B does not use (it warns and goes on)."""
  for name, given, what in (("hess", hess, "Hessian"), ("hessp", hessp, "Hessian-vector product")):
    if given is not None:
      warnings.warn(
        f"Method L-BFGS-B does not use {what} information ({name}); it is ignored, as "
        "scipy.optimize.minimize ignores it.",
        RuntimeWarning,
        stacklevel=3,
      )
  if constraints is not None and not (isinstance(constraints, (list, tuple)) and not constraints):
    warnings.warn(
      "Method L-BFGS-B cannot handle constraints; they are ignored, as scipy.optimize.minimize "
      "ignores them (use scipy.optimize.minimize with method='SLSQP' or 'trust-constr').",
      RuntimeWarning,
      stacklevel=3,
    )


def _int_option(name, value, lower=1) -> int:
  """A count as SciPy's L-BFGS-B compares it: ``n >= value``, so 100.1 allows 101."""
  ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
  if not ok or not value >= lower:
    raise ValueError(f"options {name} must be a number >= {lower}, got {value!r}.")
  return int(min(math.ceil(value) if math.isfinite(value) else math.inf, np.iinfo(np.int32).max))


def _options(options, tol, max_steps) -> dict:
  """SciPy's L-BFGS-B options, checked, with ``tol`` as SciPy maps it (ftol and gtol)."""
  if options is None and tol is None and max_steps is None:
    return dict(_defaults())
  options = dict(options or {})
  unknown = set(options) - set(SCIPY_DEFAULTS) - set(_REFUSED) - {"eps", "disp", "iprint"}
  if unknown:
    hint = ""
    if "return_all" in unknown:  # other SciPy methods' option: the iterates in a list
      hint = " For every iterate (return_all), collect them with callback=lambda xk: ...;"
    raise ValueError(
      f"unknown options {sorted(unknown)}; L-BFGS-B's are {sorted(SCIPY_DEFAULTS)}, eps, "
      f"disp and iprint.{hint} Drop the others (SciPy's L-BFGS-B would warn and ignore "
      "them; here they are refused, so that a misspelt option is not lost)."
    )
  for name, why in _REFUSED.items():
    if options.get(name) is not None and not (name == "workers" and options[name] == 1):
      raise ValueError(f"options {name}: not offered, {why}. Drop {name}.")
  for name in ("disp", "iprint"):
    if options.pop(name, None) is not None:
      warnings.warn(
        f"options {name} has no function (SciPy deprecated it in 1.15 and its L-BFGS-B prints "
        "nothing); pass progress=True for a live line, or callback=.",
        DeprecationWarning,
        stacklevel=3,
      )
  if tol is not None:  # SciPy: tol is the default of ftol and gtol for L-BFGS-B
    options.setdefault("ftol", tol)
    options.setdefault("gtol", tol)
  if max_steps is not None:
    if "maxiter" in options:
      raise ValueError("pass options maxiter or max_steps, not both (they are one limit).")
    options["maxiter"] = max_steps
  merged = {**SCIPY_DEFAULTS, **options}
  for name in ("ftol", "gtol"):
    check_tolerance(name, merged[name], f"SciPy's {name}", f"pass e.g. {name}=1e-8")
  merged["maxiter"] = _int_option("maxiter", merged["maxiter"], 0)
  merged["maxfun"] = _int_option("maxfun", merged["maxfun"])
  merged["maxcor"] = _int_option("maxcor", merged["maxcor"])
  return merged


@functools.cache
def _defaults() -> dict:
  """:func:`_options` of no options: L-BFGS-B's defaults, checked once."""
  return _options({}, None, None)


_WARNED_32_BIT = []


def _float64(leaf) -> bool:
  if isinstance(leaf, float):
    return True
  dtype = getattr(leaf, "dtype", None)
  return isinstance(leaf, (np.ndarray, np.generic)) and dtype == np.float64


def _warn_32_bit(x0, args) -> None:
  """Once per process: float64 inputs (SciPy's precision) while JAX computes in 32 bits."""
  if _WARNED_32_BIT or jax.config.read("jax_enable_x64"):
    return
  leaves = jax.tree.leaves((x0, tuple(args)))
  if any(map(_float64, leaves)):
    _WARNED_32_BIT.append(True)
    warnings.warn(
      "minimize: x0 or args are float64 (SciPy's precision), but JAX is in 32-bit mode, so "
      "the run computes in float32 (about 7 digits, and more iterations than SciPy near the "
      "solution). For SciPy's precision, call jax.config.update('jax_enable_x64', True) at "
      "the start of the script (docs/scipy.md).",
      UserWarning,
      stacklevel=3,
    )


def _start_point(x0):
  """x0 as SciPy reads it: numbers, lists and NumPy arrays become one float NumPy array (1-d at
  least, a copy in the dtype JAX computes in).

  A JAX array or a pytree of arrays (a tuple of arrays, a dict, a model) is kept as it is.
  """
  if isinstance(x0, jax.Array):
    return x0
  number = lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
  if isinstance(x0, np.ndarray) or (
    isinstance(x0, (list, tuple, int, float, np.number)) and all(map(number, jax.tree.leaves(x0)))
  ):
    x0 = np.atleast_1d(np.asarray(x0))
    if x0.dtype.kind in "iub":
      x0 = x0.astype(float)
    return np.array(x0, jax.dtypes.canonicalize_dtype(x0.dtype))  # a copy, as JAX's dtype
  return x0


class _SciPyCallback:
  """SciPy's ``callback`` on :func:`hdm_optax.solve`'s snapshot.

  ``callback(intermediate_result)`` (a parameter of that name only, as SciPy tells them
  apart) gets an :class:`IntermediateResult` with ``x`` and ``fun``; another signature gets
  ``callback(x)``, a copy. Its return value is ignored, ``StopIteration`` stops the run
  (SciPy's contract).
  """

  def __init__(self, callback):
    if not callable(callback):
      raise TypeError(f"callback must be callable or None, got {callback!r}.")
    self.callback = callback
    params = inspect.signature(callback).parameters
    self.new_style = set(params) == {"intermediate_result"}

  def __eq__(self, other):
    return isinstance(other, _SciPyCallback) and other.callback == self.callback

  def __hash__(self):
    return hash(self.callback)

  def __call__(self, snapshot) -> bool:
    if self.new_style:
      self.callback(
        intermediate_result=IntermediateResult(
          x=snapshot.params,
          fun=_host_scalar(snapshot.value),
          nit=_host_scalar(snapshot.num_steps),
          nfev=_host_scalar(snapshot.num_value_evals),
          njev=_host_scalar(snapshot.num_grad_evals),
        )
      )
    else:
      self.callback(np.copy(snapshot.params))
    return False


def _host_scalar(value):
  """A run's 0-d value as a Python number (SciPy's ``fun`` is a float), a batch's as it is."""
  return value.item() if np.ndim(value) == 0 else value


class IntermediateResult(dict):
  """SciPy's ``OptimizeResult`` as a callback sees it: a dict read as attributes.

  Keys: ``x``, ``fun`` (SciPy's for L-BFGS-B), ``nit``, ``nfev``, ``njev``.
  """

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError:
      raise AttributeError(name) from None


def _check_nan(lower, upper) -> None:
  for name, side in (("lower", lower), ("upper", upper)):
    for leaf in jax.tree.leaves(side):
      concrete = not isinstance(leaf, jax.core.Tracer) and np.asarray(leaf).dtype.kind == "f"
      if concrete and np.any(np.isnan(np.asarray(leaf))):
        raise ValueError(
          f"bounds' {name} contains NaN; use -inf / +inf (or None) for an open side."
        )


def _check_box(bounds, x0, lower, upper) -> None:
  """The box's checks before the program is built; an error says how ``bounds`` was read."""
  _check_nan(lower, upper)
  try:
    box_lib.check_order(lower, upper, "bounds' lower", "bounds' upper")
  except ValueError as error:  # SciPy's sentence too, for code that matches it
    raise ValueError(f"{error} (An upper bound is less than the corresponding lower bound.)")
  if lower is None and upper is None:
    return
  read = (
    f"bounds was read as SciPy's {np.size(x0)} (min, max) pairs"
    if _is_pair_list(bounds, x0)
    else "bounds was read as a pair (lower, upper), each a number, None or a pytree like x0"
  )
  try:
    box_lib.make_box(x0, lower, upper)
  except (ValueError, TypeError) as error:
    raise type(error)(f"{read}: {error}") from None


def _scipy_fields(res: SolveResult, mode: str, x0, traced) -> MinimizeResult:
  """``res`` with SciPy's fields; host values outside a trace."""
  grad = protocol.cache_at_params(res.state).grad
  nfev = res.num_value_evals
  if mode == "differences":
    nfev = nfev * (sum(np.size(leaf) for leaf in jax.tree.leaves(x0)) + 1)
  fields = dict(
    x=res.params,
    fun=res.value,
    jac=grad,
    success=res.converged,
    nit=res.num_steps,
    nfev=nfev,
    njev=res.num_grad_evals,
  )
  if not traced:  # through NumPy: a JAX array's int() costs several times more
    host = {"success": bool, "nit": int, "nfev": int, "njev": int, "fun": float}
    arrays = lambda v: np.asarray(v) if isinstance(v, jax.Array) else jax.tree.map(np.asarray, v)
    fields = {k: host[k](np.asarray(v)) if k in host else arrays(v) for k, v in fields.items()}
    # SciPy's status is an int, and so is the code of what stopped the run
    res = res._replace(
      status=int(np.asarray(res.status)), stopped_by=int(np.asarray(res.stopped_by))
    )
  return MinimizeResult(*res, **fields)


def minimize(
  fun: Callable[..., Any],
  x0: Any,
  args: Any = (),
  method: Optional[str] = None,
  jac: Any = None,
  hess: Any = None,
  hessp: Any = None,
  bounds: Any = None,
  constraints: Any = (),
  tol: Optional[float] = None,
  callback: Optional[Callable[..., Any]] = None,
  options: Optional[dict] = None,
  *,
  max_steps: Optional[int] = None,
  progress: bool = False,
  adjoint: Any = None,
  has_aux: bool = False,
  rtol: Any = 0.0,
  init_state: Any = None,
  trace: Optional[int] = None,
) -> MinimizeResult:
  r"""Minimizes ``fun(x, *args)`` from ``x0``, within ``bounds``, as one compiled program.

  ``scipy.optimize.minimize(fun, x0, args, method="L-BFGS-B", jac, bounds=bounds, tol=tol,
  callback=callback, options=options)``'s counterpart, with SciPy's signature (positional
  arguments too): the run is :func:`hdm_optax.solve` of :func:`hdm_optax.trial_lbfgs`
  (one oracle call per iteration, no line search) with the box given to the
  transformation. ``method`` is ``"L-BFGS-B"`` (any case), ``"trial_lbfgs"`` or ``None``:
  the same method. An infeasible ``x0`` is projected onto the box first (SciPy does the
  same).

  The run stops, as L-BFGS-B's, once the projected gradient
  :math:`\|P(x - \nabla f(x)) - x\|_\infty \le` ``gtol`` (status ``CONVERGED_IN_BOX``;
  without bounds :math:`\|\nabla f(x)\|_\infty`, ``CONVERGED``), once an update that moved
  x decreased f by :math:`(f_k - f_{k+1}) / \max(|f_k|, |f_{k+1}|, 1) \le` ``ftol``
  (``CONVERGED_FTOL``; a null step, which keeps x, is not tested), after ``maxiter``
  iterations or ``maxfun`` calls (``MAX_STEPS``), or when a ``callback`` raises
  ``StopIteration`` (``STOPPED``). The defaults are L-BFGS-B's.

  ``fun`` and its gradient: with ``jac=None`` JAX differentiates ``fun``; ``jac=True``:
  ``fun`` returns ``(value, gradient)``; a callable ``jac(x, *args)`` returns the
  gradient. A ``fun`` JAX cannot trace (NumPy code) runs on the host through
  ``jax.pure_callback`` with NumPy arrays, as SciPy calls it, and with ``jac=None`` its
  gradient is SciPy's forward difference (step ``eps``): see
  :mod:`hdm_optax.adapters.objective`. ``fun`` is traced once with abstract values to tell
  the two apart (a counter in ``fun`` sees that call). An exception the NumPy ``fun`` (or
  ``jac``) raises reaches the caller as itself (chained from JAX's runtime error where the
  host call was JAX's); under a caller's ``jax.jit`` the program runs after ``minimize``
  has returned, and JAX's ``JaxRuntimeError`` (which quotes ``fun``'s traceback) is raised.

  Called outside ``jit``/``vmap`` it compiles once per (``fun``, ``jac``, ``method``,
  ``maxiter``, ``maxcor``, ``callback``, ``progress``) and the shapes and dtypes of
  ``x0``, ``args`` and the bounds: another start, data, box or tolerance reuses the
  program. Inside ``jax.vmap`` it traces inline, so per-problem boxes batch into one
  program: ``jax.vmap(lambda x0, lo, hi: minimize(fun, x0, bounds=(lo, hi)))``. float32
  and float64 both work (bounds given as numbers or SciPy objects take x0's dtype; arrays
  must have it).

  Args:
    fun: ``fun(x, *args) -> scalar`` (``-> (scalar, gradient)`` with ``jac=True``).
    x0: the start: a JAX array, any pytree of float arrays of one dtype, or (as SciPy)
      a number, list or NumPy array, read as one float array of at least one dimension.
    args: extra arguments of ``fun`` (and ``jac``), a tuple; anything else is one argument,
      as in SciPy (``args=a`` calls ``fun(x, a)``). Arrays and numbers enter the program as
      arguments, other values are static (hashable).
    method: ``None``, ``"L-BFGS-B"`` or ``"trial_lbfgs"`` (:data:`METHODS`).
    jac: ``None``, ``True``, a callable, or ``"2-point"`` (a host ``fun`` only).
    hess: not used by L-BFGS-B: must be ``None``.
    hessp: not used by L-BFGS-B: must be ``None``.
    bounds: ``None``; ``(lower, upper)``, each a number, ``None`` (open) or a pytree shaped
      like x0 (-inf / +inf or ``None`` for an open side); ``scipy.optimize.Bounds``; or, for
      a flat x0, SciPy's ``(min, max)`` pairs with ``None`` for an open side: a sequence or
      an iterator (``zip(lo, hi)``) of them, or an ``(n, 2)`` array of them
      (:func:`bounds_to_box`).
    constraints: L-BFGS-B takes none: must be empty.
    tol: SciPy's: the default of ``ftol`` and ``gtol``.
    callback: ``callback(intermediate_result)`` (``.x``, ``.fun``) or ``callback(xk)``,
      after every iteration, on the host; ``StopIteration`` stops the run. Under
      ``jax.vmap`` it is called once per iteration with the batch.
    options: L-BFGS-B's: ``maxiter`` (15000), ``maxfun`` (15000: each iteration is one
      call; with forward differences, ``fun``'s calls, ``n + 1`` a gradient), ``gtol``
      (1e-5), ``ftol`` (2.2e-9), ``maxcor`` (10, the memory), ``eps`` (the
      forward-difference step, 1e-8, host ``fun`` with ``jac=None`` only); ``disp`` and
      ``iprint`` have no function (as in SciPy, with a ``DeprecationWarning``); ``maxls``,
      ``finite_diff_rel_step`` and ``workers`` are refused (no line search, no relative or
      parallel finite differences).
    max_steps: ``maxiter`` under the name :func:`hdm_optax.solve` gives it.
    progress: a live line on stderr (:func:`hdm_optax.solve`'s ``progress``).
    adjoint: how ``jax.grad``/``jax.jvp`` see the result as a function of ``args``:
      :class:`hdm_optax.ImplicitAdjoint` (``None``, the default; with bounds on the free
      variables, the others have derivative 0; needs ``jac=None`` and a ``fun`` JAX
      differentiates twice) or :class:`hdm_optax.UnrolledAdjoint` (through the iterations
      of a ``maxiter`` run), as in :func:`hdm_optax.solve`.

  Returns:
    A :class:`hdm_optax.MinimizeResult`: :class:`hdm_optax.SolveResult`'s fields
    (``grad_norm`` is the projected gradient's with bounds), then SciPy's ``x``, ``fun``,
    ``jac``, ``success``, ``nit``, ``nfev``, ``njev``.

  Raises:
    ValueError: ``lower > upper`` somewhere, NaN in ``bounds``, a box of another structure
      or shape, an unknown ``method`` or option, a refused option, ``hess``, ``hessp`` or
      ``constraints``; TypeError: bounds of another dtype than x0's, or of a form not listed
      above. Each message names the argument and the fix.

  Examples:
    >>> import jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum((x - jnp.array([2.0, -1.0, 0.5])) ** 2)
    >>> res = hdm_optax.minimize(fun, [0.0, 0.0, 0.0], method="L-BFGS-B",
    ...                          bounds=[(0, 1), (0, None), (None, None)])
    >>> [round(float(v), 6) for v in res.x], res.success
    ([1.0, 0.0, 0.5], True)
  """
  method = _method(method)
  args = args if isinstance(args, tuple) else (args,)  # SciPy's rule
  _warn_32_bit(x0, args)
  _unused(hess, hessp, constraints)
  opts = _options(options, tol, max_steps)
  x0 = solving.check_params(_start_point(x0), "x0")
  bounds = _once(bounds)  # read once, here: bounds_to_box and _check_box read it again
  lower, upper = bounds_to_box(bounds, x0)
  _check_box(bounds, x0, lower, upper)
  x0, lower, upper, gtol, ftol = _strong(x0, lower, upper, opts["gtol"], opts["ftol"])
  eps, box = opts.get("eps"), (lower, upper)
  objective, args, mode = objective_lib.objective(fun, jac, x0, args, eps, has_aux, box)
  if mode == "differences":  # maxfun caps fun's calls, n + 1 a gradient (SciPy's nfev)
    size = sum(np.size(leaf) for leaf in jax.tree.leaves(x0))
    opts = {**opts, "maxfun": max(1, opts["maxfun"] // (size + 1))}
  if has_aux and mode != "jax":
    raise ValueError(
      f"has_aux=True with jac={jac!r} is not offered (fun then returns the gradient, or runs "
      "on the host): return the aux from a JAX fun with jac=None."
    )
  own = lambda a: jnp.asarray(a, a.dtype) if getattr(a, "weak_type", False) else a
  args = jax.tree.map(own, tuple(args))
  try:
    keywords = dict(has_aux=has_aux, init_state=init_state, callback=callback)
    keywords.update(progress=progress, adjoint=adjoint, trace=trace, rtol=rtol)
    with objective_lib.raised_in():  # fun's own exception, not JAX's runtime error
      res = _solve(method, objective, x0, args, opts, lower, upper, gtol, ftol, **keywords)
  except BaseException as error:  # a callback's error or Ctrl-C: the partial result, SciPy's
    if isinstance(getattr(error, "result", None), SolveResult):
      error.result = _scipy_fields(error.result, mode, x0, False)
    raise
  # Traced also where only the arrays fun closes over are (jax.grad of them, no jax.jit).
  return _scipy_fields(res, mode, x0, bool(programs.tracers(res)))


@functools.lru_cache(maxsize=16)
def _built(method: str, memory_size) -> Any:
  """``METHODS[method](memory_size)`` without a box, built once (a call of ``minimize``
  would otherwise build it each time)."""
  return METHODS[method](memory_size)


def _solve(method, objective, x0, args, opts, lower, upper, gtol, ftol, **keywords):
  """minimize's run: :func:`hdm_optax.solve` of the method with the box."""
  callback = keywords.pop("callback")
  unboxed = lower is None and upper is None
  method = (
    _built(method, opts["maxcor"])
    if unboxed
    else METHODS[method](opts["maxcor"], lower=lower, upper=upper)
  )
  return solving.solve(
    method,
    objective,
    x0,
    fun_args=args,
    max_steps=opts["maxiter"],
    tol=gtol,
    ftol=ftol,
    max_grad_evals=opts["maxfun"],
    min_value=None,
    callback=None if callback is None else _SciPyCallback(callback),
    **keywords,
  )
