"""The one cache policy: what a compiled program is keyed on, what enters it as arguments,
and the programs compiled (:func:`call`).

The rule: **a compiled program is reused only where a fresh one would give the same answer.**
Every front door prepares its call here before it runs a program:

- :func:`hoist` traces the objective at the call. The arrays it reads from outside its
  arguments (closure cells, module globals, a bound method's object, an equinox Module's
  fields, a ``functools.partial``'s arrays) become arguments of the program, as ``fun_args``
  are; the program is keyed on the trace's structure (its equations, shapes, dtypes and the
  Python numbers written into it), not on the function object, so a new ``lambda`` of the
  same code reuses it. Where the objective holds custom derivative rules of the user's
  (``jax.custom_jvp``/``custom_vjp``; JAX's, optax's and the library's own read no state of
  the user's) or calls a ``jax.jit``-ed function, the arrays those read are compared by
  content (the rules are traced at the call to find them).
- In ``fun_args``, arrays and Python floats are arguments; Python ints and bools are
  static, as ``jax.jit``'s ``static_argnums`` (a new value compiles a new program); other
  leaves (functions, strings) are compared as static arguments are.
- :class:`OptimizerKey`: an hdm_optax transformation is rebuilt inside the program from its
  factory call (``trial_lbfgs(upper=...)``), with the arrays among its arguments passed as
  arguments (a NumPy array edited in place is read at the next call). Any other optax
  transformation is compared by :func:`fingerprint`: the functions it is made of and what
  they close over (NumPy arrays by content). Where a function of the user's lies anywhere
  inside (a schedule, a transformation of the user's), ``init`` and ``update`` are also
  traced at the call, so that what they read (a module global, an attribute) is in the key;
  JAX's, optax's and the library's own code reads no state of the user's and is not traced.
- :func:`built_signature`: ``sweep``'s ``make_optimizer`` is keyed on the optimizer it
  builds from a grid point's values, traced: what it reads at the call (a module global, an
  object's attribute) is in the key.
- What a front door cannot key (an optimizer holding traced values) runs without a cache,
  traced inline (:class:`Uncacheable`).

A front door prepares its call (:func:`prepare`) and runs it with :func:`call`: one
``jax.jit`` per entry function and XLA options (:func:`compiler_options`), whose cache holds
a program per key and shapes (:func:`compiled_count`).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import types
from typing import Any, Callable, Optional

import jax
import jax.core
import jax.extend.core as jex
from jax.extend import linear_util as lu
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _numerics
from hdm_optax.driver import compiled as compiled_lib
from hdm_optax.driver import protocol

__all__ = (
  "Closed",
  "ConfiguredTransformation",
  "OptimizerKey",
  "SMALL_PROGRAM",
  "Uncacheable",
  "arrays_of",
  "built_signature",
  "call",
  "compile_lowered",
  "compiled_count",
  "compared",
  "compiler_options",
  "configuration_key",
  "configuration_of",
  "configured",
  "fingerprint",
  "hoist",
  "init_shape",
  "jitted",
  "prepare",
  "program_key",
)

# Leaves of fun_args that enter the program as traced values.
_DYNAMIC = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, float, complex)
_CUSTOM_RULES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


# --- what a transformation is: its factory call ------------------------------------------


def configuration_key(value):
  """``value`` as part of a hashable key: numbers with their type, containers item by item."""
  if value is None or isinstance(value, (bool, int, float, complex, str, bytes, np.generic)):
    return (type(value), value)  # 1, 1.0 and True build different programs
  if type(value) in (tuple, list):  # pylint: disable=unidiomatic-typecheck
    return (type(value), tuple(configuration_key(v) for v in value))
  if type(value) is dict:  # pylint: disable=unidiomatic-typecheck
    return (dict, tuple((k, configuration_key(v)) for k, v in value.items()))
  return _Held(value)  # by value where hashable, else (an array) only equal to itself


class ConfiguredTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that knows the factory call that built it.

  Two are equal, and hash alike, when the same factory was called with equal
  arguments (defaults filled in; numbers compared with their type; an argument
  that cannot be hashed, such as an array, only with itself), so a cache keyed on
  the transformation, as :func:`hdm_optax.solve`'s compiled programs are, serves
  every equal one: ``solve(trial_lbfgs(), ...)`` in a loop compiles once.
  Otherwise it is the ``optax.GradientTransformationExtraArgs`` of the factory.
  """

  configuration = None  # also after optax's ``_replace``/``_make``, which build the tuple alone

  def __new__(cls, init, update, configuration=None):
    self = super().__new__(cls, init, update)
    self.configuration = configuration
    return self

  def __eq__(self, other):
    theirs = getattr(other, "configuration", None)
    if self.configuration is None or theirs is None:
      return tuple.__eq__(self, other)
    return self.configuration == theirs

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    return tuple.__hash__(self) if self.configuration is None else hash(self.configuration)

  def __repr__(self):
    return super().__repr__() if self.configuration is None else repr(self.configuration)


def configuration_of(optimizer) -> Optional[Any]:
  """The factory call that built ``optimizer`` (its ``factory`` and ``arguments``), where it
  is a :class:`ConfiguredTransformation` that knows it; else ``None``."""
  return optimizer.configuration if isinstance(optimizer, ConfiguredTransformation) else None


