"""A learner process (`--role=learner --learner_id=M`): one learner, its own devices, a store.

It builds its mesh over every device this process sees (on a TPU pod: its slice, with
`jax.distributed` inside the slice), takes a fresh incarnation number from the store,
resumes its own checkpoint (params, AdamW state, data position) if it has one, or
optionally a healthy peer's AdamW state, then loads the latest published global
fragments and trains. It checkpoints every `checkpoint.every_steps` steps (asynchronously).
On SIGTERM it flushes its deliveries, checkpoints and either leaves cleanly ("retired",
exit 0) or, with `store.on_sigterm=restart`, exits 143 to be started again ("preempted": the
syncer times it out; the next incarnation resumes from that checkpoint). A SIGKILL loses only
the steps since its last checkpoint; the launcher (or Kubernetes) restarts it.

A learner over several hosts runs this on every host (`--jax_distributed`); host 0 alone
writes to the store, and every decision that depends on timing (merged versions to apply,
retiring, giving up on a late round) is host 0's, shared through `diloco.distributed.hosts`. Hosts
other than 0 keep their activity and metric records under `workdir/hosts/h{index}`.

With a sharded syncer (`sync.shards` > 1) each delivery goes to its fragment's shard folder
and the learner reads every shard's index (`LearnerStoreLink`); nothing else here depends on
the shard count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time

import jax
import numpy as np
from absl import logging

from diloco import fragments as fragments_lib
from diloco.config.run_config import Config, ConfigError
from diloco.distributed import chaos, process_hooks, wan
from diloco.distributed import hosts as hosts_lib
from diloco.distributed.store import Store, global_view, shard_stores, shared_store
from diloco.distributed.store import layout as store_layout
from diloco.distributed.store.learner_registry import DONE, RETIRED
from diloco.learner import island
from diloco.learner import loop as learner_loop
from diloco.learner.learner import Learner, Resume
from diloco.observe import hooks as hooks_lib
from diloco.observe import metrics as metrics_lib
from diloco.sync import ownership
from diloco.train import checkpoint as checkpoint_lib
from diloco.train import optim
from diloco.transport import Heartbeat

PREEMPTED = "preempted"
_PREEMPTED_EXIT = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended


def _identity(cfg: Config) -> dict:
  return {"model": dataclasses.asdict(cfg.model), "seed": cfg.seed,
          "data_source": cfg.data.source, "seq_len": cfg.data.seq_len}


def _speed(cfg: Config, learner_id: int) -> float:
  speeds = cfg.learners.speed_factors()
  return speeds[learner_id] if learner_id < len(speeds) else 1.0


class _ActivityFile:
  """Appends this learner's activity records to `workdir/activity/l{m}.jsonl`, each flushed
  as written (the launcher reads them at the end, whatever ended this process)."""

  def __init__(self, workdir: str, learner: int):
    os.makedirs(os.path.join(workdir, "activity"), exist_ok=True)
    self._file = open(os.path.join(workdir, "activity", f"l{learner}.jsonl"), "a",
                      encoding="utf-8")

  def write(self, record: dict) -> None:
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def _plan_shapes(plan, spec) -> list[dict[str, tuple]]:
  """Per fragment, {path: shape} of the plan: what the store link takes from a version."""
  flat = fragments_lib.flatten_tree(spec.abstract["params"])
  return [{k: tuple(flat[k].shape) for k in paths} for paths in plan.fragments]


def run(cfg: Config, workdir: str, store_root: str, learner_id: int) -> dict:
  """Trains learner `learner_id` until `train.steps` local steps or SIGTERM."""
  shards = chaos.max_learners(cfg)
  if not 0 <= learner_id < shards:
    raise ConfigError(f"--learner_id={learner_id} must be in [0, {shards}) (learners.count "
                      "plus the learners the chaos schedule adds, or launch.max_learners)")
  retiring = threading.Event()
  # SIGINT (a Ctrl-C on a learner started by hand) stops it the same way: a flag the loop
  # reads, never an exception raised at whatever line the main thread is on.
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda *_: retiring.set())

  store = shared_store(store_root, cfg.sync.shards)  # the run's records; shards: below
  hosts = hosts_lib.HostGroup()
  incarnation = hosts.share("incarnation", lambda: store.learners.next_incarnation(learner_id))
  devices = jax.devices()
  spec, init_fn, step_fn = island.build_learner(cfg, devices, learner_id)
  plan = island.fragment_plan(cfg, spec)
  store_layout.claim(store, store_layout.layout_record(cfg.sync.shards, plan,
                                                       spec.abstract["params"]))
  up, down = wan.learner_links(cfg.store, learner_id)
  # Each fragment's deliveries and versions live in the folder of the shard that owns it.
  folders = shard_stores(store_root, cfg.sync.shards)
  owner = ownership.assign(plan.num_elements, cfg.sync.shards)
  shapes = _plan_shapes(plan, spec)
  link = hosts_lib.AgreedLink(store, learner_id, incarnation, hosts, poll_s=cfg.store.poll_s,
                              up=up, down=down, heartbeat_every_s=cfg.store.heartbeat_every_s,
                              send_queue=cfg.sync.send_queue, shards=folders, owner=owner,
                              shapes=shapes)
  link.agree_initial(plan.num_fragments, cfg.store.join_timeout_s)
  origin = store.run.start() or time.time()
  clock = lambda: time.time() - origin  # noqa: E731  (the run's clock, shared by all processes)
  joined_at = clock()
  # It starts from every version published before it joined, or a newer one: the newest
  # usable by the commit markers (its poller may not have fetched it yet). Not the index: a
  # version it names that nobody can use (phantom, non-finite) would time the join out.
  published = hosts.share("published", lambda: {str(p): v for p, v in global_view.join_floor(
      folders, owner, shapes, {q: link.latest_version(q) for q in range(plan.num_fragments)}
  ).items()})
  link.agree_initial(plan.num_fragments, cfg.store.join_timeout_s,
                     {int(p): v for p, v in published.items()})

  ckpt = checkpoint_lib.Checkpointer(str(store.learners.learner_dir(learner_id)), cfg.checkpoint)
  learner = Learner(learner_id=learner_id, incarnation=incarnation, num_groups=shards, cfg=cfg,
                    spec=spec, init_fn=init_fn, step_fn=step_fn, plan=plan, transport=link,
                    resume=Resume(), background_io=True)
  latest = _place(cfg, store, hosts, learner, ckpt, spec)
  link.heartbeat(Heartbeat(learner_id, incarnation, learner.local_step, 0.0, clock()))
  if learner_id < cfg.learners.count:
    first = incarnation == 0 and latest is None
    hosts.share("started_together", lambda: _start_together(cfg, store, learner_id, first))
  records = workdir if hosts.leader else os.path.join(workdir, "hosts", f"h{hosts.index}")
  activity_file = _ActivityFile(records, learner_id)
  activity = learner_loop.SpanLog(activity_file.write, learner_id, incarnation, len(devices),
                                  _speed(cfg, learner_id))
  activity("load", joined_at, clock(), local_step=learner.local_step)
  writer = _metric_writer(cfg, records, hosts, learner)
  print(f"learner {learner_id} incarnation {incarnation}: joined at local step "
        f"{learner.local_step} on {len(devices)} {jax.default_backend()} devices", flush=True)
  user_hooks = process_hooks.learner_hooks(cfg.log.hooks, hosts.leader, hosts.count)
  # Host 0 decides whether the run is ending; the other hosts follow its agreed retirement.
  ending = process_hooks.EndWatch(store.run, f"learner {learner_id}", clock, cfg.store.poll_s)
  hooks = _ProcessHooks(cfg, learner, link, ckpt, activity, writer, clock, retiring, ending,
                        user_hooks)
  ended = []  # whether the run ended early, as host 0 saw it when this learner left

  def on_purpose(done: bool) -> bool:
    ended.append(hosts.share("run_ended", ending.is_set))
    return done or ended[0] or cfg.store.on_sigterm != "restart"

  try:
    if hosts.leader:
      ending.watch(user_hooks)
    # A preempted learner comes back (its next incarnation resumes): only a finished or
    # retired one makes its final deliveries, as does every learner of a run a hook ended.
    finished, final = learner_loop.run(learner, cfg, hooks, hooks, on_purpose=on_purpose)
    state = DONE if finished else RETIRED
    preempted = not (finished or any(ended)) and cfg.store.on_sigterm == "restart"
    if not preempted:
      _write_alive(link, learner, clock, final)
  finally:
    ending.close()
    hooks_lib.report(user_hooks.close())
    writer.close()
    activity_file.close()
  return _shut_down(cfg, learner, link, ckpt, hosts, saved=hooks.saved,
                    state=PREEMPTED if preempted else state)


def _shut_down(cfg: Config, learner: Learner, link: hosts_lib.AgreedLink,
               ckpt: checkpoint_lib.Checkpointer, hosts: hosts_lib.HostGroup, *, saved: int,
               state: str) -> dict:
  """Saves where a restart picks up, says goodbye (or not, when preempted) and reports."""
  preempted = state == PREEMPTED
  if (cfg.checkpoint.every_steps or preempted) and saved != learner.local_step:
    _save(cfg, ckpt, learner)  # where a restart of this learner id picks up
  ckpt.close()
  learner.close()
  if preempted:
    link.flush()  # no goodbye: the syncer times this incarnation out, the next one rejoins
  else:
    link.leave(state)
  link.close()
  print(f"learner {learner.id} incarnation {learner.incarnation}: {state} at local "
        f"step {learner.local_step}", flush=True)
  return {"learner": learner.id, "incarnation": learner.incarnation, "state": state,
          "exit_code": _PREEMPTED_EXIT if preempted else 0,
          "local_step": learner.local_step, "bytes_up": link.bytes_up,
          "bytes_down": link.bytes_down, "wan_wait_s": round(link.wan_wait_s, 3),
          "send_wait_s": round(learner.send_wait_s, 3),
          "host": hosts.index, "hosts": hosts.count, "agreements": link.agreements}


def _write_alive(link: hosts_lib.AgreedLink, learner: Learner, clock, final: list[int]
                 ) -> None:
  """Writes the final deliveries (of fragments `final`) to the store, heartbeating
  meanwhile, and says which fragments they were (the log). The syncer admits a
  delivery only from a learner it heard within `sync.heartbeat_timeout_s`; no step heartbeats
  any more, so on a loaded host the last of several final entries could otherwise land after
  the learner's last heartbeat had timed out, and be rejected as from a dead learner."""
  written = threading.Event()

  def flush() -> None:
    try:
      link.flush()
    finally:
      written.set()

  writer = threading.Thread(target=flush, name="final-deliveries", daemon=True)
  writer.start()
  while True:
    link.heartbeat(Heartbeat(learner.id, learner.incarnation, learner.local_step, 0.0, clock()))
    if written.wait(0.5):
      break
  writer.join()
  print(f"learner {learner.id} incarnation {learner.incarnation}: final deliveries of "
        f"fragments {final} at local step {learner.local_step}", flush=True)


