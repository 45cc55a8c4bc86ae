"""A batched loop's step, written only where its member runs.

A batched loop (:class:`hdm_optax.driver.runs.Staged`) steps every member and keeps a
stopped member's state as it was, ``where(running, new, old)`` leaf by leaf: a pass over the
whole state at every step. A secant memory's step changes one row of its pairs; where that
row is written only for the members that run (:func:`hdm_optax.pieces.lbfgs.memory`), the
pairs come out equal to the old ones for the others, and the loop skips them: under
``jax.vmap`` the write is then a scatter into the pairs in place, not a pass over them.

The loop opens a :func:`gate` around the trace of its step. A piece asks :func:`current` for
it and, where :meth:`Gate.holds` its input arrays (they are the old state's own, unchanged),
writes only where :attr:`Gate.running` and records the result with :meth:`Gate.wrote`;
:meth:`Gate.where` then passes exactly those results through. Any other leaf, or one that a
later operation changed, is selected as before: a piece that ignores the gate costs a pass,
never a wrong state.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp

__all__ = ("Gate", "current", "gate")

_CURRENT: contextvars.ContextVar[Optional["Gate"]] = contextvars.ContextVar(
  "hdm_optax_gate", default=None
)


class Gate:
  """The members that run (``running``, a boolean scalar of the member's trace) and the old
  state's leaves, held while one step is traced."""

  def __init__(self, running: jax.Array, old: Any):
    self.running = running
    self._old = {id(x): x for x in jax.tree.leaves(old)}
    self._written: dict = {}  # id(result) -> (result, the old leaf it was written over)

  def holds(self, arrays: Sequence[Any]) -> bool:
    """Whether every one of ``arrays`` is a leaf of the old state, as it was."""
    return all(self._old.get(id(a)) is a for a in arrays)

  def wrote(self, olds: Sequence[Any], news: Sequence[Any]) -> None:
    """Records that each of ``news`` equals its old leaf wherever the member does not run."""
    for old, new in zip(olds, news):
      self._written[id(new)] = (new, old)

  def where(self, new: Any, old: Any) -> Any:
    """``where(running, new, old)`` leaf by leaf, but a leaf :meth:`wrote` is passed as is."""

    def leaf(n, o):
      held = self._written.get(id(n))
      if held is not None and held[0] is n and held[1] is o:
        return n
      return jnp.where(self.running, n, o)

    return jax.tree.map(leaf, new, old)


@contextlib.contextmanager
def gate(running: jax.Array, old: Any) -> Iterator[Gate]:
  """Opens a :class:`Gate` for the step traced inside it (one member's view under ``vmap``).

  Args:
    running: whether the member runs, a boolean scalar.
    old: the state the step starts from.

  Yields:
    The gate; after the step, ``gate.where(new, old)`` keeps a stopped member's state.
  """
  opened = Gate(running, old)
  token = _CURRENT.set(opened)
  try:
    yield opened
  finally:
    _CURRENT.reset(token)


def current() -> Optional[Gate]:
  """The gate open around the step being traced, or ``None``."""
  return _CURRENT.get()
