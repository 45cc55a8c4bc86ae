"""Small pieces shared by every HDM variant: diagnostics, dtype and input checks."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hdm_optax import _blocks


class HDMInfo(NamedTuple):
  """Diagnostics of the last update, kept in every HDM state as ``info``.

  Attributes:
    accepted: whether the trial point became the new iterate (False on a null
      step or on a non-finite trial point).
    hypergrad_norm: Euclidean norm of the hypergradient used to update P
      (and B or beta when learned), at the last update (0 if it was not finite).
    num_null_steps: number of updates so far that kept the iterate.
    null_run: number of consecutive null steps up to and including the last
      update (0 after an accepted one); a run that only makes null steps has
      stalled (``hdm_optax.solve`` reports it).
    num_value_evals: objective evaluations made by ``update`` so far.
    num_grad_evals: gradient evaluations made by ``update`` so far.
    num_stale_updates: updates so far that received params other than the
      point of the cached f and grad f together with the cached ``value``:
      the value and gradient they were given belong to another point
      (``hdm_optax._common.track_point``). 0 in every correct loop.
    point_sum: the fingerprint of the point of the cached f and grad f
      (a weighted sum of its entries, ``_common.point_fingerprint``).
    point_scale: the sum of the absolute entries of the params the last
      update received, the scale of ``point_sum``'s rounding; -1 where the last update
      ran without the check (``values_at_params``): no point is recorded.
    num_uphill_trials: rejected trials whose step went down the received updates u but not
      down f (:math:`\\langle u, s\\rangle < 0 \\le \\langle \\nabla f(x), s\\rangle`). Always 0
      where the method is first or alone in a chain (u is grad f); where a transformation
      before it changed u (a weight decay, whose term f leaves out), the run stalls on such
      trials: put the term in f (:func:`uphill_advice`).    nonfinite_run: updates since the last accepted one before the last update (the last
      update included) whose evaluations met a non-finite f or grad f; after an accepted
      update, 1 where one of its own candidates did, else 0. The stop rule reads it: a
      small decrease right after such trials is the edge of the region where f is finite,
      not a sign of convergence (:func:`hdm_optax.driver.engine.judge`).
  """

  accepted: jax.Array
  hypergrad_norm: jax.Array
  num_null_steps: jax.Array
  null_run: jax.Array
  num_value_evals: jax.Array
  num_grad_evals: jax.Array
  num_stale_updates: jax.Array
  point_sum: jax.Array
  point_scale: jax.Array
  num_uphill_trials: jax.Array
  nonfinite_run: jax.Array


def init_info(dtype) -> HDMInfo:
  zero = jnp.zeros([], jnp.int32)
  return HDMInfo(
    accepted=jnp.asarray(True),
    hypergrad_norm=jnp.zeros([], dtype),
    num_null_steps=zero,
    null_run=zero,
    num_value_evals=zero,
    num_grad_evals=zero,
    num_stale_updates=zero,
    point_sum=jnp.zeros([], dtype),
    point_scale=jnp.zeros([], dtype),
    num_uphill_trials=zero,
    nonfinite_run=zero,
  )


def null_steps(state) -> Any:
  """The null steps every hdm_optax method in ``state`` made (:attr:`HDMInfo.num_null_steps`,
  summed; 0 where there is none): a resumed run's count of them."""
  infos = [i for i in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, HDMInfo))]
  counts = [i.num_null_steps for i in infos if isinstance(i, HDMInfo)]
  return sum(counts, jnp.zeros([], jnp.int32))


def uphill_advice(state) -> str:
  """What to do where a transformation before an HDM method stalls it ("" where nothing).

  Reads :attr:`HDMInfo.num_uphill_trials` of every HDM state in ``state`` (concrete
  values: an optimizer state after a run, or a state with a leading batch axis).
  """
  infos = [
    leaf
    for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, HDMInfo))
    if isinstance(leaf, HDMInfo)
  ]
  uphill = sum(int(np.sum(np.asarray(info.num_uphill_trials))) for info in infos)
  if not uphill:
    return ""
  return (
    f"{uphill} rejected trials went down the updates the method received but not down f: a "
    "transformation before it in the chain (such as optax.add_decayed_weights) changed the "
    "direction by a term that f does not contain, so the method rejects the steps that term "
    "asks for; put the term in f (for a weight decay, f(x) + 0.5 * wd * ||x||^2) and drop "
    "the transformation"
  )