def _metric_writer(cfg: Config, records: str, hosts: hosts_lib.HostGroup, learner: Learner):
  """Host 0's writer also feeds TensorBoard learner_<m> and wandb (one run per learner
  process); the other hosts of a multi-host learner compute the same metrics, kept locally."""
  if not hosts.leader:
    return metrics_lib.MetricWriter(records, role="learner", learner=learner.id)
  # A restarted learner redoes the steps after its checkpoint: TensorBoard hides the old ones.
  return metrics_lib.open_writer(
      cfg.log, records, role="learner", learner=learner.id, process=f"learner_{learner.id}",
      purge_step=learner.local_step + 1 if learner.local_step else None)


def _place(cfg: Config, store: Store, hosts: hosts_lib.HostGroup, learner: Learner,
           ckpt: checkpoint_lib.Checkpointer, spec) -> int | None:
  """Where a new incarnation starts: its own checkpoint (params, AdamW state, data position)
  or, optionally, a healthy peer's AdamW state; its peers' cohort step and schedule phase
  (`learner_loop.align_with_peers`); then the published fragments. Returns the checkpoint
  step it resumed (None: none)."""
  mine = ckpt.latest_step()
  latest = hosts.share("resume_step", lambda: mine)
  if latest is not None:
    learner.state, meta = ckpt.restore(latest, spec.abstract, learner.data_iter,
                                       expect_meta=_identity(cfg), counts=("local_step",))
    learner.local_step = int(meta["local_step"])
    logging.info("learner %d: resumed its checkpoint at local step %d", learner.id, latest)
  elif cfg.store.peer_optimizer:
    _adopt_peer_optimizer(cfg, store, learner, spec, hosts)
  # A learner of the first cohort without a checkpoint starts with its peers, at step 0.
  joins_running = not (learner.incarnation == 0 and learner.id < cfg.learners.count)
  peers = hosts.share("peer_steps", lambda: _live_peer_steps(cfg, store, learner.id))
  learner_loop.align_with_peers(learner, peers, cfg, joins_running=joins_running)
  learner.load_global()  # the published fragments replace whatever parameters it had
  return latest