class _Call:
  """A factory and its bound arguments; equal calls are equal keys."""

  __slots__ = ("factory", "arguments", "_key", "plain")

  def __init__(self, factory, arguments: dict):
    self.factory = factory
    self.arguments = arguments
    self._key = (factory, tuple((k, configuration_key(v)) for k, v in arguments.items()))
    self.plain = _plain(self._key)  # equal plain calls build alike

  def __eq__(self, other):
    return isinstance(other, _Call) and self._key == other._key

  def __hash__(self):
    return hash(self._key)

  def __repr__(self):
    shown = ", ".join(f"{name}={value!r}" for name, value in self.arguments.items())
    return f"{self.factory.__name__}({shown})"


def configured(factory: Callable[..., optax.GradientTransformation]):
  """Decorates a factory: its transformations carry their configuration.

  The factory returns a :class:`ConfiguredTransformation` that compares equal to
  every other one built by an equal call (``trial_lbfgs() == trial_lbfgs()``,
  ``!= trial_lbfgs(memory_size=5)``).

  What it holds: the arguments as they were at the call, their dicts, lists and tuples (the
  containers compared item by item) copied, so that the factory, the configuration and
  every program built from it (:class:`OptimizerKey`) see one value for the
  transformation's whole life: a later edit of the caller's dict or list
  (``upper["a"] = 2.0``) reaches none of them (build a new transformation for new
  values). The leaves are held as they are: an array is read at each call of a front door,
  so a NumPy array edited in place is seen.

  Args:
    factory: a function returning an ``optax.GradientTransformationExtraArgs``.

  Returns:
    The factory, with its name, docstring and signature.
  """
  signature = inspect.signature(factory)

  @functools.wraps(factory)
  def build(*args, **kwargs):
    try:
      bound = signature.bind(*args, **kwargs)
    except TypeError:  # the factory's own message names it
      return factory(*args, **kwargs)
    bound.apply_defaults()
    for name, value in bound.arguments.items():
      bound.arguments[name] = _copied(value)
    transformation = factory(*bound.args, **bound.kwargs)
    configuration = _Call(build, dict(bound.arguments))
    return ConfiguredTransformation(transformation.init, transformation.update, configuration)

  return build


def _copied(value):
  """``value`` with its dicts, lists and tuples (those :func:`configuration_key` compares
  item by item) copied, its other values the same objects."""
  if type(value) in (tuple, list):  # pylint: disable=unidiomatic-typecheck
    return type(value)(map(_copied, value))
  if type(value) is dict:  # pylint: disable=unidiomatic-typecheck
    return {k: _copied(v) for k, v in value.items()}
  return value


class Uncacheable(Exception):
  """A call that no key describes (it holds traced values): it runs traced inline."""


def is_dynamic(leaf) -> bool:
  return isinstance(leaf, _DYNAMIC) and not isinstance(leaf, (bool, np.bool_))


def content(array) -> tuple:
  """An array as a key: its shape, dtype and a digest of its bytes."""
  if isinstance(array, jax.core.Tracer):
    raise Uncacheable("a traced array")
  if jnp.issubdtype(getattr(array, "dtype", None), jax.dtypes.prng_key):
    array = jax.random.key_data(array)  # a typed key: its bits
  a = np.asarray(array)
  return ("array", a.shape, a.dtype.str, hashlib.blake2b(np.ascontiguousarray(a)).digest())


def _plain(key) -> bool:
  """Whether a :func:`configuration_key` holds numbers, strings and None only, or the
  libraries' own named tuples of them (a rule such as ``pairs_diagonal()``): no array, and
  nothing of the user's."""
  if isinstance(key, _Held):
    obj = key.obj
    named = isinstance(obj, tuple) and _libraries(obj)
    return named and _plain(tuple(configuration_key(v) for v in obj))
  return all(map(_plain, key)) if isinstance(key, tuple) else True


class _Held:
  """``obj`` compared by ``==`` where it is hashable, else by identity (held)."""

  __slots__ = ("obj", "_hash", "_by_value")

  def __init__(self, obj):
    self.obj = obj
    try:
      self._hash, self._by_value = hash(obj), True
    except TypeError:
      self._hash, self._by_value = id(obj), False

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    if not isinstance(other, _Held) or other._hash != self._hash:
      return False
    if self.obj is other.obj:
      return True
    return self._by_value and other._by_value and bool(self.obj == other.obj)


def fingerprint(obj) -> Any:
  """A hashable picture of what ``obj`` computes with: functions by their code, defaults and
  closure cells, containers item by item, NumPy arrays by content, JAX arrays by identity
  (they are immutable), other objects as static arguments are compared.

  Raises:
    Uncacheable: ``obj`` holds a traced value.
  """
  return _Walk().picture(obj)


