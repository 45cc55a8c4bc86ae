"""Kernels per loop iteration, read off a compiled program's optimized HLO.

    kernels = hlo.loop_kernels(jax.jit(f).lower(*args).compile().as_text(), n)

XLA compiles each instruction of a ``while`` body that is not pure bookkeeping
(``parameter``, ``tuple``, ``get-tuple-element``, ``constant``, ``bitcast``) into
one kernel launch on a GPU: a ``fusion`` (its ``kind`` says whether it is an
elementwise loop or a reduction), a ``custom-call`` (cuBLAS, cuSPARSE, sort),
a stand-alone ``copy``, ``scatter``, ``gather`` or ``reduce``. A kernel whose
operands or result hold at least ``n`` elements reads or writes a vector of
size n: one pass over n. Nested loops and conditionals in the body are
counted through (a conditional by its larger branch), so the counts are per
iteration of the outermost loop found. On a CPU, XLA fuses differently and
many of these are plain loops, not launches; the counts there only compare
programs with each other.
"""

from __future__ import annotations

import collections
import dataclasses
import re

__all__ = ["Kernels", "loop_kernels"]

_BOOKKEEPING = {
  "parameter",
  "tuple",
  "get-tuple-element",
  "constant",
  "bitcast",
  "after-all",
  "partition-id",
  "replica-id",
  "opt-barrier",
}
_CONTROL = {"while", "conditional", "call"}
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b(?:pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Kernels:
  """Kernels of one loop iteration: how many of each opcode / fusion kind, how many over n."""

  kinds: collections.Counter
  over_n: int

  @property
  def total(self) -> int:
    return sum(self.kinds.values())

  def __add__(self, other: "Kernels") -> "Kernels":
    return Kernels(self.kinds + other.kinds, self.over_n + other.over_n)

  def __str__(self) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in self.kinds.most_common())
    return f"{self.total} kernels ({self.over_n} over n: {kinds})"


_NONE = Kernels(collections.Counter(), 0)


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  comps, entry, name = {}, None, None
  for line in text.splitlines():
    if name is None:
      m = _COMPUTATION.match(line)
      if m:
        name = m.group(2)
        comps[name] = []
        if m.group(1):
          entry = name
    elif line.strip() == "}":
      name = None
    else:
      comps[name].append(line)
  return comps, entry


def _size(dims: str) -> int:
  size = 1
  for d in dims.split(","):
    if d:
      size *= int(d)
  return size


def _called(rest: str, key: str) -> list[str]:
  m = re.search(key + r"=\{?([^,}]+(?:,\s*%?[\w.\-]+)*)\}?", rest)
  if not m:
    return []
  return [c.strip().lstrip("%") for c in m.group(1).split(",")]


def _callees(op: str, rest: str) -> list[list[str]]:
  """The computations a control instruction runs per iteration: groups, of which a
  conditional runs one (its larger branch is counted), the others all."""
  if op == "conditional":
    branches = _called(rest, "branch_computations") or (
      _called(rest, "true_computation") + _called(rest, "false_computation")
    )
    return [branches]
  keys = ("body", "condition") if op == "while" else ("to_apply",)
  return [[c] for key in keys for c in _called(rest, key)]


def _count(comps, name, n, seen=()) -> Kernels:
  counted = _NONE
  for line in comps.get(name, []):
    m = _INSTRUCTION.match(line)
    if not m or m.group(4) in _BOOKKEEPING:
      continue
    op, rest = m.group(4), m.group(3) + " " + m.group(5)
    if op in _CONTROL:
      for group in _callees(op, rest):
        parts = [_count(comps, c, n, seen + (name,)) for c in group if c not in seen]
        counted += max(parts, key=lambda k: k.total, default=_NONE)
      continue
    kind = op
    if op == "fusion":
      km = re.search(r"kind=(k\w+)", rest)
      kind = km.group(1) if km else "fusion"
    over = any(_size(d) >= n for d in _SHAPE.findall(rest))
    counted += Kernels(collections.Counter([kind]), int(over))
  return counted


def loop_kernels(hlo_text: str, n: int) -> Kernels:
  """The kernels of one iteration of the outermost ``while`` loop of a compiled program.

  Args:
    hlo_text: ``compiled.as_text()`` of a program with a loop (``fori_loop``,
      ``scan``, ``while_loop``).
    n: the size that makes an array a vector of n.

  Returns:
    :class:`Kernels` of the loop's body and condition, nested loops counted once
    per iteration of theirs times one (their trip count is not multiplied in).
  """
  comps, entry = _computations(hlo_text)
  for line in comps.get(entry, []):
    m = _INSTRUCTION.match(line)
    if m and m.group(4) == "while":
      rest = m.group(3) + " " + m.group(5)
      return sum((_count(comps, c, n, (entry,)) for [c] in _callees("while", rest)), _NONE)
  raise ValueError("hlo_text: no while loop in the entry computation; pass a looped program")
