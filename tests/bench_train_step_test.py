"""The train-step bench: its FLOP counts, its variant grammar and a two-variant sweep on CPU, so
the figures a short GPU run depends on cannot silently change meaning."""

import gzip
import json
import os
import subprocess
import sys

import pytest
from script_import import import_script

from diloco.config import run_config
from diloco.errors import ConfigError
from diloco.train import flops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ARGS = ["--preset=tiny", "--steps=2", "--batch_size=2", "--seq_len=32", "--matmul_size=64"]


def _bench(*args):
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  return subprocess.run(
      [sys.executable, os.path.join(REPO, "scripts", "bench_train_step.py"), *_ARGS, *args],
      capture_output=True, text=True, env=env, timeout=300, check=False)


def _tiny_model(**fields):
  cd = run_config.load(os.path.join(REPO, "configs", "dp.py") + ":tiny")
  with cd.unlocked():
    cd.model.update(fields)
  return run_config.from_config_dict(cd).model


@pytest.mark.parametrize("seq_len,window", [(1, None), (7, None), (32, 8), (8, 8), (5, 9)])
def test_attended_pairs_counts_each_query_key_pair(seq_len, window):
  w = window or seq_len
  brute = sum(1 for q in range(seq_len) for k in range(seq_len) if k <= q and q - k < w)
  assert flops.attended_pairs(seq_len, window) == brute


def test_causal_count_is_exact_per_layer_pattern():
  cfg = _tiny_model(num_layers=3, attention_pattern="LG", sliding_window=8)
  assert flops.layer_kinds(cfg) == "LGL"
  per_key = 12 * cfg.num_heads * cfg.head_dim
  pairs = 2 * (36 + 24 * 8) + 32 * 33 // 2  # two windowed layers, one global, 32 positions
  full, causal = flops.flops_per_token(cfg, 32), flops.causal_flops_per_token(cfg, 32)
  assert full - causal == pytest.approx(per_key * (3 * 32 - pairs / 32), rel=1e-12)


def test_recompute_estimates_follow_the_policy():
  cfg = _tiny_model(num_layers=2)
  head = cfg.vocab_size * cfg.embed_dim
  attention = flops.attention_flops_per_token(cfg, 32, causal=True) / 3
  layers = 2 * (flops.matmul_params(cfg) - head) + attention
  expect = {"none": (0.0, "none"), "full": (layers, "layer_forward"),
            "nothing_saveable": (layers, "layer_forward"),
            "dots_with_no_batch_dims_saveable": (attention, "attention_forward"),
            "offload_dots": (attention, "attention_forward"),
            "save_dots_and_attention": (attention, "attention_forward"),
            "save_attention": (layers, "layer_forward (the attention output kept)")}
  for remat, (extra, label) in expect.items():
    got = flops.recompute_flops_per_token(_tiny_model(num_layers=2, remat=remat), 32, "xla")
    assert got == (pytest.approx(extra), label), remat
  dots = _tiny_model(num_layers=2, remat="dots_saveable")
  assert flops.recompute_flops_per_token(dots, 32, "xla") == (0.0, "elementwise_only")
  assert flops.recompute_flops_per_token(dots, 32, "cudnn")[0] == pytest.approx(attention)
  chunked = _tiny_model(num_layers=2, loss_chunk=48)  # 48 tokens over 4 rows: 12 positions,
  extra, label = flops.recompute_flops_per_token(chunked, 32, "xla", 4)  # 3 chunks, 36 padded
  assert label == "none+head_forward" and extra == pytest.approx(8 * head * 36 / 32 - 6 * head)


def test_parse_variants_types_and_errors():
  bench = import_script("bench_train_step")
  assert bench.parse_variants("") == [{}]
  got = bench.parse_variants("batch_size=4, remat=full ;mesh=1,8,1,scan_layers=false;"
                             "rope_base_local=5e3")
  assert got == [{"batch_size": 4, "remat": "full"}, {"mesh": "1,8,1", "scan_layers": False},
                 {"rope_base_local": 5000.0}]
  with pytest.raises(ConfigError, match="'bogus'"):
    bench.parse_variants("remat=full;bogus=1")
  with pytest.raises(ConfigError, match="batch_size='four'"):
    bench.parse_variants("batch_size=four")


