"""Tracking: TensorBoard event files and wandb offline runs, read back from disk after real runs."""

import dataclasses
import glob
import json
import math
import os
import struct

import pytest
import runtime_configs

from diloco.config import run_config
from diloco.runtime import data_parallel, decoupled

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def _config(path="decoupled.py:tiny", **dotted):
  return runtime_configs.load(path, **{"learners__virtual_clock": True, **dotted})


def _scalars(logdir):
  """{tag: [(step, value)]} of a TensorBoard run directory, read by TensorBoard itself."""
  from tensorboard.backend.event_processing import event_accumulator as ea
  acc = ea.EventAccumulator(logdir, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def _finite(points):
  return points and all(math.isfinite(v) for _, v in points)


def test_decoupled_run_logs_learners_syncer_accounting_and_hparams(tmp_path):
  cfg = _config(learners__count=2, train__steps=12, checkpoint__every_rounds=0)
  assert cfg.log.tensorboard  # on by default
  workdir = str(tmp_path / "run")
  decoupled.run(cfg, workdir)
  tb = os.path.join(workdir, "tensorboard")
  assert sorted(os.listdir(tb)) == ["learner_0", "learner_1", "syncer"]
  for m in (0, 1):
    scalars, _ = _scalars(os.path.join(tb, f"learner_{m}"))
    for tag in ("train/loss", "train/grad_norm", "train/lr", "train/tokens"):
      assert _finite(scalars.get(tag)), (m, tag, sorted(scalars))
    steps = [s for s, _ in scalars["train/loss"]]
    # One step late, flushed at the end: every local step 1..12 is there once.
    assert steps == list(range(1, 13)), steps
  scalars, acc = _scalars(os.path.join(tb, "syncer"))
  assert [s for s, _ in scalars["eval/loss"]] == [0, 12]
  for tag in ("eval/loss", "outer/rounds", "accounting/goodput", "accounting/bytes_up",
              "accounting/rounds", "wall_s"):
    assert _finite(scalars.get(tag)), (tag, sorted(scalars))
  with open(os.path.join(workdir, "accounting.json")) as f:
    assert scalars["accounting/rounds"][0][1] == json.load(f)["accounting/rounds"] > 0
  # The resolved config: hparams plugin data and a config text.
  hp = acc.PluginTagToContent("hparams")
  assert "_hparams_/session_start_info" in hp
  assert b"model.embed_dim" in hp["_hparams_/session_start_info"]
  text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
  assert json.loads(text.strip("`\n"))["learners"]["count"] == 2


def test_data_parallel_logs_train_eval_and_accounting(tmp_path):
  cfg = _config("dp.py:tiny", train__steps=4, train__batch_size=8, checkpoint__every_steps=0)
  workdir = str(tmp_path / "dp")
  data_parallel.run(cfg, workdir)
  scalars, _ = _scalars(os.path.join(workdir, "tensorboard", "dp"))
  assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
  for tag in ("train/loss", "eval/loss", "accounting/tokens_per_s", "accounting/wall_s"):
    assert _finite(scalars.get(tag)), (tag, sorted(scalars))


def _wandb_records(path):
  """Records of a `.wandb` file: a 7-byte header, then LevelDB-log chunks in 32 KiB blocks
  (crc32, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4), each record a protobuf."""
  from wandb.proto import wandb_internal_pb2 as pb
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B", data[:8]
  records, pos, chunks = [], 7, b""
  block = 32768
  while pos + 7 <= len(data):
    room = block - pos % block
    if room < 7:
      pos += room
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if length == 0 and kind == 0:
      pos += room  # zero padding to the end of the block
      continue
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    chunks = chunk if kind in (1, 2) else chunks + chunk
    if kind in (1, 4):
      record = pb.Record()
      record.ParseFromString(chunks)
      records.append(record)
  return records


def test_wandb_offline_run_has_scalars_and_config(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  os.makedirs(tmp_path / "wandb_home")
  cfg = _config(learners__count=2, train__steps=8, checkpoint__every_rounds=0,
                log__wandb=True, log__tensorboard=False, log__wandb_project="tests")
  workdir = str(tmp_path / "run")
  decoupled.run(cfg, workdir)
  assert not os.path.exists(os.path.join(workdir, "tensorboard"))
  files = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  assert len(files) == 1, files  # one run for the whole single-controller process
  history, summary, config = {}, {}, {}
  for record in _wandb_records(files[0]):
    kind = record.WhichOneof("record_type")
    if kind == "history":
      for item in record.history.item:
        key = item.key or "/".join(item.nested_key)
        history.setdefault(key, []).append(json.loads(item.value_json))
    elif kind == "summary":
      for item in record.summary.update:
        summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    elif kind in ("run", "config"):
      update = record.run.config.update if kind == "run" else record.config.update
      for item in update:
        config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
  for key in ("learner_0/train/loss", "learner_1/train/loss", "learner_0/step", "eval/loss",
              "step"):
    assert key in history and all(math.isfinite(v) for v in history[key]), (key, sorted(history))
  # The end-of-run accounting is logged once, after the last eval; wandb keeps it as the run's
  # summary (its history row was missing from one CI run's file, the summary was not checked).
  for key in ("accounting/goodput", "accounting/rounds", "eval/loss"):
    assert key in summary and math.isfinite(summary[key]), (key, sorted(summary))
  assert history["learner_1/step"] == list(range(1, 9))
  assert len(history["eval/loss"]) == 2
  model = config["model"]
  assert (model.get("value", model))["embed_dim"] == cfg.model.embed_dim
  assert config["learners"].get("value", config["learners"])["count"] == 2


def test_bad_wandb_mode_is_one_line_error(tmp_path):
  with pytest.raises(run_config.ConfigError, match="log.wandb_mode: must be one of"):
    _config("dp.py:tiny", train__steps=1, log__wandb_mode="cloud")
  cfg = _config("dp.py:tiny", train__steps=1)
  unchecked = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, wandb_mode="cloud"))
  with pytest.raises(run_config.ConfigError, match="log.wandb_mode: must be one of"):
    data_parallel.run(unchecked, str(tmp_path))