class _Walk:
  """:func:`fingerprint`'s walk, which also notes whether its picture is all ``obj`` computes
  with.

  Attributes:
    library: every function met is JAX's, optax's or the library's own (their code reads no
      state of the user's; :func:`_libraries`) and every other value is one the picture shows
      whole (a number, a string, an array, a dtype, a container of them, a library class),
      so that equal pictures compute alike. A function of the user's, or an object the
      picture holds by ``==`` or identity (its attributes unseen), clears it.
    arrays: ``None``, or a list that takes the JAX arrays met (traced or not), each pictured
      by its place in the list, for a trace to picture them (:func:`built_signature`).
  """

  def __init__(self, arrays: Optional[list] = None):
    self.library = True
    self.arrays = arrays

  def picture(self, obj, seen: frozenset = frozenset()) -> Any:
    """``obj``'s picture (``seen``: the ids of the containers it lies in).

    Raises:
      Uncacheable: ``obj`` holds a traced value and :attr:`arrays` is ``None``.
    """
    if isinstance(obj, jax.Array) and self.arrays is not None:
      self.arrays.append(obj)
      return ("array", len(self.arrays) - 1)
    if isinstance(obj, jax.core.Tracer):
      raise Uncacheable("a traced value")
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, np.generic)):
      return (type(obj), obj)
    if isinstance(obj, np.ndarray):
      return content(obj)
    if isinstance(obj, jax.Array):
      return ("jax", _Held(obj))
    if id(obj) in seen:
      return ("cycle",)
    seen = seen | {id(obj)}
    walk = lambda x: self.picture(x, seen)
    configuration = configuration_of(obj)
    if configuration is not None:
      self.library &= _factory_ours(configuration)
      return ("configured", configuration.factory, walk(configuration.arguments))
    self.library &= _shown_whole(obj)
    if isinstance(obj, functools.partial):
      return ("partial", walk(obj.func), walk(obj.args), walk(obj.keywords))
    if isinstance(obj, types.MethodType):
      return ("method", walk(obj.__func__), walk(obj.__self__))
    if isinstance(obj, types.FunctionType):
      cells = tuple(walk(c.cell_contents) for c in obj.__closure__ or () if _filled(c))
      return ("function", obj.__code__, cells, walk(obj.__defaults__), walk(obj.__kwdefaults__))
    if isinstance(obj, (tuple, list)):
      return (type(obj), tuple(map(walk, obj)))
    if isinstance(obj, dict):
      return (dict, tuple((_Held(k), walk(v)) for k, v in obj.items()))
    return ("object", _Held(obj))


# Values a picture shows whole where they are keys of a dict.
_NUMBERS = (bool, int, float, complex, str, bytes, np.generic, type(None))


def _shown_whole(obj) -> bool:
  """Whether :meth:`_Walk.picture` shows all ``obj`` (a container, a function or other value
  its walk does not take apart further) computes with, where the parts it walks do: a
  function of the libraries, a container of theirs or Python's, a dtype, a class of theirs,
  their ``jax.custom_jvp``/``jax.jit`` objects (:func:`_library_code`)."""
  if isinstance(obj, types.FunctionType):
    return _libraries(obj)
  if isinstance(obj, types.MethodType):
    return True  # its function and its object are walked
  if isinstance(obj, (functools.partial, tuple, list, dict)):
    builtin = type(obj) in (functools.partial, tuple, list, dict)
    keys = all(isinstance(k, _NUMBERS) for k in obj) if isinstance(obj, dict) else True
    return keys and (builtin or _libraries(type(obj)))
  if isinstance(obj, np.dtype):
    return True
  if isinstance(obj, type):
    return obj.__module__.split(".")[0] in ("builtins", "numpy", "ml_dtypes", *_LIBRARIES)
  return callable(obj) and _library_code(obj)


def _factory_ours(configuration) -> bool:
  """Whether a configured transformation's factory is the library's own (``configured`` may
  decorate a factory of the user's)."""
  return _libraries(getattr(configuration.factory, "__wrapped__", configuration.factory))


def _filled(cell) -> bool:
  try:
    cell.cell_contents  # pylint: disable=pointless-statement
  except ValueError:  # an empty cell
    return False
  return True


def _signature(jaxpr, inner: list) -> tuple:
  """A hashable picture of ``jaxpr``: equations, shapes, dtypes and literals.

  The constants of inner closed jaxprs (a ``jax.jit``-ed function's) are appended to
  ``inner``. A custom rule's functions arrive wrapped anew at each trace: they are compared
  by name here, and by what they read in :func:`hoist`.
  """
  names = {}

  def atom(x):
    if isinstance(x, jex.Literal):
      value = np.asarray(x.val)  # its bytes: a NaN literal equals itself
      return ("literal", value.dtype.str, value.tobytes(), x.aval)
    return names.setdefault(x, len(names))

  def param(value, callback=False):
    if callback:
      return ("host callback", _callback_key(value))
    if isinstance(value, jex.ClosedJaxpr):
      inner.extend(value.consts)
      return ("closed", _signature(value.jaxpr, inner))
    if isinstance(value, jex.Jaxpr):
      return ("jaxpr", _signature(value, inner))
    if isinstance(value, (tuple, list)):
      return tuple(map(param, value))
    if isinstance(value, (lu.WrappedFun, types.FunctionType)):
      return ("callable", getattr(value, "__name__", type(value).__name__))
    inner_rule = getattr(value, "rule", None)  # a custom batching rule, wrapped anew each trace
    if callable(value) and callable(inner_rule):
      return ("rule", type(value).__name__, _callback_key(inner_rule))
    return _Held(value)

  head = tuple((atom(v), v.aval) for v in (*jaxpr.constvars, *jaxpr.invars))
  eqns = tuple(
    (
      eqn.primitive.name,
      tuple(map(atom, eqn.invars)),
      tuple((atom(v), v.aval) for v in eqn.outvars),
      tuple(
        (k, param(v, k == "callback" and eqn.primitive.name in _HOST_CALLS))
        for k, v in sorted(eqn.params.items())
      ),
    )
    for eqn in jaxpr.eqns
  )
  return head, eqns, tuple(map(atom, jaxpr.outvars))


# Primitives that call a Python function on the host: what it does is not in the trace.
_HOST_CALLS = ("debug_callback", "pure_callback", "io_callback")


