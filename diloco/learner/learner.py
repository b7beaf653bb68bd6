"""A Decoupled DiLoCo learner: the ordinary train step on its own mesh, plus fragment I/O.

The learner knows nothing about the syncer: it talks to a transport. Each inner step
it updates per-fragment counters; when fragment p is due (every H local steps at
offset p*H//P) it delivers its current values with `steps`, `tokens` and `base`; it
applies the merged result `tau` steps later (`sync_point`), and any other newer
version of a fragment as soon as it sees one. Device-to-host copies of a delivery
are started asynchronously and finished on a background sender (`diloco.learner.sender`,
bounded in bytes); overwrites are asynchronous `device_put`s swapped into the state between
steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import MuonState

from diloco import fragments as fragments_lib
from diloco import outer
from diloco.delivery import Delivery
from diloco.learner.receipt import KEEP_LOCAL, MIX, OVERWRITE, ReceiptConfig
from diloco.learner.sender import Sender
from diloco.model.config import ModelConfig
from diloco.model.sharding import batch_sharding
from diloco.outer.merge import OuterConfig
from diloco.sync.policy import SyncConfig
from diloco.train import data as data_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train.data import DataConfig
from diloco.train.mesh import MeshConfig
from diloco.train.optim import OptimConfig
from diloco.transport import Heartbeat, LearnerTransport, Merged


class TrainFields(Protocol):
  """What a learner reads of the runtimes' `train` group (`run_config.TrainConfig`)."""
  steps: int
  batch_size: int
  init_from: str


class LearnersFields(Protocol):
  """What a learner reads of the runtimes' `learners` group (`run_config.LearnersConfig`)."""
  min_step_s: float
  join_schedule: str


class LearnerConfig(Protocol):
  """The groups of the run configuration that a learner, its island and its loop read
  (`diloco.config.run_config.Config` is one): a Protocol, so that the learner package does not
  import the configuration that composes every group (tests/imports_test.py)."""
  seed: int
  model: ModelConfig
  data: DataConfig
  mesh: MeshConfig
  optim: OptimConfig
  sync: SyncConfig
  receipt: ReceiptConfig
  outer: OuterConfig
  train: TrainFields
  learners: LearnersFields


class NonFiniteMetrics(FloatingPointError):
  """A learner's step produced NaN/Inf metrics: that learner failed (not the run)."""


@dataclasses.dataclass
class Resume:
  """What survives a learner's failure: its local step and data position (its checkpoint)."""
  local_step: int = 0
  data_state: dict | None = None


@dataclasses.dataclass(frozen=True)
class _Awaiting:
  apply_at: int      # local step at which the merged result is applied (t + tau)
  seen_version: int  # latest published version when delivering; a newer one answers it


