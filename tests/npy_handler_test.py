"""The `.npy` leaf handler, driven by Orbax's own PyTree handler as the store drives it."""

import asyncio
import os
import time

import ml_dtypes
import numpy as np
import object_store
import orbax.checkpoint as ocp
import pytest
from etils import epath

from diloco.distributed.store.npy_handler import NpyHandler


@pytest.fixture(params=["local", "object"])
def where(request, tmp_path, monkeypatch):
  """(entry path, local folder of its files), on a local disk or the emulated object store."""
  root, files = object_store.location(request.param, tmp_path, monkeypatch, name="e")
  return epath.Path(root), epath.Path(files)


def _handler(sync=False):
  registry = ocp.type_handlers.create_type_handler_registry((np.ndarray, NpyHandler(sync)))
  return ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=registry)


def _save(path, tree, sync=False):
  """As the store saves: into a directory it created (the handler is called directly)."""
  path.mkdir(parents=True)  # nothing on an object store: a prefix exists through its objects
  _handler(sync).save(path, args=ocp.args.PyTreeSave(tree))


def _tree():
  rng = np.random.default_rng(0)
  return {
      "t0000": rng.standard_normal((3, 5)).astype(np.float32),
      "t0001": {"values": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
                "scales": np.arange(4, dtype=np.float32)},
      "t0002": rng.integers(-8, 8, (2, 3, 4)).astype(np.int8),
      "t0003": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
      "t0004": np.asfortranarray(rng.standard_normal((4, 3))),  # float64, not C-ordered
      "t0005": np.zeros((0, 2), np.uint8),
  }


def _leaves(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def test_round_trip_keeps_values_shapes_and_dtypes_including_ml_dtypes(where):
  entry, _ = where
  tree = _tree()
  _save(entry, tree)
  got = _handler().restore(entry, args=ocp.args.PyTreeRestore())
  for name, want in _leaves(tree):
    have = dict(_leaves(got))[name]
    assert have.dtype == want.dtype and have.shape == want.shape, name
    # Compare the raw bytes: exact, and independent of how each dtype compares.
    assert np.ascontiguousarray(have).tobytes() == np.ascontiguousarray(want).tobytes(), name


def test_each_leaf_is_a_npy_file_plain_numpy_reads(where):
  entry, files = where
  tree = _tree()
  _save(entry, tree)
  names = sorted(p.name for p in files.iterdir() if p.suffix == ".npy")
  assert names == sorted(f"{name}.npy" for name, _ in _leaves(tree))
  plain = np.load(files / "t0000.npy", allow_pickle=False)
  np.testing.assert_array_equal(plain, tree["t0000"])
  bf16 = np.load(files / "t0001.values.npy", allow_pickle=False)
  assert bf16.dtype == np.dtype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(bf16.astype(np.float32),
                                tree["t0001"]["values"].astype(np.float32))


def test_metadata_reports_shapes_and_dtypes_from_the_file_headers(where):
  entry, _ = where
  tree = _tree()
  _save(entry, tree)
  handler = NpyHandler()
  infos = [ocp.type_handlers.ParamInfo(name=n, parent_dir=entry, ts_context=None)
           for n, _ in _leaves(tree)]
  metas = asyncio.run(handler.metadata(infos))
  for meta, (name, want) in zip(metas, _leaves(tree)):
    assert meta.name == name and meta.shape == want.shape and meta.dtype == want.dtype


def test_sync_flushes_every_file_only_when_asked(tmp_path, monkeypatch):
  calls = []
  real = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
  tree = _tree()
  _save(tmp_path / "a", tree, sync=False)
  assert calls == []
  _save(tmp_path / "b", tree, sync=True)
  assert len(calls) == len(list(_leaves(tree)))


@pytest.mark.parametrize("damage, error", [
    ("truncate", "Failed to read all data"),
    ("garbage", "magic string is not correct"),  # never a pickle or npz fallback
    ("missing", "No such file"),
])
def test_damaged_files_fail_the_restore(where, damage, error):
  entry, files = where
  tree = {"t0000": np.arange(1000, dtype=np.float32)}
  _save(entry, tree)
  path = files / "t0000.npy"
  if damage == "truncate":
    path.write_bytes(path.read_bytes()[:200])
  elif damage == "garbage":
    path.write_bytes(b"\x00\xff" * 100)
  else:
    path.unlink()
  with pytest.raises((ValueError, FileNotFoundError), match=error):
    _handler().restore(entry, args=ocp.args.PyTreeRestore())


def test_leaves_numpy_cannot_store_are_refused_by_name(tmp_path):
  with pytest.raises(TypeError, match="'t0000'.*objects"):
    _save(tmp_path / "e", {"t0000": np.array([{"a": 1}], dtype=object)})


def test_a_failed_save_returns_only_once_every_write_has_ended(tmp_path, monkeypatch):
  """The store removes a failed entry as soon as the save raises; a write still running
  then would put its file back (on a full disk, writes fail one by one)."""
  from diloco.distributed.store import npy_handler  # pylint: disable=import-outside-toplevel
  real, ended = npy_handler._write, []  # pylint: disable=protected-access

  def write(path, value, sync):
    if path.name == "t0000.npy":
      raise OSError(28, "No space left on device", str(path))
    time.sleep(0.3)
    real(path, value, sync)
    ended.append(path.name)

  monkeypatch.setattr(npy_handler, "_write", write)
  tree = {f"t{i:04d}": np.arange(4, dtype=np.float32) for i in range(4)}
  with pytest.raises(OSError, match="No space"):
    _save(tmp_path / "e", tree)
  assert sorted(ended) == ["t0001.npy", "t0002.npy", "t0003.npy"]
