"""An offline object store with Cloud Storage semantics, for running the store's tests on `gs://`.

`etils.epath` sends `gs://` paths to the fsspec filesystem registered for "gcs" (when
TensorFlow is not installed), so registering this class under "gs"/"gcs" makes
`Store("gs://bucket/run")` run the object-store code path with no network. The objects live
as files under one local directory (`DILOCO_OBJECT_STORE_DIR`, so that subprocesses share
the bucket), but the semantics are an object store's, not a file system's:

- a write becomes visible whole when its file is closed (never half-written), and
  `pipe_file(mode="create")` creates an object only if it does not exist, atomically (GCS:
  the `ifGenerationMatch=0` precondition);
- there are no directories: `mkdir` does nothing, a prefix exists only while an object lies
  under it, listing a prefix without objects raises FileNotFoundError, and a prefix has no
  modification time;
- there is no rename (`mv` raises): GCS copies and deletes object by object, which is not
  atomic, so the store must never rely on it;
- deleting a prefix deletes its objects one by one.
"""

from __future__ import annotations

import io
import os
import uuid

import fsspec
from fsspec.spec import AbstractFileSystem

ENV = "DILOCO_OBJECT_STORE_DIR"


class ObjectStoreEmulation(AbstractFileSystem):
  """A `gs://` filesystem over a local directory with object-store semantics (see module)."""

  protocol = ("gs", "gcs")
  root_marker = ""
  cachable = False

  def __init__(self, *args, **kwargs):
    del args, kwargs  # gcsfs options (`finalize_on_close=True` from etils) mean nothing here
    super().__init__()
    base = os.environ.get(ENV)
    if not base:
      raise RuntimeError(f"object store emulation: set {ENV} to the directory of the bucket")
    self._base = os.path.abspath(base)
    self._staging = os.path.join(self._base, ".staging")
    os.makedirs(self._staging, exist_ok=True)

  @classmethod
  def _strip_protocol(cls, path):
    return str(path).removeprefix("gs://").removeprefix("gcs://").rstrip("/")

  def _local(self, path: str) -> str:
    key = self._strip_protocol(path)
    if not key or key.startswith((".", "/")) or ".." in key.split("/"):
      raise ValueError(f"object store emulation: bad object name {path!r}")
    return os.path.join(self._base, key)

  # Reading and listing.
  def info(self, path, **kwargs):
    local, name = self._local(path), self._strip_protocol(path)
    if os.path.isfile(local):
      st = os.stat(local)
      return {"name": name, "size": st.st_size, "type": "file", "mtime": st.st_mtime}
    if os.path.isdir(local) and self._has_objects(local):
      return {"name": name, "size": 0, "type": "directory"}  # a prefix: no time of its own
    raise FileNotFoundError(name)

  def _has_objects(self, local: str) -> bool:
    return any(files for _, _, files in os.walk(local))

  def ls(self, path, detail=True, **kwargs):
    info = self.info(path)
    if info["type"] == "file":
      return [info] if detail else [info["name"]]
    out = []
    for entry in sorted(os.listdir(self._local(path))):
      try:
        out.append(self.info(f"{info['name']}/{entry}"))
      except FileNotFoundError:  # deleted meanwhile, or a prefix without objects
        continue
    return out if detail else [i["name"] for i in out]

  def _open(self, path, mode="rb", **kwargs):
    if mode == "rb":
      return open(self._local(path), "rb")  # FileNotFoundError when there is no object
    if mode in ("wb", "xb"):
      return _Upload(self, path, create_only=mode == "xb")
    raise ValueError(f"object store emulation: mode {mode!r} is not supported")

  def cat_file(self, path, start=None, end=None, **kwargs):
    with self._open(path, "rb") as f:
      data = f.read()
    return data[start:end]

  def pipe_file(self, path, value, mode="overwrite", **kwargs):
    with _Upload(self, path, create_only=mode == "create") as f:
      f.write(value)

  # Writing.
  def _publish(self, staged: str, path: str, create_only: bool) -> None:
    """Makes a staged upload the object `path`, whole; `create_only`: only if it is absent."""
    target = self._local(path)
    for _ in range(20):  # a concurrent delete may prune the folder between the two calls
      os.makedirs(os.path.dirname(target), exist_ok=True)
      try:
        if create_only:
          os.link(staged, target)  # fails if the object exists: atomic create-if-absent
          os.unlink(staged)
        else:
          os.replace(staged, target)
        return
      except FileExistsError:
        os.unlink(staged)
        raise FileExistsError(f"{path}: the object exists (precondition failed)") from None
      except FileNotFoundError:
        if not os.path.exists(staged):
          raise
    raise OSError(f"object store emulation: could not publish {path}")

  def mkdir(self, path, create_parents=True, **kwargs):
    del path  # prefixes exist only through their objects

  def makedirs(self, path, exist_ok=False):
    del path

  def rmdir(self, path):
    del path

  def rm_file(self, path):
    local = self._local(path)
    if not os.path.isfile(local):
      raise FileNotFoundError(self._strip_protocol(path))
    os.unlink(local)
    self._prune(os.path.dirname(local))

  def rm(self, path, recursive=False, maxdepth=None):
    for p in [path] if isinstance(path, str) else path:
      info = self.info(p)
      if info["type"] == "file":
        self.rm_file(p)
        continue
      if not recursive:
        raise IsADirectoryError(f"{p}: a prefix; pass recursive=True")
      for root, _, files in os.walk(self._local(p)):
        for f in files:  # one object at a time, as an object store deletes
          try:
            os.unlink(os.path.join(root, f))
          except FileNotFoundError:
            pass
      self._prune_tree(self._local(p))

  def _prune(self, folder: str) -> None:
    """Removes folders left without objects (a prefix disappears with its last object)."""
    while folder.startswith(self._base + os.sep) and folder != self._base:
      try:
        os.rmdir(folder)
      except OSError:  # not empty, or gone
        return
      folder = os.path.dirname(folder)

  def _prune_tree(self, folder: str) -> None:
    for root, _, _ in sorted(os.walk(folder), key=lambda x: -len(x[0])):
      try:
        os.rmdir(root)
      except OSError:
        pass
    self._prune(os.path.dirname(folder))

  def mv(self, path1, path2, **kwargs):
    raise NotImplementedError(f"object store emulation: no rename ({path1} -> {path2})")

  rename = mv

  def cp_file(self, path1, path2, **kwargs):
    with self._open(path1, "rb") as src, _Upload(self, path2, create_only=False) as dst:
      dst.write(src.read())


