"""The config on the command line: misspelled keys, derived fields, field help, the summary."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from configs import diloco, dp, multiprocess, streaming
from diloco.cli import config_flags
from diloco.config import run_config
from diloco.errors import ConfigError
from diloco.learner import receipt
from diloco.sync import policy

REPO = os.path.dirname(os.path.dirname(__file__))


def _cli(*args, timeout=120):
  return subprocess.run([sys.executable, "-m", "diloco.main", *args], capture_output=True,
                        text=True, cwd=REPO, timeout=timeout)


def test_misspelled_key_names_it_and_the_nearest_keys(tmp_path):
  proc = _cli("--config=configs/decoupled.py:tiny", f"--workdir={tmp_path}",
              "--config.outer.lr=0.5")
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 3
  first = proc.stderr.splitlines()[0]
  assert "--config.outer.lr" in first and "did you mean outer.learning_rate" in first
  group = _cli("--config=configs/decoupled.py:tiny", f"--workdir={tmp_path}",
               "--config.outr.lr=1")
  assert group.returncode != 0 and "Traceback" not in group.stderr
  assert "unknown config group 'outr'" in group.stderr and "did you mean outer?" in group.stderr
  assert not os.listdir(tmp_path)  # nothing ran


def test_nearest_keys():
  keys = config_flags._leaf_keys(diloco.get_config("tiny"))  # pylint: disable=protected-access
  assert config_flags.nearest_keys("outer.lr", keys)[0] == "outer.learning_rate"
  assert config_flags.nearest_keys("sync.quorm", keys) == ["sync.quorum"]
  assert config_flags.nearest_keys("outer.tau", keys) == ["sync.tau"]
  assert config_flags.unknown_key_message(diloco.get_config("tiny"), "sync.quorum") is None
  message = config_flags.unknown_key_message(diloco.get_config("tiny"), "learners.cont")
  assert message.startswith("unknown config key --config.learners.cont; did you mean "
                            "learners.count")  # (its own group's first)
  assert "learners has: count, devices" in message


@pytest.mark.parametrize("module", [diloco, streaming])
def test_quorum_all_learners_follows_learners_count(module):
  raw = module.get_config("cpu")
  raw.learners.count = 8
  cfg = run_config.from_config_dict(raw)
  assert cfg.sync.quorum == run_config.ALL_LEARNERS
  k = policy.PolicyConfig.from_config(cfg.sync).quorum
  assert policy.required_quorum(k, cfg.learners.count) == 8  # K = M, not the preset's 4
  assert policy.required_quorum(k, 3) == 3  # and only the live ones once some are gone
  assert "quorum=0 (all learners, K = M = 8)" in " ".join(config_flags.summary(cfg))


def test_quorum_validation():
  raw = diloco.get_config("tiny")
  raw.sync.quorum = -1
  with pytest.raises(ConfigError, match=r"sync.quorum: must be >= 1, or 0 for all learners"):
    run_config.from_config_dict(raw)
  raw.sync.quorum = 5
  with pytest.raises(ConfigError, match=r"sync.quorum: must be <= the number of learners \(4\)"):
    run_config.from_config_dict(raw)


def test_derived_fields_follow_until_overridden():
  raw = multiprocess.get_config("tiny")
  raw.learners.count = 5
  assert run_config.from_config_dict(raw).launch.max_learners == 6
  raw.launch.max_learners = 9
  raw.learners.count = 2
  assert run_config.from_config_dict(raw).launch.max_learners == 9
  raw = dp.get_config("tiny")
  raw.train.eval_every = 7
  assert run_config.from_config_dict(raw).checkpoint.every_steps == 7
  raw.checkpoint.every_steps = 3
  cfg = run_config.from_config_dict(raw)
  assert (cfg.checkpoint.every_steps, cfg.train.eval_every) == (3, 7)


def test_derived_fields_follow_command_line_overrides():
  proc = _cli("--config=configs/multiprocess.py:tiny", "--config.learners.count=5",
              "--config_help=launch.max_learners")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "launch.max_learners = 6" in proc.stdout


def test_every_field_has_its_comment_as_help():
  helps = config_flags.field_help()
  for name, cls in run_config.GROUPS.items():
    assert set(helps[name][1]) == {f.name for f in dataclasses.fields(cls)}, name
  assert helps["sync"][1]["quorum"].startswith("K: a round merges once")
  assert helps["sync"][1]["quorum"].endswith("however many there are.")
  assert helps["sync"][0].startswith("Fragments, schedule, quorum")
  assert helps["store"][1]["poll_s"].startswith("How often readers look")  # two fields, one text
  assert helps[""][1]["seed"]


def test_config_help_from_the_command_line():
  proc = _cli("--config=configs/diloco.py:tiny", "--config_help=sync")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("[sync] Fragments")
  assert "  sync.quorum = 0  # K: a round merges" in proc.stdout
  assert "  sync.num_fragments = 1  # P:" in proc.stdout  # the config's value, not the default
  assert not any(line.startswith("[") for line in lines[1:])  # only the sync group
  everything = _cli("--config_help")  # bare, no --config and no --workdir needed
  assert everything.returncode == 0, everything.stderr[-2000:]
  assert all(f"[{group}]" in everything.stdout for group in run_config.GROUPS)
  assert "  sync.quorum = 1  # K:" in everything.stdout  # the dataclass default
  nothing = _cli("--config_help=nonexistent_field")
  assert nothing.returncode != 0 and "no config field matches" in nothing.stderr


def test_workdir_still_required():
  proc = _cli("--config=configs/dp.py:tiny")
  assert proc.returncode != 0 and "--workdir=DIR is required" in proc.stderr


@pytest.mark.slow
def test_resolved_config_printed_and_saved(tmp_path):
  proc = _cli("--config=configs/dp.py:tiny", f"--workdir={tmp_path}", "--config.train.steps=2",
              "--config.train.eval_every=2", "--config.train.eval_batches=1", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  head = proc.stdout.split("\n  model:")[0]
  assert head.endswith("config (non-default fields; all of them in WORKDIR/config.json):")
  assert "\n  train: steps=2 eval_every=2 eval_batches=1\n" in proc.stdout
  assert "checkpoint: every_steps=2" in proc.stdout  # derived from train.eval_every
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["train"]["steps"] == 2 and saved["checkpoint"]["every_steps"] == 2


@pytest.mark.parametrize("old, new", sorted(receipt.FORMER_SYNC_FIELDS.items()))
def test_the_receipt_fields_moved_out_of_sync_are_read_and_named(tmp_path, old, new):
  """The learner's `receipt` group took four fields of `sync`: a run's config.json written
  before reads them into the group (nothing lost), a config that has the group and names
  the old field, or a flag of the old name, is one line saying where it went."""
  # A value other than the field's default, of the field's own type.
  value = {str: "mix", float: 0.25, bool: not getattr(run_config.ReceiptConfig(), new)}[
      type(getattr(run_config.ReceiptConfig(), new))]
  cfg = dataclasses.asdict(run_config.from_config_dict(diloco.get_config("tiny")))
  cfg["receipt"][new] = dataclasses.asdict(run_config.ReceiptConfig())[new]
  before = dict(cfg, sync=dict(cfg["sync"], **{old: value}))
  before.pop("receipt")
  if old == "mixing_alpha":
    before["sync"]["receipt"] = "mix"
  path = tmp_path / "config.json"
  path.write_text(json.dumps(before))
  assert getattr(run_config.read_file(str(path)).receipt, new) == value
  with pytest.raises(ConfigError, match=f"unknown field sync.{old}: it is now receipt.{new}$"):
    run_config.from_config_dict(dict(cfg, sync=dict(cfg["sync"], **{old: value})))
  assert config_flags.unknown_key_message(diloco.get_config("tiny"), f"sync.{old}") == (
      f"--config.sync.{old} is now --config.receipt.{new} (the learner's receipt group)")
