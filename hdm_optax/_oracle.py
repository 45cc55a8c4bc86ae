"""The oracle contract of ``update``: ``value=``, ``grad=`` and ``value_fn=`` checked, the
incoming updates compared with the gradient, and one counted value-and-gradient call."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


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


def same_leaves(a, b) -> bool:
  """The two trees hold the same leaf objects (one tree passed twice, at trace time)."""
  return all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def held_coordinates(updates, grad):
  """Where a transformation before the method held a coordinate (u_i = 0, grad_i != 0).

  A step that mixes the coordinates (H_m u, a full P u) would move such a coordinate
  anyway; :func:`hold` keeps it where it is.

  Returns:
    A boolean pytree shaped like ``updates``, or ``None`` where ``updates`` are the
    gradient itself (the method alone or first in a chain: the program then has no test).
  """
  if same_leaves(updates, grad):
    return None
  return jax.tree.map(lambda u, g: (u == 0) & (g != 0), updates, grad)


def hold(step, held):
  """``step`` with 0 where ``held`` (from :func:`held_coordinates`; ``None``: as it is)."""
  if held is None:
    return step
  return jax.tree.map(lambda s, h: jnp.where(h, jnp.zeros_like(s), s), step, held)


def untransformed(updates, grad):
  """Whether ``updates`` are the gradient ``grad`` itself.

  ``True`` for the same leaves (one tree passed twice, at trace time) or no ``grad``.
  Separate arrays are compared by value: a concrete bool, or a traced one where both are
  arguments of the program being traced (``jax.jit(opt.update)`` called with the gradient
  as both): at trace time nothing tells those apart. ``False`` where the updates were
  computed in the program (a transformation before this one in ``optax.chain``).
  """
  if updates is None or grad is None or same_leaves(updates, grad):
    return True
  pairs = list(zip(jax.tree.leaves(updates), jax.tree.leaves(grad)))
  leaves = [leaf for pair in pairs for leaf in pair]
  if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return all(np.array_equal(u, g) for u, g in pairs)
  if all(_program_input(leaf) for leaf in leaves):
    return jnp.all(jnp.stack([jnp.all(u == g) for u, g in pairs]))
  return False


def _program_input(leaf) -> bool:
  """An argument of the program being traced, not a value computed in it: a tracer with
  no equation behind it (JAX's ``parent``; where a tracer has no such attribute, as under
  ``vmap``, the answer is no)."""
  return isinstance(leaf, jax.core.Tracer) and getattr(leaf, "parent", 0) is None


def require_untransformed(name: str, same, reason: str):
  """Raises a ``ValueError`` unless ``same``, :func:`untransformed`'s answer, is true.

  For a variant that cannot honour a transformation before it in a chain:
  refusing is better than dropping the user's clipping or weight decay without
  a word. Where ``same`` is traced (the two were separate arguments of the program),
  the program raises the error when it runs and they differ.
  """
  message = (
    f"{name}.update got updates that differ from grad=: a transformation before "
    f"{name} in optax.chain changed them, and {name} cannot honour it ({reason}). "
    f"Put {name} first (or alone) in the chain, or use a variant that steps along the "
    "incoming updates (hdm, hdm_hb, hdm_best, hdm_auto, osgm_best)."
  )
  if not isinstance(same, jax.core.Tracer):
    if not same:
      raise ValueError(message)
    return

  def refuse(same):
    if not np.all(same):
      raise ValueError(message)

  jax.lax.cond(same, lambda: None, lambda: jax.debug.callback(refuse, same))


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
      f"  params: {p_def}\n  got:    {t_def}{_masked_hint(name, params)}"
    )
  if t_shapes != p_shapes:
    raise ValueError(
      f"{name}.update: {what} does not have the leaf shapes of params: "
      f"params {p_shapes}, got {t_shapes}"
    )


def _masked_hint(name: str, params) -> str:
  """Where ``params`` hold ``optax.masked``'s placeholders, why and the fix ("" elsewhere)."""
  masked = lambda node: isinstance(node, optax.MaskedNode)
  if not any(map(masked, jax.tree.leaves(params, is_leaf=masked))):
    return ""
  return (
    f"\n{name} runs inside optax.masked (or optax.multi_transform), which hands it part of "
    "the params while value= and grad= are f's over all of them. To hold some params "
    f"fixed, put the mask before {name}: optax.chain(optax.masked(optax.set_to_zero(), "
    f"held), {name}(...)) (held: True for the params to keep)."
  )


def _described(out) -> str:
  """What a function returned, in words (its structure, shapes and dtypes, not tracers)."""
  if isinstance(out, (tuple, list)):
    return f"a {type(out).__name__} of length {len(out)}"
  leaves = jax.tree.leaves(out)
  if len(leaves) == 1 and jax.tree.structure(out).num_nodes == 1:
    return f"a single array of shape {jnp.shape(out)} and dtype {jnp.result_type(out)}"
  return f"a {type(out).__name__} with {len(leaves)} array(s)"


def _check_value(value, name: str) -> None:
  """A ``TypeError`` where ``value`` (what ``name`` returned as f) is not a real floating
  scalar, whose gradient JAX takes."""
  if value is None:
    raise TypeError(
      f"{name}'s value is None, not a scalar: return it (a function without a return "
      "statement returns None)."
    )
  if jnp.ndim(value) != 0:
    raise TypeError(
      f"{name} must return a scalar, got an array of shape {jnp.shape(value)}; return e.g. "
      f"jnp.sum(...) or value[0]."
    )
  if not jnp.issubdtype(jnp.result_type(value), jnp.floating):
    raise TypeError(
      f"{name}'s value has dtype {jnp.result_type(value)}, which has no gradient; return a "
      "real floating value: drop the cast to an integer or bool, or compute in the "
      "params' dtype (e.g. jnp.asarray(value, jnp.float32))."
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
        "return the value alone (or, where it returns (value, aux), pass has_aux=True to "
        "hdm_optax.solve / sweep, or give the transformation value_fn=lambda p: fun(p)[0])."
      )
    else:
      value = out
    _check_value(value, name)
    return out

  return jax.value_and_grad(checked_fn, has_aux=has_aux)(params)


# Construction-time checks. Python numbers and concrete arrays are checked;
# traced values skip them (vmap sweeps build optimizers from tracers).
