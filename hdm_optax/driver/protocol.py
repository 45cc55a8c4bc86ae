"""What the driver reads of an optimizer: one small protocol, and its defaults.

A driver runs any optax transformation. What it reads of the optimizer's state, beyond
``init`` and ``update``:

- **its cache of f and grad f** (:func:`cache_at_params`): a transformation that caches
  ``value`` and ``grad`` in its state (every hdm_optax transformation, optax's linesearches
  and so ``optax.lbfgs``) caches them at the point *its* update leads to; they are f and grad
  f at the new params where that update reaches the params unchanged. The fields'
  names are the contract, and :func:`calls_in_update` counts the oracle calls an update made
  from the counters a state keeps (hdm_optax's ``info``, optax's ``num_linesearch_steps``);
  so do :func:`null_steps` (a resumed run's count) and :func:`nonfinite_trials` (the stop
  rule's edge of the region where f is finite) from ``num_null_steps`` and ``nonfinite_run``.
- **its verdict, its box and its preconditioner**: a state that speaks
  :class:`OptimizerState` (every hdm_optax method's state does, at any depth of a chain's
  state) says whether its step rule accepted the update (:func:`accepted`), which bounds
  its iterate keeps (:func:`box_of`), and which approximation of the inverse Hessian it
  holds (:func:`preconditioner`, for the implicit adjoint's linear solves).

Any other optax transformation gets the defaults: every update accepted, no box, no
preconditioner, and a cache only where its state has ``value`` and ``grad`` fields.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

__all__ = (
  "ArgNames",
  "OptimizerState",
  "accepted",
  "box_of",
  "cache_at_params",
  "caches_anywhere",
  "calls_in_update",
  "check_optimizer",
  "check_state",
  "is_optimizer",
  "nonfinite_trials",
  "null_steps",
  "preconditioner",
  "with_box_of",
)


def is_optimizer(obj) -> bool:
  """Whether ``obj`` is an optax transformation: it has ``init`` and ``update`` (duck typed:
  ``optax.MultiSteps`` is no ``optax.GradientTransformation``)."""
  return callable(getattr(obj, "init", None)) and callable(getattr(obj, "update", None))


def check_optimizer(door: str, optimizer):
  """``optimizer``, refused where it is no optax transformation (no ``init`` and ``update``).

  The common case is the factory given instead of what it builds
  (``solve(hdm_optax.trial_lbfgs, ...)``), which otherwise fails deep in the run with
  "'function' object has no attribute 'init'".

  Returns:
    ``optimizer``; a plain ``optax.GradientTransformation`` (whose ``update`` takes no
    extra arguments) wrapped by ``optax.with_extra_args_support``, which drops the
    ``value``, ``grad`` and ``value_fn`` a driver passes.

  Raises:
    TypeError: naming what was given and the fix (call the factory).
  """
  if is_optimizer(optimizer):
    plain = not isinstance(optimizer, optax.GradientTransformationExtraArgs)
    if plain and isinstance(optimizer, optax.GradientTransformation):
      return optax.with_extra_args_support(optimizer)
    return optimizer
  if callable(optimizer):
    name = getattr(optimizer, "__qualname__", None) or type(optimizer).__name__
    module = (getattr(optimizer, "__module__", None) or "").split(".")[0]
    call = f"{module}.{name}" if module in ("hdm_optax", "optax") else name
    call += "()" if module == "hdm_optax" else "(...)"  # hdm_optax's settings have defaults
    raise TypeError(
      f"{door}: optimizer must be an optax transformation (with init and update), got "
      f"{name!r}, a callable without them (the factory?); call it to build the optimizer: "
      f"{door}({call}, ...)."
    )
  raise TypeError(
    f"{door}: optimizer must be an optax transformation (with init and update), got "
    f"{optimizer!r} ({type(optimizer).__name__}); pass one, e.g. hdm_optax.trial_lbfgs()."
  )


# Counters of the oracle calls an update makes (:func:`calls_in_update`).
_CALL_COUNTERS = ("num_value_evals", "num_grad_evals", "num_linesearch_steps")


class ArgNames(NamedTuple):
  """How a front door names its arguments in the messages of the checks it shares.

  The defaults are the drivers' (``solve(optimizer, fun, init_params, init_state=...,
  fun_args=...)``); a door whose arguments have other names passes its own, so that each
  message names what its user wrote.

  Attributes:
    door: the door's name, put before each message (``""``: none).
    fun: the objective, called ``fun(params, *fun_args)``.
    fun_args: the objective's extra arguments (its data).
    params: the params a run starts from.
    state: an optimizer state handed in.
    state_source: where a state that fits comes from, said after "Pass the state of a run
      ...".
  """

  door: str = ""
  fun: str = "fun"
  fun_args: str = "fun_args"
  params: str = "init_params"
  state: str = "init_state"
  state_source: str = "(result.state), or leave init_state out"

  def lead(self, text: str) -> str:
    """``text`` after the door's name, where the door has one."""
    return f"{self.door}: {text}" if self.door else text