class _Upload(io.BytesIO):
  """An object being uploaded: invisible until closed, then published whole."""

  def __init__(self, fs: ObjectStoreEmulation, path: str, create_only: bool):
    super().__init__()
    self._fs, self._path, self._create_only = fs, path, create_only
    fs._local(path)  # a bad name fails before anything is written

  def __exit__(self, exc_type, exc, tb):
    if exc_type is not None:  # an aborted upload leaves no object
      super().close()
      return False
    self.close()
    return False

  def close(self) -> None:
    if self.closed:
      return
    staged = os.path.join(self._fs._staging, uuid.uuid4().hex)
    with open(staged, "wb") as f:
      f.write(self.getbuffer())
    super().close()
    self._fs._publish(staged, self._path, self._create_only)


def register() -> None:
  """Sends `gs://` paths (through etils.epath and fsspec) to the emulation."""
  for name in ObjectStoreEmulation.protocol:
    fsspec.register_implementation(name, ObjectStoreEmulation, clobber=True)
  from etils.epath import backend  # pylint: disable=import-outside-toplevel
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


def location(kind: str, tmp_path, monkeypatch, name: str = "store") -> tuple[str, str]:
  """(root to give `Store`, local directory where its files lie) for a "local" directory
  store or an "object" store (`gs://bucket/NAME` in the emulation, objects under tmp_path)."""
  if kind == "local":
    path = os.path.join(tmp_path, name)
    return path, path
  if kind != "object":
    raise ValueError(f"unknown store kind {kind!r}")
  objects = os.path.join(tmp_path, "objects")
  monkeypatch.setenv(ENV, objects)
  register()
  return f"gs://bucket/{name}", os.path.join(objects, "bucket", name)