def _callback_key(fn, depth: int = 0, library: bool = True) -> Any:
  """A host callback of the trace as a key: a function by its code, its defaults and what
  its closure holds (a function again so; a dict or list that JAX's or the library's own
  function holds by its contents; anything else by ``==`` where it is hashable, else by identity: a
  list or a file the user's function writes to is part of what it does). Two traces of
  ``jax.debug.callback(lambda x: log(x))`` share a key; with ``log_a`` and ``log_b``, or with
  two lists to append to, they do not."""
  if depth > 8:
    return _Held(fn)
  if isinstance(fn, jax.core.Tracer):  # a value of the trace the rule closes over
    return ("traced", fn.aval)
  inner = lambda x: _callback_key(x, depth + 1, library)
  if isinstance(fn, functools.partial):
    return ("partial", inner(fn.func), tuple(map(inner, fn.args)), inner(fn.keywords))
  wrapped = getattr(fn, "callback_func", None)  # jax.pure_callback's flat wrapper
  if wrapped is not None:
    return ("flat", inner(wrapped), _Held(getattr(fn, "in_tree", None)))
  if isinstance(fn, dict) and library:
    return (dict, tuple((k, inner(v)) for k, v in fn.items()))
  if isinstance(fn, tuple) or (isinstance(fn, list) and library):
    return (type(fn), tuple(map(inner, fn)))
  if isinstance(fn, types.FunctionType):
    ours = (getattr(fn, "__module__", "") or "").split(".")[0] in ("jax", "hdm_optax")
    held = lambda x: _callback_key(x, depth + 1, ours)
    cells = tuple(held(c.cell_contents) for c in fn.__closure__ or () if _filled(c))
    named = sorted((fn.__kwdefaults__ or {}).items())
    defaults = (held(fn.__defaults__ or ()), tuple((k, held(v)) for k, v in named))
    return ("function", fn.__code__, id(fn.__globals__), cells, defaults)
  return _Held(fn)


def _user_rules(jaxpr) -> bool:
  """Whether ``jaxpr`` holds a custom derivative rule that may read the user's state (one
  that is not JAX's, optax's or the library's own all the way down: :func:`_library_code`)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _CUSTOM_RULES:
      rules = [v for v in eqn.params.values() if callable(v) or isinstance(v, lu.WrappedFun)]
      if not all(_library_code(rule) for rule in rules):
        return True
  return any(_user_rules(sub) for sub in jex.subjaxprs(jaxpr))


def _library_code(fn, seen: frozenset = frozenset()) -> bool:
  """Whether ``fn`` is code of JAX, optax or the library all the way down: a function of
  theirs whose closure holds only their functions (a rule's wrappers, ``defjvps``'s per-argument
  rules) and no array. Anything else, a function of the user's or an object holding one, may
  read state the trace does not show."""
  if id(fn) in seen:  # a cycle (jax.nn.relu's rule holds relu): judged where it began
    return True
  if len(seen) > 32:
    return False
  inner = lambda x: _library_code(x, seen | {id(fn)})
  if isinstance(fn, lu.WrappedFun):
    return inner(fn.f)
  if isinstance(fn, functools.partial):
    return inner(fn.func) and not jax.tree.leaves((fn.args, fn.keywords))
  if isinstance(fn, (jax.custom_jvp, jax.custom_vjp)):  # jax.nn.relu is one
    parts = [getattr(fn, name, None) for name in ("fun", "jvp", "jvps", "fwd", "bwd")]
    return _library_held(parts, inner)
  if not isinstance(fn, types.FunctionType) and type(fn).__module__.startswith("jax"):
    wrapped = getattr(fn, "__wrapped__", None)  # a jax.jit-ed function
    return wrapped is not None and inner(wrapped)
  if not isinstance(fn, types.FunctionType) or not _libraries(fn):
    return False
  return all(_library_held(c.cell_contents, inner) for c in fn.__closure__ or () if _filled(c))


def _library_held(value, inner) -> bool:
  """Whether a value held by a library function's closure is no array and no code or object
  of the user's (``inner`` judges code; a tuple, such as ``defjvps``'s rules, or a dict item by
  item; other objects only where they are JAX's, optax's or the library's own)."""
  if isinstance(value, (jax.Array, np.ndarray)):
    return False
  if isinstance(value, (tuple, list)):
    return all(_library_held(x, inner) for x in value)
  if callable(value) or isinstance(value, lu.WrappedFun):
    return inner(value)
  if isinstance(value, dict):
    return all(_library_held(x, inner) for x in value.values())
  if value is None or type(value) is object or isinstance(value, (bool, int, float, str, bytes)):
    return True
  return type(value).__module__.split(".")[0] in ("jax", "jaxlib", "optax", "hdm_optax")


class Closed:
  """``fun`` as traced at one call, with the arrays it read as its last argument.

  ``closed(params, *args, consts)`` is ``fun(params, *fun_args)``, ``args`` the dynamic
  leaves of ``fun_args`` (:func:`hoist`). Two are equal when their keys are: the traces'
  signatures, the static leaves of ``fun_args`` and, where the trace holds custom rules or
  inner ``jit``-ed functions, the content of the arrays those read.
  """

  def __init__(self, jaxpr, out_tree, key):
    self._jaxpr = jaxpr
    self._in_avals = [v.aval for v in jaxpr.invars]
    self._out_tree = out_tree
    self._key = key

  def __call__(self, params, *args):
    *args, consts = args
    leaves = jax.tree.leaves((params, list(args)))
    # A caller may evaluate at another precision (optax's line search promotes float32
    # params under x64): fun was traced at these dtypes and computes in them.
    leaves = [
      jnp.asarray(x).astype(a.dtype) if jnp.result_type(x) != a.dtype else x
      for x, a in zip(leaves, self._in_avals)
    ]
    out = jax.core.eval_jaxpr(self._jaxpr, consts, *leaves)
    return jax.tree.unflatten(self._out_tree, out)

  def objective(self, has_aux: bool) -> Callable[[Any, Any], Any]:
    """``objective(params, args) -> f``: the value alone (the aux dropped with ``has_aux``),
    as a function of the params and the tuple of ``args``."""
    return lambda params, args: self(params, *args)[0] if has_aux else self(params, *args)

  def __hash__(self):
    if self._key is None:
      raise TypeError("a Closed without a key (it reads traced values) is not hashable")
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, Closed) and self._key is not None and other._key == self._key


