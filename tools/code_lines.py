"""Code lines of Python modules: lines that hold code, without blanks, comments and docstrings.

``python -m tools.code_lines`` prints the engine and its front doors, the adapters, the rest
of the driver and the library; ``python -m tools.code_lines FILE ...`` counts the files given.
Functions over 60 code lines are listed (``--long``).
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
DRIVER = ROOT / "hdm_optax" / "driver"
# The engine and its own front doors (issue 53's target: at most 1,600 code lines).
ENGINE = (
  "engine",
  "runs",
  "programs",
  "protocol",
  "hooks",
  "results",
  "limits",
  "solving",
  "batching",
  "members",
  "cache",
  "adjoint",
)
ADAPTERS = ROOT / "hdm_optax" / "adapters"
LONG = 60


def _docstring_lines(tree: ast.AST) -> set[int]:
  lines: set[int] = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
          lines.update(range(body[0].lineno, body[0].end_lineno + 1))
  return lines


def code_lines(source: str) -> set[int]:
  """The line numbers of ``source`` that hold code (a token other than a comment)."""
  skip = _docstring_lines(ast.parse(source))
  kinds = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
  lines: set[int] = set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type in kinds or token.type == tokenize.ENDMARKER:
      continue
    for line in range(token.start[0], token.end[0] + 1):
      if line not in skip:
        lines.add(line)
  return lines


def count(path: pathlib.Path) -> int:
  return len(code_lines(path.read_text()))


def long_functions(path: pathlib.Path, limit: int = LONG) -> list[tuple[str, int]]:
  """``(name, code lines)`` of every function in ``path`` over ``limit`` code lines (its
  decorators, signature and body; nested functions count in the function that holds them)."""
  source = path.read_text()
  lines, out = code_lines(source), []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      start = min([node.lineno] + [d.lineno for d in node.decorator_list])
      body = {n for n in lines if start <= n <= node.end_lineno}
      if len(body) > limit:
        out.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", len(body)))
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("files", nargs="*", type=pathlib.Path)
  parser.add_argument("--long", action="store_true", help="list functions over 60 code lines")
  args = parser.parse_args(argv)
  if args.files:
    for path in args.files:
      print(f"{count(path):6d}  {path}")
    return
  engine = [DRIVER / f"{name}.py" for name in ENGINE if (DRIVER / f"{name}.py").exists()]
  driver = sorted(DRIVER.rglob("*.py"))
  library = sorted((ROOT / "hdm_optax").rglob("*.py"))
  rest = [p for p in driver if p not in engine] + sorted(ADAPTERS.rglob("*.py"))
  for label, paths in (("engine and front doors", engine), ("adapters and the rest", rest)):
    print(f"{label}: {sum(map(count, paths))}")
    for path in paths:
      print(f"  {count(path):5d}  {path.relative_to(ROOT)}")
  print(f"driver and adapters: {sum(map(count, driver + sorted(ADAPTERS.rglob('*.py'))))}")
  print(f"library: {sum(map(count, library))}")
  if args.long:
    found = [f for path in library for f in long_functions(path)]
    print(f"functions over {LONG} code lines: {len(found)}")
    for name, n in sorted(found, key=lambda f: -f[1]):
      print(f"  {n:4d}  {name}")


if __name__ == "__main__":
  sys.exit(main())