def oracle_fields(params, dtype) -> dict:
  """The fields every state of the package shares, as ``init`` sets them.

  ``count`` 0, ``value`` +inf and ``grad`` 0 (nothing evaluated yet) and
  fresh ``info``.
  """
  return dict(
    count=jnp.zeros([], jnp.int32),
    value=jnp.asarray(jnp.inf, dtype),
    grad=optax.tree.zeros_like(params),
    info=init_info(dtype),
  )


def next_info(
  info: HDMInfo, *, accepted, hypergrad_norm, calls: int, uphill=False, finite=True
) -> HDMInfo:
  """Info after one update that made ``calls`` value-and-gradient calls.

  ``uphill``: the trial was rejected and went down the received updates but not down f
  (:attr:`HDMInfo.num_uphill_trials`). ``finite``: f and grad f were finite at every point
  the update evaluated (:attr:`HDMInfo.nonfinite_run`).
  """
  nonfinite = (~jnp.asarray(finite)).astype(jnp.int32)
  return info._replace(
    nonfinite_run=jnp.where(accepted, nonfinite, info.nonfinite_run + nonfinite).astype(jnp.int32),
    num_uphill_trials=info.num_uphill_trials + jnp.asarray(uphill).astype(jnp.int32),
    accepted=jnp.asarray(accepted),
    # 0 when the trial point was not finite (no hypergradient was used).
    hypergrad_norm=jnp.where(jnp.isfinite(hypergrad_norm), hypergrad_norm, 0).astype(
      info.hypergrad_norm.dtype
    ),
    num_null_steps=info.num_null_steps + (~accepted).astype(jnp.int32),
    null_run=jnp.where(accepted, 0, info.null_run + 1).astype(jnp.int32),
    num_value_evals=info.num_value_evals + calls,
    num_grad_evals=info.num_grad_evals + calls,
  )


def _described(out) -> str:
  """What a function returned, in words (its structure, shapes and dtypes, not tracers)."""
  if isinstance(out, (tuple, list)):
    return f"a {type(out).__name__} of length {len(out)}"
  leaves = jax.tree.leaves(out)
  if len(leaves) == 1 and jax.tree.structure(out).num_nodes == 1:
    return f"a single array of shape {jnp.shape(out)} and dtype {jnp.result_type(out)}"
  return f"a {type(out).__name__} with {len(leaves)} array(s)"


def params_dtype(params) -> jnp.dtype:
  """The floating dtype of ``params``; raises for integer, complex or mixed."""
  leaves = jax.tree.leaves(params)
  if not leaves:
    raise ValueError("params is an empty pytree: there is nothing to optimize.")
  if not any(math.prod(jnp.shape(leaf)) for leaf in leaves):
    shapes = [jnp.shape(leaf) for leaf in leaves]
    raise ValueError(
      f"params has no entries (leaves of shapes {shapes}): there is nothing to optimize; "
      "pass params with at least one entry."
    )
  dtypes = {jnp.asarray(leaf).dtype for leaf in leaves}
  for dt in dtypes:
    if not jnp.issubdtype(dt, jnp.floating):
      raise TypeError(
        f"params must be real floating-point arrays, got dtype {dt}; "
        "cast them, e.g. jnp.asarray(x, jnp.float32)."
      )
  if len(dtypes) > 1:
    raise TypeError(f"all params leaves must share one dtype, got {sorted(map(str, dtypes))}.")
  return dtypes.pop()


def cast(value, dtype) -> jax.Array:
  """A hyper-parameter as a 0-d array of the params dtype (no promotion)."""
  return jnp.asarray(value).astype(dtype)


def all_finite(*trees) -> jax.Array:
  return _blocks.all_finite(*trees)