def _nodes(state, kind) -> list:
  """The nodes of ``state`` that are ``kind``, in the tree's order."""
  is_kind = lambda node: isinstance(node, kind)
  return [node for node in jax.tree.leaves(state, is_leaf=is_kind) if is_kind(node)]


def check_state(state) -> None:
  """Refuses the optax wrappers a driver cannot run, found in the structure of ``state``
  (an optimizer's ``init``, or its ``jax.eval_shape``): no cost at run time.

  - ``optax.MultiSteps`` around a transformation that calls the oracle in its update (an
    hdm_optax method, ``optax.lbfgs``): MultiSteps runs the inner update, calls included, on
    every mini-step but keeps its state only on the k-th, so the mini-steps' calls would
    escape ``num_grad_evals`` and ``max_grad_evals``. Around other transformations it runs.
  - ``optax.lookahead``: its params are ``optax.LookaheadParams``, a driver's plain.

  Raises:
    TypeError: naming the wrapper, why, and the fix.
  """
  for multi in _nodes(state, optax.MultiStepsState):
    calls = [k for k in _CALL_COUNTERS if optax.tree.get_all_with_path(multi.inner_opt_state, k)]
    if calls:
      raise TypeError(
        "optimizer: optax.MultiSteps(...) around a transformation that calls f in its update "
        f"(its state counts {', '.join(calls)}: an hdm_optax method, optax.lbfgs) is refused. "
        "MultiSteps runs the inner update, with its oracle calls, on every mini-step but "
        "keeps the inner state only every k-th, so the mini-steps' calls would escape "
        "num_grad_evals and max_grad_evals, and their trials would be wasted. Pass the "
        "method alone (e.g. solve(hdm_optax.trial_lbfgs(), ...)); for minibatch gradients, "
        "use hdm_optax.minibatch_step."
      )
  if _nodes(state, optax.LookaheadState):
    raise TypeError(
      "optimizer: optax.lookahead(...) is refused: its update reads params.fast and "
      "params.slow (optax.LookaheadParams), but a driver holds plain params and evaluates f "
      "at them. Pass the fast optimizer alone (e.g. solve(optax.sgd(0.1), ...)), or run "
      "lookahead in an optax loop of your own on LookaheadParams."
    )


@runtime_checkable
class OptimizerState(Protocol):
  """What a state tells a driver (every hdm_optax method's state speaks it).

  ``driver_verdict()`` is the protocol's one method; a state may also have
  ``driver_box()``, the bounds the iterate keeps (``None`` without), and
  ``driver_preconditioner(free)``, ``v -> H v`` with H an approximation of the inverse
  Hessian on the ``free`` variables and the identity off them (``None`` without). A bounds
  object has ``lower`` and ``upper`` and the methods ``project(x)``,
  ``projected_gradient(x, grad)``, ``projected_gradient_norm(x, grad)`` and
  ``free_at_solution(x, grad, tol)`` (:class:`hdm_optax.pieces.box.Box`).
  """

  def driver_verdict(self) -> jax.Array:
    """Whether the step rule accepted the last update (the trial became the iterate)."""


