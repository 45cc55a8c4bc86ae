"""The code blocks of README.md and docs/*.md and the docstring examples run as written."""

import inspect
import re
from pathlib import Path

import pytest

import hdm_optax
from helpers import check_doctests, run_page
from hdm_optax.methods import (
  _hdm,
  _hdm_agd,
  _hdm_auto,
  _hdm_best,
  _hdm_hb,
  _osgm_best,
  _trial_lbfgs,
)
from hdm_optax.pieces import acceptance, backtracking, box, candidates, curvature, decay, directions
from hdm_optax.pieces import hypergradient, learners, momentum, secant, shell, step_control
from hdm_optax.driver import adjoint, cache, compiled, loops, scipy_api

PIECES = [
  acceptance,
  backtracking,
  box,
  candidates,
  curvature,
  decay,
  directions,
  hypergradient,
  learners,
  momentum,
  secant,
  shell,
  step_control,
]

ROOT = Path(__file__).resolve().parents[1]


# docs/minibatch.md and docs/optimistix.md run in their own modules' tests.
PAGES = ["README.md", "docs/guide.md", "docs/bounds.md", "docs/gradients.md"]


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page):
  """Each page's python blocks run in order, in one namespace."""
  run_page(page)


def test_readme_and_guide_have_examples():
  count = lambda page: len(re.findall(r"```python\n", (ROOT / page).read_text()))
  assert count("README.md") >= 1 and count("docs/guide.md") >= 4


def test_every_docs_page_is_in_the_index():
  index = (ROOT / "docs" / "index.md").read_text()
  for page in (ROOT / "docs").glob("*.md"):
    if page.name != "index.md":
      assert f"\n{page.stem}\n" in index, page.name


@pytest.mark.parametrize(
  "module",
  [
    _hdm,
    _hdm_hb,
    _hdm_agd,
    _hdm_best,
    _hdm_auto,
    _osgm_best,
    _trial_lbfgs,
    adjoint,
    cache,
    loops,
    compiled,
    scipy_api,
    box,
    *PIECES,
  ],
  ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
  check_doctests(module)


def test_all_names_exist():
  for name in hdm_optax.__all__:
    assert hasattr(hdm_optax, name), name


@pytest.mark.parametrize("module", PIECES, ids=lambda m: m.__name__)
def test_public_pieces_have_full_docstrings(module):
  """Every public function of a piece module has a runnable example; the module cites
  the paper's arXiv id."""
  assert "arXiv:2502.11229" in module.__doc__
  for name in module.__all__:
    obj = getattr(module, name)
    if inspect.isfunction(obj):
      assert obj.__doc__ and "Examples:" in obj.__doc__, f"{module.__name__}.{name}"