def safe_div(num, den):
  """``num / den`` with 0 where ``den == 0`` (the gradient is exactly zero)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1), 0)


def scaled_norm(tree, square=None) -> jax.Array:
  """The Euclidean norm of a pytree, without overflow where its square overflows.

  Where the sum of squares (``square``, computed here when not given) is finite, its square
  root; where it is not (entries of 1e19 in float32, 1e155 in float64), ``m * ||tree / m||``
  with ``m`` the largest magnitude. The rescaled norm is computed only where it is needed
  (``lax.cond``; under ``jax.vmap``, for every member).
  """
  if square is None:
    square = optax.tree.vdot(tree, tree)
  norm = jnp.sqrt(square)

  def rescaled():
    biggest = optax.tree.norm(tree, ord=jnp.inf).astype(norm.dtype)
    unit = optax.tree.scale(safe_div(jnp.ones([], norm.dtype), biggest), tree)
    return (biggest * optax.tree.norm(unit)).astype(norm.dtype)

  return jax.lax.cond(jnp.isfinite(norm), lambda: norm, rescaled)


def copy_tree(tree):
  """Fresh buffers (so a state built by ``init`` can be donated)."""
  return jax.tree.map(jnp.array, tree)


def keep_if(pred, new, old):
  """``new`` where ``pred`` else ``old``, leaf by leaf (a null step)."""
  return optax.tree.where(pred, new, old)


def require_oracle(name: str, value, grad, value_fn, updates, params=None, state_grad=None):
  """Checks the extra args of ``update`` and returns ``(value, grad)``.

  With ``params``, also checks that ``updates`` and ``grad`` (and the state's
  cached ``state_grad``, i.e. the pytree ``init`` saw) have the pytree
  structure and leaf shapes of ``params``.
  """
  missing = [n for n, v in (("value", value), ("value_fn", value_fn)) if v is None]
  if missing:
    raise TypeError(
      f"{name}.update needs the keyword arguments value=, grad= and value_fn= "
      f"(missing: {', '.join(missing)}). Call it as in\n"
      "  value_and_grad = optax.value_and_grad_from_state(fun)\n"
      "  value, grad = value_and_grad(params, state=state)\n"
      "  updates, state = opt.update(grad, state, params, value=value, "
      "grad=grad, value_fn=fun)\n"
      "or use hdm_optax.solve(opt, fun, params, max_steps=...)."
    )
  if grad is None:
    grad = updates
  if not callable(value_fn):
    raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}.")
  if params is not None:
    for what, tree in (
      ("the gradient (updates)", updates),
      ("grad=", grad),
      ("the optimizer state (built by init)", state_grad),
    ):
      if tree is not None:
        check_like(name, what, tree, params)
  return value, grad


# The point check's tolerance, in eps of the params' dtype times the sum of |x| over
# the point before and after the update (the weights are below 1.5): a fused
# multiply-add in the update's trial point (which XLA uses and ``optax.apply_updates``
# cannot) moves an entry by an eps of the larger of x and the step, and the two sums
# reduce in their own kernels.
_POINT_EPS = 256


def point_fingerprint(params) -> tuple[jax.Array, jax.Array]:
  r"""A point's summary in two scalars: :math:`(\sum_i w_i x_i,\ \sum_i |x_i|)`.

  The weights :math:`w_i \in [0.5, 1.5)` are a fixed hash of each entry's position
  (over the leaves in order), so a change whose entries sum to zero (a gradient step
  on a translation-invariant f) still moves the weighted sum. Each leaf is one pass
  that XLA fuses into the kernel that reads or produces it.

  Args:
    params: a pytree of float arrays of one dtype.

  Returns:
    ``(weighted_sum, absolute_sum)``, scalars of the params' dtype.
  """
  sums, scales, offset = [], [], 0
  for leaf in jax.tree.leaves(params):
    leaf = jnp.asarray(leaf)
    index = jax.lax.iota(jnp.uint32, leaf.size).reshape(leaf.shape) + jnp.uint32(offset % 2**32)
    mixed = (index * jnp.uint32(0x9E3779B1)) >> jnp.uint32(8)  # Knuth's multiplicative hash
    weight = 0.5 + mixed.astype(leaf.dtype) * 2.0**-24
    sums.append(jnp.sum(weight * leaf))
    scales.append(jnp.sum(jnp.abs(leaf)))
    offset += leaf.size
  return functools.reduce(jnp.add, sums), functools.reduce(jnp.add, scales)


# Entries of each leaf of the gradient compared with the cached gradient's, evenly spaced.
_GRAD_SAMPLES = 8


def _sample(tree) -> list:
  """A few entries of each leaf, evenly spaced (the first and the last among them)."""
  out = []
  for leaf in jax.tree.leaves(tree):
    flat = jnp.reshape(leaf, -1)
    index = np.unique(np.linspace(0, flat.size - 1, min(flat.size, _GRAD_SAMPLES)).astype(int))
    out.append(flat[index])
  return out


def _is_stale(state, params, value, grad, point_sum, point_scale) -> jax.Array:
  """Whether ``update`` received a stale cache.

  Stale: the params are not the point of the cache (beyond rounding) while the value and
  gradient received are the cached ones (the value bit for bit, and a few entries of the
  gradient). A fresh evaluation at the params differs from the cache unless f and grad f
  agree at the two points, and then nothing is wrong. The gradient's entries are read, not
  reduced: no pass over the gradient. Before the first update no point is recorded (a
  cache set from outside, as ``hdm_optax.solve`` sets it at x0, is not checked).
  """
  old = state.info
  dtype = old.point_sum.dtype
  tol = _POINT_EPS * float(jnp.finfo(dtype).eps) * (point_scale + old.point_scale)
  recorded = (old.num_grad_evals > 0) & (old.point_scale >= 0)
  elsewhere = recorded & (jnp.abs(point_sum - old.point_sum) > tol)
  same_value = jnp.isfinite(state.value) & (jnp.asarray(value).astype(dtype) == state.value)
  same_grad = jnp.all(
    jnp.stack([jnp.all(a == b) for a, b in zip(_sample(grad), _sample(state.grad))])
  )
  return elsewhere & same_value & same_grad


def _stale_warning(name: str) -> str:
  return (
    f"{name}.update received params other than the point where it cached f and grad f, "
    "together with that cached value: value= and grad= belong to another point. It "
    "evaluated f and grad f at the params instead (one more oracle call at every such "
    "update, counted in info.num_stale_updates). A transformation after it in optax.chain "
    f"changed its update (e.g. optax.chain({name}(), optax.scale(0.5))) and "
    f"optax.value_and_grad_from_state returned the cache. Put {name} last in the chain, or "
    "call hdm_optax.value_and_grad_from_state(fun), which evaluates f at the params then "
    "(docs/pitfalls.md)."
  )


def _refresh(state, params, value, grad, value_fn, fingerprint, report):
  """``(value, grad, stale)``: f and grad f at ``params`` where the cache received was stale.

  Concrete values (outside ``jit``) branch in Python; traced ones in ``lax.cond``, whose
  evaluation branch reports through ``jax.debug.callback``. Under ``jax.vmap`` the batch
  takes one ``lax.cond`` on whether any member is stale (:func:`_fresh_where_stale`): a
  correct loop pays no evaluation and no host call.
  """
  dtype = state.value.dtype
  stale = _is_stale(state, params, value, grad, *fingerprint)
  kept = (jnp.asarray(value).astype(dtype), grad)

  def evaluate(params, *consts):
    fresh_value, fresh_grad = value_and_grad(lambda p: evaluate_fn(p, *consts), params)
    fresh_grad = jax.tree.map(lambda new, old: jnp.asarray(new).astype(old.dtype), fresh_grad, grad)
    return jnp.asarray(fresh_value).astype(dtype), fresh_grad

  if not isinstance(stale, jax.core.Tracer):
    evaluate_fn = lambda p: value_fn(p)
    if bool(stale):
      report(True)
      return (*evaluate(params), stale)
    return value, grad, stale
  evaluate_fn, consts = jax.closure_convert(value_fn, params)
  return (*_fresh_where_stale(evaluate, report)(stale, kept, params, consts), stale)


def _fresh_where_stale(evaluate, report):
  """``pick(stale, kept, params, consts)``: ``evaluate(params, *consts)`` where stale, else kept."""

  @jax.custom_batching.custom_vmap
  def pick(stale, kept, params, consts):
    def fresh():
      jax.debug.callback(report, stale)
      return evaluate(params, *consts)

    return jax.lax.cond(stale, fresh, lambda: kept)

  @pick.def_vmap
  def _batched(axis_size, in_batched, stale, kept, params, consts):
    spread = lambda tree, flags: jax.tree.map(
      lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + jnp.shape(a)), tree, flags
    )
    stale, kept, params = (spread(*pair) for pair in zip((stale, kept, params), in_batched))
    axes = jax.tree.map(lambda b: 0 if b else None, in_batched[3])

    def fresh():
      jax.debug.callback(report, stale)  # one host call for the batch
      new = jax.vmap(evaluate, in_axes=(0, *axes))(params, *consts)
      row = lambda a, b: jnp.where(jnp.reshape(stale, (-1,) + (1,) * (a.ndim - 1)), a, b)
      return jax.tree.map(row, new, kept)

    out = jax.lax.cond(jnp.any(stale), fresh, lambda: kept)
    return out, jax.tree.map(lambda _: True, out)

  return pick


def _recorded(info: HDMInfo, params, updates, point_scale, stale) -> HDMInfo:
  """``info`` with the fingerprint of the new cache's point and the stale update's call."""
  dtype = info.point_sum.dtype
  next_point, _ = point_fingerprint(optax.apply_updates(params, updates))
  calls = jnp.asarray(stale).astype(jnp.int32)
  return info._replace(
    num_value_evals=info.num_value_evals + calls,
    num_grad_evals=info.num_grad_evals + calls,
    num_stale_updates=info.num_stale_updates + calls,
    point_sum=next_point.astype(dtype),
    point_scale=point_scale.astype(dtype),
  )


_VALUES_AT_PARAMS = contextvars.ContextVar("hdm_optax_values_at_params", default=False)


@contextlib.contextmanager
def values_at_params():
  """A context in which ``update`` takes ``value`` and ``grad`` as f and grad f at the params.

  Updates traced or run inside it leave :func:`track_point`'s stale-cache check out of
  the program (under ``jax.vmap`` that check's evaluation at the params runs at every
  update). The drivers trace their loops inside it, since they always evaluate at the
  params; a loop of your own that does the same can too. It is the form of the extra
  argument ``value_at_params=True`` for chains with ``optax.lbfgs``, whose linesearch
  passes extra arguments on to ``value_fn`` and rejects that one.

  Returns:
    A context manager.

  Examples:
    >>> import jax, jax.numpy as jnp, hdm_optax
    >>> fun = lambda x: jnp.sum(x ** 2)
    >>> opt = hdm_optax.trial_lbfgs()
    >>> x = jnp.ones((4, 3))
    >>> state = jax.vmap(opt.init)(x)
    >>> def step(x, state):
    ...   value, grad = jax.value_and_grad(fun)(x)
    ...   return opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
    >>> with hdm_optax.values_at_params():
    ...   updates, state = jax.jit(jax.vmap(step))(x, state)
    >>> updates.shape
    (4, 3)
  """
  token = _VALUES_AT_PARAMS.set(True)
  try:
    yield
  finally:
    _VALUES_AT_PARAMS.reset(token)


def track_point(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorates an ``update_fn``: it never acts on a cache of another point.

  A transformation caches f and grad f at ``params + u``, ``u`` the update it
  returns. The next ``update`` must receive that point; when it receives another
  one (a later transformation in ``optax.chain`` changed ``u``) together with the
  cached ``value`` (``optax.value_and_grad_from_state`` returns the cache it finds),
  the value and gradient it was given belong to another point. The decorated
  ``update_fn`` then evaluates f and grad f at the params with ``value_fn`` (one
  more oracle call, counted in ``info``'s calls) and acts on those, counts the
  update in ``info.num_stale_updates`` and warns, once per transformation, under
  ``jit`` too (through ``jax.debug.callback``). Incoming ``updates`` that are the
  received gradient itself (the method first in the chain) are replaced by the
  fresh gradient; updates that a transformation before the method made from the
  stale gradient are kept as they are.

  The check compares :func:`point_fingerprint` of the params with the one
  recorded for the cache (two scalars in ``info``, no vector of n kept), within
  rounding: a change of the point below ``256 eps`` of its entries' magnitudes
  goes unseen. Under ``jit`` the evaluation is a ``lax.cond``; under ``vmap`` a
  cond runs both branches, so a vmapped loop of one's own pays the call at every
  update. A caller that always passes f and grad f at the params (as
  ``hdm_optax.solve``, ``sweep``, ``minibatch_step`` and
  ``hdm_optax.value_and_grad_from_state`` loops do) says so with the extra argument
  ``value_at_params=True`` (where no optax linesearch is in the chain: it passes extra
  arguments on to ``value_fn``) or by calling ``update`` within :func:`values_at_params`,
  as the drivers do: the check is then left out of the program.

  Args:
    name: the transformation's name, for the warning.

  Returns:
    The decorator.
  """

  def decorate(update_fn):
    warned = []

    def report(stale):
      if np.any(stale) and not warned:
        warned.append(True)
        warnings.warn(_stale_warning(name), stacklevel=5)

    @functools.wraps(update_fn)
    def checked(
      updates,
      state,
      params,
      *,
      value=None,
      grad=None,
      value_fn=None,
      value_at_params=False,
      **extra_args,
    ):
      value, received = require_oracle(
        name, value, grad, value_fn, updates, params=params, state_grad=state.grad
      )
      if value_at_params or _VALUES_AT_PARAMS.get():  # the check is off: nothing of it runs
        out, new_state = update_fn(
          updates, state, params, value=value, grad=received, value_fn=value_fn, **extra_args
        )
        unknown = -jnp.ones_like(new_state.info.point_scale)  # no point recorded
        return out, new_state._replace(info=new_state.info._replace(point_scale=unknown))
      point_sum, point_scale = point_fingerprint(params)
      value, fresh, stale = _refresh(
        state, params, value, received, value_fn, (point_sum, point_scale), report
      )
      if updates is None or _same_leaves(updates, received):
        updates = fresh
      out, new_state = update_fn(
        updates, state, params, value=value, grad=fresh, value_fn=value_fn, **extra_args
      )
      info = _recorded(new_state.info, params, out, point_scale, stale)
      return out, new_state._replace(info=info)

    return checked

  return decorate


