"""A writer process for the lease tests: takes the store's syncer lease, then commits merged
versions of fragment 0 through the syncer's own write path until it is killed or loses the
lease (exit status 3), or finds that its version was committed by the new holder while it was
paused between its check and its write (status 4: the create-only marker refused it). Each
marker records who wrote it, so the test can tell the writers apart.

  python tests/lease_holder.py ROOT NAME LEASE_S [--object-dir DIR] [--no-same-host]
"""

import argparse
import os
import sys
import time

import numpy as np

LOST, CONFLICT = 3, 4


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("root")
  parser.add_argument("name")
  parser.add_argument("lease_s", type=float)
  parser.add_argument("--object-dir", default="")
  parser.add_argument("--no-same-host", action="store_true")
  args = parser.parse_args()
  if args.object_dir:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import object_store  # pylint: disable=import-outside-toplevel
    os.environ[object_store.ENV] = args.object_dir
    object_store.register()
  from diloco.distributed import store as store_lib  # pylint: disable=import-outside-toplevel
  from diloco.distributed.store import names as store_names  # pylint: disable=import-outside-toplevel
  from diloco.distributed.store.entry_check import StoreError  # pylint: disable=import-outside-toplevel
  from diloco.distributed.store.lease import Lease, LeaseLost  # pylint: disable=import-outside-toplevel
  from diloco.transport import Merged  # pylint: disable=import-outside-toplevel

  store = store_lib.Store(args.root)
  lease = Lease(store, duration_s=args.lease_s, holder=args.name,
                same_host=not args.no_same_host)
  print(f"{args.name}: waiting", flush=True)
  generation = lease.acquire()
  print(f"{args.name}: holds generation {generation}", flush=True)
  lease.start()
  try:
    while True:
      # From the commit markers, as a recovering syncer does: a holder killed between its
      # marker and its index write leaves the index one version behind.
      version = max(store.merged.versions(0), default=-1) + 1
      tensors = {"w": np.full(4, version, np.float32)}
      store.merged.put(Merged(0, version, tensors, time.time()), {"w": np.zeros(4, np.float32)},
                       {"holder": args.name, "generation": generation, "time": time.time()},
                       fence=lease.check)
      time.sleep(0.02)
  except LeaseLost as e:
    print(f"{args.name}: {e}", flush=True)
    return LOST
  except StoreError as e:
    if e.reason != store_names.CONFLICT:
      raise
    print(f"{args.name}: {e}", flush=True)
    return CONFLICT


if __name__ == "__main__":
  sys.exit(main())
