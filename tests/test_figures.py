"""Smoke test of experiments.figures: toy figures and one dataset figure are written."""

import csv

import numpy as np

from experiments import figures


def _fake_results(folder):
  """A tiny results folder in the format of experiments.table1."""
  (folder / "svm").mkdir(parents=True)
  traces, rows = {}, []
  for i, name in enumerate(["GD", "BFGS", "HDM-Best", "SomeNewMethod"]):
    calls = np.arange(1, 51 - 10 * i)
    value = 1.0 + np.exp(-calls / (5.0 + i))
    traces[f"{name}/grad_calls"] = calls.astype(np.int32)
    traces[f"{name}/value"] = value
    traces[f"{name}/grad_inf"] = (value - 1.0).astype(np.float32)
    rows.append(
      dict(
        algorithm=name,
        solved=int(i > 0),
        iterations=calls[-1] - 1,
        grad_calls=calls[-1],
        hyperparams="",
      )
    )
  np.savez_compressed(folder / "svm" / "tiny.npz", **traces)
  with open(folder / "svm" / "tiny.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def test_figures_are_written(tmp_path):
  _fake_results(tmp_path / "results")
  out = tmp_path / "figures"
  pngs = figures.make_dataset_figures(tmp_path / "results", out)
  assert pngs == [out / "svm" / "tiny.png"]
  pngs += figures.make_toy_figures(out / "toy", steps=200)
  assert len(pngs) == 6
  for png in pngs:
    assert png.exists() and png.stat().st_size > 1000, png
  assert "vanilla HDM" in (out / "toy" / "README.md").read_text()