def _same_leaves(a, b) -> bool:
  """The two trees hold the same leaf objects (one tree passed twice, at trace time)."""
  return all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class _Identity:
  """A key that is equal only to itself (an unhashable argument, such as an array)."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __eq__(self, other):
    return isinstance(other, _Identity) and other.value is self.value

  def __hash__(self):
    return id(self.value)


def _config_key(value):
  """``value`` as part of a hashable key: numbers with their type, containers item by item."""
  if value is None or isinstance(value, (bool, int, float, complex, str, bytes, np.generic)):
    return (type(value), value)  # 1, 1.0 and True build different programs
  if type(value) in (tuple, list):  # pylint: disable=unidiomatic-typecheck
    return (type(value), tuple(_config_key(v) for v in value))
  if type(value) is dict:  # pylint: disable=unidiomatic-typecheck
    return (dict, tuple((k, _config_key(v)) for k, v in value.items()))
  try:
    hash(value)
  except TypeError:
    return _Identity(value)
  return value


class ConfiguredTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that knows the factory call that built it.

  Two are equal, and hash alike, when the same factory was called with equal
  arguments (defaults filled in; numbers compared with their type; an argument
  that cannot be hashed, such as an array, only with itself), so a cache keyed on
  the transformation, as :func:`hdm_optax.solve`'s compiled programs are, serves
  every equal one: ``solve(trial_lbfgs(), ...)`` in a loop compiles once.
  Otherwise it is the ``optax.GradientTransformationExtraArgs`` of the factory.
  """

  def __new__(cls, init, update, configuration=None):
    self = super().__new__(cls, init, update)
    self.configuration = configuration
    return self

  def _configuration(self):
    # None after optax's ``_replace``/``_make``, which build the tuple alone.
    return getattr(self, "configuration", None)

  def __eq__(self, other):
    mine = self._configuration()
    theirs = getattr(other, "configuration", None)
    if mine is None or theirs is None:
      return tuple.__eq__(self, other)
    return mine == theirs

  def __ne__(self, other):
    return not self == other

  def __hash__(self):
    mine = self._configuration()
    return tuple.__hash__(self) if mine is None else hash(mine)

  def __repr__(self):
    mine = self._configuration()
    return super().__repr__() if mine is None else repr(mine)


