"""Tests of experiments/data.py: loading LIBSVM files and the verified downloader."""

import bz2
import hashlib
import http.server
import lzma
import socket
import threading

import numpy as np
import pytest

from experiments import data

REAL_DIR = data.default_data_dir()
needs_real_data = pytest.mark.skipif(
  REAL_DIR is None or not (REAL_DIR / "MANIFEST.tsv").is_file(),
  reason="LIBSVM data directory not found (set HDM_DATA_DIR)",
)

TEXT = b"2 1:0.5 3:-1\n1 2:1.5\n2 1:1 2:2 3:3\n"
SHA = hashlib.sha256(TEXT).hexdigest()
MANIFEST_HEADER = (
  "name\trows\tfeatures_in_file\tstated_features\tlabels\tsha256_of_uncompressed\t"
  "source_repo\tnotes\n"
)


# ----------------------------------------------------------------------------
# Real datasets
# ----------------------------------------------------------------------------


@needs_real_data
@pytest.mark.parametrize("name", ["heart_scale", "fourclass_scale", "svmguide1"])
def test_load_real_dataset(name, tmp_path):
  entry = data.read_manifest(REAL_DIR)[name]
  X, y = data.load_dataset(name, data_dir=REAL_DIR, cache_dir=tmp_path)
  assert X.format == "csr" and X.dtype == np.float64
  assert X.shape == (entry.rows, entry.stated_features)
  assert y.dtype == np.float64 and y.shape == (entry.rows,)
  assert set(np.unique(y)) == {-1.0, 1.0}


@needs_real_data
def test_list_datasets_real():
  names = data.list_datasets(REAL_DIR)
  assert {"heart_scale", "a9a", "w8a"} <= set(names)
  assert "a5a" not in names  # listed as not available in README


@needs_real_data
def test_missing_dataset_message(tmp_path):
  with pytest.raises(FileNotFoundError, match="a5a") as info:
    data.load_dataset("a5a", data_dir=REAL_DIR, cache_dir=tmp_path)
  assert str(REAL_DIR) in str(info.value)


# ----------------------------------------------------------------------------
# Synthetic data directory
# ----------------------------------------------------------------------------


def _write_dir(path, text=TEXT, sha=SHA, stated=5):
  path.mkdir(exist_ok=True)
  (path / "toy.xz").write_bytes(lzma.compress(text))
  (path / "MANIFEST.tsv").write_text(
    MANIFEST_HEADER + f"toy\t3\t3\t{stated}\t1,2\t{sha}\tlocal\tsynthetic\n"
    f"gone\t3\t3\t3\t1,2\t{sha}\tlocal\tnot on disk\n"
  )
  return path


def test_load_synthetic_labels_and_features(tmp_path):
  d = _write_dir(tmp_path / "d")
  X, y = data.load_dataset("toy", data_dir=d, cache_dir=tmp_path / "c")
  assert X.shape == (3, 5)  # stated feature count, not the max index 3
  np.testing.assert_array_equal(y, [1.0, -1.0, 1.0])  # smaller label 1 -> -1
  np.testing.assert_array_equal(X.toarray()[0], [0.5, 0, -1, 0, 0])
  assert data.list_datasets(d) == ["toy"]


def test_env_var_sets_data_dir(tmp_path, monkeypatch):
  d = _write_dir(tmp_path / "d")
  monkeypatch.setenv("HDM_DATA_DIR", str(d))
  assert data.default_data_dir() == d
  assert data.list_datasets() == ["toy"]


def test_missing_dataset_synthetic(tmp_path):
  d = _write_dir(tmp_path / "d")
  with pytest.raises(FileNotFoundError, match=r"'gone'.*" + str(d).replace("\\", "/")):
    data.load_dataset("gone", data_dir=d, cache_dir=tmp_path / "c")