_ARG = object()


def _abstract(x):
  if isinstance(x, jax.core.Tracer):
    return x
  weak = isinstance(x, (float, complex)) or bool(getattr(x, "weak_type", False))
  return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), weak_type=weak)


def _returnable(leaf) -> bool:
  """Whether a traced function may return ``leaf``: an array or a number (JAX's types)."""
  if isinstance(leaf, (jax.Array, bool, int, float, complex)) or hasattr(leaf, "__jax_array__"):
    return True
  if not isinstance(leaf, (np.ndarray, np.generic)):
    return False
  return jnp.issubdtype(leaf.dtype, jnp.number) or jnp.issubdtype(leaf.dtype, jnp.bool_)


def check_returned(out) -> None:
  """A ``TypeError`` naming the leaf of ``fun``'s output (its value, or the aux of a pair
  ``(value, aux)``) that a compiled program cannot return, such as a string."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
    if _returnable(leaf):
      continue
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if pair and path[0] == jax.tree_util.SequenceKey(1):
      where = f"aux{jax.tree_util.keystr(path[1:])}"
    else:
      where = f"output{jax.tree_util.keystr(path)}"
    raise TypeError(
      f"fun's {where} is a {type(leaf).__name__}{_numerics.shown(leaf)}, which a compiled "
      "program cannot return: the value and the aux (has_aux=True) must hold arrays or "
      "numbers only; keep strings and other Python objects outside fun (e.g. in a dict "
      "beside it), or drop them from aux."
    )


def hoist(fun: Callable[..., Any], params: Any, fun_args: tuple) -> tuple[Closed, tuple]:
  """``fun`` traced at this call, with what it reads from outside its arguments as arguments.

  Args:
    fun: ``fun(params, *fun_args) -> Any`` (a scalar, or ``(scalar, aux)``).
    params: the params, or values of their shapes and dtypes.
    fun_args: ``fun``'s other arguments.

  Returns:
    ``(closed, args)`` with ``closed(params, *args) == fun(params, *fun_args)``: ``args`` is
    the tuple of the dynamic leaves of ``fun_args`` (arrays, Python floats) followed by the
    list of arrays ``fun`` read from outside its arguments at this call.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.driver import programs
    >>> a = jnp.array([1.0, 2.0])
    >>> fun = lambda x: jnp.sum(a * x)
    >>> closed, args = programs.hoist(fun, jnp.ones(2), ())
    >>> a = jnp.array([3.0, 4.0])  # rebound: a new trace reads it, as an argument
    >>> again, new_args = programs.hoist(fun, jnp.ones(2), ())
    >>> again == closed, float(closed(jnp.ones(2), *args)), float(again(jnp.ones(2), *new_args))
    (True, 3.0, 7.0)
  """
  leaves, treedef = jax.tree.flatten(tuple(fun_args))
  dynamic = [leaf for leaf in leaves if is_dynamic(leaf)]
  statics = tuple(_ARG if is_dynamic(leaf) else leaf for leaf in leaves)

  def flat(params, dynamic):
    given = iter(dynamic)
    full = [next(given) if s is _ARG else s for s in statics]
    out = fun(params, *jax.tree.unflatten(treedef, full))
    check_returned(out)
    return out

  abstract = jax.tree.map(_abstract, (params, dynamic))
  # A new function each call: jax.make_jaxpr caches traces on the function's identity.
  traced, shape = jax.make_jaxpr(lambda p, d: flat(p, d), return_shape=True)(*abstract)
  inner: list = []
  key = [treedef, _signature(traced.jaxpr, inner), jax.tree.structure(shape)]
  if _user_rules(traced.jaxpr):
    value = lambda p, d: flat(p, d)[0] if isinstance(shape, tuple) else flat(p, d)
    derivative = jax.make_jaxpr(jax.value_and_grad(value))(*abstract)
    key.append(_signature(derivative.jaxpr, inner))
    inner.extend(derivative.consts)
  try:
    named = tuple(fingerprint(s) for s in statics if s is not _ARG)
    key = (*key, tuple(map(content, inner)), named)
  except Uncacheable:  # it reads a traced value where no argument reaches: no key
    key = None
  return Closed(traced.jaxpr, jax.tree.structure(shape), key), (*dynamic, list(traced.consts))


class OptimizerKey:
  """An optimizer as a program's key; :meth:`build` makes it inside the program.

  An hdm_optax transformation (it knows its factory call) is keyed on the factory and its
  non-array arguments, and rebuilt from the arrays passed in; any other is keyed on its
  :func:`fingerprint` and used as it is. Where the key cannot see all an optimizer computes
  with (a function of the user's anywhere inside, such as a schedule or a transformation of
  the user's in a chain, which may read module globals or the attributes of objects it
  holds; an object whose attributes the fingerprint does not walk), it also holds the trace
  of ``init`` and ``update`` at the params' shapes (:func:`update_signature`): what those
  read at this call is in the key, as ``fun``'s is. An optimizer made of JAX's, optax's and
  the library's code alone, whose values the fingerprint shows whole, is keyed without the
  trace: their code reads no state of the user's.
  The key holds the avals of the arrays, not the arrays: those are the program's arguments
  (:func:`arrays_of`), so a table keyed on it keeps none of them.

  Attributes:
    opaque: the key alone does not see all the optimizer computes with (it needs the trace).
  """

  def __init__(self, optimizer, params=None):
    configuration, walk = configuration_of(optimizer), _Walk()
    if configuration is not None:
      leaves, self._treedef = jax.tree.flatten(dict(configuration.arguments))
      self._arrays = [_is_array(x) for x in leaves]
      self._factory = configuration.factory
      self._statics = tuple(x for x, a in zip(leaves, self._arrays) if not a)
      avals = tuple((np.shape(x), jnp.result_type(x)) for x in leaves if _is_array(x))
      self._key = ("configured", self._factory, self._treedef, walk.picture(self._statics), avals)
      walk.library &= _factory_ours(configuration)
      self._optimizer = None
    else:
      self._key = ("fingerprint", walk.picture(optimizer))
      self._optimizer = optimizer
    self.opaque = not walk.library
    if self.opaque and params is not None:
      self._key += (update_signature(optimizer, params),)

  def build(self, arrays):
    """The optimizer, with ``arrays`` (:func:`arrays_of`'s, traced inside the program) for its
    array arguments."""
    if self._optimizer is not None:
      return self._optimizer
    given, held = iter(arrays), iter(self._statics)
    leaves = [next(given) if a else next(held) for a in self._arrays]
    return self._factory(**jax.tree.unflatten(self._treedef, leaves))

  def describe(self) -> tuple:
    """What the key is made of, for a description that does not depend on the process
    (:func:`hdm_optax.driver.store.describe`)."""
    if self._optimizer is not None:
      return ("optimizer", self._optimizer)
    return ("configured", self._factory, self._treedef, self._statics, self._key[4])

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, OptimizerKey) and other._key == self._key


def arrays_of(optimizer) -> list:
  """The arrays among an hdm_optax transformation's arguments, in the order
  :meth:`OptimizerKey.build` takes them; ``[]`` for any other transformation."""
  configuration = configuration_of(optimizer)
  if configuration is None:
    return []
  return [x for x in jax.tree.leaves(dict(configuration.arguments)) if _is_array(x)]


def _libraries(fn) -> bool:
  """Whether ``fn`` is one of the library's, optax's or JAX's (its code is theirs: a function by
  the module its code is written in, which ``functools.wraps`` does not rename)."""
  if isinstance(fn, types.FunctionType):
    module = fn.__globals__.get("__name__", "") or ""
  else:
    module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""
  return module.split(".")[0] in _LIBRARIES


_LIBRARIES = ("hdm_optax", "optax", "jax")


def _placeholder_objective(params):
  return 0.5 * optax.tree.vdot(params, params)


def update_signature(optimizer, params) -> tuple:
  """``optimizer.init`` and ``update`` traced at the params' shapes, as a key: their
  equations, the numbers written into them and the content of the arrays they hold.

  Raises:
    Uncacheable: they read a traced value.
  """
  return _update_trace(lambda _: optimizer, params, ())


def built_signature(build: Callable[[Any], Any], settings, params) -> tuple:
  """The optimizer ``build(settings)`` as a key, ``settings`` (a pytree of
  ``jax.ShapeDtypeStruct``) traced as a program traces them: what the optimizer computes from
  them, and what it reads elsewhere at this call (module globals, an object's attributes).

  An optimizer whose :class:`OptimizerKey` sees all it computes with (not ``opaque``) is keyed
  on that key, its arrays (an hdm_optax transformation's array arguments; the JAX arrays an
  optax transformation holds) pictured by the trace that computes them from ``settings``;
  any other optimizer on the trace of ``build``, ``init`` and ``update`` at the params'
  shapes (:func:`update_signature`).

  Raises:
    Uncacheable: the optimizer reads a traced value from outside ``settings``.
  """
  seen = []

  def arguments(settings):
    key, arrays = _whole_key(build(settings))
    seen.append(key)
    return arrays

  traced = jax.make_jaxpr(arguments)(settings)
  if seen[0] is None:
    return _update_trace(build, params, settings)
  return ("arguments", seen[0], _trace_key(traced))  # the key, not its traced arrays


def _whole_key(optimizer) -> tuple:
  """``(key, arrays)``: ``optimizer``'s key where it sees all ``optimizer`` computes with (no
  function of the user's: :attr:`OptimizerKey.opaque`) but ``arrays``, which the caller's
  trace pictures (an hdm_optax transformation's array arguments, :func:`arrays_of`; the JAX
  arrays another holds, traced settings among them); ``(None, [])`` elsewhere."""
  if configuration_of(optimizer) is not None:
    try:
      key = OptimizerKey(optimizer)
    except Uncacheable:  # a function of the user's that holds a traced setting
      return None, []
    return (None, []) if key.opaque else (key._key, arrays_of(optimizer))
  walk = _Walk(arrays=[])
  picture = walk.picture(optimizer)
  return (("fingerprint", picture), walk.arrays) if walk.library else (None, [])


def _update_trace(build: Callable[[Any], Any], params, settings) -> tuple:
  """:func:`update_signature` of ``build(settings)``, ``settings`` traced as arguments."""

  def run(params, settings):
    optimizer = build(settings)
    state = optimizer.init(params)
    protocol.check_state(state)  # before its update is traced
    value = jnp.zeros((), _numerics.params_dtype(params))
    return optimizer.update(
      params, state, params, value=value, grad=params, value_fn=_placeholder_objective
    )

  return _trace_key(jax.make_jaxpr(run)(jax.tree.map(_abstract, params), settings))


def _trace_key(traced) -> tuple:
  """A closed jaxpr as a key: its :func:`_signature` and the content of the arrays it holds."""
  inner: list = []
  signature = _signature(traced.jaxpr, inner)
  return ("trace", signature, tuple(map(content, [*traced.consts, *inner])))


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


# --- the compiled programs --------------------------------------------------------------


def tracers(tree) -> list:
  """The traced leaves of ``tree``."""
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.core.Tracer)]


def is_batched(tracer) -> bool:
  """Whether ``tracer`` is (or wraps) one of ``jax.vmap``'s."""
  for _ in range(8):
    if type(tracer).__name__ == "BatchTracer":
      return True
    inner = getattr(tracer, "primal", None)
    tracer = getattr(tracer, "val", None) if inner is None else inner
    if not isinstance(tracer, jax.core.Tracer):
      return False
  return False


def staged() -> bool:
  """Whether the caller is being staged out (inside ``jax.jit``, a loop body, ...)."""
  if type(jex.find_top_trace(())).__name__ == "EvalTrace":  # under no transformation
    return False
  return isinstance(jax.lax.stop_gradient(0.0), jax.core.Tracer)  # the cheapest bind


def prepare(optimizer, params) -> tuple:
  """``(optimizer_key, optimizer_arrays, state_shape)``: a front door's optimizer as a
  program's static and arguments (:class:`OptimizerKey`), and ``jax.eval_shape`` of
  ``optimizer.init``.

  The optimizer's ``init`` is traced first with its own values, so that its checks of its
  arguments against the params (a box's shape, NaN) run before they become traced. An
  optimizer that holds traced values gets a key that makes :func:`call` trace inline.
  """
  return _by_plain_call("prepare", optimizer, params, lambda: _prepare(optimizer, params))


def _prepare(optimizer, params) -> tuple:
  shape = init_shape(optimizer, params)
  try:
    return OptimizerKey(optimizer, params), arrays_of(optimizer), shape
  except Uncacheable:  # a static that is not hashable, so that call traces inline
    return types.SimpleNamespace(build=lambda arrays: optimizer), [], shape


def init_shape(optimizer, params):
  """``jax.eval_shape(optimizer.init, params)``, kept for an hdm_optax transformation by what
  decides it (:func:`_init_key`)."""
  return _by_plain_call("init", optimizer, params, lambda: _init_shape(optimizer, params))


def _init_shape(optimizer, params):
  named = _init_key(optimizer, params)
  shape = _INIT_SHAPES.get(named)  # never None's: no key, no shape kept
  if shape is None:
    shape = jax.eval_shape(optimizer.init, params)
    if named is not None:
      _INIT_SHAPES[named] = shape
      while len(_INIT_SHAPES) > _INIT_SHAPES_KEPT:
        _INIT_SHAPES.popitem(last=False)
  return shape


def _by_plain_call(kind: str, optimizer, params, make: Callable[[], Any]):
  """``make()`` (:func:`prepare`'s or :func:`init_shape`'s answer), kept
  (:func:`~hdm_optax.driver.compiled.kept`) for an hdm_optax transformation of plain
  arguments (:func:`_plain`), which depends on the factory call and the params' shapes
  alone."""
  configuration = configuration_of(optimizer)
  if configuration is None or not configuration.plain or tracers(params):
    return make()
  return compiled_lib.kept((kind, configuration, compiled_lib.abstract(params)), make)


# ``jax.eval_shape`` of an hdm_optax transformation's ``init`` by what decides it and what its
# checks read (:func:`_init_key`), the oldest first and at most the last 64.
_INIT_SHAPES: collections.OrderedDict = collections.OrderedDict()
compiled_lib.releases(_INIT_SHAPES.clear)
_INIT_SHAPES_KEPT = 64
_SMALL_ARGUMENT = 1 << 16


def _init_key(optimizer, params):
  """What ``optimizer.init``'s shapes and checks at ``params`` depend on, as a key: the
  factory, its arguments (arrays of at most :data:`_SMALL_ARGUMENT` entries by content) and
  the params' shapes; ``None`` for other transformations and for function arguments (which
  may read state)."""
  configuration = configuration_of(optimizer)
  if configuration is None:
    return None
  leaves, treedef = jax.tree.flatten(dict(configuration.arguments))
  if any(callable(x) or (_is_array(x) and np.size(x) > _SMALL_ARGUMENT) for x in leaves):
    return None
  try:
    named = tuple(content(x) if _is_array(x) else configuration_key(x) for x in leaves)
    key = (configuration.factory, treedef, named, compiled_lib.abstract(params))
    hash(key)
  except (TypeError, Uncacheable):
    return None
  return key


@functools.cache
def jitted(entry):
  """``jax.jit`` of a front door's entry, its first ``entry.num_statics`` arguments static."""
  return jax.jit(entry, static_argnums=tuple(range(entry.num_statics)))


def program_key(entry, statics: tuple, dynamic: tuple):
  """The cache key of ``entry``'s program for ``statics`` and the abstract ``dynamic`` (what
  names a program and its inputs' shapes; ``None`` where ``statics`` cannot be keyed).

  The key holds what the statics are compared by (:func:`compared`), not the statics, so
  that the tables keyed on it (the programs, the runs each was asked for) keep no more of
  the user's than the comparison reads.
  """
  try:
    hash(statics)
  except TypeError:
    return None
  return (entry, tuple(map(compared, statics)), compiled_lib.abstract(dynamic))


def compared(static):
  """``static`` as it is compared: a :class:`Closed` or an :class:`OptimizerKey` by its key
  alone, without what it is built from (a trace's jaxpr holds the constants of the
  objective's inner ``jax.jit`` functions)."""
  if isinstance(static, (Closed, OptimizerKey)):
    return (type(static), static._key)
  return static


# Inputs of at most this many entries in all compile for a short first call.
SMALL_PROGRAM = 65_536


def on_device(key, make: Callable[[], Any]):
  """``make()`` on the device, kept for the next call with the same ``key``
  (:func:`hdm_optax.driver.compiled.kept`; ``key`` says all ``make()`` depends on).

  A NumPy leaf is a transfer at every call of a program; a kept device array is not. For
  the values a front door passes alike at every call of some shapes: the limits
  (:func:`numbers`), a fresh start's zeros.
  """
  return compiled_lib.kept(("on device", key), lambda: jax.device_put(make()))


def numbers(tree) -> tuple:
  """``tree``'s numbers as a key: its structure, and each leaf's type, dtype and bytes."""
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [np.asarray(leaf) for leaf in leaves]
  return treedef, tuple((type(x), a.dtype.str, a.tobytes()) for x, a in zip(leaves, arrays))


def compiler_options(inputs, *, host_loop: bool = False) -> dict:
  """XLA's options for a front door's program, by the size of its ``inputs`` (a pytree).

  On the CPU, a problem whose inputs (params, data, state) hold at most
  :data:`SMALL_PROGRAM` entries in all is compiled with XLA's elemental kernel emitters
  (``xla_cpu_use_fusion_emitters=False``), which compile faster; larger problems keep XLA's
  fusion emitters, whose kernels run faster (docs/speed.md). A small ``host_loop`` program
  (one that calls the host at every iteration: the separate path's) is also scheduled
  depth first (XLA's memory-optimized scheduler), under which it runs faster than under
  the default schedule for concurrency (docs/speed.md). Other backends get ``{}``. :func:`call` passes
  no options where the program is staged inside a caller's trace (JAX takes them only at
  the top level); :func:`compile_lowered` compiles with them.

  Returns:
    The ``compiler_options`` of ``jax.jit``, ``{}`` for XLA's defaults.
  """
  if jax.default_backend() != "cpu":
    return {}
  if sum(int(np.size(leaf)) for leaf in jax.tree.leaves(inputs)) > SMALL_PROGRAM:
    return {}
  return {"xla_cpu_use_fusion_emitters": False, **(_DEPTH_FIRST[0] if host_loop else {})}


# The depth-first scheduler's option as XLA has spelt it, newest first; an XLA that takes
# none of them compiles with its default schedule. The first spelling is the cache's key.
_DEPTH_FIRST = (
  {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
  {"xla_cpu_enable_concurrency_optimized_scheduler": False},
  {},
)
_SPELLING = [0]  # the index of the spelling this process's XLA took


def compile_lowered(lowered, options: dict):
  """``lowered.compile(options)``, the scheduler's option (:func:`compiler_options`) in the
  first spelling this XLA takes."""
  (name,) = _DEPTH_FIRST[0]
  while True:
    spelt = dict(options)
    if spelt.pop(name, None) is not None:
      spelt.update(_DEPTH_FIRST[_SPELLING[0]])
    try:
      return lowered.compile(spelt or None)
    except jax.errors.JaxRuntimeError as error:
      refused = "No such compile option" in str(error) and any(
        f"'{option}'" in str(error) for option in _DEPTH_FIRST[_SPELLING[0]]
      )
      if not refused or name not in options:
        raise
      _SPELLING[0] += 1


def compiled_count() -> int:
  """How many programs the front doors have compiled in this process (every kind: a fused
  run, a method's program, an objective's value and gradient)."""
  return compiled_lib.compiles()


def call(entry: Callable, statics: tuple, dynamic: tuple, *, handle, traced: bool, key=None):
  """``entry(*statics, handle, *dynamic)``, compiled once per ``statics`` and shapes (``key``:
  the program's :func:`program_key`, where the caller has made it) and kept in the bounded
  cache (:mod:`hdm_optax.driver.compiled`).

  ``entry.num_statics`` leading arguments are static: hashable (the cache policy's keys);
  where one cannot be keyed (an optimizer that holds traced values) the entry is traced
  inline. ``handle`` is the hook's (:mod:`hdm_optax.driver.hooks`), an argument. In a
  caller's trace, or where any of ``dynamic`` is traced (``jax.grad``, ``jax.vmap``,
  ``jax.jvp`` around the front door, the arrays ``fun`` closes over included), the entry's
  ``jax.jit`` is called with XLA's default options: JAX takes ``compiler_options`` only at
  the top level.
  """
  dynamic = (handle, *dynamic)
  try:
    hash(statics)
  except TypeError:
    return entry(*statics, *dynamic)
  if traced or staged() or tracers(dynamic):
    return jitted(entry)(*statics, *dynamic)
  options = compiler_options(dynamic)
  build = lambda: jitted(entry).lower(*statics, *dynamic).compile(options or None)
  program = compiled_lib.lookup(key or program_key(entry, statics, dynamic), build)
  return compiled_lib.dispatched(program)(*dynamic)