def test_multiprocess_run_logs_every_process_and_exports(tmp_path):
  import subprocess
  import sys
  workdir = str(tmp_path / "mp")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/multiprocess.py:tiny",
       f"--workdir={workdir}", "--role=launch", "--config.learners.count=2",
       "--config.launch.chaos_faults=0", "--config.launch.max_learners=2",
       "--config.train.steps=30", "--config.train.eval_every=0",
       "--config.learners.min_step_s=0.0", "--config.launch.timeout_s=400"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=450, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  tb = os.path.join(workdir, "tensorboard")
  assert sorted(os.listdir(tb)) == ["learner_0", "learner_1", "syncer"]
  for m in (0, 1):
    scalars, _ = _scalars(os.path.join(tb, f"learner_{m}"))
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 31))
    assert _finite(scalars["train/loss"]) and _finite(scalars["train/grad_norm"])
  scalars, acc = _scalars(os.path.join(tb, "syncer"))
  for tag in ("eval/loss", "outer/rounds", "accounting/goodput", "accounting/rounds",
              "accounting/bytes_up"):
    assert _finite(scalars.get(tag)), (tag, sorted(scalars))
  assert scalars["accounting/rounds"][0][1] > 0
  assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
  from diloco.artifacts import export
  params, meta = export.load(workdir)
  assert meta["runtime"] == "multiprocess" and meta["outer/rounds"] > 0
  assert params["embedder"]["embedding"].shape == (384, 64)  # the tiny preset's table


def test_resumed_data_parallel_run_hides_the_redone_steps_in_tensorboard(tmp_path):
  import shutil
  cfg = _config("dp.py:tiny", train__steps=4, train__batch_size=8, checkpoint__every_steps=2)
  workdir = str(tmp_path / "dp")
  data_parallel.run(cfg, workdir)
  # As if killed after step 4's events but before its checkpoint: resume at step 2.
  shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))
  data_parallel.run(cfg, workdir)
  scalars, _ = _scalars(os.path.join(workdir, "tensorboard", "dp"))
  assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]  # 3 and 4 once, the redone ones
