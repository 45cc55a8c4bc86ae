"""Smoke test of experiments/perf/sharded_scaling.py at a tiny size: one subprocess per device
count, the table and the figure written, each device's data halved by twice the devices. Its
times are measured by the script, never asserted here."""

from experiments.perf import sharded_scaling


def test_scaling_table_and_figure(tmp_path, capsys):
  rows, cols = 4096, 16
  out = tmp_path / "scaling"
  measured = sharded_scaling.main(
    ["--rows", str(rows), "--cols", str(cols), "--steps", "3", "--devices", "1", "2"]
    + ["--out", str(out)]
  )
  text = out.with_suffix(".txt").read_text()
  assert text in capsys.readouterr().out
  assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
  assert [m["devices"] for m in measured] == [1, 2]
  assert [m["steps"] for m in measured] == [3, 3]
  data = [m["data_bytes_per_device"] for m in measured]
  assert data == [rows * (cols + 1) * 4, rows * (cols + 1) * 2]
  assert (
    measured[0]["params_state_bytes_per_device"] == measured[1]["params_state_bytes_per_device"]
  )
  assert f"A {rows} x {cols} float32" in text and "sharing" in text and "bytes per row" in text
