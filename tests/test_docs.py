"""The code blocks of README.md and docs/*.md and the docstring examples run as written."""

import inspect
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import hdm_optax
from helpers import bash_blocks, check_doctests, run_page
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
from hdm_optax.pieces import hypergradient, learners, momentum, shell, step_control
from hdm_optax.pieces.lbfgs import bounded, direction, memory, step_rule
from hdm_optax.adapters import scipy_api
from hdm_optax.driver import adjoint, cache, engine, programs, runs, solving

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
  shell,
  step_control,
  bounded,
  direction,
  memory,
  step_rule,
]

ROOT = Path(__file__).resolve().parents[1]


# docs/minibatch.md and docs/optimistix.md run in their own modules' tests.
PAGES = ["README.md", "docs/guide.md", "docs/bounds.md", "docs/scipy.md", "docs/gradients.md"]


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page):
  """Each page's python blocks run in order, in one namespace."""
  run_page(page)


def test_readme_and_guide_have_examples():
  count = lambda page: len(re.findall(r"```python\n", (ROOT / page).read_text()))
  assert count("README.md") >= 1 and count("docs/guide.md") >= 4


def test_every_docs_page_is_in_the_index():
  """The manual's pages in docs/index.md, the research record's in docs/research/index.md."""
  for folder in (ROOT / "docs", ROOT / "docs" / "research"):
    index = (folder / "index.md").read_text()
    for page in folder.glob("*.md"):
      if page.name != "index.md":
        assert f"\n{page.stem}\n" in index, page.name
  assert "\nresearch/index\n" in (ROOT / "docs" / "index.md").read_text()


def test_no_page_speaks_of_issue_numbers():
  """Pages say what a thing is and what was measured, not which tracker entry asked for it."""
  pages = [ROOT / "README.md", ROOT / "experiments" / "README.md", *(ROOT / "docs").rglob("*.md")]
  for page in pages:
    found = re.findall(r"\bissues? #?\d+", page.read_text(), flags=re.IGNORECASE)
    assert not found, (page.name, found)


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
    engine,
    programs,
    solving,
    scipy_api,
    *PIECES,  # box among them
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


# ---------------------------------------------------------------------------
# docs/guide.md's claims that its blocks do not assert. Elsewhere: the cache rule, statement
# by statement (test_cache_policy.py, test_seams_adversarial.py, test_closure.py), limits
# traced (test_driver_usage.py sections 1-2), check_every's same run
# (test_solver.py::test_check_every_*), a chain after the caching transformation
# (test_solver.py::test_chain_after_a_caching_transformation_reports_f_at_params,
# test_driver_usage.py section 3), stop_at_first_converged, compact and settings that fix
# shapes (test_solver.py), composition with optax, pytrees and dtypes (test_interop.py).
# ---------------------------------------------------------------------------


def test_guide_configurations_compare_by_arguments():
  assert hdm_optax.trial_lbfgs() == hdm_optax.trial_lbfgs()
  assert hdm_optax.trial_lbfgs() != hdm_optax.trial_lbfgs(memory_size=5)


def test_guide_default_max_steps_and_its_trace():
  """max_steps defaults to 1000; the trace keeps the whole run up to 1024 entries, none under
  jax.vmap unless trace= asks, and its memory does not grow with max_steps."""
  fun = lambda x: 0.5 * jnp.sum(x**2)
  opt = optax.sgd(1e-3)  # far from converging in 1000 steps
  res = hdm_optax.solve(opt, fun, jnp.ones(2), tol=0.0)
  assert int(res.num_steps) == 1000 and res.trace.value.shape == (1001,)
  assert res.trace.step.tolist() == list(range(1001))
  longer = hdm_optax.solve(opt, fun, jnp.ones(2), tol=0.0, max_steps=1500)
  assert longer.trace.step.tolist() == list(range(477, 1501))  # the last 1024
  batched = jax.jit(jax.vmap(lambda x: hdm_optax.solve(opt, fun, x, tol=0.0).trace))
  shapes = jax.eval_shape(batched, jnp.ones((1000, 2)))
  assert {leaf.shape for leaf in jax.tree.leaves(shapes)} == {(1000, 0)}
  asked = jax.jit(jax.vmap(lambda x: hdm_optax.solve(opt, fun, x, tol=0.0, trace=8).trace))
  assert {leaf.shape for leaf in jax.tree.leaves(jax.eval_shape(asked, jnp.ones((4, 2))))} == {
    (4, 8)
  }
  assert runs.trace_size(None, 10**8, batch=False) == (1024, 1024)


def _rosenbrock(x):
  return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the figure is the CPU's")
