"""LIBSVM binary-classification datasets: locate, verify, download and load.

The datasets live outside the repository, except ``a9a``, bundled in
``experiments/datasets`` (its provenance and licence: the README there) so that the
demo runs on a machine without them. By default they are read from
``$HDM_DATA_DIR`` or ``<repo>/../shared/datasets/libsvm``, a directory holding
``<name>.xz`` files and a ``MANIFEST.tsv`` that states, per dataset, the row
count, the feature count of the LIBSVM page and the SHA-256 of the uncompressed
text; then from the download cache; then from the bundled directory. Every file
is checked against that SHA-256 before use, so an altered file is never parsed.

Files can also be downloaded (``download_dataset``) into a cache directory
(``$HDM_CACHE_DIR`` or ``~/.cache/hdm_optax/libsvm``); a download goes to a
temporary file in the cache directory that is renamed only after it is
complete and verified.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import http.client
import io
import lzma
import os
import socket
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.datasets import load_svmlight_file

LIBSVM_BINARY_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary/"
# Files that the LIBSVM site only offers bz2-compressed.
_REMOTE_NAMES = {"ijcnn1": "ijcnn1.bz2"}
_CHUNK = 1 << 16
# The datasets of the paper's experiments that the shared folder holds (Table 1's rows).
PAPER_DATASETS = tuple(
  "a1a a2a a3a a4a a7a a8a a9a australian_scale fourclass_scale german.numer_scale heart_scale "
  "ijcnn1 ionosphere_scale mushrooms phishing sonar_scale splice_scale svmguide1 svmguide3 "
  "w1a w4a w6a w7a w8a".split()
)
# The datasets that ship with the repository (MANIFEST.tsv, <name>.xz, README.md).
BUNDLED_DIR = Path(__file__).resolve().parent / "datasets"


@dataclass(frozen=True)
class ManifestEntry:
  """One row of ``MANIFEST.tsv``.

  Attributes:
      name: Dataset name (file stem).
      rows: Number of examples.
      features_in_file: Largest feature index present in the file.
      stated_features: Feature count stated on the LIBSVM page (or None).
      labels: Label tokens as written in the file, e.g. ``("+1", "-1")``.
      sha256: SHA-256 of the uncompressed text (or None).
  """

  name: str
  rows: int | None
  features_in_file: int | None
  stated_features: int | None
  labels: tuple[str, ...]
  sha256: str | None


def repo_root() -> Path:
  """Returns the repository root (the parent of ``experiments/``)."""
  return Path(__file__).resolve().parents[1]


def default_data_dir() -> Path | None:
  """Returns the dataset directory, or None if there is none.

  ``$HDM_DATA_DIR`` wins when set; otherwise ``<repo>/../shared/datasets/libsvm``
  is used when it exists.
  """
  env = os.environ.get("HDM_DATA_DIR")
  if env:
    return Path(env).expanduser()
  candidate = _shared_dir()
  return candidate if candidate.is_dir() else None


def _shared_dir() -> Path:
  return (repo_root() / ".." / "shared" / "datasets" / "libsvm").resolve()


def default_cache_dir() -> Path:
  """Returns the download cache (``$HDM_CACHE_DIR`` or ``~/.cache/hdm_optax/libsvm``)."""
  env = os.environ.get("HDM_CACHE_DIR")
  return Path(env).expanduser() if env else Path.home() / ".cache" / "hdm_optax" / "libsvm"


def _int_or_none(text: str | None) -> int | None:
  text = (text or "").strip()
  return int(text) if text else None


def read_manifest(data_dir: str | os.PathLike | None = None) -> dict[str, ManifestEntry]:
  """Parses ``MANIFEST.tsv`` of ``data_dir`` (default: ``default_data_dir()``).

  Returns:
      A dict name -> ManifestEntry, empty when there is no manifest.
  """
  data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
  path = data_dir / "MANIFEST.tsv" if data_dir is not None else None
  if path is None or not path.is_file():
    return {}
  entries = {}
  with open(path, newline="", encoding="utf-8") as f:
    for row in csv.DictReader(f, delimiter="\t"):
      name = row["name"].strip()
      entries[name] = ManifestEntry(
        name=name,
        rows=_int_or_none(row.get("rows")),
        features_in_file=_int_or_none(row.get("features_in_file")),
        stated_features=_int_or_none(row.get("stated_features")),
        labels=tuple(t.strip() for t in (row.get("labels") or "").split(",") if t.strip()),
        sha256=(row.get("sha256_of_uncompressed") or "").strip().lower() or None,
      )
  return entries


def _find_file(name: str, directory: Path | None) -> Path | None:
  """Returns ``<dir>/<name>.xz``, ``<dir>/<name>.bz2`` or ``<dir>/<name>`` if present."""
  if directory is None:
    return None
  for suffix in (".xz", ".bz2", ""):
    path = directory / f"{name}{suffix}"
    if path.is_file():
      return path
  return None


def list_datasets(data_dir: str | os.PathLike | None = None) -> list[str]:
  """Returns the MANIFEST names whose file is present in ``data_dir``, in MANIFEST order.

  Without a data directory (``data_dir`` None and no ``default_data_dir()``) these are
  the bundled datasets.
  """
  data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
  data_dir = BUNDLED_DIR if data_dir is None else data_dir
  return [n for n in read_manifest(data_dir) if _find_file(n, data_dir) is not None]


def find_dataset(
  name: str,
  data_dir: str | os.PathLike | None = None,
  cache_dir: str | os.PathLike | None = None,
) -> Path | None:
  """Returns the file of dataset ``name``: in ``data_dir``, the cache or the bundled ones.

  ``data_dir`` and ``cache_dir`` default to ``default_data_dir()`` and
  ``default_cache_dir()``; None when no file is found.
  """
  data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
  cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
  for directory in (data_dir, cache_dir, BUNDLED_DIR):
    path = _find_file(name, directory)
    if path is not None:
      return path
  return None


def _where_looked(data_dir: Path | None) -> str:
  if data_dir is not None:
    return f"not in the data directory {data_dir}"
  return f"no data directory (HDM_DATA_DIR is unset and {_shared_dir()} does not exist)"


def missing_message(name: str, data_dir: Path | None, cache_dir: Path) -> str:
  """Says that dataset ``name`` is missing, where it was looked for and how to get it."""
  bundled = ", ".join(list_datasets(BUNDLED_DIR)) or "none"
  return (
    f"dataset {name!r} not found: {_where_looked(data_dir)}, not in the download cache "
    f"{cache_dir}, and not bundled (bundled: {bundled}). To get it: download "
    f"{default_url(name)} into a directory and set HDM_DATA_DIR to that directory (or pass "
    f"--data-dir DIR), or run `python -m experiments.data --download {name}` (into the "
    "cache; needs network)"
  )


def data_dir_note(data_dir: str | os.PathLike | None, wanted=PAPER_DATASETS) -> str | None:
  """Says which of ``wanted`` are missing without a data directory, or None when there is one.

  For the experiments that run "all" datasets: without ``data_dir`` (and
  ``default_data_dir()``) they run the bundled datasets only, and say so with this.
  """
  data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
  if data_dir is not None:
    return None
  bundled = list_datasets(BUNDLED_DIR)
  missing = [n for n in wanted if n not in bundled]
  return (
    f"{_where_looked(None)}: running the bundled dataset(s) {', '.join(bundled)} only; "
    f"missing: {' '.join(missing)}. Get the LIBSVM files from {LIBSVM_BINARY_URL} "
    "(see experiments/datasets/README.md), put them in a directory and set HDM_DATA_DIR "
    "to it or pass --data-dir DIR"
  )


def _read_text(path: Path) -> bytes:
  """Returns the uncompressed bytes of ``path`` (.xz, .bz2 or plain)."""
  if path.suffix == ".xz":
    with lzma.open(path, "rb") as f:
      return f.read()
  if path.suffix == ".bz2":
    with bz2.open(path, "rb") as f:
      return f.read()
  return path.read_bytes()


# A feature index above this is refused where no MANIFEST states the count (the largest
# LIBSVM binary dataset, kdd2012, has 54,686,452 features): the problems built from the
# file hold arrays of one entry per feature, so a stray 10^9 would allocate gigabytes.
MAX_FEATURES = 1 << 27


def _limit_text(max_features: int) -> str:
  if max_features == MAX_FEATURES:
    return (
      f"MAX_FEATURES = {MAX_FEATURES}, the limit where no MANIFEST states the count (the "
      "largest LIBSVM dataset has 54,686,452 features); a MANIFEST.tsv row states a larger one"
    )
  return f"the {max_features} features its MANIFEST.tsv row states"


def _line_problem(line: bytes, max_features: int) -> str | None:
  """What is wrong with one LIBSVM line (``label index:value ...``), or None."""
  tokens = line.split(b"#", 1)[0].split()
  if not tokens:
    return None
  try:
    label = float(tokens[0])
  except ValueError:
    return f"the label {tokens[0].decode(errors='replace')!r} is not a number"
  if not np.isfinite(label):
    return f"the label is {tokens[0].decode(errors='replace')}, not a finite number"
  for token in tokens[1:]:
    index, colon, value = token.partition(b":")
    shown = token.decode(errors="replace")
    if not colon:
      return f"{shown!r} is not index:value"
    if index == b"qid":
      continue
    try:
      number, entry = int(index), float(value)
    except ValueError:
      return f"{shown!r} is not index:value with an integer index and a number"
    if number < 1:
      return f"feature index {number} in {shown!r}: LIBSVM's indices start at 1"
    if number > max_features:
      return f"feature index {number} exceeds {_limit_text(max_features)}"
    if not np.isfinite(entry):
      return f"the value of feature {number} is {value.decode(errors='replace')}, not finite"
  return None


def _first_problem(text: bytes, max_features: int, row: int | None = None) -> tuple[int, str]:
  """``(line number, what)`` of the first bad line (or of data row ``row``, 0-based)."""
  data_rows = -1
  for number, line in enumerate(text.splitlines(), start=1):
    problem = _line_problem(line, max_features)
    data_rows += bool(line.split(b"#", 1)[0].strip())
    if problem is not None or (row is not None and data_rows == row):
      return number, problem or "this row"
  return 0, "no line is at fault"


def parse_libsvm(
  text: bytes, path, n_features: int | None = None
) -> tuple[sp.csr_matrix, np.ndarray]:
  """``(X, y)`` of LIBSVM text (1-based indices), every entry and label finite.

  Raises:
    ValueError: naming ``path`` and the line: a line that does not parse, a label or value
      that is not finite (NaN, inf), an index below 1 or above ``n_features`` (else
      :data:`MAX_FEATURES`), checked before any array of one entry per feature is made.
  """
  limit = MAX_FEATURES if n_features is None else n_features
  fail = lambda line, what: ValueError(f"{path}, line {line}: {what}")
  try:
    X, y = load_svmlight_file(
      io.BytesIO(text), n_features=n_features, dtype=np.float64, zero_based=False
    )
  except (ValueError, OverflowError) as error:
    line, what = _first_problem(text, limit)
    raise fail(line, what if line else str(error)) from None
  if X.shape[1] > limit:
    raise fail(*_first_problem(text, limit))
  bad_labels, bad_entries = np.flatnonzero(~np.isfinite(y)), np.flatnonzero(~np.isfinite(X.data))
  rows = [*bad_labels[:1], *(np.searchsorted(X.indptr, bad_entries[:1], side="right") - 1)]
  if rows:
    raise fail(*_first_problem(text, limit, int(min(rows))))
  return X, y


def _map_labels(y: np.ndarray, name: str) -> np.ndarray:
  """Maps two distinct labels to -1/+1 (smaller -> -1)."""
  classes = np.unique(y)
  if classes.size != 2:
    raise ValueError(f"{name}: expected 2 distinct labels, found {classes.tolist()}")
  return np.where(y == classes[0], -1.0, 1.0)


def load_dataset(
  name: str,
  data_dir: str | os.PathLike | None = None,
  cache_dir: str | os.PathLike | None = None,
  download: bool = False,
) -> tuple[sp.csr_matrix, np.ndarray]:
  """Loads a LIBSVM dataset as (X, y).

  The file is looked up in ``data_dir`` (default ``default_data_dir()``), then
  in ``cache_dir`` (default ``default_cache_dir()``), then among the bundled
  datasets (``BUNDLED_DIR``); if absent and ``download`` is True it is
  downloaded into ``cache_dir``. Its uncompressed text must match the MANIFEST
  SHA-256 when one is listed (the data directory's, else the bundled one's).

  Args:
      name: Dataset name as in MANIFEST.tsv, e.g. ``"a9a"``.
      data_dir: Directory with ``<name>.xz`` files and MANIFEST.tsv.
      cache_dir: Directory with downloaded (uncompressed) files.
      download: Whether to download a missing dataset.

  Returns:
      X: ``scipy.sparse.csr_matrix`` float64 of shape (rows, n_features), with
        n_features the MANIFEST's stated feature count when given, else the
        largest index in the file.
      y: float64 array of -1.0/+1.0 (the smaller original label -> -1).

  Raises:
      FileNotFoundError: The dataset is missing and ``download`` is False; the
        message says where it was looked for and how to get it.
      ValueError: The file's checksum or shape disagrees with MANIFEST; a line does not
        parse, holds a label or value that is not finite, or a feature index out of range
        (:func:`parse_libsvm`; the message names the file and the line).
      ConnectionError: A download was needed but failed.
  """
  data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
  cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
  entry = read_manifest(data_dir).get(name) if data_dir is not None else None
  entry = entry or read_manifest(BUNDLED_DIR).get(name)
  path = find_dataset(name, data_dir, cache_dir)
  if path is None:
    if not download:
      raise FileNotFoundError(missing_message(name, data_dir, cache_dir))
    path = download_dataset(name, cache_dir, sha256=entry.sha256 if entry else None)

  text = _read_text(path)
  if entry is not None and entry.sha256 is not None:
    digest = hashlib.sha256(text).hexdigest()
    if digest != entry.sha256:
      raise ValueError(
        f"{path}: SHA-256 of the uncompressed text is {digest}, MANIFEST says "
        f"{entry.sha256}; the file is altered or corrupt, delete or replace it"
      )
  n_features = entry.stated_features if entry is not None else None
  if n_features is not None and entry.features_in_file is not None:
    n_features = max(n_features, entry.features_in_file)
  X, y = parse_libsvm(text, path, n_features)
  X = sp.csr_matrix(X, dtype=np.float64)
  X.sum_duplicates()
  X.sort_indices()
  if entry is not None and entry.rows is not None and X.shape[0] != entry.rows:
    raise ValueError(f"{name}: {X.shape[0]} rows, MANIFEST says {entry.rows}")
  return X, _map_labels(np.asarray(y, dtype=np.float64), name)


def default_url(name: str) -> str:
  """Returns the LIBSVM download URL of dataset ``name``."""
  return LIBSVM_BINARY_URL + _REMOTE_NAMES.get(name, name)


def download_dataset(
  name: str,
  cache_dir: str | os.PathLike,
  url: str | None = None,
  sha256: str | None = None,
  timeout: float = 30.0,
) -> Path:
  """Downloads a LIBSVM file into ``cache_dir/<name>`` (uncompressed text).

  The data are streamed into a temporary file in ``cache_dir``, checked, and
  renamed to ``<name>`` only when complete: fewer bytes than Content-Length,
  a truncated bz2 stream or a SHA-256 mismatch remove the temporary file.

  Args:
      name: Dataset name; the target file is ``cache_dir/<name>``.
      cache_dir: Destination directory (created if needed).
      url: Source URL (default ``default_url(name)``); a URL ending in
        ``.bz2`` is decompressed on the fly.
      sha256: Expected SHA-256 of the uncompressed text. None looks it up in
        the MANIFEST of ``default_data_dir()`` (no check if not listed there);
        ``""`` skips the check.
      timeout: Socket timeout in seconds.

  Returns:
      The path of the downloaded file.

  Raises:
      ConnectionError: The URL could not be reached or the transfer broke.
      ValueError: The data are truncated or fail the checksum.
  """
  cache_dir = Path(cache_dir)
  cache_dir.mkdir(parents=True, exist_ok=True)
  url = url or default_url(name)
  if sha256 is None:
    entry = read_manifest().get(name)
    sha256 = entry.sha256 if entry is not None else None
  target = cache_dir / name

  def offline(reason) -> ConnectionError:
    return ConnectionError(
      f"could not download {name} from {url}: {reason}; "
      f"put the file in {cache_dir} or set HDM_DATA_DIR"
    )

  try:
    response = urllib.request.urlopen(url, timeout=timeout)
  except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
    raise offline(getattr(exc, "reason", exc)) from exc

  with response:
    return _stream_to_cache(response, name, url, target, sha256, offline)


def _stream_to_cache(response, name, url, target, sha256, offline) -> Path:
  """Writes ``response`` (decompressed if bz2) to ``target`` via a verified temp file."""
  fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=target.parent)
  tmp = Path(tmp_name)
  try:
    digest = hashlib.sha256()
    decomp = bz2.BZ2Decompressor() if url.endswith(".bz2") else None
    expected = response.headers.get("Content-Length")
    received = 0
    with os.fdopen(fd, "wb") as out:
      while True:
        try:
          chunk = response.read(_CHUNK)
        except http.client.IncompleteRead as exc:
          raise ValueError(f"download of {name} from {url} is truncated") from exc
        except (OSError, socket.timeout, http.client.HTTPException) as exc:
          raise offline(exc) from exc
        if not chunk:
          break
        received += len(chunk)
        try:
          data = decomp.decompress(chunk) if decomp is not None else chunk
        except (OSError, EOFError) as exc:
          raise ValueError(f"download of {name} from {url} is not valid bz2") from exc
        digest.update(data)
        out.write(data)
    if expected is not None and received != int(expected):
      raise ValueError(
        f"download of {name} from {url} is truncated: {received} of {expected} bytes received"
      )
    if decomp is not None and not decomp.eof:
      raise ValueError(f"download of {name} from {url} is truncated: incomplete bz2 stream")
    if sha256 and digest.hexdigest() != sha256.lower():
      raise ValueError(
        f"checksum mismatch for {name} from {url}: SHA-256 {digest.hexdigest()}, "
        f"expected {sha256.lower()}; file discarded"
      )
    os.replace(tmp, target)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  return target


def main(argv=None):
  """``python -m experiments.data [--download NAME ...]``: lists or downloads datasets."""
  import argparse

  parser = argparse.ArgumentParser(description="LIBSVM datasets: where they are, download")
  parser.add_argument("--download", nargs="+", default=[], metavar="NAME")
  args = parser.parse_args(argv)
  data_dir, cache_dir = default_data_dir(), default_cache_dir()
  for name in args.download:
    path = find_dataset(name, data_dir, cache_dir)
    print(f"{name}: {path or download_dataset(name, cache_dir)}")
  if not args.download:
    print(f"data directory: {data_dir or _where_looked(None)}")
    print(f"download cache: {cache_dir}")
    print(f"bundled ({BUNDLED_DIR}): {' '.join(list_datasets(BUNDLED_DIR))}")
    if data_dir is not None:
      print(f"in the data directory: {' '.join(list_datasets(data_dir))}")


if __name__ == "__main__":
  main()
