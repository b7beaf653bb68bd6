"""The single-controller runtime on a virtual clock: invariants of docs/design.md 2.3-2.5."""

import json
import os
import types

import jax
import numpy as np
import pytest
import runtime_configs

from diloco import fragments
from diloco.learner import island
from diloco.model.sharding import batch_sharding
from diloco.runtime import data_parallel, decoupled
from diloco.runtime.core import Recorder
from diloco.train import data as data_lib
from diloco.train import optim
from diloco.train import state as train_state
from diloco.train import step as train_step

pytestmark = pytest.mark.slow


def _config(preset="tiny", **dotted):
  return runtime_configs.load(f"decoupled.py:{preset}", **{"learners__virtual_clock": True, **dotted})


def _tape(workdir):
  with open(os.path.join(workdir, "tape.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_one_learner_reduces_to_data_parallel(tmp_path):
  cfg = _config(learners__count=1, sync__num_fragments=1, sync__period=1, sync__tau=0,
                sync__gamma=0.0, outer__learning_rate=1.0, outer__momentum=0.0,
                outer__merge="mean", train__steps=6)
  rt, _ = decoupled.run_with_runtime(cfg, str(tmp_path / "diloco"))
  dp_cfg = _config(learners__count=0, train__steps=6, checkpoint__every_steps=6)
  data_parallel.run(dp_cfg, str(tmp_path / "dp"))
  from orbax import checkpoint as ocp
  dp = ocp.PyTreeCheckpointer().restore(str(tmp_path / "dp" / "checkpoints" / "6" / "state"))
  dp_flat = fragments.flatten_tree(dp["params"])
  assert rt.syncer.versions == [6]
  for k, v in rt.syncer.params.items():
    # Exact up to the rounding of G - (G - theta): one ulp per outer step.
    np.testing.assert_allclose(v, np.asarray(dp_flat[k]), rtol=1e-5, atol=1e-6)
  moved = max(np.abs(v - np.asarray(fragments.flatten_tree(
      jax.device_get(train_state.create(cfg.model, rt.slots[0].spec,
                                        jax.random.key(cfg.seed))["params"]))[k])).max()
              for k, v in rt.syncer.params.items())
  assert moved > 1e-3  # training happened


def test_synchronous_diloco_matches_direct_reference(tmp_path):
  m, h, rounds, lr, mu = 2, 3, 2, 0.7, 0.9
  cfg = _config(learners__count=m, sync__num_fragments=1, sync__period=h, sync__tau=0,
                sync__quorum=m, sync__gamma=0.0, outer__merge="mean",
                outer__weights="uniform", train__steps=h * rounds)
  rt, _ = decoupled.run_with_runtime(cfg, str(tmp_path))
  # Reference: M learners on the same meshes, H AdamW steps each, then a Nesterov step on
  # the mean outer gradient; every learner restarts the round from the new G.
  spec = [s.spec for s in rt.slots]
  total = cfg.train.steps
  steps = [train_step.make_train_step(sp, cfg.optim, optim.lr_schedule(cfg.optim, total))
           for sp in spec]
  init = train_state.create(cfg.model, spec[0], jax.random.key(cfg.seed))
  g = {k: np.asarray(v, np.float64)
       for k, v in fragments.flatten_tree(jax.device_get(init["params"])).items()}
  b = {k: np.zeros_like(v) for k, v in g.items()}
  states = [train_state.create(cfg.model, sp, jax.random.key(1)) for sp in spec]
  iters = [iter(data_lib.train_dataset(cfg.data, batch_size=cfg.train.batch_size,
                                       learner_id=i, num_learners=m, seed=cfg.seed))
           for i in range(m)]
  for _ in range(rounds):
    thetas = []
    for i in range(m):
      params = fragments.unflatten_tree({k: np.asarray(v, np.float32) for k, v in g.items()})
      states[i] = dict(states[i], params=jax.device_put(params, spec[i].shardings["params"]))
      with jax.set_mesh(spec[i].mesh):
        for _ in range(h):
          batch = jax.device_put(next(iters[i]), batch_sharding(spec[i].mesh))
          states[i], _ = steps[i](states[i], batch)
      thetas.append(fragments.flatten_tree(jax.device_get(states[i]["params"])))
    for k in g:
      grad = np.mean([g[k] - np.asarray(t[k], np.float64) for t in thetas], axis=0)
      b[k] = mu * b[k] + grad
      g[k] = g[k] - lr * (grad + mu * b[k])
  assert rt.syncer.versions == [rounds]
  for k, v in rt.syncer.params.items():
    np.testing.assert_allclose(v, g[k], rtol=1e-4, atol=1e-5)
  assert all(len(r["admitted"]) == m for r in _tape(str(tmp_path)))


def test_killed_learner_is_skipped_and_rejoins_from_published_versions(tmp_path):
  cfg = _config(learners__count=3, learners__devices="2,2,2,2", train__steps=40,
                learners__faults="kill:1@10+12", sync__heartbeat_timeout_s=3.0)
  rt, summary = decoupled.run_with_runtime(cfg, str(tmp_path))
  tape = _tape(str(tmp_path))
  during = [r for r in tape if 14 <= r["closed_at"] <= 22]
  assert during, "the others kept merging while learner 1 was down"
  assert all(a["learner"] != 1 for r in during for a in r["admitted"])
  rejoined = [(r, a) for r in tape for a in r["admitted"]
              if a["learner"] == 1 and a["incarnation"] == 1]
  assert rejoined, "learner 1 contributes again after rejoining"
  first_round, first = min(rejoined, key=lambda ra: ra[0]["round"])
  assert first_round["closed_at"] >= 22 + cfg.learners.virtual_step_s
  assert first["base_version"] >= 1 and first["staleness"] >= 0
  assert all(a["base_version"] >= 0 for r in tape for a in r["admitted"])
  with open(os.path.join(tmp_path, "activity.jsonl")) as f:
    kinds = {(json.loads(line)["learner"], json.loads(line)["kind"]) for line in f}
  assert (1, "down") in kinds and (1, "load") in kinds
  assert 0 < summary["accounting/goodput"] < 1
  assert summary["eval/loss"] < summary["eval/initial_loss"] - 1.0


@pytest.mark.parametrize("quorum, gamma", [(3, 0.0), (1, 0.0), (1, 0.8)])
def test_heterogeneous_quorum_and_grace(tmp_path, quorum, gamma):
  cfg = _config(learners__count=3, learners__devices="2,2,4", learners__speeds="1,1,2",
                sync__quorum=quorum, sync__gamma=gamma, train__steps=32)
  _, summary = decoupled.run_with_runtime(cfg, str(tmp_path))
  tape = _tape(str(tmp_path))
  slow_admitted = sum(a["learner"] == 2 for r in tape for a in r["admitted"])
  # The rounds of the final sync (`receipt.final_sync`) wait for every learner still alive,
  # whatever K: the quorum and grace rules are those of the other rounds.
  regular = [r for r in tape if not any(a["final"] for a in r["admitted"])]
  assert 0 < len(regular) < len(tape)
  per_round = np.mean([len(r["admitted"]) for r in regular])
  wait = summary["accounting/wait_fraction"]
  if quorum == 3:   # K = M: the fast learners wait for the slow one
    assert wait > 0.2 and per_round == 3
  elif gamma == 0:  # K = 1: nobody waits, rounds close on the first delivery
    assert wait == 0 and per_round == 1
  else:
    # K = 1 with grace: the slow learner gets merged too. The window is sized from the
    # slowest learner's step time, so a fast learner may wait for the publish latency
    # (virtual_sync_s) now and then: far from K = M's lock-step.
    assert wait < 0.05 and per_round > 1.2 and slow_admitted > 0


# Three learners of unequal, jittered speed without grace: the run that the sharded-syncer and
# same-seed tests both compare against (one run shared by the two, module-scoped).
_JITTERED = dict(learners__count=3, learners__devices="2,2,2", learners__speeds="1,1.4,1",
                 learners__step_jitter=0.2, sync__gamma=0.0, train__steps=24)


@pytest.fixture(scope="module")
def jittered_run(tmp_path_factory):
  """(runtime, summary, workdir) of the one-syncer run of `_JITTERED`."""
  workdir = str(tmp_path_factory.mktemp("jittered"))
  rt, summary = decoupled.run_with_runtime(_config(**_JITTERED), workdir)
  return rt, summary, workdir


def test_a_sharded_syncer_trains_like_one_syncer_without_grace(tmp_path, jittered_run):
  """`sync.shards = 2` (docs/design.md 3.1): two policy instances, each merging its fragments.
  With gamma = 0 a round's close depends on its deliveries and the liveness of learners only,
  never on a shard's EMAs, so the run is the one-syncer run bit for bit: the same G, eval
  loss and goodput, and the same rounds on the tape, each tagged with its owning shard."""
  one, s1, one_dir = jittered_run
  two, s2 = decoupled.run_with_runtime(_config(sync__shards=2, **_JITTERED), str(tmp_path / "s2"))
  tape1, tape2 = _tape(one_dir), _tape(str(tmp_path / "s2"))
  assert {r["shard"] for r in tape1} == {0} and {r["shard"] for r in tape2} == {0, 1}
  assert [r["round"] for r in tape2] == list(range(len(tape2)))
  assert all(r["shard"] == two.syncer.assignment[r["fragment"]] for r in tape2)
  drop = ("merge_wall_s", "shard", "shard_round")
  assert [{k: v for k, v in r.items() if k not in drop} for r in tape1] == [
      {k: v for k, v in r.items() if k not in drop} for r in tape2]
  assert s2["eval/loss"] == s1["eval/loss"] < s1["eval/initial_loss"]
  assert s2["accounting/goodput"] == s1["accounting/goodput"] > 0.5
  assert s2["accounting/shard0/rounds"] + s2["accounting/shard1/rounds"] == s2[
      "accounting/rounds"] == s1["accounting/rounds"]
  assert "accounting/shards" not in s1 and s2["accounting/shards"] == 2
  for k in one.syncer.params:
    np.testing.assert_array_equal(one.syncer.params[k], two.syncer.params[k])


def test_same_seed_same_tape_and_parameters(tmp_path, jittered_run):
  """The jittered run again, from scratch: the same tape and parameters."""
  a, _, a_dir = jittered_run
  b, _ = decoupled.run_with_runtime(_config(**_JITTERED), str(tmp_path / "b"))
  def strip(tape):  # the measured wall time of a merge is the one non-replayable field
    return [{k: v for k, v in r.items() if k != "merge_wall_s"} for r in tape]
  assert strip(_tape(a_dir)) == strip(_tape(str(tmp_path / "b")))
  assert len(a.recorder.tape()) > 10 and a.recorder.tape_count == len(a.recorder.tape())
  for k in a.syncer.params:
    np.testing.assert_array_equal(a.syncer.params[k], b.syncer.params[k])


def test_threaded_wall_clock_run_with_faults(tmp_path):
  # Paced steps (24 x at least 0.1 s): the add at 1.0 s lands mid-run on any host, however fast
  # a warm compilation cache makes the first two learners.
  cfg = _config(learners__count=2, learners__devices="2,2,4", learners__virtual_clock=False,
                learners__faults="add@1.0", train__steps=24, train__eval_every=12,
                learners__min_step_s=0.1)
  rt, summary = decoupled.run_with_runtime(cfg, str(tmp_path))
  tape = _tape(str(tmp_path))
  assert {a["learner"] for r in tape for a in r["admitted"]} == {0, 1, 2}  # 2 joined late
  assert [s.status for s in rt.slots] == ["done", "done", "done"]
  assert summary["eval/loss"] < summary["eval/initial_loss"]
  versions = [r["version"] for r in tape]
  for p in range(rt.plan.num_fragments):
    mine = [r["version"] for r in tape if r["fragment"] == p]
    assert mine == list(range(1, len(mine) + 1))  # strictly increasing, no gaps
  assert len(versions) == rt.syncer.rounds
  assert (tmp_path / "timeline.png").stat().st_size > 10_000
  assert (tmp_path / "loss.png").stat().st_size > 10_000


@pytest.mark.parametrize("join_schedule", ["own", "cohort"])
def test_an_added_learner_starts_its_schedule_by_learners_join_schedule(tmp_path, join_schedule):
  steps, add_at = 16, 6.0
  cfg = _config(learners__count=2, learners__devices="2,2,2", train__steps=steps,
                train__eval_every=0, learners__faults=f"add@{add_at}",
                learners__join_schedule=join_schedule)
  decoupled.run_with_runtime(cfg, str(tmp_path))
  with open(tmp_path / "activity.jsonl") as f:
    spans = [json.loads(line) for line in f]
  def local_steps(m):
    return [r["local_step"] for r in spans if r["kind"] == "step" and r["learner"] == m]
  added = local_steps(2)
  if join_schedule == "own":  # a warmup and a whole schedule of its own
    assert added == list(range(1, steps + 1))
  else:  # the peers' step when it takes its first, so their learning rate; it ends with them
    first = next(r["start"] for r in spans if r["kind"] == "step" and r["learner"] == 2)
    ends = [r["end"] for r in spans if r["kind"] == "step" and r["learner"] == 0]
    # Steps ending at the very moment it starts may be counted either way.
    assert sum(e < first for e in ends) <= added[0] - 1 <= sum(e <= first for e in ends)
    assert added == list(range(added[0], steps + 1)) and added[0] > add_at


@pytest.mark.parametrize("measured, factor, min_step, wait", [
    (0.1, 1.0, 0.0, 0.0),    # no pacing
    (0.1, 1.5, 0.0, 0.05),   # a learner 1.5x slower than its hardware
    (0.1, 1.0, 0.25, 0.15),  # paced to 0.25 s steps
    (0.1, 2.0, 0.25, 0.4),   # both: 2 x 0.25 s
    (0.4, 1.0, 0.25, 0.0),   # already slower than the pace
])
def test_pacing_wait_closed_form(measured, factor, min_step, wait):
  assert island.pacing_wait(measured, factor, min_step) == pytest.approx(wait)


def test_recorder_streams_records_and_keeps_only_a_window(tmp_path):
  """A long run's tape and activity live in their files, not in memory: the recorder keeps
  the newest `recent` records, counts, and replays the file to a late follower."""
  slot = types.SimpleNamespace(index=1, incarnation=0, devices=2, speed=1.0)
  rec = Recorder(str(tmp_path), recent=4)
  rounds = [{"round": i, "admitted": [{"learner": 1, "incarnation": 0, "local_step": 8 * i}]}
            for i in range(10)]
  for r in rounds[:6]:
    rec.round(r)
  seen = []
  rec.follow(seen.append)  # the six already written, then every new one
  for r in rounds[6:]:
    rec.round(r)
  for i in range(20):
    rec.span(slot, "step", float(i), i + 1.0, local_step=i + 1)
  assert seen == rounds
  assert [r["round"] for r in rec.recent()[0]] == [6, 7, 8, 9]
  assert len(rec.recent()[1]) == 16
  assert rec.mark() == (10, 20)
  rec.close()
  assert rec.tape() == rounds and len(rec.activity()) == 20
  resumed = Recorder(str(tmp_path), append=True, recent=4)  # a resumed run continues the files
  resumed.round({"round": 10, "admitted": []})
  assert resumed.mark() == (11, 20) and resumed.tape()[-1]["round"] == 10
  resumed.close()
