"""The store's layout record: a resume with another `sync.shards` or fragment plan is refused,
naming the field, and the store's G stays intact and readable."""

import json
import os

import numpy as np
import pytest
import runtime_configs

from diloco import fragments
from diloco.distributed import store as store_lib
from diloco.distributed import syncer_process
from diloco.distributed.store import global_view
from diloco.distributed.store import layout as store_layout
from diloco.distributed.store.lease import Lease
from diloco.errors import ConfigError
from diloco.sync import ownership
from diloco.transport import Merged

SHAPES = {"embedder/embedding": (6, 4), "layers/0/w": (4, 4), "layers/1/w": (4, 3)}
PLAN = fragments.plan_fragments(SHAPES, num_fragments=3)
PARAMS = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, s in SHAPES.items()}
TREE = fragments.unflatten_tree(PARAMS)


def _publish(root, shards):
  """Version 3 of every fragment, in its owner's folder, with the layout recorded."""
  stores = store_lib.shard_stores(root, shards)
  store_layout.claim(stores[0].shared, store_layout.layout_record(shards, PLAN, TREE))
  owner = ownership.assign(PLAN.num_elements, shards)
  for p, paths in enumerate(PLAN.fragments):
    tensors = {k: PARAMS[k] for k in paths}
    stores[owner[p]].merged.put(Merged(p, 3, tensors, 1.0),
                                {k: np.zeros_like(v) for k, v in tensors.items()},
                                {"round": None})
  return stores


def _g_intact(root, shards, layout=None):
  flat, index = global_view.read_global(store_lib.shard_stores(root, shards), layout=layout)
  assert index == {p: 3 for p in range(PLAN.num_fragments)}
  assert all(np.array_equal(flat[k], PARAMS[k]) for k in SHAPES)


def test_the_first_process_records_the_layout_and_the_same_layout_resumes(tmp_path):
  root = str(tmp_path / "store")
  stores = _publish(root, 2)
  record = json.loads((tmp_path / "store" / "layout.json").read_text())
  assert record["shards"] == 2 and record["fragments"][0][0] == [
      PLAN.fragments[0][0], list(SHAPES[PLAN.fragments[0][0]]), "float32"]
  store_layout.claim(stores[1].shared, store_layout.layout_record(2, PLAN, TREE))
  store_layout.check_shards(store_lib.shared_store(root, 2), 2)
  _g_intact(root, 2)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 3)])
def test_another_shard_count_is_refused_and_nothing_is_lost(tmp_path, before, after):
  root = str(tmp_path / "store")
  _publish(root, before)
  with pytest.raises(ConfigError, match=rf"^sync.shards={after}: .*sync.shards={before}"):
    store_layout.check_shards(store_lib.shared_store(root, after), after)
  with pytest.raises(ConfigError, match=r"^sync.shards="):
    store_layout.claim(store_lib.shared_store(root, after),
                       store_layout.layout_record(after, PLAN, TREE))
  _g_intact(root, before)


@pytest.mark.parametrize("change", ["num_fragments", "shape", "dtype"])
def test_another_fragment_plan_is_refused(tmp_path, change):
  root = str(tmp_path / "store")
  _publish(root, 2)
  plan, tree = PLAN, TREE
  if change == "num_fragments":
    plan = fragments.plan_fragments(SHAPES, num_fragments=2)
  elif change == "shape":
    tree = fragments.unflatten_tree(dict(PARAMS, **{"layers/1/w": np.zeros((3, 4), np.float32)}))
  else:
    tree = fragments.unflatten_tree({k: v.astype(np.float16) for k, v in PARAMS.items()})
  with pytest.raises(ConfigError, match=r"^the fragment plan \(sync.num_fragments"):
    store_layout.claim(store_lib.shared_store(root, 2), store_layout.layout_record(2, plan, tree))
  _g_intact(root, 2)


@pytest.mark.parametrize("before,after", [(1, 2), (2, 1), (3, 2)])
def test_a_store_without_a_record_is_checked_by_its_folders(tmp_path, before, after):
  root = str(tmp_path / "store")
  _publish(root, before)
  os.remove(tmp_path / "store" / "layout.json")  # a store made before the record existed
  with pytest.raises(ConfigError, match=rf"^sync.shards={after}: "):
    store_layout.claim(store_lib.shared_store(root, after),
                       store_layout.layout_record(after, PLAN, TREE))
  assert not (tmp_path / "store" / "layout.json").exists()
  _g_intact(root, before, store_layout.layout_record(before, PLAN, TREE))


@pytest.mark.parametrize("shards", [1, 2])
def test_a_store_made_before_the_record_resumes_when_its_versions_match_the_plan(tmp_path,
                                                                                shards):
  """No layout.json, versions of this run's plan in the folders that own them: resumed (the
  syncer, the learners and the evaluator `claim`), the record then written, G intact."""
  root = str(tmp_path / "store")
  _publish(root, shards)
  os.remove(tmp_path / "store" / "layout.json")
  record = store_layout.layout_record(shards, PLAN, TREE)
  # train.init_from reads it under the layout its versions give, and writes nothing.
  flat, index = global_view.read_store(root, shards)
  assert index == {p: 3 for p in range(PLAN.num_fragments)}
  assert all(np.array_equal(flat[k], PARAMS[k]) for k in SHAPES)
  assert not (tmp_path / "store" / "layout.json").exists()
  store_layout.claim(store_lib.shared_store(root, shards), record)
  assert json.loads((tmp_path / "store" / "layout.json").read_text()) == record
  _g_intact(root, shards)


