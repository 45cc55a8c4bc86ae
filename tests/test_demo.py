"""experiments.demo (the README's first command) on a small dataset."""

import pytest

from experiments import data as data_lib
from experiments import demo


def test_demo_prints_every_method_and_says_what_seconds_measure(capsys):
  data_dir = data_lib.default_data_dir()
  if data_dir is None or "heart_scale" not in data_lib.list_datasets(data_dir):
    pytest.skip("the shared LIBSVM datasets are not available")
  demo.main(["--dataset", "heart_scale", "--max-grad-calls", "200"])
  out = capsys.readouterr().out
  assert all(name in out for name in ("trial_lbfgs", "hdm_auto", "HDM-Best", "optax.lbfgs"))
  assert "compilation excluded" in out


def test_readme_links_the_pitfalls_near_the_top_and_states_the_suite_time():
  from pathlib import Path

  readme = (Path(__file__).parents[1] / "README.md").read_text()
  top = readme.split("## ")[0]
  assert "docs/pitfalls.md" in top
  assert ("CPU time" in top or "wall time" in top) and "compilation excluded" in top