def _live_peer_steps(cfg: Config, store: Store, learner_id: int) -> list[int]:
  """The local steps in the live peers' last heartbeats (written within the heartbeat
  timeout, by their wall clocks: a generous bound across machines)."""
  now = time.time()
  peers = []
  for m, record in store.learners.heartbeats().items():
    try:
      if m != learner_id and record.get("state") == "up" and \
          now - float(record["sent_at"]) < cfg.sync.heartbeat_timeout_s:
        peers.append(int(record["local_step"]))
    except (KeyError, TypeError, ValueError):
      continue
  return peers


def _start_together(cfg: Config, store: Store, learner_id: int, wait: bool) -> bool:
  """The first cohort's learners take their first step together (`learner_loop.start_together`,
  through the store's ready marks). A restarted learner only says it is ready (a peer may
  still be waiting for it)."""
  store.run.mark_ready(learner_id)
  if not wait:
    return False
  initial = set(range(cfg.learners.count))
  return learner_loop.start_together(
      learner_id, lambda: len(store.run.ready_learners() & initial), cfg.learners.count,
      cfg.store.join_timeout_s, wait=lambda s: time.sleep(min(s, cfg.store.poll_s)))


class _ProcessHooks:
  """`learner_loop.LoopHooks` (and `WallClock`) of a learner process: the run's clock, SIGTERM
  as a retirement agreed by all its hosts (`hosts.AgreedLink.agree`), its own activity file and
  metric writer, and a checkpoint every `checkpoint.every_steps` steps."""

  def __init__(self, cfg: Config, learner: Learner, link, ckpt, activity, writer, clock,
               retiring: threading.Event, ending: process_hooks.EndWatch,
               user_hooks: hooks_lib.HookRunner):
    self._cfg, self._learner, self._link, self._ckpt = cfg, learner, link, ckpt
    self.span, self._writer, self.now, self._retiring = activity, writer, clock, retiring
    self._ending, self._user_hooks, self._offered = ending, user_hooks, None
    self._speed = _speed(cfg, learner.id)
    self._rng = np.random.default_rng([cfg.seed, learner.id, learner.incarnation])
    self._written = None
    self.saved = ckpt.latest_step()  # a resumed learner's step is saved already

  def stopped(self) -> bool:
    return False  # a SIGTERM counts once host 0 has seen it: `agree` decides

  def slowdown(self) -> float:
    jitter = self._cfg.learners.step_jitter
    return self._speed * (1.0 + jitter * self._rng.uniform(-1.0, 1.0)) if jitter else self._speed

  def pause(self, seconds: float) -> None:
    self._retiring.wait(seconds)

  def agree(self, give_up: bool = False) -> learner_loop.Agreement:
    decision = self._link.agree(retire=self._retiring.is_set() or self._ending.is_set(),
                                give_up=give_up)
    return learner_loop.Agreement(decision.retire, decision.give_up)

  def after_step(self, final: bool) -> None:
    last = self._learner.last_values
    if last is not None and last[0] != self._written:
      self._written = last[0]
      self._writer.write(last[0], dict(last[1], incarnation=self._learner.incarnation,
                                       time=self.now()))
    if self._user_hooks and self._learner.local_step != self._offered:
      self._offered = self._learner.local_step  # a hand-over to the hooks' threads
      hooks_lib.offer_learner_step(self._user_hooks, self._offered, self._learner.id,
                                   self._learner.hook_parts)

  def checkpoint(self) -> None:
    every = self._cfg.checkpoint.every_steps
    if every and self._learner.local_step % every == 0:
      _save(self._cfg, self._ckpt, self._learner)
      self.saved = self._learner.local_step


