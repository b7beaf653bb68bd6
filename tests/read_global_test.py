"""The one reader of G (`global_view.read_global`): planted version sets yield the newest usable
G or one clear error, never a wrong G (docs/decisions/store_and_trust.md, "The readers of G")."""

import os
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco import fragments
from diloco.distributed import store as store_lib
from diloco.distributed.store import global_view
from diloco.distributed.store import layout as store_layout
from diloco.sync import ownership
from diloco.transport import Merged

SHAPES = {"embedder/embedding": (6, 4), "layers/0/w": (4, 4), "layers/1/w": (4, 3)}
PLAN = fragments.plan_fragments(SHAPES, num_fragments=3)
SHARDS = 2
OWNER = ownership.assign(PLAN.num_elements, SHARDS)
LAYOUT = store_layout.layout_record(
    SHARDS, PLAN, fragments.unflatten_tree({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}))

# What a planted version is; only "good" in its owner's folder may enter G.
KINDS = ("good", "wrong_owner", "reshaped", "extra_path", "missing_path", "nan", "inf",
         "float16")


def _tensors(p, version, kind):
  value = np.float32(100 * p + version)
  out = {k: np.full(SHAPES[k], value, np.float32) for k in PLAN.fragments[p]}
  first = PLAN.fragments[p][0]
  if kind == "reshaped":
    out[first] = np.full((int(np.prod(SHAPES[first])),), value, np.float32)  # same bytes
  elif kind == "extra_path":
    out["zz/planted"] = np.zeros((2,), np.float32)
  elif kind == "missing_path":
    out = {k: v for k, v in out.items() if k != first} or {"zz/other": np.zeros((2,), np.float32)}
  elif kind in ("nan", "inf"):
    out[first].flat[0] = np.nan if kind == "nan" else np.inf
  elif kind == "float16":
    out[first] = out[first].astype(np.float16)
  return out


def _plant(stores, p, version, kind):
  folder = stores[1 - OWNER[p]] if kind == "wrong_owner" else stores[OWNER[p]]
  tensors = _tensors(p, version, kind)
  folder.merged.put(Merged(p, version, tensors, 1.0),
                    {k: np.zeros(v.shape, np.float32) for k, v in tensors.items()},
                    {"round": None})


version_sets = st.lists(st.dictionaries(st.integers(0, 9), st.sampled_from(KINDS), max_size=4),
                        min_size=PLAN.num_fragments, max_size=PLAN.num_fragments)


@settings(max_examples=25, deadline=None, database=None)
@given(planted=version_sets, index=st.sampled_from(["kept", "missing", "empty", "phantom",
                                                    "garbage"]))
def test_planted_versions_yield_the_newest_usable_g_or_a_clear_error(planted, index):
  old = (global_view._READ_ATTEMPTS, global_view._RETRY_S)
  global_view._READ_ATTEMPTS, global_view._RETRY_S = 1, 0.0
  try:
    with tempfile.TemporaryDirectory() as root:
      stores = store_lib.shard_stores(root, SHARDS)
      store_layout.claim(stores[0].shared, LAYOUT)
      for p, versions in enumerate(planted):
        for version, kind in sorted(versions.items()):
          _plant(stores, p, version, kind)
      for s in stores:
        path = os.path.join(str(s.root), "merged", "index.json")
        if index == "missing":
          if os.path.exists(path):
            os.remove(path)
        elif index != "kept":
          with open(path, "w") as f:
            f.write({"empty": "", "phantom": '{"0": 99, "1": 99, "2": 99}',
                     "garbage": "[1, 2"}[index])
      want = {p: max((v for v, kind in versions.items() if kind == "good"), default=None)
              for p, versions in enumerate(planted)}
      if None in want.values():
        with pytest.raises(RuntimeError, match="no usable committed version"):
          global_view.read_global(stores)
        return
      flat, got = global_view.read_global(stores)
      assert got == want
      assert set(flat) == set(SHAPES)
      for p, paths in enumerate(PLAN.fragments):
        for k in paths:
          assert flat[k].shape == SHAPES[k] and flat[k].dtype == np.float32
          assert np.all(flat[k] == 100 * p + want[p])
  finally:
    global_view._READ_ATTEMPTS, global_view._RETRY_S = old


def test_another_models_parameters_are_refused(tmp_path):
  stores = store_lib.shard_stores(str(tmp_path), SHARDS)
  store_layout.claim(stores[0].shared, LAYOUT)
  with pytest.raises(Exception, match="the fragment plan"):
    global_view.read_global(stores, paths=["other/w"])
  with pytest.raises(Exception, match="sync.shards=1"):
    global_view.read_global(stores[:1])


@pytest.mark.parametrize("kind", ["reshaped", "extra_path", "missing_path", "float16"])
def test_a_learners_link_never_takes_a_version_off_the_plan(tmp_path, kind):
  """The learner's store link reads with the plan's shapes: a planted version of other shapes
  or paths is skipped, and the next good one is taken."""
  from diloco.distributed.learner_link import LearnerStoreLink  # noqa: PLC0415
  stores = store_lib.shard_stores(str(tmp_path), SHARDS)
  for p in range(PLAN.num_fragments):
    _plant(stores, p, 0, "good")
  p = 0
  _plant(stores, p, 1, kind)
  shapes = [{k: SHAPES[k] for k in paths} for paths in PLAN.fragments]
  link = LearnerStoreLink(stores[0].shared, 0, 0, poll_s=0.01, shards=stores, owner=OWNER,
                          shapes=shapes)
  try:
    link.wait_initial(PLAN.num_fragments, timeout=30)
    assert link.latest_version(p) == 0
    _plant(stores, p, 2, "good")
    got = link.wait_for(p, 2, timeout=30)
    assert got.version == 2 and all(got.tensors[k].shape == SHAPES[k] for k in PLAN.fragments[p])
  finally:
    link.close()
