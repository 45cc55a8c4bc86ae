"""tests/backends.py: what a test may assume on each backend, the non-CPU paths included."""

import jax
import numpy as np
import pytest

from experiments.sparse import host_csr

try:  # pytest's default rootdir-relative import (tests/ is not a package)
  import backends
except ImportError:  # pragma: no cover - tests/ turned into a package
  from tests import backends


def test_cpu_is_strict_and_other_backends_have_the_documented_tolerances(monkeypatch):
  for dtype in (np.float32, np.float64):
    assert backends.cross_program_rtol(dtype, "cpu") == 0.0
  assert backends.cross_program_rtol(np.float64, "gpu") == 1e-5
  assert backends.cross_program_rtol(np.float32, "tpu") == 1e-4
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not backends.is_cpu() and backends.cross_program_rtol(np.float64) == 1e-5


def test_rounding_noise_is_a_function_of_the_point_and_the_run():
  x = np.array([0.5, -1.0, 2.0])
  u = backends.rounding_noise(x, 1, (4,))
  np.testing.assert_array_equal(u, backends.rounding_noise(x.copy(), 1, (4,)))  # a tie stays one
  assert np.all(np.abs(u) <= 1.0) and len(set(u)) == 4
  assert not np.any(u == backends.rounding_noise(x, 2, (4,)))
  assert not np.any(u == backends.rounding_noise(np.nextafter(x, 3.0), 1, (4,)))


def test_spread_tol_is_ten_times_the_running_spread_plus_a_last_update_rounding():
  want = [np.array([1.0, -4.0]), np.array([2.0, 0.0]), np.array([2.0, 0.0])]
  runs = [
    [np.array([1.0, -4.0]), np.array([2.0, 1e-9]), np.array([2.0, 0.0])],
    [np.array([1.0 + 1e-12, -4.0]), np.array([2.0, 0.0]), np.array([2.0, 0.0])],
  ]
  floor = backends.rounding_tol(3) * np.array([4.0, 2.0, 2.0])
  d = (1.0 + 1e-12) - 1.0
  spread = np.array([d, 1e-9, 1e-9])  # max over entries and runs, then over steps <= k
  tol = backends.spread_tol(want, runs, terms=3)
  np.testing.assert_allclose(tol, 10 * spread + floor, rtol=1e-12)
  # no spread: the floor alone; a quantity not formed yet (None) counts as 0
  np.testing.assert_array_equal(
    backends.spread_tol([None, 3.0], [[None, 3.0]], terms=2), [0.0, backends.rounding_tol(2) * 3.0]
  )


def test_across_programs_bit_exact_on_cpu_within_the_tolerance_elsewhere():
  want = np.array([1.0, -2.0, 0.0])
  last_bit = np.nextafter(want, np.inf)
  with pytest.raises(AssertionError):
    backends.assert_same_across_programs(last_bit, want, np.float64, "cpu")
  backends.assert_same_across_programs(last_bit, want, np.float64, "gpu")
  with pytest.raises(AssertionError):
    backends.assert_same_across_programs(want * (1 + 1e-4), want, np.float64, "gpu")
  # a gradient near a minimizer: its entries carry the rounding of terms of size 1
  near_zero = np.array([3e-9, -4e-8])
  with pytest.raises(AssertionError):
    backends.assert_same_across_programs(near_zero + 1e-12, near_zero, np.float64, "gpu")
  backends.assert_same_across_programs(near_zero + 1e-12, near_zero, np.float64, "gpu", scale=1.0)
  flags = np.array([True, False])
  with pytest.raises(AssertionError):  # counters and flags stay exact everywhere
    backends.assert_same_across_programs(~flags, flags, np.float64, "gpu")


def test_without_a_cpu_backend_the_kernel_tests_skip_with_the_reason(monkeypatch):
  def devices(backend=None):
    raise RuntimeError(f"Unknown backend {backend}")

  monkeypatch.setattr(jax, "devices", devices)
  assert backends.cpu_device() is None
  with pytest.raises(pytest.skip.Exception, match="CPU backend"):
    with backends.on_cpu_device():
      pass
  with pytest.raises(RuntimeError, match="JAX has no CPU backend here .* JAX_PLATFORMS"):
    host_csr.register(np.eye(3))


def test_cpu_default_device_fixture(cpu_default_device):
  assert cpu_default_device.platform == "cpu"
  assert jax.numpy.zeros(2).devices() == {cpu_default_device}