def _save(cfg: Config, ckpt: checkpoint_lib.Checkpointer, learner: Learner) -> None:
  ckpt.save(learner.local_step, learner.state, learner.data_iter,
            dict(_identity(cfg), local_step=learner.local_step, incarnation=learner.incarnation))


def _newest_peer_checkpoint(cfg: Config, store: Store, learner_id: int) -> list[int] | None:
  """[peer, step] of the peer learner with the newest checkpoint, or None."""
  best = None
  for m in range(chaos.max_learners(cfg)):
    if m == learner_id:
      continue
    peer = checkpoint_lib.Checkpointer(str(store.learners.learner_dir(m)), cfg.checkpoint)
    step = peer.latest_step()
    peer.close()
    if step is not None and (best is None or step > best[1]):
      best = [m, step]
  return best


def _adopt_peer_optimizer(cfg: Config, store: Store, learner: Learner, spec,
                          hosts: hosts_lib.HostGroup) -> None:
  """Starts from the AdamW state of the peer with the newest checkpoint, if any (host 0
  picks it; every host restores it, and keeps it only if host 0 could)."""
  # Every host opens the peers' checkpoint directories (Orbax may synchronise the hosts when it
  # opens one); host 0's pick counts.
  mine = _newest_peer_checkpoint(cfg, store, learner.id)
  best = hosts.share("peer", lambda: mine)
  if best is None:
    logging.info("learner %d: no peer checkpoint; fresh AdamW state", learner.id)
    return
  m, step = best
  peer = checkpoint_lib.Checkpointer(str(store.learners.learner_dir(m)), cfg.checkpoint)
  state, error = None, None
  try:
    state = peer.restore_state(step, spec.abstract)
  except Exception as e:  # the peer may have collected that step meanwhile
    error = e
  finally:
    peer.close()
  if not hosts.share("peer_restored", lambda: error is None):
    logging.warning("learner %d: could not read learner %d's checkpoint %d (%r); fresh AdamW "
                    "state", learner.id, m, step, error)
    return
  if error is not None:
    raise RuntimeError(f"learner {learner.id}: host {hosts.index} could not read learner "
                       f"{m}'s checkpoint {step} that host 0 read: {error!r}") from error
  # The peer's moments, but this learner's own place in the learning-rate schedule.
  learner.state = dict(learner.state, opt_state=optim.at_schedule_step(state["opt_state"],
                                                                       learner.local_step))
  print(f"learner {learner.id}: adopted learner {m}'s AdamW state (its step {step})", flush=True)
