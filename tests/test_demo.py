"""experiments.demo (the README's first command) and what it does without the shared data."""

from pathlib import Path

import pytest

from experiments import data as data_lib
from experiments import demo
from experiments import table1
from experiments.benchmark import suites


@pytest.fixture
def no_data(tmp_path, monkeypatch):
  """A machine without ../shared/datasets/libsvm, HDM_DATA_DIR or a download cache."""
  monkeypatch.delenv("HDM_DATA_DIR", raising=False)
  monkeypatch.setenv("HDM_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(data_lib, "_shared_dir", lambda: tmp_path / "shared" / "libsvm")
  assert data_lib.default_data_dir() is None


def test_demo_runs_on_the_bundled_dataset_without_shared_data(no_data, capsys):
  demo.main(["--max-grad-calls", "20"])
  out, err = capsys.readouterr()
  assert "logistic regression on a9a: m = 32561, n = 124" in out
  assert all(name in out for name in ("trial_lbfgs", "hdm_auto", "HDM-Best", "optax.lbfgs"))
  assert "compilation excluded" in out
  assert "'ijcnn1' not found" in err and "bundled a9a instead" in err
  assert "HDM_DATA_DIR" in err and "--data-dir" in err and "None" not in err


def test_missing_dataset_message_says_where_it_looked_and_how_to_get_it(no_data, tmp_path):
  with pytest.raises(FileNotFoundError) as info:
    data_lib.load_dataset("ijcnn1")
  message = str(info.value)
  assert "None" not in message
  assert "HDM_DATA_DIR is unset" in message and str(tmp_path / "shared") in message
  assert str(tmp_path / "cache") in message and "bundled: a9a" in message
  assert "ijcnn1.bz2" in message and "--data-dir" in message
  assert "experiments.data --download ijcnn1" in message
  with pytest.raises(FileNotFoundError, match="not in the data directory"):
    data_lib.load_dataset("ijcnn1", data_dir=tmp_path)


def test_bundled_dataset_is_checked_against_its_manifest(no_data):
  assert data_lib.list_datasets() == ["a9a"]
  assert data_lib.find_dataset("a9a") == data_lib.BUNDLED_DIR / "a9a.xz"
  assert data_lib.read_manifest(data_lib.BUNDLED_DIR)["a9a"].sha256 is not None


def test_table1_and_benchmark_say_what_is_missing(no_data, tmp_path, capsys):
  table1.main(["--datasets", "ijcnn1", "--out", str(tmp_path / "out")])
  err = capsys.readouterr().err
  assert "skipping ijcnn1: dataset 'ijcnn1' not found" in err and "HDM_DATA_DIR" in err
  note = data_lib.data_dir_note(None)
  assert "running the bundled dataset(s) a9a only" in note and "ijcnn1" in note
  tasks = suites.tasks("libsvm", tol=1e-4, datasets=["a9a", "ijcnn1"])
  assert [t.name for t in tasks] == ["a9a/svm", "a9a/logistic"]
  assert "skipping ijcnn1: dataset 'ijcnn1' not found" in capsys.readouterr().err
  suites.tasks("libsvm", tol=1e-4)
  assert "missing: a1a" in capsys.readouterr().err


def test_readme_links_the_pitfalls_near_the_top_and_states_the_suite_time():
  readme = (Path(__file__).parents[1] / "README.md").read_text()
  top = readme.split("## ")[0]
  assert "docs/pitfalls.md" in top
  assert ("CPU time" in top or "wall time" in top) and "compilation excluded" in top
  assert "HDM_DATA_DIR" in top and "experiments/datasets" in top
