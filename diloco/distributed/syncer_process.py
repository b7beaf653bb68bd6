"""The syncer process (`--role=syncer`): the host syncer over a store, durable round by round.

Each merged round is written to the store as one entry (the fragment's new values and
Nesterov momentum) plus a commit marker that carries the syncer's small state and the
round's tape record; only then is it added to `merged/index.json`, the one file learners
poll. So a learner can only act on a durable round, and a restarted syncer resumes from
the newest committed entry of every fragment: versions continue from there (none is
reused), the round counter from the newest committed round, deliveries still in the
store are read again (those already merged are skipped), and `tape.jsonl` is repaired
so that it has every committed round exactly once.

Only the holder of the store's lease (`lease.py`) writes: the process takes it before it
reads anything, renews it in the background, checks it before every merged commit (data,
marker, index), and stops with `LeaseLost` the moment it may no longer write. A commit that
fails (a full disk) is retried, with the error logged, until it succeeds: the round is
published to nobody until then, and the syncer stays up.

With `sync.shards = S > 1` the process is shard `sync.shard` (docs/design.md 3.1): it holds,
merges and publishes only the fragments `ownership.assign` gives it, over its own folder
of the store (`Store(root, shard=s)`: its own lease, merged entries, markers, payloads and
registry), and recovers from its own entries only. Its tape is WORKDIR/shards/s{s}/tape.jsonl
(the durable copy is its commit markers), every record tagged with `"shard"`. The global eval
needs every shard's versions, so a sharded syncer runs none itself (the launcher starts the
evaluator process, `evaluator.py`); shard 0 writes the run's export once every shard has
stopped, from all shards' newest committed versions (`global_view.read_global`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
from absl import logging

from diloco import fragments as fragments_lib
from diloco.artifacts import export
from diloco.config.run_config import Config
from diloco.distributed import chaos, process_hooks
from diloco.distributed import evaluator as evaluator_lib
from diloco.distributed.store import Store, global_view, shard_stores
from diloco.distributed.store import layout as store_layout
from diloco.distributed.store import markers as store_markers
from diloco.distributed.store.entry_check import StoreError
from diloco.distributed.store.learner_registry import DONE, RETIRED
from diloco.distributed.store.lease import Lease
from diloco.distributed.store.names import WRITE_FAILED, merged_name
from diloco.distributed.syncer_link import SyncerStoreLink
from diloco.errors import ConfigError
from diloco.learner.island import fragment_plan, initial_global
from diloco.observe import hooks as hooks_lib
from diloco.observe import metrics as metrics_lib
from diloco.sync import intake, ownership
from diloco.sync.syncer import Syncer
from diloco.transport import Merged

TAPE_FILE = "tape.jsonl"


def recover(store: Store, syncer: Syncer, num_fragments: int, max_staleness: int,
            fence=None) -> tuple[bool, set, list[dict]]:
  """Restores `syncer` from the store's committed rounds (`fence`: the lease's check, run
  before the store is changed).

  Each fragment resumes from its newest version that reads back whole, typed and finite
  (`MergedVersions.read` with the plan's shapes); newer ones that do not (corrupt or planted)
  are moved aside, so their version numbers are free for the rounds to come. A store whose
  versions none reads back (another layout, when the caller skipped `store_layout.claim`) is
  refused, never restarted from the initial G. Returns
  (recovered?, keys (fragment, learner, incarnation, step) of deliveries that committed
  rounds merged, the committed rounds' tape records).
  """
  store.merged.collect_uncommitted()  # a dead syncer's half-written rounds
  own = [p for p in syncer.owned if p < num_fragments]  # a shard recovers its fragments only
  found = {p: _newest_usable(store, syncer, p, max_staleness) for p in own}
  if not any(found.values()):
    held = [p for p in own if store.merged.versions(p)]
    if held:  # never a fresh start over a run's rounds (another layout, or all unreadable)
      raise ConfigError(f"store {store.root}: fragments {held[:8]} hold committed versions, "
                        "none of which reads back with this run's fragment plan and shapes; "
                        "resume with the store's config, or start a new store")
    return False, set(), []
  missing = [p for p, f in found.items() if f is None]
  if missing:
    raise ConfigError(f"store {store.root}: fragments {missing[:8]} have no usable committed "
                      "version while others have; the store is not from this run's layout")
  if fence is not None:
    fence()
  for p, (_, _, _, _, refused) in found.items():
    for version, why in refused:
      store.merged.set_aside(f"merged/{merged_name(p, version)}.json", why)
  fragments = {p: (f[0], f[1].tensors, f[2]) for p, f in found.items()}
  history = {p: f[3] for p, f in found.items()}
  markers = {p: store_markers.typed_marker(store.merged.marker(p, f[0]))
             for p, f in found.items()}
  with_rounds = [m for m in markers.values() if m["round"] is not None]
  newest = max(with_rounds, key=lambda m: m["round"], default=markers[own[0]])
  rounds = newest["round"] + 1 if with_rounds else 0
  state = dict(newest["state"], ledger=store_markers.joined_ledger(markers))
  syncer.restore_state(state, fragments, history, rounds)
  merged_keys = {(m["fragment"], a["learner"], a["incarnation"], a["local_step"])
                 for m in with_rounds for a in m["tape"]["admitted"]}
  # The index may lag the markers by one write if the syncer died in between.
  if fence is not None:
    fence()
  store.blobs.write_json("merged/index.json", {str(p): fragments[p][0] for p in own}, durable=True)
  return True, merged_keys, [m["tape"] for m in with_rounds]


def _newest_usable(store: Store, syncer: Syncer, p: int, max_staleness: int):
  """(version, Merged, momentum, history, refused newer versions) of fragment p's newest
  version that reads back whole, or None if none does."""
  shapes = {k: syncer.params[k].shape for k in syncer.plan.fragments[p]}
  versions = store.merged.versions(p)
  refused = []
  for version in reversed(versions):
    try:
      if store_markers.typed_marker(store.merged.marker(p, version)) is None:
        raise StoreError("unreadable", f"merged f{p}_v{version}: commit marker of wrong types")
      merged, momentum = store.merged.read(p, version, with_momentum=True, shapes=shapes)
    except StoreError as e:
      logging.error("syncer: merged version %d of fragment %d refused: %s", version, p, e)
      refused.append((version, str(e)))
      continue
    history = {version: merged.tensors}
    for older in versions:
      if version - max_staleness <= older < version:
        try:
          history[older] = store.merged.read(p, older, shapes=shapes)[0].tensors
        except StoreError as e:  # a base nobody can use: deliveries on it are stale
          logging.error("syncer: merged version %d of fragment %d refused: %s", older, p, e)
    return version, merged, momentum, history, refused
  return None


def repair_tape(path: str, rounds: int, committed: list[dict], *,
                versions: dict[int, int] | None) -> None:
  """Leaves `path` with every committed round (< `rounds`) exactly once, in round order.

  `versions`: {fragment: the version `recover` resumed it from}; a record of that fragment
  at a newer version (one `recover` refused: torn, non-finite, off the plan) is dropped, so
  the tape never lists a merge that G does not hold, and the version number the next round
  reuses is listed once. Required: None (a fresh start, nothing resumed) must be said, so that
  a caller that resumed cannot keep a refused round by forgetting it."""
  versions = versions or {}

  def refused(r: dict) -> bool:
    return r.get("fragment") in versions and not (
        isinstance(r.get("version"), int) and r["version"] <= versions[r["fragment"]])

  records = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
          continue  # torn by a crash mid-write (or not a record of ours)
        if (isinstance(record, dict) and isinstance(record.get("round"), int)
            and 0 <= record["round"] < rounds and not refused(record)):
          records.setdefault(record["round"], record)
  for record in committed:
    if not refused(record):
      records.setdefault(record["round"], record)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for r in sorted(records):
      f.write(json.dumps(records[r]) + "\n")
  os.replace(tmp, path)


def open_store(cfg: Config, store_root: str) -> Store:
  """This syncer's store: the root with one syncer, shard `sync.shard`'s view with several."""
  if cfg.sync.shards == 1:
    return Store(store_root)
  ownership.check_shard(cfg.sync.shard, cfg.sync.shards)
  return Store(store_root, shard=cfg.sync.shard)


def tape_dir(cfg: Config, workdir: str) -> str:
  """Where this syncer's tape goes: WORKDIR, or WORKDIR/shards/s{s} for a shard."""
  if cfg.sync.shards == 1:
    return workdir
  return os.path.join(workdir, "shards", f"s{cfg.sync.shard}")


def run(cfg: Config, workdir: str, store_root: str) -> dict:
  """Serves rounds until the launcher writes `stop.json` or every learner has left."""
  os.makedirs(workdir, exist_ok=True)
  store = open_store(cfg, store_root)
  lease = Lease(store, duration_s=cfg.store.lease_s)
  lease.acquire()  # before anything is read: a stale syncer may still be writing
  lease.start()
  try:
    return _serve(cfg, workdir, store, lease)
  finally:
    lease.release()


def _make_syncer(cfg: Config, plan, global_params: dict, records: list[dict]) -> Syncer:
  """The host syncer of this process: all fragments, or shard `sync.shard`'s."""
  owned, on_round = None, records.append
  if cfg.sync.shards > 1:
    shard = cfg.sync.shard
    owned = ownership.owned(ownership.assign(plan.num_elements, cfg.sync.shards), shard)
    on_round = lambda record: records.append(dict(record, shard=shard))  # noqa: E731
  return Syncer(global_params, plan, cfg.sync, cfg.outer, on_round=on_round,
                limits=intake.Limits(cfg.train.batch_size * cfg.data.seq_len,
                                     chaos.max_learners(cfg) or None), owned=owned)


@dataclasses.dataclass
class _Boot:
  """What a starting syncer (or shard) process builds before its loop."""
  spec: Any  # the model on the first device: shapes and the eval
  eval_fn: Any
  syncer: Syncer
  records: list[dict]  # round records not yet committed (`sync_once` drains them)
  expected: dict[int, dict[str, tuple]]  # each fragment's tensor shapes
  recovered: bool
  merged_keys: set
  committed: list[dict]


def _boot(cfg: Config, store: Store, lease: Lease, clock) -> _Boot:
  """Builds the model and this process's syncer, resumes from the store's committed rounds
  (`recover`), or publishes version 0 of every owned fragment on a fresh store."""
  spec, init_fn, eval_fn = evaluator_lib.model_on_first_device(cfg)
  plan = fragment_plan(cfg, spec)
  # Before anything is read: a store of another layout is refused, never restarted.
  store_layout.claim(store.shared, store_layout.layout_record(cfg.sync.shards, plan,
                                                              spec.abstract["params"]))
  with jax.set_mesh(spec.mesh):
    # train.init_from seeds G; a recovered store replaces it (`recover`).
    global_params = initial_global(init_fn, cfg.seed, cfg, spec.abstract["params"],
                                   global_view.read_store)
  records: list[dict] = []
  syncer = _make_syncer(cfg, plan, global_params, records)
  recovered, merged_keys, committed = recover(store, syncer, plan.num_fragments,
                                              cfg.sync.max_staleness, fence=lease.check)
  if not recovered:
    for merged in syncer.initial(clock()):
      store.merged.put(merged, syncer.momentum, {"round": None, "state": syncer.export_state()},
                       fence=lease.check)
  expected = {p: {k: global_params[k].shape for k in paths}
              for p, paths in enumerate(plan.fragments)}
  return _Boot(spec, eval_fn, syncer, records, expected, recovered, merged_keys, committed)


def _start_evaluator(cfg: Config, workdir: str, boot: _Boot, writer, clock):
  """The in-process global eval ("background"; None for "process", "off" or a shard, which
  holds only its fragments): it never delays a merge."""
  if cfg.train.eval_mode != "background" or cfg.sync.shards > 1:
    return None
  evaluator = evaluator_lib.Evaluator(cfg, boot.spec, boot.eval_fn, writer)
  if boot.recovered:
    evaluator.recall(workdir)  # what the syncer before this one evaluated
  else:
    evaluator.start(boot.syncer.global_params(), 0, clock(), 0)
  return evaluator


def _write_registry(cfg: Config, store: Store, syncer: Syncer, now: float, **extra) -> None:
  """`registry.json`: the syncer's state for people and tools (and the launcher's report)."""
  store.blobs.write_json("registry.json", dict(
      syncer.state_summary(), time=now, versions=syncer.versions, shard=cfg.sync.shard,
      owned=list(syncer.owned), **extra))


def _serve(cfg: Config, workdir: str, store: Store, lease: Lease) -> dict:
  origin = store.run.start(create=True)
  clock = lambda: time.time() - origin  # noqa: E731  (the run's clock, shared by all processes)
  boot = _boot(cfg, store, lease, clock)
  syncer, records = boot.syncer, boot.records
  keep = cfg.sync.max_staleness + 2
  os.makedirs(tape_dir(cfg, workdir), exist_ok=True)
  tape_path = os.path.join(tape_dir(cfg, workdir), TAPE_FILE)
  repair_tape(tape_path, syncer.rounds, boot.committed,
              versions={p: syncer.versions[p] for p in syncer.owned} if boot.recovered else None)
  who = (f"syncer shard {cfg.sync.shard}/{cfg.sync.shards}" if cfg.sync.shards > 1
         else "syncer")
  user_hooks = process_hooks.SyncerHooks(cfg.log.hooks, store.run, syncer, who)
  print(f"{who}: {'resumed at round ' + str(syncer.rounds) if boot.recovered else 'started'}, "
        f"versions {syncer.versions}", flush=True)
  link = SyncerStoreLink(store, boot.expected, boot.merged_keys,
                         fresh_s=cfg.sync.heartbeat_timeout_s / 2)
  # A shard holds only its fragments: the global eval is the evaluator process's.
  writer = None if cfg.sync.shards > 1 else metrics_lib.open_writer(
      cfg.log, workdir, role="syncer", process="syncer", config=dataclasses.asdict(cfg))
  evaluator = _start_evaluator(cfg, workdir, boot, writer, clock)
  progress, next_eval = 0, cfg.train.eval_every if evaluator else 0
  tape = open(tape_path, "a", encoding="utf-8")
  last_registry = 0.0
  try:
    while True:
      now = clock()
      if not lease.held:
        lease.check()  # raises LeaseLost, with the reason
      beats, deadline = sync_once(store, syncer, link, records, tape, keep, now,
                                  fence=lease.check, on_round=user_hooks.after_round)
      user_hooks.end_if_stopped(clock)
      progress = max([progress] + [b.local_step for b in beats])
      if evaluator is not None and evaluator.due(progress, next_eval, cfg.train.steps):
        evaluator.start(syncer.global_params(), progress, clock(), syncer.rounds)
        next_eval = (progress // cfg.train.eval_every + 1) * cfg.train.eval_every
      if now - last_registry >= 1.0:
        last_registry = now
        store.payloads.collect_uncommitted(max_age_s=max(60.0, 2 * cfg.sync.heartbeat_timeout_s))
        _write_registry(cfg, store, syncer, now, alive=syncer.alive(now))
      if store.run.stop_requested() or _all_left(store):
        _settle(cfg, store, syncer, link, records, tape, keep, clock, lease.check)
        break
      wait = cfg.store.poll_s if deadline is None else min(cfg.store.poll_s,
                                                           max(deadline - clock(), 0.0))
      time.sleep(wait)
    final = _finish(cfg, workdir, store, syncer, evaluator, progress, clock)
  finally:
    hooks_lib.report(user_hooks.runner.close())
    link.close()
    tape.close()
    if writer is not None:
      writer.close()
  # `stopped`: the final versions are published (the evaluator process evaluates them).
  _write_registry(cfg, store, syncer, clock(), alive=[], stopped=True)
  print(f"{who}: stopped after {syncer.rounds} rounds"
        + (f", eval/loss {final:.4f}" if final is not None else ""), flush=True)
  return dict(syncer.state_summary(), versions=syncer.versions, shard=cfg.sync.shard,
              owned=list(syncer.owned), **{"eval/loss": final})


def _finish(cfg: Config, workdir: str, store: Store, syncer: Syncer, evaluator, progress: int,
            clock) -> float | None:
  """After the last merge: the final global eval (in-process) and the export; a shard marks
  itself stopped first, and shard 0 assembles the export from every shard. Returns the final
  eval loss (None where the evaluator process or nobody evaluates)."""
  final = None
  if evaluator is not None:
    evaluator.join()  # after the last merge: nothing waits on it any more
    final = evaluator.final(syncer.global_params(), progress, clock(), syncer.rounds)
  if cfg.sync.shards == 1:
    export.save(workdir, fragments_lib.unflatten_tree(syncer.global_params()),
                model=cfg.model, data=cfg.data, seed=cfg.seed, step=progress,
                runtime="multiprocess",
                extra={"outer/rounds": syncer.rounds, "eval/loss": final,
                       "fragment_versions": {str(p): v for p, v in enumerate(syncer.versions)}})
  else:
    # Stopped (its final versions published) before shard 0 assembles the export.
    _write_registry(cfg, store, syncer, clock(), alive=[], stopped=True)
    if cfg.sync.shard == 0:
      _export_sharded(cfg, workdir, store.base, progress, clock)
  return final


def _export_sharded(cfg: Config, workdir: str, root, progress: int, clock) -> None:
  """Shard 0's end of a sharded run: once every shard has stopped, the run's export from all
  shards' newest committed versions, recording which version of each fragment it holds."""
  stores = shard_stores(root, cfg.sync.shards)
  while not all(global_view.stopped(s) for s in stores):
    time.sleep(cfg.store.poll_s)  # the launcher restarts a shard that died meanwhile
  flat, index, rounds = global_view.read_global(stores, with_rounds=True)
  export.save(workdir, fragments_lib.unflatten_tree(flat), model=cfg.model, data=cfg.data,
              seed=cfg.seed, step=progress,
              runtime="multiprocess",
              extra={"outer/rounds": rounds, "eval/loss": None, "syncer_shards": cfg.sync.shards,
                     "fragment_versions": {str(p): v for p, v in sorted(index.items())}})
  print(f"syncer shard 0: exported the global model at versions {index}", flush=True)


def _settle(cfg: Config, store: Store, syncer: Syncer, link: SyncerStoreLink,
            records: list[dict], tape, keep: int, clock, fence) -> None:
  """The run's end, before the final eval and export: one more pass, so that rounds holding
  what the last learners flushed before leaving close now that nobody is left to wait for.
  With `receipt.final_sync` those are their final deliveries (every fragment): passes go on until
  the syncer has settled (all of them merged), for at most `sync.heartbeat_timeout_s`, the
  time a learner that died without leaving takes to stop counting."""
  until = clock() + cfg.sync.heartbeat_timeout_s
  while True:
    sync_once(store, syncer, link, records, tape, keep, clock(), fence=fence)
    if not cfg.receipt.final_sync or syncer.settled():
      return
    if clock() > until:
      logging.warning("syncer: not every final delivery was merged within "
                      "sync.heartbeat_timeout_s=%g s", cfg.sync.heartbeat_timeout_s)
      return
    time.sleep(cfg.store.poll_s)


# A loop pass slower than this is logged with its parts (a stalled store, a starved host).
_SLOW_PASS_S = 2.0


def sync_once(store: Store, syncer: Syncer, link: SyncerStoreLink, records: list[dict], tape,
              keep: int, now: float, fence=None, on_round=None) -> tuple[list, float | None]:
  """One pass of the syncer loop: poll the store, tick the syncer, make the closed rounds
  durable (then `on_round(record)` for each), then let go of the entries they consumed
  (deleted in the background, with all but the newest `keep` versions of each merged
  fragment). Returns the new heartbeats and when the next round must close (None: no
  deadline)."""
  t0 = time.perf_counter()
  beats, payloads, rejected, left = link.poll(now)
  t1 = time.perf_counter()
  for r in rejected:
    syncer.reject(r.fragment, r.learner, r.incarnation, r.reason, r.nbytes, now)
  merged, deadline = syncer.tick(now, beats, payloads)
  link.quarantine(syncer.take_faults())  # malformed deliveries, or ones that raised
  # After the tick: the deliveries a learner flushed before leaving are merged, not rejected.
  for learner, incarnation in left:
    syncer.forget(learner, incarnation)
  t2 = time.perf_counter()
  committed = list(records) if on_round is not None else []
  _commit(store, syncer, merged, records, tape, fence=fence)
  for record in committed:
    on_round(record)
  for m in merged:
    link.collect_merged(m.fragment, keep)
  link.release(syncer.pending_keys())
  t3 = time.perf_counter()
  if t3 - t0 > _SLOW_PASS_S:
    logging.warning("syncer: slow pass %.1f s (poll %.1f s for %d payloads, tick %.1f s, "
                    "commit %.1f s for %d rounds)", t3 - t0, t1 - t0, len(payloads), t2 - t1,
                    t3 - t2, len(merged))
  return beats, deadline


# How long a failed commit (a full disk) waits before it is tried again, at most.
_COMMIT_RETRY_MAX_S = 10.0


def _commit(store: Store, syncer: Syncer, merged: list[Merged], records: list[dict],
            tape, fence=None, sleep=time.sleep) -> None:
  """Durable entry, commit marker and index (in that order), then the tape line.

  A write that fails (StoreError WRITE_FAILED: a full disk, a lost bucket connection) is
  retried with backoff until it succeeds, checking the lease each time: the round is
  published to nobody meanwhile, so nothing is lost, and freeing space resumes the run.
  """
  assert len(merged) == len(records), (len(merged), len(records))
  for m, record in zip(merged, records):
    wait = 0.1
    while True:
      try:
        store.merged.put(m, syncer.momentum, {"round": record["round"],
                                              "state": syncer.export_state(), "tape": record},
                         fence=fence)
        break
      except StoreError as e:
        if e.reason != WRITE_FAILED:
          raise
        logging.error("syncer: round %d not committed, retrying in %.1f s: %s",
                      record["round"], wait, e)
        sleep(wait)
        wait = min(2 * wait, _COMMIT_RETRY_MAX_S)
    tape.write(json.dumps(record) + "\n")
    tape.flush()
  records.clear()


def _all_left(store: Store) -> bool:
  """True once learners have heartbeats and every one of them is done or retired (one done,
  or all retired in a run a hook ended)."""
  states = [r.get("state") for r in store.learners.heartbeats().values()]
  return bool(states) and all(s in (DONE, RETIRED) for s in states) and (
      DONE in states or store.run.end_requested())