def test_sweep_prints_one_line_per_variant_then_a_summary(tmp_path):
  variants = ("remat=full,sliding_window=8,attention_impl=xla;"
              "batch_size=4,remat=dots_with_no_batch_dims_saveable,sliding_window=8,data=corpus")
  out = _bench("--num_layers=3", f"--variants={variants}", f"--hlo_dir={tmp_path}")
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
  assert len(lines) == 3 and lines[-1]["summary"] and lines[-1]["variants"] == lines[:2]
  summary = lines[-1]
  for key in ("jax", "jaxlib", "flax", "python", "platform_version", "matmul_bf16_tflops",
              "matmul_fp32_flops_per_s"):
    assert summary[key], key
  assert set(summary["env"]) >= {"XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                 "XLA_PYTHON_CLIENT_PREALLOCATE"}
  first, second = lines[:2]
  assert (first["remat"], first["batch_size"], first["data"]) == ("full", 2, "random")
  assert (second["remat"], second["batch_size"], second["data"]) == (
      "dots_with_no_batch_dims_saveable", 4, "corpus")
  assert first["state_build_s"] > 0 and second["state_build_s"] == 0  # one layout: reused
  cfg = _tiny_model(num_layers=3, sliding_window=8)
  per_key = 12 * cfg.num_heads * cfg.head_dim
  pairs = 2 * (36 + 24 * 8) + 32 * 33 // 2
  for row in (first, second):
    assert "error" not in row and row["host_ops"] == [] and row["mfu"] is None
    assert (row["attention_requested"], row["attention_resolved"]) in (
        ("xla", "xla"), ("reference", "xla"))
    assert row["model_flops_per_token"] < row["model_flops_per_token_full_attention"]
    assert row["model_flops_per_token"] == pytest.approx(
        flops.causal_flops_per_token(cfg, 32), rel=1e-12)
    assert row["model_flops_per_token_full_attention"] - row["model_flops_per_token"] == (
        pytest.approx(per_key * (3 * 32 - pairs / 32), rel=1e-9))
    assert 0 < row["step_s"] <= row["step_s_p90"] and row["compile_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(row["batch_size"] * 32 / row["step_s"],
                                                rel=1e-3)
    assert row["hardware_flops_per_token"] > row["model_flops_per_token"]
    assert row["compiled_temp_bytes"] > 0 and row["compiled_argument_bytes"] > 0
  assert first["hfu_recompute"] == "layer_forward"
  assert second["hfu_recompute"] == "attention_forward"
  # The compiled program's own account, and its text kept for digesting again elsewhere.
  for index, row in enumerate((first, second)):
    program = row["program"]
    assert program["host_transfer_count"] == 0 and program["attention_kernels"] == []
    assert list(program["dot_flops_by_dtypes"]) == ["f32 x f32 -> f32"]
    # The masked attention computes every query-key pair: at least the causal count.
    assert program["dot_flops"] >= row["model_flops_per_token"] * row["batch_size"] * 32
    with gzip.open(tmp_path / f"v{index}.hlo.txt.gz", "rt") as f:
      assert "HloModule" in f.read(200)


def test_unknown_variant_key_is_a_one_line_error():
  out = _bench("--variants=remat=full;embed_sizee=3")
  assert out.returncode != 0 and out.stdout == ""
  assert "Traceback" not in out.stderr
  assert "unknown key 'embed_sizee'" in out.stderr.strip().splitlines()[-1]


def test_time_budget_skips_what_would_not_fit():
  out = _bench("--steps=1", "--variants=remat=none;remat=full", "--time_budget_s=0.01")
  assert out.returncode == 0, out.stderr[-3000:]
  first, second, summary = [json.loads(line) for line in out.stdout.strip().splitlines()]
  assert "error" not in first and second["error"] == "skipped"
  assert [row.get("error") for row in summary["variants"]] == [None, "skipped"]


def test_attention_and_oom_are_read_from_the_program_and_the_error():
  bench = import_script("bench_train_step")

  class Program:  # what compiled.as_text() shows of a GPU step with and without cuDNN attention
    def __init__(self, text):
      self.text = text

    def as_text(self):
      return self.text

  fused = ('%fmha = (bf16[4,2048,8,256]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
           'custom_call_target="__cudnn$fmhaSoftmax", backend_config={}')
  assert bench.compiled_attention(Program(fused)) == "cudnn"
  gemm = 'custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"'
  assert bench.compiled_attention(Program(gemm)) == "xla"
  assert bench.compiled_attention(Program("")) == "xla"
  assert bench.is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
  assert not bench.is_oom(ValueError("shapes do not match"))