def _speakers(state) -> list:
  """The states in ``state`` that speak :class:`OptimizerState`, in the tree's order."""
  speaks = lambda node: isinstance(node, OptimizerState)
  return [node for node in jax.tree.leaves(state, is_leaf=speaks) if speaks(node)]


def _said(state, method: str, *args) -> list:
  """What the speakers in ``state`` that have ``method`` say (``None`` left out)."""
  said = [getattr(s, method)(*args) for s in _speakers(state) if hasattr(s, method)]
  return [x for x in said if x is not None]


def accepted(state) -> jax.Array:
  """The step rules' verdict: every state in ``state`` that has one accepted its update
  (True for optimizers without a step rule)."""
  verdicts = [s.driver_verdict() for s in _speakers(state)]
  return functools.reduce(jnp.logical_and, verdicts, jnp.asarray(True))


def box_of(state) -> Optional[Any]:
  """The bounds the optimizer keeps its iterate in, or ``None``.

  The state that holds them must be the last transformation's (:func:`cache_at_params`): a
  later transformation could move the iterate out of the box.

  Raises:
    ValueError: bounds held elsewhere, or by two transformations.
  """
  found = _said(state, "driver_box")
  if not found:
    return None
  held = _said(cache_at_params(state), "driver_box")
  if len(found) > 1 or len(held) != 1:
    raise ValueError(
      "a transformation with bounds (lower=/upper=) must be the last one of the chain, and "
      "the only one with bounds: a later transformation changes its step and could move the "
      "iterate out of the box. Put the bounded transformation last (a clip goes before it; "
      "a weight decay goes into f)."
    )
  return held[0]


def _bounds_or_none(state):
  """``is_leaf`` for ``state``: a ``None`` node, or bounds a state in it holds."""
  boxes = _said(state, "driver_box")
  return lambda node: node is None or any(node is b for b in boxes)


def with_box_of(fresh, given, names: ArgNames = ArgNames()):
  """``given`` (a state handed back in) with the bounds of ``fresh`` (the optimizer's own).

  Args:
    fresh: the optimizer's ``init`` at the params.
    given: the state handed in.
    names: how the door names its arguments in the messages.

  Raises:
    ValueError: ``given`` is not a state of this optimizer (another structure, or a leaf of
      another shape or dtype).
  """
  fresh_bounds = _bounds_or_none(fresh)
  fresh_paths, fresh_def = jax.tree_util.tree_flatten_with_path(fresh, is_leaf=fresh_bounds)
  given_leaves, given_def = jax.tree.flatten(given, is_leaf=_bounds_or_none(given))
  if fresh_def != given_def:
    rows = {f"optimizer.init({names.params}):": fresh, f"{names.state}:": given}
    width = max(map(len, rows))
    shown = "".join(f"  {k:<{width}} {jax.tree.structure(v)}\n" for k, v in rows.items())
    raise ValueError(
      names.lead(f"{names.state} is not a state of this optimizer (another structure):\n")
      + f"{shown}Pass the state of a run of the same optimizer {names.state_source}."
    )
  leaves = []
  for (path, f), g in zip(fresh_paths, given_leaves):
    if fresh_bounds(f):  # the optimizer's own bounds (or None)
      leaves.append(f)
      continue
    want, got = (jnp.shape(f), jnp.result_type(f)), (jnp.shape(g), jnp.result_type(g))
    if want != got:
      raise ValueError(
        names.lead(f"{names.state} is not a state of this optimizer for these params: ")
        + f"its leaf {jax.tree_util.keystr(path)} has shape {got[0]} and dtype {got[1]}, "
        + f"where optimizer.init({names.params}) gives shape {want[0]} and dtype {want[1]}. "
        + f"Pass the state of a run on params of this shape and dtype {names.state_source}."
      )
    leaves.append(g)
  return jax.tree.unflatten(fresh_def, leaves)


