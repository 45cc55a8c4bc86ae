"""SciPy's ``fun``, ``jac`` and ``args`` as a function :func:`hdm_optax.solve` differentiates.

:func:`objective` returns ``(f, args)`` with ``f(x, *args)`` a JAX function:

- ``jac=None`` and a ``fun`` JAX can trace: ``fun`` itself, differentiated by JAX.
- ``jac=True`` (``fun`` returns ``(value, gradient)``) or a callable ``jac``: the pair is
  traced at the call (:func:`hdm_optax.driver.programs.hoist`: what ``fun`` and ``jac`` read
  from outside their arguments becomes an argument), and ``f`` is a ``jax.custom_vjp``
  whose gradient is the user's, so one oracle call is one call of ``fun`` (and ``jac``).
- a ``fun`` JAX cannot trace (NumPy code): ``fun`` (and ``jac``) run on the host with NumPy
  arrays, as SciPy calls them (the separate path's oracle, or ``jax.pure_callback`` inside a
  caller's trace); with ``jac=None`` (a warning says so) or ``"2-point"`` the gradient is
  SciPy's forward difference with absolute step ``eps``, ``n + 1`` calls of ``fun`` per
  gradient.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import warnings
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from hdm_optax.driver import compiled
from hdm_optax.driver import oracle as oracle_lib
from hdm_optax.driver import programs

__all__ = ("objective", "raised_in")

# Raised when ``fun`` cannot be traced: it needs concrete values (NumPy code).
_UNTRACEABLE = (
  jax.errors.TracerArrayConversionError,
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerIntegerConversionError,
  jax.errors.TracerBoolConversionError,
)


def _scalar(value, dtype, xp=jnp, differentiated=False):
  """SciPy's scalar: a number or an array of one entry, as ``dtype`` (``xp``: the array
  module, ``np`` on the host). ``differentiated``: JAX differentiates the cast, so a value
  that is not floating (whose gradient would read zero) is refused."""
  if isinstance(value, (tuple, list)) and len(value) == 2:
    raise TypeError(
      f"fun returned a {type(value).__name__} of length 2, not a scalar: if it "
      "returns (value, gradient), pass jac=True; if it returns (value, aux) (a JAX fun), "
      "pass has_aux=True; else return the value alone."
    )
  if value is None:
    raise TypeError(
      "fun returned None, not a number: return its value (a number or an array of one "
      "entry); a function without a return statement returns None."
    )
  value = xp.asarray(value)
  if not (jnp.issubdtype(value.dtype, jnp.number) or jnp.issubdtype(value.dtype, jnp.bool_)):
    raise TypeError(
      f"fun returned a value of dtype {value.dtype}, not a number: return a float (a "
      "number or an array of one entry)."
    )
  if value.size != 1:
    raise ValueError(
      f"fun must return a scalar (or an array of one entry), got shape {value.shape}."
    )
  _refuse_complex(value, "fun returned")
  if differentiated and not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(
      f"fun's value has dtype {value.dtype}, which has no gradient (JAX's would read zero and "
      "the run stop at x0); return a real floating value: drop the cast to an integer or "
      "bool, or compute in x0's dtype."
    )
  return value.reshape(()).astype(dtype, copy=False)


def _refuse_complex(value, what: str) -> None:
  """Refuses a complex ``value``: casting it to x's real dtype would drop its imaginary
  part without a word, so a fun computed in complex arithmetic by mistake would be
  minimised on its real part only."""
  if jnp.issubdtype(value.dtype, jnp.complexfloating):
    shown = f", e.g. {value.reshape(-1)[0]}" if isinstance(value, np.ndarray) and value.size else ""
    raise TypeError(
      f"{what} a complex value (dtype {value.dtype}{shown}): minimize needs real "
      "numbers; return the real part (np.real) if the imaginary part is only rounding, "
      "else check the computation that made it complex."
    )


def _like(grad, x, xp=jnp):
  """The user's gradient as a pytree of x's leaves' shapes and dtype (``xp`` as for
  :func:`_scalar`)."""
  if isinstance(x, (jax.Array, np.ndarray)):  # one array (SciPy's x)
    return _like_leaf(grad, x, xp)
  leaves, treedef = jax.tree.flatten(x)
  out = [_like_leaf(g, leaf, xp) for g, leaf in zip(treedef.flatten_up_to(grad), leaves)]
  return jax.tree.unflatten(treedef, out)


def _like_leaf(g, leaf, xp):
  g = xp.asarray(g)
  _refuse_complex(g, "the gradient (jac's output, or fun's second output with jac=True) is")
  if g.size != leaf.size:
    raise ValueError(
      f"the gradient (jac's output, or fun's second output with jac=True) has shape "
      f"{g.shape} for x of shape {leaf.shape}: return one entry per entry of x."
    )
  return g.reshape(leaf.shape).astype(leaf.dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class _Scalar:
  """SciPy's ``fun`` with its value as a scalar of x's dtype (a number or one entry)."""

  fun: Callable[..., Any]
  has_aux: bool

  def __call__(self, x, *args):
    out, dtype = self.fun(x, *args), jax.tree.leaves(x)[0].dtype
    if self.has_aux:
      return _scalar(out[0], dtype, differentiated=True), out[1]
    return _scalar(out, dtype, differentiated=True)


def _pair_of(out):
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(f"with jac=True, fun must return (value, gradient), got {type(out).__name__}.")
  return out


@dataclasses.dataclass(frozen=True)
class _Pair:
  """``(f(x), grad f(x))`` from SciPy's ``fun`` and ``jac``, traced (a static key)."""

  fun: Callable[..., Any]
  jac: Any

  def __call__(self, x, *args):
    dtype = jax.tree.leaves(x)[0].dtype
    if self.jac is True:
      value, grad = _pair_of(self.fun(x, *args))
    else:
      value, grad = self.fun(x, *args), self.jac(x, *args)
    return _scalar(value, dtype), _like(grad, x)


