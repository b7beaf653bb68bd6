"""Data-parallel and learner checkpoints (`checkpoints/N`) and the arrays an export lists, read
back from disk: typed before use, one error naming the file and the field, no allocation of
what planted metadata claims (docs/decisions/store_and_trust.md, "Documents read back from disk")."""

import copy
import dataclasses
import os

import documents_test
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import runtime_configs
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco import documents
from diloco.artifacts import export
from diloco.errors import ConfigError, DocumentError
from diloco.model import registry
from diloco.train import checkpoint as checkpoint_lib

PROPERTY = settings(max_examples=60, deadline=5000, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
CFG = runtime_configs.load("dp.py:tiny")
# What a learner process (`learner_process._identity`) and a data-parallel run expect.
LEARNER = {"model": dataclasses.asdict(CFG.model), "seed": CFG.seed,
           "data_source": CFG.data.source, "seq_len": CFG.data.seq_len}
DATA_PARALLEL = {"model": dataclasses.asdict(CFG.model), "data": dataclasses.asdict(CFG.data),
                 "seed": CFG.seed}


def _check(meta, expect, counts=()):
  checked = checkpoint_lib.check_meta(meta, "ckpt/4/meta", expect, counts)
  checkpoint_lib.compare_meta(checked, expect, "ckpt/4")
  return checked


@PROPERTY
@given(data=st.data(), learner=st.booleans())
def test_mutated_learner_and_data_parallel_meta_pass_or_fail_in_one_clear_error(data, learner):
  expect = LEARNER if learner else DATA_PARALLEL
  valid = dict(copy.deepcopy(expect), local_step=4) if learner else copy.deepcopy(expect)
  text = data.draw(documents_test._mutated(valid))
  try:
    meta = _check(documents.parse(text, "ckpt/4/meta"), expect,
                  ("local_step",) if learner else ())
  except ConfigError:
    return
  if learner:
    assert isinstance(meta["local_step"], int) and meta["local_step"] >= 0


@pytest.mark.parametrize("meta, field", [
    ([1, 2], ""),
    ({"seed": 0}, "model"),
    (dict(LEARNER, model="tiny"), "model"),
    (dict(LEARNER, seq_len="32"), "seq_len"),
    (dict(LEARNER, seed=True), "seed"),
    (dict(LEARNER, local_step="4"), "local_step"),
    (dict(LEARNER, local_step=-1), "local_step"),
    ({k: v for k, v in LEARNER.items()}, "local_step"),
])
def test_a_tampered_learner_meta_names_the_file_and_the_field(meta, field):
  with pytest.raises(DocumentError) as e:
    _check(meta, LEARNER, ("local_step",))
  assert e.value.file == "ckpt/4/meta" and e.value.field == field
  assert "\n" not in str(e.value)


def _params():
  with nnx.use_eager_sharding(False):
    model = registry.build(CFG.model, nnx.Rngs(0))
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def _run_checkpoint(root, params):
  """WORKDIR/checkpoints/1/params, as a durable run checkpoint holds its parameters."""
  item = os.path.join(root, "checkpoints", "1", "params")
  ocp.PyTreeCheckpointer().save(item, params)
  return root


def test_a_checkpoints_arrays_are_checked_before_use(tmp_path):
  params = _params()
  good = _run_checkpoint(str(tmp_path / "good"), params)
  _, source = export.read_params(good)
  assert "run checkpoint" in source
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  export.load_init(good, abstract)
  # Another model: refused by its shapes, before any array is read.
  other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape + (1,), x.dtype), params)
  with pytest.raises(ConfigError, match=r"^train.init_from: tensor .* has shape"):
    export.load_init(good, other)
  # NaN in a tensor: one line naming the checkpoint and the tensor.
  bad = copy.deepcopy(params)
  leaf = next(iter(jax.tree.leaves(bad)))
  leaf.flat[0] = np.nan
  with pytest.raises(DocumentError, match="values are not finite") as e:
    export.read_params(_run_checkpoint(str(tmp_path / "nan"), bad))
  assert "checkpoints/1/params" in e.value.file and "\n" not in str(e.value)


def test_saved_shapes_and_dtypes_are_compared_with_the_model_before_a_restore():
  abstract = {"w": jax.ShapeDtypeStruct((4, 3), np.float32)}
  checkpoint_lib.check_saved({"w": jax.ShapeDtypeStruct((4, 3), np.float32)}, abstract, "f")
  for saved, field in (({"w": jax.ShapeDtypeStruct((3, 4), np.float32)}, "w"),
                       ({"w": jax.ShapeDtypeStruct((4, 3), np.float16)}, "w"),
                       ({}, "w"),
                       ({"w": jax.ShapeDtypeStruct((4, 3), np.float32),
                         "x": jax.ShapeDtypeStruct((1,), np.float32)}, "x")):
    with pytest.raises(DocumentError) as e:
      checkpoint_lib.check_saved(saved, abstract, "f")
    assert e.value.field == field
  with pytest.raises(DocumentError, match="holds no tree"):
    checkpoint_lib.check_saved([1], abstract, "f")


def test_planted_metadata_claiming_a_huge_array_is_one_line_not_an_allocation(
    tmp_path, monkeypatch):
  """Orbax metadata that lists a 10**12-element tensor: refused before any array is read."""
  params = _params()
  workdir = str(tmp_path / "run")
  export.save(workdir, params, model=CFG.model, data=CFG.data, seed=CFG.seed, step=3,
              runtime="data_parallel")
  planted = {"embedder": {"embedding": jax.ShapeDtypeStruct((10**6, 10**6), np.float32)}}

  def never(*_, **__):
    raise AssertionError("an array was read")

  monkeypatch.setattr(export, "_saved_shapes", lambda _: planted)
  from orbax.checkpoint import v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(ocp_v1, "load", never)
  with pytest.raises(DocumentError, match="elements") as e:
    export.load(workdir)
  assert e.value.file.endswith("params") and "\n" not in str(e.value)
  checkpoint = _run_checkpoint(str(tmp_path / "ckpt"), params)
  monkeypatch.setattr(checkpoint_lib, "saved_tree", lambda _: planted)
  monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", never)
  with pytest.raises(DocumentError, match="elements"):
    export.read_params(checkpoint)