def test_guide_un_jitted_steps_round_apart_from_the_compiled_ones():
  """Rosenbrock-100: grad f at x0 un-jitted and compiled agree to rounding: a few ulps of
  its largest entry (792); the guide's 3e-14 is the development CPU's. Whether the
  two differ at all is the compiler's choice (XLA at -O0 rounds both alike), so only the
  bound is asserted."""
  x0 = jnp.tile(jnp.array([-1.2, 1.0]), 50)
  run = hdm_optax.loop(hdm_optax.trial_lbfgs(), _rosenbrock)
  compiled = jax.jit(run.start)(x0).grad
  gap = float(jnp.max(jnp.abs(run.start(x0).grad - compiled)))
  assert gap <= 8 * float(jnp.finfo(jnp.float64).eps * jnp.max(jnp.abs(compiled)))


# ---------------------------------------------------------------------------
# docs/multihost.md's commands that need no cluster, run as written (the coordinator's port
# replaced by a free one), with `python` this interpreter and the repository on the path.
# ---------------------------------------------------------------------------

MULTIHOST_RUNS = [
  block
  for block in bash_blocks("docs/multihost.md")
  if "sharded_logistic" in block and not re.search(r"\b(ssh|srun)\b", block)
]


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_bash(block, cwd, timeout=300):
  """Runs ``block`` in bash; kills the whole process group (background jobs too) on a timeout."""
  bin_dir = cwd / "bin"
  bin_dir.mkdir()
  python = bin_dir / "python"
  python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
  python.chmod(0o755)
  env = dict(os.environ)
  env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.Popen(
    ["bash", "-e", "-c", block],
    cwd=cwd,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"the block did not finish within {timeout} s:\n{block}\n{out}")
  finally:
    try:  # a background job that outlived the block (its peer failed)
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  return proc.returncode, out


@pytest.mark.skipif(sys.platform == "win32", reason="jaxlib has no gloo collectives on Windows")
@pytest.mark.parametrize(
  "block", MULTIHOST_RUNS, ids=lambda b: "processes" if "--process-id" in b else "devices"
)
def test_multihost_commands_run_as_written(block, tmp_path):
  """Each solve converges and its params are the one-device ones to a printed number."""
  block = block.replace("127.0.0.1:1234", f"127.0.0.1:{_free_port()}")
  code, out = _run_bash(block, tmp_path)
  assert code == 0, out
  assert "status = converged" in out, out
  match = re.search(r"max relative difference of the params: (\S+)", out)
  assert match and float(match.group(1)) < 1e-5, out
  if "--process-id" in block:
    assert "2 process(es), 2 device(s) (cpu)" in out, out


def test_multihost_scaling_table_is_the_measured_one():
  """The page's table is results/perf/sharded_scaling.txt's, and its bytes per row (4n + 20)
  and per column (about 90) are the ones the script printed for n = 256."""
  page = (ROOT / "docs" / "multihost.md").read_text()
  measured = (ROOT / "results" / "perf" / "sharded_scaling.txt").read_text()
  table = [line for line in measured.splitlines() if line.startswith("|")]
  assert len(table) == 6 and "\n".join(table) in page
  assert "A 262144 x 256 float32" in measured and "sharing 2 cores" in measured
  assert f"{4 * 256 + 20} bytes per row" in measured and "90 bytes per column" in measured
  assert "4n + 20 bytes" in page and "about 90 bytes" in page


# ---------------------------------------------------------------------------
# The manual reads as a manual: present tense, no lab-notebook context, no paths a user
# does not have, no references to pages that do not exist.
# ---------------------------------------------------------------------------

MANUAL = [
  ROOT / "README.md",
  ROOT / "experiments" / "README.md",
  *sorted((ROOT / "docs").glob("*.md")),
]


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: p.name)
def test_manual_pages_carry_no_lab_notes(page):
  """Dates, the development machine's state and the shared folder belong to the research
  record (docs/research/), not to the pages a user plans by."""
  text = page.read_text()
  for pattern in (
    r"\b20\d\d-\d\d-\d\d\b",
    r"\.\./shared",
    r"development (machine|CPU)",
    r"this (2-core|busy|shared) (CPU )?machine",
    r"this machine",
    r"load near",
    r"previous version",
  ):
    assert not re.search(pattern, text), (page.name, pattern)


def test_docstrings_name_pages_that_exist():
  """Every ``docs/....md`` a module of the library names is a page of the repository."""
  for path in (ROOT / "hdm_optax").rglob("*.py"):
    for page in re.findall(r"docs/[\w/.-]+\.md", path.read_text()):
      assert (ROOT / page).is_file(), (path.relative_to(ROOT), page)


def test_guide_names_the_iteration_state_fields():
  """The guide's account of ``IterationState`` names its fields, and the shell's two slots."""
  guide = (ROOT / "docs" / "guide.md").read_text()
  start = guide.index("The\none-call methods' state is `hdm_optax.IterationState`")
  sentence = guide[start : guide.index("and `direction`", start)]
  sentence = re.sub(r"\([^()]*\)", "", sentence)  # the fields, not what they hold
  named = set(re.findall(r"`(\w+)`", sentence)) | {"direction"}
  assert named == set(hdm_optax.IterationState._fields), named
  assert "two slots" in guide and "three slots" not in guide
  assert "two slots" in shell.__doc__