class Learner:
  """One incarnation of learner `learner_id` on `spec.mesh`."""

  def __init__(self, *, learner_id: int, incarnation: int, num_groups: int, cfg: LearnerConfig,
               spec: train_state.StateSpec, init_fn, step_fn,
               plan: fragments_lib.FragmentPlan,
               transport: LearnerTransport, resume: Resume, background_io: bool,
               clock: Callable[[], float] = time.monotonic, sender: Sender | None = None):
    """`clock` times a delivery's transit (the run's virtual clock makes it 0 there).

    Deliveries are sent by `sender` when one is given (the caller's, shared, e.g. by every
    learner of the virtual clock, which hands them over before its syncer takes messages and
    counts its waits itself), else by a sender of its own with `background_io` (bounded by
    `sync.send_queue_bytes` and `sync.send_queue`), else at once on the calling thread.
    """
    self.id, self.incarnation, self.cfg = learner_id, incarnation, cfg
    self.spec, self._step_fn, self.plan, self.transport = spec, step_fn, plan, transport
    self._clock = clock
    key = jax.random.fold_in(jax.random.key(cfg.seed), learner_id)
    self.state = init_fn(key)  # replaced fragment by fragment by `load_global`
    self.local_step = 0
    if resume.local_step:
      self.start_at(resume.local_step)
    dataset = data_lib.train_dataset(cfg.data, batch_size=cfg.train.batch_size,
                                     learner_id=learner_id, num_learners=num_groups,
                                     seed=cfg.seed)
    self.data_iter = iter(dataset)
    if resume.data_state is not None:
      self.data_iter.set_state(resume.data_state)
    num = plan.num_fragments
    self.steps = np.zeros(num, np.int64)
    self.tokens = np.zeros(num, np.int64)
    self.base = [-1] * num  # -1: no published version loaded yet (unknown lineage)
    self._awaiting: dict[int, _Awaiting] = {}
    self._base_values: dict[int, dict[str, np.ndarray]] = {}
    # Fragment p's counters as delivered, until its receipt, and its values where a receipt may
    # keep the local progress made since (`keep_local`, or a receipt at the last sync point).
    self._delivered: dict[int, tuple[list[jax.Array] | None, int, int]] = {}
    self._keeping = False  # `keep_progress`: every receipt keeps the steps since the delivery
    self._last_delivery = [-1] * num  # local step of each fragment's latest delivery
    self._residual: dict[str, np.ndarray] = {}
    self._sharding = batch_sharding(spec.mesh)
    self._flat_shardings = fragments_lib.flatten_tree(spec.shardings["params"])
    # Over several hosts (one `jax.distributed` world), a delivery's copy is gathered onto every
    # device (the copy is collective, so every host makes it) and host 0 alone sends it.
    self._copy = (_copy_leaves if jax.process_count() == 1 else
                  jax.jit(_copies, out_shardings=NamedSharding(spec.mesh, PartitionSpec())))
    self._sends = jax.process_index() == 0
    self._own_sender = sender is None and background_io
    self._sender = (Sender(cfg.sync.send_queue_bytes, cfg.sync.send_queue)
                    if self._own_sender else sender)
    # Wall seconds its steps waited for room to send (backpressure) on its own sender; a shared
    # sender's waits are its owner's to count (they take no time on the virtual clock).
    self.send_wait_s = 0.0
    self._last_metrics: Any = None
    self._poisoned = False
    self.phase = 0  # schedule shift of a rejoining learner (`fragments.aligned_phase`)
    self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    self.last_values: tuple[int, dict[str, float]] | None = None  # (local step, metrics)

  def start_at(self, step: int) -> None:
    """Places a learner with fresh AdamW state at local step `step`: its step count and its
    learning-rate schedule (`optim.at_schedule_step`) go on from there, not from a warmup."""
    self.local_step = step
    self.state["step"] = jax.device_put(jnp.asarray(step, jnp.int32),
                                        self.spec.shardings["step"])
    self.state["opt_state"] = optim.at_schedule_step(self.state["opt_state"], step)

  def resume_point(self) -> Resume:
    return Resume(self.local_step, self.data_iter.get_state())

  # Receiving.
  def load_global(self) -> None:
    """Overwrites every fragment with the latest published version (join or rejoin)."""
    for p in range(self.plan.num_fragments):
      merged = self.transport.latest(p)
      if merged is not None:
        self._apply(merged, mode=OVERWRITE)  # a joining learner's own values are its init

  def _apply(self, merged: Merged, mode: str | None = None) -> None:
    """Takes merged fragment p by the receipt `mode` (default `receipt.mode`; the modes are
    defined in `diloco/learner/receipt.py`)."""
    p = merged.fragment
    delivered = self._delivered.pop(p, None)
    if mode is None:
      mode = self.cfg.receipt.mode
      if self._keeping and (delivered is None or delivered[0] is not None):
        mode = KEEP_LOCAL
    flat = fragments_lib.flatten_tree(self.state["params"])
    paths = self.plan.fragments[p]
    if mode == KEEP_LOCAL and delivered is None and p in self._base_values:
      # No delivery since the last receipt: all local progress is measured from that G_p.
      delivered = ([jax.device_put(self._base_values[p][k], self._flat_shardings[k])
                    for k in paths], 0, 0)
    if mode == KEEP_LOCAL and delivered is None:
      mode = OVERWRITE  # no reference to measure local progress from
    references = dict(zip(paths, delivered[0])) if mode == KEEP_LOCAL else {}
    for path, value in merged.tensors.items():
      new = jax.device_put(value, self._flat_shardings[path])
      if mode == MIX:
        new = _mixed(flat[path], new, self.cfg.receipt.mixing_alpha)
      elif mode == KEEP_LOCAL:
        new = _kept_local(flat[path], new, references[path])
      flat[path] = new
    self.state = dict(self.state, params=fragments_lib.unflatten_tree(flat))
    if self.cfg.receipt.reset_moments:
      self.state["opt_state"] = _zero_moments(self.state["opt_state"], set(merged.tensors))
    self.base[p] = merged.version
    if mode == KEEP_LOCAL:  # the steps made since the delivery are kept: keep counting them
      self.steps[p] -= delivered[1]
      self.tokens[p] -= delivered[2]
    else:
      self.steps[p] = self.tokens[p] = 0
    self._base_values[p] = merged.tensors
    self.transport.count_download(merged.nbytes)

  def keep_progress(self) -> None:
    """Ends the overlap before the final sync (docs/design.md 2.3): from now on a receipt keeps
    the local steps made since the fragment's delivery, as `keep_local` does, whatever
    `receipt.mode` says, and the round of every delivery the learner has stepped past is due at
    once (`sync_point`; one not published yet is waited for, whatever
    `sync.block_on_late_round`). Called at the last sync point of a learner that finishes, and
    before a retiring learner's final sync: a round received there would otherwise overwrite
    (or mix away) its last steps, and one received after it would see them delivered twice,
    since the final sync (`deliver_final`) delivers the steps counted since the last receipt."""
    self._keeping = True

  def sync_point(self) -> list[int]:
    """Applies what is due; returns the fragments whose awaited round is not published yet."""
    blocked = []
    for p in range(self.plan.num_fragments):
      awaiting = self._awaiting.get(p)
      # Past its last step a learner has no steps left to overlap: the round of a delivery it
      # has stepped past is due now, so that the final sync delivers only the steps since.
      ending = self._keeping and self._last_delivery[p] < self.local_step
      if awaiting is not None and self.local_step < awaiting.apply_at and not ending:
        continue  # bounded overlap: the result of this delivery lands at t + tau
      merged = self.transport.latest(p)
      if awaiting is not None and (merged is None or merged.version <= awaiting.seen_version):
        if self.cfg.sync.block_on_late_round or ending:
          blocked.append(p)
        continue
      if merged is not None and merged.version > self.base[p]:
        self._apply(merged)
      self._awaiting.pop(p, None)
    return blocked

  def give_up_waiting(self, fragments: list[int]) -> None:
    """Stops waiting for rounds that may never come (e.g. the delivery was rejected)."""
    for p in fragments:
      self._awaiting.pop(p, None)

  # Stepping.
  def poison(self) -> None:
    """Fault injection (`nan:M@T`): the next step starts from NaN parameters, as after a
    numerical blow-up. Safe to call from another thread: the learner's own thread applies it."""
    self._poisoned = True

  def step(self, now: float, step_time: float) -> None:
    """One inner step; then the deliveries that are due and a heartbeat.

    Raises `NonFiniteMetrics` when the previous step's metrics were NaN/Inf.
    """
    if self._poisoned:
      self._poisoned = False
      self.state = dict(self.state, params=jax.tree.map(lambda x: x * jnp.nan,
                                                        self.state["params"]))
    batch = jax.device_put(next(self.data_iter), self._sharding)
    self.state, metrics = self._step_fn(self.state, batch)
    self.read_metrics()  # the previous step's: done by now, read while this one runs
    self._last_metrics = (self.local_step + 1, metrics)
    self.local_step += 1
    self.steps += 1
    self.tokens += self.tokens_per_step
    cfg = self.cfg.sync
    for p in fragments_lib.due_fragments(self.local_step + self.phase, cfg.period,
                                         self.plan.num_fragments):
      self._deliver(p)
    self.transport.heartbeat(Heartbeat(self.id, self.incarnation, self.local_step, step_time,
                                       now))

  def hook_parts(self, with_params: bool) -> tuple[int, Any, Any]:
    """(local step, its metrics as they come off the device, a device copy of the parameters
    when `with_params`, else None) for a hook's worker to read off this thread
    (`diloco.observe.hooks`): the copy is dispatched, not awaited, so the next step's
    donation of the parameters cannot reach what the hook reads."""
    step, metrics = self._last_metrics if self._last_metrics else (self.local_step, {})
    params = jax.tree.map(jnp.copy, self.state["params"]) if with_params else None
    return step, metrics, params

  def read_metrics(self) -> tuple[int, dict[str, float]] | None:
    """Host values of the last dispatched step's metrics (blocks until it is done)."""
    if self._last_metrics is None:
      return None
    step, device_metrics = self._last_metrics
    values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    bad = {k: v for k, v in values.items() if not np.isfinite(v)}
    if bad:
      raise NonFiniteMetrics(f"learner {self.id}: non-finite metrics at local step {step}: "
                               f"{bad}")
    self.last_values = (step, values)
    return step, values

  def deliver_final(self) -> list[int]:
    """Delivers every fragment with progress not yet delivered, flagged final (docs/design.md 2.3,
    "Final sync"): called when the learner finishes or retires on purpose, so that its last
    steps reach G. Returns the fragments delivered."""
    due = [p for p in range(self.plan.num_fragments)
           if self.steps[p] >= 1 and self._last_delivery[p] != self.local_step]
    for p in due:
      self._deliver(p, final=True)
    return due

  def _deliver(self, p: int, final: bool = False) -> None:
    paths = self.plan.fragments[p]
    flat = fragments_lib.flatten_tree(self.state["params"])
    leaves = [flat[k] for k in paths]
    copies = self._copy(leaves)  # survives the next step's donation
    self._last_delivery[p] = self.local_step
    # The reference a keeping receipt subtracts, in the parameters' own sharding: always under
    # `keep_local`; otherwise only where the receipt is due at or after the last step, where
    # `keep_progress` may keep what it would overwrite (a copy held tau steps costs memory).
    reference = None
    if self.cfg.receipt.mode == KEEP_LOCAL or (self.cfg.receipt.final_sync and (
        self.local_step + self.cfg.sync.tau >= self.cfg.train.steps)):
      reference = copies if self._copy is _copy_leaves else _copy_leaves(leaves)
    self._delivered[p] = (reference, int(self.steps[p]), int(self.tokens[p]))
    self._awaiting[p] = _Awaiting(self.local_step + self.cfg.sync.tau,
                                  self.transport.latest_version(p))
    if not self._sends:
      return
    for c in copies:
      c.copy_to_host_async()
    # The base version and its values are captured together: a receipt that lands before the
    # I/O thread quantises must not relabel this delta with the newer base.
    args = (p, paths, copies, self.local_step, int(self.steps[p]), int(self.tokens[p]),
            self.base[p], self._base_values.get(p), self._clock(), final)
    if self._sender is None:
      self._send(*args)
      return
    # Backpressure: the copies are held (device, then host) until sent, so a slow link waits
    # here rather than pinning unbounded memory. A failed send raises here.
    waited = self._sender.submit(self, sum(c.nbytes for c in copies), self._send, *args)
    if self._own_sender:
      self.send_wait_s += waited

  def _send(self, p, paths, copies, local_step, steps, tokens, base, base_values,
            delivered_at, final) -> None:
    values = {k: np.asarray(c, np.float32) for k, c in zip(paths, copies)}
    on_host = self._clock()  # the step is done and its values are here: transit starts
    bits = self.cfg.outer.quantize_bits
    kind, tensors = "values", values
    if bits and base >= 0 and base_values is not None:
      kind, tensors = "delta", {}
      for k, v in values.items():
        delta = base_values[k] - v
        if self.cfg.outer.error_feedback:
          tensors[k], self._residual[k] = outer.quantize_with_feedback(
              delta, self._residual.get(k), bits, self.cfg.outer.quantize_block)
        else:
          tensors[k] = outer.quantize(delta, bits, self.cfg.outer.quantize_block)
    self.transport.deliver(Delivery(learner=self.id, incarnation=self.incarnation, fragment=p,
                                    local_step=local_step, steps=steps, tokens=tokens,
                                    base_version=base, kind=kind, tensors=tensors,
                                    transit_s=max(self._clock() - on_host, 0.0),
                                    lead_s=max(on_host - delivered_at, 0.0), final=final))

  def flush(self) -> None:
    """Waits for in-flight deliveries (end of run or before a planned stop)."""
    if self._sender is not None:
      self._sender.drain(self)

  def close(self) -> None:
    if self._own_sender:
      self._sender.close()
    else:
      self.flush()

  def params_flat(self) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in
            fragments_lib.flatten_tree(jax.device_get(self.state["params"])).items()}


