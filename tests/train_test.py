"""Train step numerics, golden values, NaN detection, learning and exact resumption."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.errors import ConfigError
from diloco.model.sharding import batch_sharding
from diloco.observe import metrics as metrics_lib
from diloco.runtime import data_parallel
from diloco.train import mesh as mesh_lib
from diloco.train import optim, tokenizers
from diloco.train import state as train_state
from diloco.train import step as train_step

GOLDEN_TEXT = b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 8
# Update only for an intended numerical change, by printing the values this test computes.
GOLDEN_LOSS_STEP0 = 5.992640495300293
GOLDEN_LOSS_STEP1 = 4.491425514221191


def _golden_batch(seq_len=64, batch=8):
  ids = tokenizers.ByteTokenizer().encode(GOLDEN_TEXT)
  rows = [ids[i * 7:i * 7 + seq_len + 1] for i in range(batch)]
  return np.stack(rows).astype(np.int32)


def test_token_losses_match_numpy_oracle():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 11)).astype(np.float32) * 4
  targets = rng.integers(0, 11, size=(2, 3))
  ce, z = train_step.token_losses(jnp.asarray(logits), jnp.asarray(targets))
  shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(shifted).sum(-1)) + logits.max(-1)
  expected = log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(ce), expected, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(z), log_z ** 2, rtol=1e-5)


def _one_step(cfg):
  mesh = mesh_lib.learner_mesh(jax.devices(), cfg.mesh)
  schedule = optim.lr_schedule(cfg.optim, cfg.train.steps)
  spec = train_state.make_spec(cfg.model, optim.inner_optimizer(cfg.optim, cfg.train.steps), mesh)
  state = train_state.create(cfg.model, spec, jax.random.key(0))
  batch = jax.device_put(_golden_batch(cfg.data.seq_len), batch_sharding(mesh))
  eval_fn = train_step.make_eval_step(spec)
  step_fn = train_step.make_train_step(spec, cfg.optim, schedule)
  with jax.set_mesh(mesh):
    loss0 = float(eval_fn(state["params"], batch))
    state, metrics = step_fn(state, batch)
    loss1 = float(eval_fn(state["params"], batch))
  return loss0, loss1, jax.device_get(metrics), state


def test_a_fresh_optimizer_placed_at_step_t_takes_step_ts_learning_rate(tiny_config):
  cfg = tiny_config.optim
  tx = optim.inner_optimizer(cfg, 100)
  rng = np.random.default_rng(0)
  params = {"w": jnp.zeros((3, 4), jnp.float32)}  # zero weights: weight decay adds nothing
  grads = {"w": jnp.asarray(rng.normal(size=(3, 4)) * 0.05, jnp.float32)}  # norm < clip
  g = np.asarray(grads["w"], np.float64)
  schedule = optim.lr_schedule(cfg, 100)
  for step in (0, 10, 57):
    state = optim.at_schedule_step(tx.init(params), step)
    updates, _ = tx.update(grads, state, params)
    # Adam's first step on fresh moments (bias-corrected): g / (|g| + eps), times -lr(t).
    want = -float(schedule(step)) * g / (np.abs(g) + cfg.eps)
    np.testing.assert_allclose(np.asarray(updates["w"]), want, rtol=1e-5, atol=1e-9)
  assert float(schedule(57)) > 0 and float(schedule(0)) == 0.0  # the check can fail


def test_golden_loss_after_one_step(tiny_config, replace):
  cfg = replace(tiny_config, "train", batch_size=8)
  cfg = replace(cfg, "optim", warmup_steps=0)
  loss0, loss1, metrics, state = _one_step(cfg)
  print(f"golden: step0={loss0!r} step1={loss1!r}")
  # Independent sanity: a fresh model is close to uniform over the 384-way vocabulary.
  assert abs(loss0 - np.log(cfg.model.vocab_size)) < 0.5
  assert float(metrics["train/loss"]) == pytest.approx(loss0, rel=1e-5)
  assert loss1 < loss0
  assert int(state["step"]) == 1
  assert float(metrics["train/lr"]) == pytest.approx(cfg.optim.learning_rate)
  assert GOLDEN_LOSS_STEP0 is not None, f"record the golden values: {loss0!r}, {loss1!r}"
  assert loss0 == pytest.approx(GOLDEN_LOSS_STEP0, rel=1e-4)
  assert loss1 == pytest.approx(GOLDEN_LOSS_STEP1, rel=1e-4)


def test_non_finite_loss_raises(tiny_config, replace, tmp_path):
  cfg = replace(tiny_config, "optim", learning_rate=1e30, warmup_steps=0, grad_clip_norm=0.0)
  cfg = replace(cfg, "train", steps=8, eval_every=0)
  cfg = replace(cfg, "checkpoint", every_steps=0)
  with pytest.raises(FloatingPointError, match="non-finite metrics at step"):
    data_parallel.run(cfg, str(tmp_path))


def _params(workdir, step):
  from orbax import checkpoint as ocp
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  return ocp.PyTreeCheckpointer().restore(path)["params"]


@pytest.mark.slow
def test_resume_is_bit_identical(tiny_config, replace, tmp_path):
  cfg = replace(tiny_config, "train", steps=12, eval_every=0)
  cfg = replace(cfg, "optim", decay_steps=12)  # the schedule must not depend on train.steps
  cfg = replace(cfg, "checkpoint", every_steps=6)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  data_parallel.run(cfg, straight)
  data_parallel.run(replace(cfg, "train", steps=6, eval_every=0), resumed)  # "interrupted" at 6
  data_parallel.run(cfg, resumed)
  a, b = _params(straight, 12), _params(resumed, 12)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  def loss(w):
    return metrics_lib.last_per_step(
        metrics_lib.read_metrics(os.path.join(w, "metrics.jsonl")), "train/loss")
  assert loss(straight) == loss(resumed)
  assert len(loss(straight)[0]) == 12


@pytest.mark.slow
def test_resume_takes_other_speed_switches_but_not_another_model(tiny_config, replace,
                                                                 tmp_path):
  cfg = replace(tiny_config, "train", steps=4, eval_every=0)
  cfg = replace(cfg, "checkpoint", every_steps=2)
  workdir = str(tmp_path / "run")
  data_parallel.run(cfg, workdir)
  # Out of memory, say: go on with remat and the loss in chunks. The parameters are the same.
  faster = replace(replace(cfg, "model", remat="full", loss_chunk=16), "train", steps=6,
                   eval_every=0)
  data_parallel.run(faster, workdir)
  records = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  # Each step once: the second run went on from step 4 rather than starting again.
  assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
  with pytest.raises(ConfigError, match=r"written with model.embed_dim=64, but this run has "
                                        r"model.embed_dim=32"):
    data_parallel.run(replace(faster, "model", embed_dim=32), workdir)


@pytest.mark.slow
def test_cli_tiny_run_learns(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "diloco.main", "--config=configs/dp.py:tiny",
       f"--workdir={workdir}"], capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(__file__)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "eval/loss" in proc.stdout and "tok/s" in proc.stdout and "ETA" in proc.stdout
  records = metrics_lib.read_metrics(str(workdir / "metrics.jsonl"))
  steps, evals = metrics_lib.last_per_step(records, "eval/loss")
  assert len(steps) >= 3 and steps[0] == 0          # initial + at least two evaluations
  assert evals[-1] < evals[0] - 1.0                 # learned real structure of the corpus
  assert (workdir / "loss.png").stat().st_size > 10_000
  config = json.loads((workdir / "config.json").read_text())
  assert config["model"]["name"] == "tiny"
  assert {"train/grad_norm", "train/lr", "train/tokens"} <= set(records[1])
  # It ends with a short table, not a dict; the final eval is printed once, in its first row.
  final = f"{evals[-1]:.4f}"
  assert [line for line in proc.stdout.splitlines() if final in line] == [
      f"  eval loss    {final} at step 60 (initial {evals[0]:.4f}), "
      f"perplexity {math.exp(evals[-1]):.2f}"]
  table = proc.stdout[proc.stdout.index("run summary"):].splitlines()
  assert [line.split()[0] for line in table] == [
      "run", "eval", "tokens/s", "plots", "tensorboard", "export"]
  assert "done: {" not in proc.stdout and "{" not in "\n".join(table)
  tokens = int(table[2].split("(")[1].split()[0].replace(",", ""))
  assert tokens == 60 * 16 * 64 == config["train"]["steps"] * 16 * config["data"]["seq_len"]


def test_eval_losses_are_read_one_program_at_a_time_and_averaged_as_before():
  """`mean_eval_loss` reads each batch's loss before dispatching the next (independent
  evaluation programs dispatched together can starve a CPU collective past its deadline),
  and gives the mean that reading them all at the end gave."""
  dispatched, read = [], []

  class Loss:  # a device value that records when it is read
    def __init__(self, i, value):
      self.i, self.value = i, value

    def __array__(self, dtype=None, copy=None):
      read.append(self.i)
      return np.asarray(self.value, dtype=dtype)

  values = np.random.default_rng(0).uniform(1.0, 3.0, 37).astype(np.float32)

  def eval_fn(params, batch):
    assert read == dispatched, "a batch was dispatched before the previous loss was read"
    dispatched.append(batch)
    return Loss(batch, values[batch] * params)

  got = train_step.mean_eval_loss(eval_fn, np.float32(1.0), range(37), place=lambda b: b)
  assert read == list(range(37))
  assert got == float(np.mean(list(values)))  # the float32 mean of the same 0-d values
  # On devices: the same value as the jitted loss of each batch averaged at the end.
  fn = jax.jit(lambda p, x: jnp.mean((x - p) ** 2))
  batches = [jnp.arange(8.0) * k for k in range(5)]
  assert train_step.mean_eval_loss(fn, jnp.float32(1.5), batches) == float(
      np.mean(jax.device_get([fn(jnp.float32(1.5), b) for b in batches])))
