"""Kernels per loop iteration, read off a compiled program's optimized HLO.

    kernels = hlo.loop_kernels(jax.jit(f).lower(*args).compile().as_text(), n)

XLA compiles each instruction of a ``while`` body that is not pure bookkeeping
(``parameter``, ``tuple``, ``get-tuple-element``, ``constant``, ``bitcast``) into
one kernel launch on a GPU: a ``fusion`` (its ``kind`` says whether it is an
elementwise loop or a reduction), a ``custom-call`` (cuBLAS, cuSPARSE, sort),
a stand-alone ``copy``, ``scatter``, ``gather`` or ``reduce``. A kernel whose
operands or result hold at least ``n`` elements reads or writes a vector of
size n: one pass over n. ``vectors`` adds up the arrays of at least n elements
that the kernels read and write, in units of n (an m x n operand is m; a fused
operand that the kernel only slices counts as its slices, a dynamic-update-slice
as the update it writes): the passes over n of one iteration, as XLA's buffers
say (a kernel may read an operand more than once). Nested loops and conditionals in the body are
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
  """Kernels of one loop iteration: how many of each opcode / fusion kind, how many over n,
  and the vectors of n they read and write together (``vectors``)."""

  kinds: collections.Counter
  over_n: int
  vectors: float = 0.0

  @property
  def total(self) -> int:
    return sum(self.kinds.values())

  def __add__(self, other: "Kernels") -> "Kernels":
    return Kernels(
      self.kinds + other.kinds, self.over_n + other.over_n, self.vectors + other.vectors
    )

  def times(self, count: int) -> "Kernels":
    kinds = collections.Counter({k: v * count for k, v in self.kinds.items()})
    return Kernels(kinds, self.over_n * count, self.vectors * count)

  def __str__(self) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in self.kinds.most_common())
    return (
      f"{self.total} kernels ({self.over_n} over n, {self.vectors:.0f} vectors of n read or "
      f"written: {kinds})"
    )


_NONE = Kernels(collections.Counter(), 0, 0.0)


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


def _trips(op: str, rest: str, by_trips: bool) -> int:
  """How often a nested instruction's computations run per iteration: a ``while``'s
  known trip count where ``by_trips`` (XLA writes it into the loop's backend config)."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest) if op == "while" else None
  return int(m.group(1)) if (m and by_trips) else 1


def _operands(args: str) -> list[str]:
  """The operand names of an instruction, from the text after its opcode's ``(``."""
  depth = 0
  for i, ch in enumerate(args):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      if depth == 0:
        return re.findall(r"%([\w.\-]+)", args[:i])
      depth -= 1
  return re.findall(r"%([\w.\-]+)", args)


def _instructions(lines):
  """(name, result elements, opcode, operand names, text after the opcode, is root) of each
  instruction (a tuple result: the sum of its elements)."""
  for line in lines:
    m = _INSTRUCTION.match(line)
    if m:
      size = sum(_size(d) for d in _SHAPE.findall(m.group(3)))
      yield m.group(2), size, m.group(4), _operands(m.group(5)), m.group(5), bool(m.group(1))


_SLICES = ("dynamic-slice", "slice", "dynamic-update-slice")


def _moved(comps, op, rest, size, operand_sizes) -> tuple[list[int], int]:
  """Elements read per operand and written: a fusion's operand that its body only slices is
  read as the slices; a dynamic-update-slice (also a fusion's root) writes the update only."""
  body = _called(rest, "calls")
  if op == "dynamic-update-slice":
    update = operand_sizes[1] if len(operand_sizes) > 1 else size
    return [0, update] + operand_sizes[2:], update
  if op != "fusion" or not body or body[0] not in comps:
    return operand_sizes, size
  inside = list(_instructions(comps[body[0]]))
  sizes = {name: s for name, s, *_ in inside}
  reads = list(operand_sizes)
  for name, _, code, _, text, _ in inside:
    index = int(text.split(")")[0]) if code == "parameter" else len(reads)
    users = [(c, a, s) for _, s, c, a, _, _ in inside if name in a]
    if index < len(reads) and users and all(c in _SLICES and a[0] == name for c, a, _ in users):
      reads[index] = sum(s for c, _, s in users if c != "dynamic-update-slice")
  written = size
  for _, s, code, args, _, root in inside:
    if root and code == "dynamic-update-slice":
      written = sizes.get(args[1], s)
  return reads, written


def _count(comps, name, n, seen=(), by_trips=False) -> Kernels:
  counted = _NONE
  sizes = {}
  for line in comps.get(name, []):
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    size = sum(_size(d) for d in _SHAPE.findall(m.group(3)))
    sizes[m.group(2)] = size
    if m.group(4) in _BOOKKEEPING:
      continue
    op, rest = m.group(4), m.group(3) + " " + m.group(5)
    if op in _CONTROL:
      for group in _callees(op, rest):
        parts = [_count(comps, c, n, seen + (name,), by_trips) for c in group if c not in seen]
        counted += max(parts, key=lambda k: k.total, default=_NONE).times(
          _trips(op, rest, by_trips)
        )
      continue
    kind = op
    if op == "fusion":
      km = re.search(r"kind=(k\w+)", rest)
      kind = km.group(1) if km else "fusion"
    operand_sizes = [sizes.get(a, 0) for a in _operands(m.group(5))]
    reads, written = _moved(comps, op, rest, size, operand_sizes)
    over = size >= n or any(s >= n for s in operand_sizes)
    vectors = sum(s for s in reads + [written] if s >= n) / n
    counted += Kernels(collections.Counter([kind]), int(over), vectors)
  return counted


def loop_kernels(hlo_text: str, n: int, by_trips: bool = False) -> Kernels:
  """The kernels of one iteration of the outermost ``while`` loop of a compiled program.

  Args:
    hlo_text: ``compiled.as_text()`` of a program with a loop (``fori_loop``,
      ``scan``, ``while_loop``).
    n: the size that makes an array a vector of n.
    by_trips: count a nested loop's body as often as it runs (its known trip
      count, where XLA knows it); otherwise once.

  Returns:
    :class:`Kernels` of the loop's body and condition, nested loops counted once
    per iteration of theirs, or ``by_trips`` times their trip count.
  """
  comps, entry = _computations(hlo_text)
  for line in comps.get(entry, []):
    m = _INSTRUCTION.match(line)
    if m and m.group(4) == "while":
      rest = m.group(3) + " " + m.group(5)
      parts = (_count(comps, c, n, (entry,), by_trips) for [c] in _callees("while", rest))
      return sum(parts, _NONE)
  raise ValueError("hlo_text: no while loop in the entry computation; pass a looped program")