@jax.jit
def _mixed(theta: jax.Array, merged: jax.Array, alpha: float) -> jax.Array:
  """The `mix` receipt: `alpha * theta + (1 - alpha) * merged`."""
  return alpha * theta + (1.0 - alpha) * merged


@jax.jit
def _kept_local(theta: jax.Array, merged: jax.Array, reference: jax.Array) -> jax.Array:
  """The `keep_local` receipt: G plus the local progress made since `reference` (formed first,
  as parenthesised)."""
  return merged + (theta - reference)


def _copies(leaves):
  return [jnp.copy(x) for x in leaves]


# Fresh device buffers (one jit for all learners; the next step donates the originals).
_copy_leaves = jax.jit(_copies)


def _zero_moments(opt_state, paths: set[str]):
  """The inner optimizer's state with the moments of the given parameter paths set to zero:
  AdamW's mu and nu, Muon's momentum (a parameter the other part of Muon takes is masked out
  of its state: left as it is)."""

  def zero(tree):
    flat = fragments_lib.flatten_tree(tree)
    flat = {k: jnp.zeros_like(v) if k in paths and hasattr(v, "shape") else v
            for k, v in flat.items()}
    return fragments_lib.unflatten_tree(flat)

  def reset(node):
    if isinstance(node, optax.ScaleByAdamState):
      return node._replace(mu=zero(node.mu), nu=zero(node.nu))
    if isinstance(node, MuonState):
      return node._replace(mu=zero(node.mu))
    return node

  return jax.tree.map(reset, opt_state,
                      is_leaf=lambda n: isinstance(n, (optax.ScaleByAdamState, MuonState)))