class _Call:
  """A factory and its bound arguments; equal calls are equal keys."""

  __slots__ = ("factory", "arguments", "_key")

  def __init__(self, factory, arguments: dict):
    self.factory = factory
    self.arguments = arguments
    self._key = (factory, tuple((k, _config_key(v)) for k, v in arguments.items()))

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

  Args:
    factory: a function returning an ``optax.GradientTransformationExtraArgs``.

  Returns:
    The factory, with its name, docstring and signature.
  """
  signature = inspect.signature(factory)

  @functools.wraps(factory)
  def build(*args, **kwargs):
    transformation = factory(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    configuration = _Call(build, dict(bound.arguments))
    return ConfiguredTransformation(transformation.init, transformation.update, configuration)

  return build


def require_untransformed(name: str, updates, grad, reason: str):
  """Raises a ``ValueError`` unless ``updates`` are the gradient itself (leaf for leaf).

  For a variant that cannot honour a transformation before it in a chain:
  refusing is better than dropping the user's clipping or weight decay without
  a word. Identity is checked on the leaves (at trace time), so ``grad`` passed
  as both ``updates`` and ``grad=``, or through ``optax.identity()``, passes.
  """
  if not _same_leaves(updates, grad):
    raise ValueError(
      f"{name}.update got updates that differ from grad=: a transformation before "
      f"{name} in optax.chain changed them, and {name} cannot honour it ({reason}). "
      f"Put {name} first (or alone) in the chain, or use a variant that steps along the "
      "incoming updates (hdm, hdm_hb, hdm_best, hdm_auto, osgm_best)."
    )


def _shapes(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [tuple(jnp.shape(leaf)) for leaf in leaves]


def check_like(name: str, what: str, tree, params):
  """Raises a ``ValueError`` unless ``tree`` is shaped like ``params``."""
  t_def, t_shapes = _shapes(tree)
  p_def, p_shapes = _shapes(params)
  if t_def != p_def:
    raise ValueError(
      f"{name}.update: {what} does not have the pytree structure of params:\n"
      f"  params: {p_def}\n  got:    {t_def}"
    )
  if t_shapes != p_shapes:
    raise ValueError(
      f"{name}.update: {what} does not have the leaf shapes of params: "
      f"params {p_shapes}, got {t_shapes}"
    )


def value_and_grad(value_fn: Callable[..., Any], params, *, has_aux: bool = False, name="value_fn"):
  """One oracle call, like ``jax.value_and_grad``; checks what ``value_fn`` returns.

  Args:
    value_fn: ``value_fn(params) -> scalar``, or ``-> (scalar, aux)`` with ``has_aux``.
    params: where to evaluate.
    has_aux: ``value_fn`` returns a pair ``(value, aux)``; then the result is
      ``((value, aux), grad)``, as with ``jax.value_and_grad(..., has_aux=True)``.
    name: the function's name in the error messages (the drivers call it ``fun``).

  Returns:
    ``(value, grad)``, or ``((value, aux), grad)`` with ``has_aux``.
  """

  def checked_fn(p):
    out = value_fn(p)
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
          f"with has_aux=True, {name} must return a pair (value, aux), got {_described(out)}; "
          f"return (value, aux), or drop has_aux=True."
        )
      value = out[0]
    elif isinstance(out, (tuple, list)):
      raise TypeError(
        f"{name} returned a {type(out).__name__} of length {len(out)}, not a scalar; "
        "if it returns (value, aux), pass has_aux=True to hdm_optax.solve / sweep, or "
        "give the transformation value_fn=lambda p: fun(p)[0]."
      )
    else:
      value = out
    if jnp.ndim(value) != 0:
      raise TypeError(
        f"{name} must return a scalar, got an array of shape {jnp.shape(value)}; return e.g. "
        f"jnp.sum(...) or value[0]."
      )
    return out

  return jax.value_and_grad(checked_fn, has_aux=has_aux)(params)


# Construction-time checks. Python numbers and concrete arrays are checked;
# traced values skip them (vmap sweeps build optimizers from tracers).


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
