"""Syncer shards: the byte-balanced assignment (against brute force) and a shard's ownership."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import fragments
from diloco.delivery import Delivery
from diloco.errors import ConfigError
from diloco.outer.merge import OuterConfig
from diloco.sync import intake, ownership
from diloco.sync import syncer as syncer_lib
from diloco.sync.policy import SyncConfig
from diloco.transport import Heartbeat


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 10**9), min_size=1, max_size=40), data=st.data())
def test_assignment_covers_every_fragment_once_and_is_balanced(sizes, data):
  shards = data.draw(st.integers(1, len(sizes)))
  owner = ownership.assign(sizes, shards)
  assert len(owner) == len(sizes) and set(owner) == set(range(shards))
  parts = [ownership.owned(owner, s) for s in range(shards)]
  assert sorted(itertools.chain(*parts)) == list(range(len(sizes)))
  loads = [sum(sizes[p] for p in part) for part in parts]
  # Greedy largest-first: no shard exceeds the lightest by more than one fragment's size (so
  # the heaviest is within one fragment of the mean).
  assert max(loads) - min(loads) <= max(sizes)
  assert max(loads) <= sum(sizes) / shards + max(sizes)
  assert ownership.assign(list(sizes), shards) == owner  # deterministic


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=7), data=st.data())
def test_assignment_is_within_graham_bound_of_the_best(sizes, data):
  # Largest-first greedy is within 4/3 - 1/(3S) of the best maximum load (Graham 1969);
  # the best is found by brute force over every assignment.
  shards = data.draw(st.integers(1, min(3, len(sizes))))
  owner = ownership.assign(sizes, shards)
  greedy = max(sum(s for s, o in zip(sizes, owner) if o == k) for k in range(shards))
  best = min(max(sum(s for s, o in zip(sizes, choice) if o == k) for k in range(shards))
             for choice in itertools.product(range(shards), repeat=len(sizes)))
  assert greedy <= (4 / 3 - 1 / (3 * shards)) * best + 1e-9


def test_assignment_by_hand():
  # Largest first to the lightest shard, ties to the lower index: 9 -> 0, 7 -> 1, 5 -> 1,
  # 4 -> 0, 1 -> 1 (loads 13 / 13).
  assert ownership.assign([4, 9, 1, 7, 5], 2) == (0, 0, 1, 1, 1)
  assert ownership.assign([3, 3, 3], 1) == (0, 0, 0)
  assert ownership.assign([2, 2, 2, 2], 4) == (0, 1, 2, 3)


@pytest.mark.parametrize("shards", [0, -1, 5, 2.0, True])
def test_bad_shard_counts_are_refused_with_the_field(shards):
  with pytest.raises(ConfigError, match="sync.shards"):
    ownership.assign([1, 2, 3, 4], shards)


def test_config_bounds_shards_by_fragments_and_shard_by_shards():
  with pytest.raises(ConfigError, match="sync.shards"):
    SyncConfig(num_fragments=4, period=4, shards=5).check()
  with pytest.raises(ConfigError, match="sync.shard:"):
    SyncConfig(shards=2, shard=2).check()
  SyncConfig(num_fragments=4, period=4, shards=4, shard=3).check()


SHAPES = {"embedder/embedding": (6, 4), "layers/0/w": (4, 4), "layers/1/w": (4, 3)}


def test_a_shard_holds_and_merges_only_its_fragments():
  plan = fragments.plan_fragments(SHAPES, num_fragments=3, scheme="tensor")
  rng = np.random.default_rng(0)
  g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  owner = ownership.assign(plan.num_elements, 2)
  mine = ownership.owned(owner, 1)
  cfg = SyncConfig(num_fragments=3, period=3, tau=1, quorum=1, gamma=0.0)
  shard = syncer_lib.Syncer(g, plan, cfg, OuterConfig(), sync_delay_s=0.1, owned=mine)
  assert set(shard.params) == {k for p in mine for k in plan.fragments[p]}
  assert [m.fragment for m in shard.initial(0.0)] == list(mine)
  other = next(p for p in range(3) if p not in mine)
  beat = [Heartbeat(0, 0, 1, 1.0, 0.0)]

  def delivery(p):
    return Delivery(learner=0, incarnation=0, fragment=p, local_step=1, steps=1, tokens=8,
                    base_version=0, kind="values",
                    tensors={k: g[k] + 1.0 for k in plan.fragments[p]}, transit_s=0.0)

  merged, _ = shard.tick(1.0, beat, [delivery(other)])
  assert merged == [] and shard.rejections[intake.REJECT_WRONG_SHARD] == 1
  merged, _ = shard.tick(2.0, beat, [delivery(mine[0])])
  assert [m.fragment for m in merged] == [mine[0]] and shard.versions[mine[0]] == 1