# The exceptions the user's NumPy code raised inside a jax.pure_callback (the last few), in
# the order raised: JAX reports each as its own runtime error (JaxRuntimeError, INTERNAL),
# and a front door whose program ran within its call raises the user's (raised_in).
_HOST_ERRORS: collections.deque = collections.deque(maxlen=8)


@contextlib.contextmanager
def raised_in():
  """Re-raises, in place of JAX's runtime error, the exception ``fun`` or ``jac`` raised on
  the host during the block (its own type, chained ``from`` JAX's error).

  Only a program that runs within the block is seen: under a caller's ``jax.jit`` the
  program runs at the caller's call, and JAX's error (which quotes the user's traceback)
  reaches the caller as it is.

  Yields:
    Nothing.
  """
  mark = _HOST_ERRORS[-1] if _HOST_ERRORS else None
  try:
    yield
  except jax.errors.JaxRuntimeError as error:
    raised = _HOST_ERRORS[-1] if _HOST_ERRORS else None
    if raised is None or raised is mark or not isinstance(raised, Exception):
      raise
    _HOST_ERRORS.clear()
    raise raised.with_traceback(raised.__traceback__) from error


@dataclasses.dataclass(frozen=True)
class _HostPair:
  """``(f(x), grad f(x))`` on the host, with NumPy arrays, as SciPy calls ``fun``."""

  fun: Callable[..., Any]
  jac: Any
  eps: Any
  arrangement: Any
  box: Any = None  # forward differences in a box: (lower, upper) as float64 bytes

  def __call__(self, x, *args):
    dtype = jax.tree.leaves(x)[0].dtype
    shapes = (
      jax.ShapeDtypeStruct((), dtype),
      jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), x),
    )
    return jax.pure_callback(self._host, shapes, x, list(args), vmap_method="sequential")

  def _host(self, x, args):
    try:
      return self.at(x, _put_back(self.arrangement, args))
    except BaseException as error:  # pylint: disable=broad-except
      _HOST_ERRORS.append(error)  # JAX raises its own runtime error; the door raises this
      raise

  def at(self, x, args):
    """``(f(x), grad f(x))`` on the host, ``args`` as ``fun`` takes them.

    Each call of the user's gets its own copy of x, as SciPy's do: ``fun`` may write into
    its argument, and ``jac`` (or the forward differences) must still see x.
    """
    x = _own(x)
    dtype = jax.tree.leaves(x)[0].dtype
    if self.jac is True:
      value, grad = _pair_of(self.fun(x, *args))
    elif self.jac is not None:
      value, grad = self.fun(_own(x), *args), self.jac(x, *args)
    else:
      box = None if self.box is None else [np.frombuffer(side) for side in self.box]
      value, grad = _forward_differences(lambda x: self.fun(x, *args), x, self.eps, box)
    return _scalar(value, dtype, np), _like(grad, x, np)


