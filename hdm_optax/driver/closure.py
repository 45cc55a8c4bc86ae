"""Arrays that an objective closes over, as arguments of the compiled program.

``jax.jit`` keyed on a function bakes the arrays that function reads from outside
its arguments (closure cells, module globals, a bound method's object, an equinox
Module's fields, a ``functools.partial``'s arrays) into the program as constants:
rebind them to new data of the same shapes and the cached program answers for the
old data. :func:`hoist` makes a call solve the objective as it is at the call: it
traces ``fun`` on the call's abstract inputs (a fresh trace each call, so JAX's
trace cache cannot hand back old constants), and returns a function that evaluates
that trace with its constants passed as arguments. The returned function compares
equal to the one of another call when ``fun``, the non-array leaves of
``fun_args`` and the trace's structure (its equations and the Python scalars
written into it) are the same, so a compiled program cached on it is reused for
new data and rebuilt, not reused stale, when a closed-over Python number changes.

:func:`hdm_optax.solve`, :func:`hdm_optax.sweep` and :func:`hdm_optax.minimize`
call it before their compiled program when they are called outside a trace
(inside ``jax.jit``/``jax.vmap`` they trace inline, and the caller's own trace
sees the arrays as they are).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.core
import jax.extend.core as jex
from jax.extend import linear_util as lu
import numpy as np

__all__ = ("Closed", "hoist")

# Leaves of fun_args that enter the program as traced values (as jax.jit takes them).
_ARRAY_TYPES = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, int, float, complex, bool)


def _is_array(leaf) -> bool:
  return isinstance(leaf, _ARRAY_TYPES)


def _identity(fun):
  """What of ``fun`` a program is keyed on besides its trace.

  A function: itself, compared as ``jax.jit`` compares a static argument (by
  ``==``, so ``obj.method`` accessed twice is one function). A callable pytree (an
  equinox Module, its bound method): its structure, so that a Module with new
  arrays of the same shapes reuses the program (its arrays are in the trace's
  constants).
  """
  treedef = jax.tree.structure(fun)
  if jax.tree_util.treedef_is_leaf(treedef):
    return _Static(fun)
  try:
    hash(treedef)
  except TypeError:  # a static field that cannot be hashed
    return _Static(fun)
  return treedef


def _signature(jaxpr) -> tuple:
  """A hashable picture of ``jaxpr``: equations, shapes, dtypes and literals.

  Two traces of one function on inputs of the same shapes have equal signatures
  unless a Python number it reads (written into the trace as a literal) or its
  control flow changed. Functions in the equations' parameters (custom derivative
  rules) are compared by name, as ``str(jaxpr)`` prints them; this is cheaper than
  printing.
  """
  names = {}

  def atom(x):
    if isinstance(x, jex.Literal):
      value = np.asarray(x.val)  # its bytes: a NaN literal equals itself
      return ("literal", value.dtype.str, value.tobytes(), x.aval)
    return names.setdefault(x, len(names))

  def param(value):
    if isinstance(value, jex.ClosedJaxpr):
      return ("closed", _signature(value.jaxpr), tuple(np.shape(c) for c in value.consts))
    if isinstance(value, jex.Jaxpr):
      return ("jaxpr", _signature(value))
    if isinstance(value, (tuple, list)):
      return tuple(map(param, value))
    # A custom rule arrives wrapped anew at every trace (``lu.WrappedFun``, equal only to
    # itself): it too is compared by name.
    if isinstance(value, lu.WrappedFun) or (callable(value) and not isinstance(value, type)):
      return ("callable", getattr(value, "__name__", type(value).__name__))
    try:
      hash(value)
    except TypeError:
      return ("repr", repr(value))
    return value

  head = tuple((atom(v), v.aval) for v in (*jaxpr.constvars, *jaxpr.invars))
  eqns = tuple(
    (
      eqn.primitive.name,
      tuple(map(atom, eqn.invars)),
      tuple((atom(v), v.aval) for v in eqn.outvars),
      tuple((k, param(v)) for k, v in sorted(eqn.params.items())),
    )
    for eqn in jaxpr.eqns
  )
  return head, eqns, tuple(map(atom, jaxpr.outvars))


class _Static:
  """``obj`` compared by ``==`` where it is hashable (as ``jax.jit``'s static arguments), else
  by identity; held, so that an identity stays its own."""

  def __init__(self, obj):
    self.obj = obj
    try:
      self._hash = hash(obj)
      self._by_value = True
    except TypeError:
      self._hash, self._by_value = id(obj), False

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    if not isinstance(other, _Static) or other._hash != self._hash:
      return False
    if self.obj is other.obj:
      return True
    return self._by_value and other._by_value and bool(self.obj == other.obj)


class Closed:
  """``fun`` as traced at one call, with the trace's constants as its last argument.

  ``closed(params, *args, consts)`` is ``fun(params, *fun_args)``, where ``args`` is
  ``fun_args`` with its non-array leaves replaced by ``None`` (they are held here) and
  ``consts`` the arrays ``fun`` read from outside its arguments. Two instances are equal
  when ``fun`` and the held leaves compare equal as ``jax.jit``'s static arguments do (a
  callable pytree, such as an equinox Module, by its structure) and the traces have one
  signature (equations, shapes, dtypes and literals); their constants may differ.
  """

  def __init__(self, fun, statics, jaxpr, out_tree):
    self._jaxpr = jaxpr
    self._out_tree = out_tree
    self._key = (_identity(fun), tuple(map(_Static, statics)), out_tree, _signature(jaxpr))
    self._name = getattr(fun, "__name__", type(fun).__name__)

  def __call__(self, params, *args):
    *args, consts = args
    leaves = jax.tree.leaves((params, args))
    out = jax.core.eval_jaxpr(self._jaxpr, consts, *leaves)
    return jax.tree.unflatten(self._out_tree, out)

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, Closed) and other._key == self._key

  def __repr__(self):
    return f"Closed({self._name})"


def hoist(fun: Callable[..., Any], params: Any, fun_args: tuple) -> tuple[Closed, tuple]:
  """``fun`` with the arrays it closes over as an argument, traced at this call.

  Args:
    fun: ``fun(params, *fun_args) -> Any`` (a scalar, or ``(scalar, aux)``).
    params: the params, or values of their shapes and dtypes.
    fun_args: ``fun``'s other arguments; array leaves (JAX and NumPy arrays, Python
      numbers) stay arguments, other leaves (functions, strings) are held by the result.

  Returns:
    ``(closed, args)``, ``closed(params, *args)`` equal to ``fun(params, *fun_args)``:
    ``args`` is ``fun_args`` with its non-array leaves replaced by ``None``, followed by
    the list of arrays ``fun`` read from outside its arguments at this call.

  Examples:
    >>> import jax.numpy as jnp
    >>> from hdm_optax.driver import closure
    >>> a = jnp.array([1.0, 2.0])
    >>> fun = lambda x: jnp.sum(a * x)
    >>> closed, args = closure.hoist(fun, jnp.ones(2), ())
    >>> a = jnp.array([3.0, 4.0])  # rebound: a new trace sees it, as an argument
    >>> again, new_args = closure.hoist(fun, jnp.ones(2), ())
    >>> again == closed, float(closed(jnp.ones(2), *args)), float(again(jnp.ones(2), *new_args))
    (True, 3.0, 7.0)
  """
  leaves, treedef = jax.tree.flatten(tuple(fun_args))
  arrays = [_is_array(leaf) for leaf in leaves]
  statics = tuple(leaf for leaf, array in zip(leaves, arrays) if not array)
  args = jax.tree.unflatten(treedef, [leaf if a else None for leaf, a in zip(leaves, arrays)])

  def flat(params, args):
    given = iter(jax.tree.leaves(args))
    held = iter(statics)
    full = [next(given) if a else next(held) for a in arrays]
    return fun(params, *jax.tree.unflatten(treedef, full))

  # A new function each call: jax.make_jaxpr caches traces on the function's identity.
  traced, shape = jax.make_jaxpr(lambda p, a: flat(p, a), return_shape=True)(params, args)
  closed = Closed(fun, statics, traced.jaxpr, jax.tree.structure(shape))
  return closed, (*args, list(traced.consts))