@pytest.mark.parametrize("change", ["num_fragments", "shape", "owner"])
def test_a_store_made_before_the_record_of_another_plan_is_refused_naming_the_record(tmp_path,
                                                                                    change):
  """No layout.json, versions of another plan (fragment count, shapes, or a fragment in a
  folder that does not own it under this plan): one line naming layout.json; nothing written,
  the store's G still readable under its own layout."""
  root = str(tmp_path / "store")
  _publish(root, 2)
  os.remove(tmp_path / "store" / "layout.json")
  plan, tree = PLAN, TREE
  if change == "num_fragments":
    plan = fragments.plan_fragments(SHAPES, num_fragments=2)
  elif change == "shape":
    tree = fragments.unflatten_tree(dict(PARAMS, **{"layers/1/w": np.zeros((3, 4), np.float32)}))
  else:  # fragment 0 planted in the folder of the shard that does not own it
    stores = store_lib.shard_stores(root, 2)
    tensors = {k: PARAMS[k] for k in PLAN.fragments[0]}
    other = 1 - ownership.assign(PLAN.num_elements, 2)[0]
    stores[other].merged.put(Merged(0, 4, tensors, 1.0),
                             {k: np.zeros_like(v) for k, v in tensors.items()}, {"round": None})
  with pytest.raises(ConfigError, match=r"^the fragment plan .*no layout.json") as e:
    store_layout.claim(store_lib.shared_store(root, 2), store_layout.layout_record(2, plan, tree))
  assert "\n" not in str(e.value)
  if change == "owner":  # versions that give no one layout: train.init_from refuses them too
    with pytest.raises(ConfigError, match=r"^store .*: no layout.json, and its versions"):
      global_view.read_store(root, 2)
  assert not (tmp_path / "store" / "layout.json").exists()
  _g_intact(root, 2, store_layout.layout_record(2, PLAN, TREE))


@pytest.mark.parametrize("content", [b"{", b"[1]", b'{"shards": "2"}'])
def test_a_damaged_record_is_refused_in_one_line(tmp_path, content):
  root = str(tmp_path / "store")
  _publish(root, 2)
  (tmp_path / "store" / "layout.json").write_bytes(content)
  with pytest.raises(ConfigError) as e:
    store_layout.claim(store_lib.shared_store(root, 2), store_layout.layout_record(2, PLAN, TREE))
  assert "\n" not in str(e.value) and "layout.json" in str(e.value)
  with pytest.raises(ConfigError, match="layout.json"):  # nor is G read by its other readers
    global_view.read_store(root, 2)
  _g_intact(root, 2, store_layout.layout_record(2, PLAN, TREE))


@pytest.mark.parametrize("link", ["shards", "shards/s1"])
def test_a_symlinked_shard_folder_is_refused(tmp_path, link):
  root = tmp_path / "store"
  outside = tmp_path / "outside"
  (outside / "s1").mkdir(parents=True)
  (root / "shards").mkdir(parents=True)
  if link == "shards":
    os.rmdir(root / "shards")
    os.symlink(outside, root / "shards")
  else:
    os.symlink(outside / "s1", root / "shards" / "s1")
  with pytest.raises(ConfigError, match=rf"{link} is a symlink"):
    store_lib.shard_stores(str(root), 2)
  assert os.listdir(outside / "s1") == []  # nothing was written through the link


def test_a_syncer_restarted_with_another_shard_count_refuses_the_store(tmp_path):
  """The real syncer boot: a sharded run's store, resumed with one syncer, is refused before
  anything is read or published; the trained G stays as it was."""
  root = str(tmp_path / "store")
  cfg2 = runtime_configs.load(sync__shards=2, sync__shard=1)
  store = syncer_process.open_store(cfg2, root)
  lease = Lease(store, duration_s=30.0)
  lease.acquire()
  boot = syncer_process._boot(cfg2, store, lease, lambda: 0.0)
  lease.release()
  assert not boot.recovered and store.merged.index()
  before = {p: store.merged.versions(p) for p in store.merged.index()}
  cfg1 = runtime_configs.load(sync__shards=1)
  store1 = syncer_process.open_store(cfg1, root)
  lease1 = Lease(store1, duration_s=30.0)
  lease1.acquire()
  try:
    with pytest.raises(ConfigError, match=r"^sync.shards=1: .*sync.shards=2"):
      syncer_process._boot(cfg1, store1, lease1, lambda: 0.0)
  finally:
    lease1.release()
  assert store1.merged.index() == {}  # no version 0 published at the root
  assert {p: store.merged.versions(p) for p in store.merged.index()} == before