def _own(x):
  """A copy of x (one array, SciPy's x, or a pytree of them) that the user's code may write
  into."""
  return np.array(x) if isinstance(x, np.ndarray) else jax.tree.map(np.array, x)


def _put_back(arrangement, dynamic):
  treedef, statics = arrangement
  given = iter(dynamic)
  return jax.tree.unflatten(treedef, [next(given) if s is None else s for s in statics])


def _host_value(value) -> float:
  """``fun``'s value on the host as a Python float, checked as :func:`_scalar` checks it (a
  vector gets the same message whatever x0's shape)."""
  return float(_scalar(value, np.float64, np))


def _inside(flat, steps, box):
  """SciPy's one-sided steps in a box (``_adjust_scheme_to_bounds``): a step that leaves the
  box is taken backward where that fits, else to the farther side's bound."""
  lower, upper = box
  below, above = flat - lower, upper - flat
  leaves = (flat + steps < lower) | (flat + steps > upper)
  fits = np.abs(steps) <= np.maximum(below, above)
  steps = np.where(leaves & fits, -steps, steps)
  return np.where(fits, steps, np.where(above >= below, above, -below))


def _forward_differences(fun, x, eps, box=None):
  r"""SciPy L-BFGS-B's gradient for ``jac=None``: ``(f(x + h_i e_i) - f(x)) / dx_i``.

  As SciPy's ``approx_derivative``: ``h_i`` is the absolute step ``eps``, or, where that
  does not move ``x_i`` in x's dtype (a large ``|x_i|``), the relative step
  :math:`r_i = \sqrt{\epsilon}\max(1, |x_i|)` with ``x_i``'s sign (:math:`\epsilon` of x's
  dtype); ``dx_i`` is the step as x's dtype holds it. For an x of less than 64 bits (JAX's
  32-bit mode) ``h_i`` is the larger of ``eps`` and :math:`r_i`: SciPy's ``eps`` is float64's
  :math:`\sqrt{\epsilon}`, and a step below float32's moves f by less than its rounding, so
  the difference would read a zero gradient, a false convergence. In a box (``box``, the
  flat lower and upper bounds) a step that would leave it is turned as SciPy turns it.
  """
  if not isinstance(x, np.ndarray):
    raise TypeError(
      "finite differences (jac=None with a fun JAX cannot trace) need x0 as one array; "
      "pass jac= or write fun with jax.numpy."
    )
  value = _host_value(fun(x.copy()))  # fun may write into its argument; x is read below
  flat = x.ravel()
  steps = np.broadcast_to(np.asarray(eps, np.float64), flat.shape)
  relative = np.sqrt(np.finfo(flat.dtype).eps) * np.where(flat >= 0, 1.0, -1.0)
  relative = relative * np.maximum(1.0, np.abs(flat))
  if flat.dtype.itemsize < 8:
    steps = np.where(np.abs(steps) < np.abs(relative), relative, steps)
  steps = np.where((flat + steps).astype(flat.dtype) == flat, relative, steps)
  if box is not None:
    steps = _inside(flat.astype(np.float64), steps, box)
  grad = np.empty(x.size)
  for i in range(flat.size):
    moved = flat.copy()
    moved[i] += steps[i]
    step = float(moved[i]) - float(flat[i])
    grad[i] = (_host_value(fun(moved.reshape(x.shape))) - value) / step
  return value, grad.reshape(x.shape)


def _box_sides(box, x0) -> Any:
  """``box`` as flat float64 bytes per side (hashable, for the host pair's key), ``None``
  without bounds or for a pytree x0 (which forward differences refuse)."""
  if all(side is None for side in box) or len(jax.tree.leaves(x0)) != 1 or programs.tracers(box):
    return None  # no box, a pytree x0, or bounds traced (jax.grad of them): steps as given
  sides = []
  for side, open_ in zip(box, (-np.inf, np.inf)):
    side = open_ if side is None else np.asarray(side, np.float64)
    sides.append(np.broadcast_to(side, np.shape(x0)).ravel().tobytes())
  return tuple(sides)


