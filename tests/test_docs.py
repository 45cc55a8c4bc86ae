"""The README's code blocks and the docstring examples run as written."""

import doctest
import re
from pathlib import Path

import pytest

import hdm_optax
from hdm_optax import _hdm, _hdm_agd, _hdm_best, _hdm_hb, solver

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
  assert len(blocks) >= 4
  namespace = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used


@pytest.mark.parametrize(
  "module", [_hdm, _hdm_hb, _hdm_agd, _hdm_best, solver], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
  assert result.attempted > 0
  assert result.failed == 0


def test_all_names_exist():
  for name in hdm_optax.__all__:
    assert hasattr(hdm_optax, name), name
