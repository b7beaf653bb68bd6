"""A local Cloud Storage emulator speaking the real JSON/HTTP API, for the store's tests.

`tests/object_store.py` emulates object-store *semantics* in process; this module runs the real
client stack instead: `etils.epath` -> fsspec -> `gcsfs` (aiohttp, the JSON API's uploads,
listings with prefixes and delimiters, deletes) against `gcp-storage-emulator` started in a
subprocess on a free local port. `STORAGE_EMULATOR_HOST` points gcsfs at it, and
`TENSORSTORE_GCS_HTTP_URL` TensorStore (which Orbax uses for the learners' checkpoints); the
child processes a test starts inherit those and the placeholder tokens (`Emulator.env`), so a
launched run uses the same emulator.

What the emulator does not do (see `test_emulator_ignores_generation_preconditions`): it
accepts `ifGenerationMatch=0` and overwrites anyway, so the lease's create-only write is
tested on the in-memory emulation only (`tests/lease_test.py`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import fsspec
import pytest

BUCKET = "diloco-test"
# gcsfs >= 2025.x defaults to its "extended" filesystem, which first asks the bucket's layout
# (zonal or not) over gRPC; the emulator has no gRPC endpoint, so every call would wait 60 s
# for that answer. "false" selects the plain JSON-API filesystem (the one this module tests).
ZONAL = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
_START_S = 30.0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _answers(url: str) -> bool:
  try:
    with urllib.request.urlopen(url, timeout=1) as r:
      return r.status == 200
  except (urllib.error.URLError, OSError):
    return False


class Emulator:
  """One emulator process and the environment that sends `gs://` to it."""

  def __init__(self, log_path: str):
    self.port = _free_port()
    self.host = f"http://127.0.0.1:{self.port}"
    self._log = open(log_path, "w+b")  # noqa: SIM115  (closed in stop)
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host=127.0.0.1",
         f"--port={self.port}", "--in-memory", f"--default-bucket={BUCKET}", "--quiet"],
        stdout=self._log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + _START_S
    while not _answers(f"{self.host}/storage/v1/b/{BUCKET}"):
      if self.proc.poll() is not None or time.monotonic() > deadline:
        self.stop()
        raise RuntimeError(
            f"the GCS emulator (gcp-storage-emulator) did not answer on {self.host} within "
            f"{_START_S:.0f} s (exit status {self.proc.returncode}); is `pip install "
            f"-e .[test]` done? Its output:\n{self.output()}")
      time.sleep(0.05)

  def output(self) -> str:
    self._log.flush()
    self._log.seek(0)
    return self._log.read().decode(errors="replace")[-4000:]

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()

  def env(self) -> dict[str, str]:
    """What a process needs to reach the emulator (inherited by the processes it starts):
    gcsfs (the store's entries and records) and TensorStore's own GCS driver (the arrays of
    the learners' Orbax checkpoints under `learners/`), each with a token the emulator
    ignores instead of Google credentials."""
    return {"STORAGE_EMULATOR_HOST": self.host, "FSSPEC_GCS_TOKEN": "anon",
            "GOOGLE_CLOUD_PROJECT": "diloco-test", ZONAL: "false",
            "TENSORSTORE_GCS_HTTP_URL": self.host, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anon"}

  def root(self, name: str = "store") -> str:
    """A fresh `gs://` root: every test gets a prefix nobody has written."""
    return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:12]}"


def use_gcsfs(monkeypatch: pytest.MonkeyPatch, emulator: Emulator) -> None:
  """Sends `gs://` to gcsfs and the emulator in this process (undoing what
  `object_store.register` may have done in this worker) with empty caches."""
  from etils.epath import backend  # pylint: disable=import-outside-toplevel
  from gcsfs import core  # pylint: disable=import-outside-toplevel
  for key, value in emulator.env().items():
    monkeypatch.setenv(key, value)
  monkeypatch.setitem(fsspec.config.conf, "gcs", {"token": "anon"})
  for name in ("gs", "gcs"):
    fsspec.register_implementation(name, core.GCSFileSystem, clobber=True)
  core.GCSFileSystem.clear_instance_cache()
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


def gcs() -> fsspec.AbstractFileSystem:
  """The gcsfs filesystem epath uses (for tests that damage or inspect objects directly)."""
  from etils.epath import backend  # pylint: disable=import-outside-toplevel
  return backend.fsspec_backend.fs("gs://")