class _WithGradient:
  """``f(x, *args)`` whose gradient in x is the traced pair's (a ``jax.custom_vjp``); its
  derivative in ``args`` is reported as zero. Equal for equal pairs (a static key)."""

  def __init__(self, pair: programs.Closed):
    self.pair = pair

  def __call__(self, x, *args):
    @jax.custom_vjp
    def f(x, args):
      return self.pair(x, *args)[0]

    def forward(x, args):
      value, grad = self.pair(x, *args)
      return value, (grad, args)

    def backward(residual, cotangent):
      grad, args = residual
      zero = lambda a: (
        jnp.zeros_like(a)
        if jnp.issubdtype(jnp.result_type(a), jnp.inexact)
        else np.zeros(np.shape(a), jax.dtypes.float0)
      )
      return jax.tree.map(lambda g: cotangent * g, grad), jax.tree.map(zero, args)

    f.defvjp(forward, backward)
    return f(x, list(args))

  @property
  def on_host(self) -> bool:
    """Whether the pair is a NumPy one (:meth:`host_oracle` serves it)."""
    return isinstance(self.pair, _HostPair)

  def host_oracle(self, args, like, packed: bool):
    """The :class:`~hdm_optax.driver.oracle.HostOracle` of a NumPy pair (:attr:`on_host`):
    the separate path calls it on the host directly."""
    args = _put_back(self.pair.arrangement, list(args))  # once for the run's calls
    return oracle_lib.HostOracle(lambda x: self.pair.at(x, args), None, like, packed)

  def __hash__(self):
    return hash(self.pair)

  def __eq__(self, other):
    return isinstance(other, _WithGradient) and other.pair == self.pair


# Functions JAX traced, by the abstract values of their arguments (while they live).
_TRACED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
compiled.releases(_TRACED.clear)


@contextlib.contextmanager
def _released_if_abandoned():
  """Frees what a trace that the block abandons (by raising) holds.

  JAX keeps an abandoned trace alive: each array constant's tracer has a ``weakref.finalize``
  whose callback is a method of its trace, and the trace holds the tracer, so neither dies
  and the constants, the user's data read by a NumPy ``fun``, stay in memory, one copy per
  call. When the block raises, the constants' finalizers it created are detached, and the
  trace is garbage.
  """
  registry = getattr(weakref.finalize, "_registry", None)
  before = set(registry or ())
  try:
    yield
  except BaseException:
    for handle in set(registry or ()) - before:
      func = getattr(registry.get(handle), "func", None)
      if getattr(func, "__name__", None) == "finalize_const":
        handle.detach()
    raise


def _unfiltered_tracebacks():
  """JAX's traceback filtering off in this thread, for a trial trace whose failure is
  expected (the filtering walks the frames at every API boundary). Where the private switch
  is gone, a no-op."""
  state = getattr(getattr(jax, "_src", None), "config", None)
  state = getattr(state, "traceback_filtering", None)
  return state("off") if callable(state) else contextlib.nullcontext()


# Code objects of functions JAX could not trace, by the abstract values of their arguments
# (the last 256; see _traceable's by_code).
_UNTRACEABLE_CODE: collections.OrderedDict = collections.OrderedDict()
compiled.releases(_UNTRACEABLE_CODE.clear)


def _traceable(fun, x0, args, by_code: bool = False) -> bool:
  """Whether JAX can trace ``fun(x0, *args)`` (Python ints in ``args`` held static); a
  function traced before at these shapes is not traced again. ``by_code``: nor is a function
  whose code (``__code__``) JAX could not trace at these shapes, such as a new closure of the
  same NumPy function at each call (for a ``fun`` whose gradient is the user's, where the
  host runs a traceable one to the same values)."""
  leaves, treedef = jax.tree.flatten(tuple(args))
  dynamic = [leaf for leaf in leaves if programs.is_dynamic(leaf)]
  statics = [None if programs.is_dynamic(leaf) else leaf for leaf in leaves]
  try:
    seen = _TRACED.setdefault(fun, set())
    name = (treedef, tuple(statics), compiled.abstract((x0, dynamic)))
    hash(name)
  except TypeError:  # not weakly referable, or statics that cannot be keyed
    seen, name = set(), None
  if name in seen:
    return True
  code = (getattr(fun, "__code__", None), name) if by_code and name is not None else None
  if code is not None and code[0] is not None and code in _UNTRACEABLE_CODE:
    _UNTRACEABLE_CODE.move_to_end(code)
    return False

  def returned(x, d):
    out = fun(x, *_put_back((treedef, statics), d))
    programs.check_returned(out)
    return out

  trial = lambda: jax.eval_shape(returned, x0, dynamic)
  failed = False
  try:
    with _released_if_abandoned(), _unfiltered_tracebacks():
      trial()
  except _UNTRACEABLE:
    if code is not None and code[0] is not None:
      _UNTRACEABLE_CODE[code] = None
      while len(_UNTRACEABLE_CODE) > 256:
        _UNTRACEABLE_CODE.popitem(last=False)
    return False
  except Exception:  # pylint: disable=broad-except
    failed = True
  if failed:  # fun's own error: raised again, with the traceback JAX shows for it
    with _released_if_abandoned():
      trial()
  if name is not None:
    seen.add(name)
  return True


