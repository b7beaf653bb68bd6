"""An Orbax leaf handler that keeps each host array as one `.npy` file.

The store's fragments are host NumPy arrays that one process writes and another reads whole,
within seconds. Orbax's own NumPy handler goes through TensorStore, which is built for sharded
arrays read in slices: for whole host arrays it reads into its own buffers and copies again,
which made a store round trip ~2x slower than `np.save` + `np.load` of the same bytes
(`scripts/bench_store.py`). This handler plugs into Orbax's `PyTreeCheckpointHandler` (which
still writes the tree's `_METADATA` and drives the save and the restore) and writes the leaves
as `.npy` files through `etils.epath`, so a local disk and an object store use the same code.
All leaves of one entry are written and read in parallel threads (file I/O releases the GIL).

Dtypes that the `.npy` format cannot name (ml_dtypes' bfloat16, float8, int4: NumPy would save
them as anonymous void bytes) are written with their dtype name as the header's `descr`, which
`np.load` resolves once `ml_dtypes` is imported (this module imports it).

`sync=True` flushes every file to a local disk before the save returns (merged rounds are the
syncer's durable state); `sync=False` leaves them to the page cache (payloads are consumed
within seconds, and a torn file fails the checked read). Object-store writes are durable once
the object is closed, so the store passes `sync=False` there.
"""

from __future__ import annotations

import asyncio
import os
from typing import Sequence

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. by name for np.load)
import numpy as np
import orbax.checkpoint as ocp
from etils import epath


def _file(info: ocp.type_handlers.ParamInfo) -> epath.Path:
  return info.parent_dir / f"{info.name}.npy"


def _npy_names(dtype: np.dtype) -> bool:
  """Whether the standard `.npy` header describes `dtype` (false for ml_dtypes' types)."""
  fmt = np.lib.format
  return fmt.descr_to_dtype(fmt.dtype_to_descr(dtype)) == dtype


def _check_leaf(value: object, name: str) -> None:
  if not isinstance(value, np.ndarray):
    raise TypeError(f"NpyHandler: leaf {name!r} is {type(value).__name__}, not a NumPy array")
  if value.dtype.hasobject:
    raise TypeError(f"NpyHandler: leaf {name!r} holds Python objects ({value.dtype})")
  if not _npy_names(value.dtype) and np.dtype(value.dtype.name) != value.dtype:
    raise TypeError(f"NpyHandler: leaf {name!r}: dtype {value.dtype} has no name np.load "
                    "could resolve")


def _write(path: epath.Path, value: np.ndarray, sync: bool) -> None:
  with path.open("wb") as f:
    if _npy_names(value.dtype):
      np.save(f, value, allow_pickle=False)
    else:
      np.lib.format.write_array_header_1_0(
          f, {"descr": value.dtype.name, "fortran_order": False, "shape": value.shape})
      f.write(memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
    if sync:
      f.flush()
      os.fsync(f.fileno())


def _read(path: epath.Path) -> np.ndarray:
  """The array of a `.npy` file; ValueError for anything else (no pickle or npz fallback)."""
  with path.open("rb") as f:
    return np.lib.format.read_array(f, allow_pickle=False)


def _header(path: epath.Path) -> tuple[tuple[int, ...], np.dtype]:
  with path.open("rb") as f:
    version = np.lib.format.read_magic(f)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                   np.lib.format.read_array_header_2_0)
    shape, _, dtype = read_header(f)
  return shape, dtype


class NpyHandler(ocp.type_handlers.TypeHandler):
  """Orbax `TypeHandler` for `np.ndarray` leaves: one `.npy` file per leaf."""

  def __init__(self, sync: bool = True):
    self._sync = sync

  def typestr(self) -> str:
    return "diloco.npy"

  async def metadata(self, infos: Sequence[ocp.type_handlers.ParamInfo]
                     ) -> Sequence[ocp.metadata.ArrayMetadata]:
    out = []
    for info in infos:
      await info.await_path_creation()
      shape, dtype = await asyncio.to_thread(_header, _file(info))
      out.append(ocp.metadata.ArrayMetadata(name=info.name, directory=info.parent_dir,
                                            shape=tuple(shape), dtype=dtype, sharding=None))
    return out

  async def serialize(self, values: Sequence[np.ndarray],
                      infos: Sequence[ocp.type_handlers.ParamInfo],
                      args: Sequence[ocp.SaveArgs] | None = None
                      ) -> Sequence[ocp.future.Future]:
    del args  # chunking and dtype casts have no meaning for one file per array
    for value, info in zip(values, infos, strict=True):
      _check_leaf(value, info.name)

    async def write_all() -> None:
      for info in infos:
        await info.await_path_creation()
      # Every write ends before an error is raised: the caller then removes the entry, and a
      # write still running would put its file back (a full disk fails writes one by one).
      results = await asyncio.gather(*(asyncio.to_thread(_write, _file(info), value, self._sync)
                                       for value, info in zip(values, infos)),
                                     return_exceptions=True)
      for result in results:
        if isinstance(result, BaseException):
          raise result

    return [ocp.future.CommitFutureAwaitingContractedSignals(write_all(), name="npy_handler")]

  async def deserialize(self, infos: Sequence[ocp.type_handlers.ParamInfo],
                        args: Sequence[ocp.type_handlers.RestoreArgs] | None = None
                        ) -> Sequence[np.ndarray]:
    del args
    for info in infos:
      await info.await_path_creation()
    return await asyncio.gather(*(asyncio.to_thread(_read, _file(info)) for info in infos))