def preconditioner(state, free=None) -> Optional[Callable[[Any], Any]]:
  """The one preconditioner the states in ``state`` hold (``None`` where none or several)."""
  found = _said(state, "driver_preconditioner", free)
  return found[0] if len(found) == 1 else None


# --- the cache of f and grad f ------------------------------------------------------------


def _total(state, key):
  """Sum of every ``key`` field in ``state`` (0 if there is none)."""
  found = optax.tree.get_all_with_path(state, key)
  return sum((jnp.asarray(v, jnp.int32) for _, v in found), jnp.zeros([], jnp.int32))


def null_steps(state) -> jax.Array:
  """The null steps the step rules in ``state`` counted (every ``num_null_steps`` field,
  summed; 0 for optimizers without a step rule): where a resumed run's count goes on."""
  return _total(state, "num_null_steps")


def nonfinite_trials(state) -> jax.Array:
  """Trials since the last accepted update where f or grad f was not finite (every
  ``nonfinite_run`` field, summed: hdm_optax's ``info``; 0 for other optimizers)."""
  return _total(state, "nonfinite_run")


def calls_in_update(old_state, new_state):
  """(value, grad) evaluations that ``update`` made between the two states.

  Args:
    old_state: the state passed to ``update``.
    new_state: the state it returned.

  Returns:
    ``(value_evals, grad_evals)``, int32 scalars.

  hdm_optax states count them in ``info`` (``num_value_evals``,
  ``num_grad_evals``); optax's linesearches (``optax.lbfgs``) make one
  value-and-gradient call per linesearch step (``num_linesearch_steps``); other
  transformations do not call the oracle. Every occurrence in the state counts
  (several HDM transformations in one chain).
  """
  searched = _total(new_state, "num_linesearch_steps")
  values = _total(new_state, "num_value_evals") - _total(old_state, "num_value_evals")
  grads = _total(new_state, "num_grad_evals") - _total(old_state, "num_grad_evals")
  return values + searched, grads + searched


# optax's wrappers whose update is their inner transformation's update, unchanged (or, for
# apply_if_finite, zero together with the inner state put back).
_FORWARDING_STATES = tuple(
  getattr(optax, name)
  for name in ("InjectHyperparamsState", "InjectStatefulHyperparamsState", "ApplyIfFiniteState")
  if hasattr(optax, name)
)


def cache_at_params(state) -> Optional[Any]:
  r"""The state whose cached ``value`` and ``grad`` are f and grad f at the new params.

  The contract: a transformation that caches ``value`` and ``grad`` in its
  state (every hdm_optax transformation, optax's linesearches and so
  ``optax.lbfgs``) caches them at ``params + u``, ``u`` the update *it*
  returned. They are f and grad f at ``optax.apply_updates(params, updates)``
  only if ``u`` reaches the params unchanged, that is if the cache holder is the
  last transformation: the state itself, the last state of an ``optax.chain``
  (a plain tuple), or the inner state of ``optax.inject_hyperparams`` or
  ``optax.apply_if_finite``, recursively. Anything else (``optax.chain(hdm_best(),
  optax.scale(0.5))``, a named chain, ``optax.MultiSteps``, ...) has no cache at
  the params. The test reads the structure of the state only: it costs nothing
  at run time.

  Args:
    state: an optimizer state.

  Returns:
    The cache-holding state (with fields ``value`` and ``grad``), or ``None``.
  """
  while True:
    if type(state) is tuple and state:  # pylint: disable=unidiomatic-typecheck
      state = state[-1]  # optax.chain: the last transformation's update is the chain's
    elif isinstance(state, _FORWARDING_STATES):
      state = state.inner_state
    else:
      break
  fields = getattr(state, "_fields", ())
  if "value" in fields and "grad" in fields and state.grad is not None:
    return state
  return None


def caches_anywhere(state) -> bool:
  """Whether some transformation in ``state`` caches ``value`` and ``grad`` (wherever they are)."""
  return all(optax.tree.get_all_with_path(state, name) for name in ("value", "grad"))