def _check_jac(jac):
  if isinstance(jac, str):
    if jac != "2-point":
      raise ValueError(
        f"jac={jac!r}: minimize takes jac=None (JAX's gradient, or SciPy's forward "
        "differences for a fun JAX cannot trace), jac=True, a callable or '2-point'."
      )
    return jac
  if jac is None or jac is True or callable(jac):
    return jac
  if jac is not False:
    raise ValueError(f"jac must be None, True, '2-point' or a callable, got {jac!r}.")
  return None  # SciPy reads a false jac as None


def objective(
  fun, jac, x0, args, eps=None, has_aux=False, box=(None, None)
) -> tuple[Callable[..., Any], tuple, str]:
  """``(f, args, mode)``: SciPy's ``fun``, ``jac`` and ``args`` as ``f(x, *args)``.

  ``box``: ``(lower, upper)`` of x (``None``, numbers or arrays), which forward differences
  stay inside.

  ``mode`` is ``"jax"`` (JAX's gradient), ``"jac"`` (the user's gradient) or ``"host"``
  (``fun`` on the host; ``"differences"`` where its gradient is SciPy's forward difference).

  Raises:
    ValueError: a ``jac`` or ``eps`` this mode does not use.
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {fun!r}.")
  jac = _check_jac(jac)
  args = tuple(args)
  given = jac is True or callable(jac)
  host = not _traceable(fun, x0, args, by_code=given)
  if not host and callable(jac) and jac is not True:  # NumPy's jac with a JAX-traceable fun
    host = not _traceable(jac, x0, args, by_code=True)
  differences = host and jac in (None, "2-point")
  if jac == "2-point" and not host:
    raise ValueError(
      "jac='2-point' asks for finite differences, but JAX differentiates this fun exactly: "
      "pass jac=None."
    )
  if eps is not None and not differences:
    raise ValueError(
      f"options eps={eps!r} is the finite-difference step, but the gradient here is "
      f"{'JAX' if jac is None else 'jac'}'s: drop eps."
    )
  asked = jac == "2-point"  # differences the caller chose: no note that they are used
  jac = None if asked else jac
  if not host and jac is None:
    return _Scalar(fun, has_aux), args, "jax"
  if not host:
    pair, pair_args = programs.hoist(_Pair(fun, jac), x0, args)
    return _WithGradient(pair), pair_args, "jac"
  if differences and not asked:
    warnings.warn(
      "minimize: JAX cannot trace fun (it needs concrete values), so fun runs on the host "
      f"and its gradient is SciPy's forward difference ({np.size(x0) + 1} calls of fun per "
      "gradient). Write fun with jax.numpy for JAX's exact gradient, or pass jac=.",
      stacklevel=3,
    )
  step = 1e-8 if eps is None else eps
  step = float(np.asarray(step)) if np.ndim(step) == 0 else tuple(np.ravel(step).tolist())
  leaves, treedef = jax.tree.flatten(args)
  statics = tuple(None if programs.is_dynamic(leaf) else leaf for leaf in leaves)
  dynamic = tuple(leaf for leaf in leaves if programs.is_dynamic(leaf))
  sides = _box_sides(box, x0) if differences else None
  host_pair = _HostPair(fun, jac, step, (treedef, statics), sides)
  return _WithGradient(host_pair), dynamic, "differences" if differences else "host"
