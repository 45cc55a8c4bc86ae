"""Minibatch training with hdm_optax (or any optax) transformations: one jitted step."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import optax

from hdm_optax.driver import engine
from hdm_optax.driver import protocol
from hdm_optax.driver import solving
from hdm_optax.driver.limits import Limits

__all__ = ("MinibatchStats", "minibatch_step")

_STEP = "minibatch_step's step"
# The arguments as a user of minibatch_step writes them: step(params, state, batch).
_NAMES = protocol.ArgNames(
  door=_STEP,
  fun="loss_fn",
  fun_args="batch",
  params="params",
  state="state",
  state_source="(optimizer.init(params) at the first step, then the state step returns)",
)


class MinibatchStats(NamedTuple):
  """What one minibatch step measured.

  Attributes:
    loss: ``loss_fn(params, batch)`` at the params the step started from (the
      params passed in, not the params returned).
    grad_evals: value-and-gradient calls made by the step: 1 at the params
      passed in, plus those of ``update`` (1 per hdm_optax iteration, 0 for
      ``optax.adam``/``optax.sgd``).
  """

  loss: jax.Array
  grad_evals: jax.Array


def minibatch_step(
  optimizer: optax.GradientTransformation,
  loss_fn: Callable[[Any, Any], jax.Array],
  *,
  jit: bool = True,
) -> Callable[[Any, Any, Any], tuple[Any, Any, MinibatchStats]]:
  r"""One training step on a minibatch, compiled once for every batch.

  Returns ``step(params, state, batch) -> (params, state, stats)`` that

  1. evaluates the loss and its gradient on ``batch`` at ``params`` (one call),
  2. calls ``optimizer.update`` with that value and gradient and with
     ``value_fn = lambda p: loss_fn(p, batch)``, so HDM's trial point is
     judged on the same batch as the point it starts from, and
  3. applies the update.

  The batch is an argument of the compiled step, so batches of one shape
  share one compiled program (drop or pad a smaller last batch: a new shape
  compiles again). The value and gradient cached in an hdm_optax state belong
  to the previous batch and are never reused: reusing them
  (``optax.value_and_grad_from_state`` across batches) compares f on two
  different batches and turns most steps into null steps. So an HDM step on a
  minibatch costs two gradient calls (the current point and the trial point),
  and ``optax.adam`` one; ``stats.grad_evals`` counts them.

  The paper's analysis (and HDM's null step) is for a deterministic f; on
  minibatches f changes every step and this is a heuristic use.

  Args:
    optimizer: an optax transformation (hdm_optax or any other).
    loss_fn: ``loss_fn(params, batch) -> scalar``; ``batch`` is any pytree.
    jit: return the step compiled with ``jax.jit`` (``False``: the plain
      function, e.g. to call it inside your own ``jax.lax.scan``).

  Returns:
    ``step(params, state, batch) -> (params, state, MinibatchStats)``; ``state`` is
    ``optimizer.init(params)`` at the first step, then the state the previous step
    returned (``None`` is refused: the method would start afresh at every step).

  Raises:
    TypeError: ``optimizer`` is no optax transformation (e.g. the factory, not what it
      builds), or ``loss_fn`` is not callable. ``step`` raises, naming its own ``params``,
      ``state``, ``batch`` and ``loss_fn``, where ``params`` are not floating point,
      ``state`` is ``None`` or not a state of ``optimizer`` for these params (a
      ``ValueError``), or ``loss_fn`` returns no floating scalar of the params' dtype.

  Examples:
    >>> import jax, jax.numpy as jnp, hdm_optax
    >>> X = jax.random.normal(jax.random.key(0), (256, 5))
    >>> y = X @ jnp.arange(5.0)
    >>> loss = lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2)
    >>> opt = hdm_optax.hdm_best(precond_lr=0.1)
    >>> step = hdm_optax.minibatch_step(opt, loss)
    >>> w, state = jnp.zeros(5), opt.init(jnp.zeros(5))
    >>> for epoch in range(20):
    ...   for i in range(0, 256, 64):
    ...     w, state, stats = step(w, state, (X[i:i + 64], y[i:i + 64]))
    >>> bool(loss(w, (X, y)) < 1e-6 * loss(jnp.zeros(5), (X, y)))
    True
    >>> int(stats.grad_evals), step._cache_size()  # one compiled program
    (2, 1)

  References:
    Chu, Gao, Ye, Udell, *Provable and Practical Online Learning Rate
    Adaptation with Hypergradient Descent*, arXiv:2502.11229 (2025).
  """
  optimizer = protocol.check_optimizer("minibatch_step", optimizer)
  if not callable(loss_fn):
    raise TypeError(
      "minibatch_step: loss_fn must be callable as loss_fn(params, batch), got "
      f"{type(loss_fn).__name__}."
    )

  def step(params, state, batch):
    solving.check_params(params, f"{_STEP}: params")
    if state is None:
      raise TypeError(
        f"{_STEP}: state is None; pass optimizer.init(params) at the first step, then the "
        "state each step returns: params, state, stats = step(params, state, batch)."
      )
    fun = lambda p: loss_fn(p, batch)
    run = engine.make_loop(optimizer, fun, Limits().checked(), names=_NAMES)
    s = run.start(params, state)
    params, state, _, calls = run.update(s)
    return params, state, MinibatchStats(loss=s.value, grad_evals=1 + calls)

  return jax.jit(step) if jit else step