def test_altered_file_is_rejected(tmp_path):
  d = _write_dir(tmp_path / "d", text=TEXT.replace(b"0.5", b"0.6"))
  with pytest.raises(ValueError, match="SHA-256"):
    data.load_dataset("toy", data_dir=d, cache_dir=tmp_path / "c")


# ----------------------------------------------------------------------------
# Downloader against a local HTTP server
# ----------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
  routes = {
    "/good": (TEXT, len(TEXT)),
    "/good.bz2": (bz2.compress(TEXT), None),
    "/truncated": (TEXT[:10], len(TEXT)),  # Content-Length larger than the body
    "/truncated.bz2": (bz2.compress(TEXT)[:-8], None),
    "/wrong": (TEXT.replace(b"1.5", b"2.5"), None),
  }

  def do_GET(self):
    if self.path not in self.routes:
      self.send_error(404)
      return
    body, length = self.routes[self.path]
    self.send_response(200)
    self.send_header("Content-Length", str(length if length is not None else len(body)))
    self.end_headers()
    self.wfile.write(body)
    self.wfile.flush()
    self.close_connection = True

  def log_message(self, *args):
    pass


@pytest.fixture(scope="module")
def server():
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{httpd.server_address[1]}"
  httpd.shutdown()
  httpd.server_close()


def _leftovers(cache):
  return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


@pytest.mark.parametrize("route", ["/good", "/good.bz2"])
def test_download_good(server, tmp_path, route):
  path = data.download_dataset("toy", tmp_path, url=server + route, sha256=SHA)
  assert path == tmp_path / "toy"
  assert path.read_bytes() == TEXT
  assert _leftovers(tmp_path) == ["toy"]


@pytest.mark.parametrize("route", ["/truncated", "/truncated.bz2"])
def test_download_truncated(server, tmp_path, route):
  with pytest.raises(ValueError, match="truncated"):
    data.download_dataset("toy", tmp_path, url=server + route, sha256=SHA)
  assert _leftovers(tmp_path) == []


def test_download_truncated_without_checksum(server, tmp_path):
  with pytest.raises(ValueError, match="truncated"):
    data.download_dataset("toy", tmp_path, url=server + "/truncated", sha256="")
  assert _leftovers(tmp_path) == []


def test_download_wrong_checksum(server, tmp_path):
  with pytest.raises(ValueError, match="checksum"):
    data.download_dataset("toy", tmp_path, url=server + "/wrong", sha256=SHA)
  assert _leftovers(tmp_path) == []


def test_download_http_error(server, tmp_path):
  with pytest.raises(ConnectionError, match="could not download toy"):
    data.download_dataset("toy", tmp_path, url=server + "/nothing", sha256=SHA)
  assert _leftovers(tmp_path) == []


def test_download_unreachable(tmp_path):
  with socket.socket() as s:  # a port that nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}/toy"
  with pytest.raises(ConnectionError, match="HDM_DATA_DIR") as info:
    data.download_dataset("toy", tmp_path / "c", url=url, sha256=SHA, timeout=2)
  assert url in str(info.value)
  assert _leftovers(tmp_path / "c") == []


def test_load_dataset_downloads_into_cache(server, tmp_path, monkeypatch):
  d = _write_dir(tmp_path / "d")
  (d / "toy.xz").unlink()
  monkeypatch.setattr(data, "LIBSVM_BINARY_URL", server + "/")
  monkeypatch.setitem(_Handler.routes, "/toy", (TEXT, None))
  cache = tmp_path / "c"
  with pytest.raises(FileNotFoundError):
    data.load_dataset("toy", data_dir=d, cache_dir=cache)
  X, y = data.load_dataset("toy", data_dir=d, cache_dir=cache, download=True)
  assert X.shape == (3, 5) and (cache / "toy").is_file()
  X2, _ = data.load_dataset("toy", data_dir=d, cache_dir=cache)  # now from the cache
  assert (X2 != X).nnz == 0
