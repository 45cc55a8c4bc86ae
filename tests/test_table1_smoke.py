"""Smoke test of the Table 1 pipeline on a small LIBSVM dataset (each dataset's shapes
compile every algorithm's programs again: one is enough to run the whole pipeline)."""

import contextlib
import csv

import pytest

from experiments import data as data_lib
from experiments import runner
from experiments import table1
from fast_jit import FAST_COMPILE
from hdm_optax.driver import programs

DATASETS = ("heart_scale",)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  data_dir = data_lib.default_data_dir()
  if data_dir is None or not all(n in data_lib.list_datasets(data_dir) for n in DATASETS):
    pytest.skip("the shared LIBSVM datasets are not available")
  out = tmp_path_factory.mktemp("results")
  with _fast_compile():
    table1.main(["--datasets", *DATASETS, "--max-grad-calls", "300", "--out", str(out)])
  return out


@contextlib.contextmanager
def _fast_compile():
  """Compiling is most of the pipeline's time: the runner's and the front doors' programs
  compile without XLA's backend optimisation (the rows' numbers are the program's)."""
  options = programs.compiler_options
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(runner, "COMPILE_OPTIONS", FAST_COMPILE)
    patch.setattr(
      programs, "compiler_options", lambda inputs, **kw: {**options(inputs, **kw), **FAST_COMPILE}
    )
    yield


@pytest.mark.parametrize("problem", ["svm", "logistic"])
@pytest.mark.parametrize("dataset", DATASETS)
def test_instance_csv_has_every_algorithm(results, problem, dataset):
  with open(results / problem / f"{dataset}.csv") as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == table1.FIELDS
  assert sorted(r["algorithm"] for r in rows) == sorted(table1.ORDER)
  by_name = {r["algorithm"]: r for r in rows}
  best = by_name["HDM-Best"]
  assert best["solved"] == "1", best
  assert int(best["grad_calls"]) < 299
  assert float(best["final_grad_inf"]) <= 1e-4
  assert (results / problem / f"{dataset}.npz").exists()
  with open(results / problem / f"{dataset}_hdm_best_grid.csv") as f:
    assert len(list(csv.DictReader(f))) == 20


def test_table_lists_the_paper_column(results):
  text = (results / "table1.md").read_text()
  for alg, (svm, logistic) in table1.PAPER.items():
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {alg} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-2:] == [str(svm), str(logistic)]
    count = f"/{len(DATASETS)}"
    assert cells[1].endswith(count) and cells[2].endswith(count)


def test_grid_seconds_times_the_hdm_best_grid_alone(tmp_path, capsys):
  data_dir = data_lib.default_data_dir()
  if data_dir is None or "heart_scale" not in data_lib.list_datasets(data_dir):
    pytest.skip("the shared LIBSVM datasets are not available")
  out = tmp_path / "out"
  argv = ["--grid-seconds", "--datasets", "heart_scale", "--problems", "svm"]
  with _fast_compile():
    table1.main([*argv, "--max-grad-calls", "50", "--out", str(out)])
  line = next(ln for ln in capsys.readouterr().out.splitlines() if "HDM-Best grid" in ln)
  assert "warm lockstep" in line and "compact" in line, line
  assert not out.exists()  # no table, no rows: the grid is only timed
