"""The DiLoCo scaling-law study's 35M row on one GPU: data-parallel, synchronous DiLoCo and
Decoupled at M = 2 and 4, D = 20N tokens (or `--token_fraction` of them, labelled partial).

    python -m experiments.scaling.gpu35m --outdir=runs/experiments/gpu35m [--token_fraction=1]

The `m35` preset (~35.6M parameters, Gemma-style, byte vocabulary, bf16 compute) trains on
the embedded corpus (this interpreter's standard library, whole: `data.max_bytes=0`); every
learner of a DiLoCo run shares the one GPU (`learners.share_devices`, virtual clock), so all
methods train the same tokens per step and evaluate the same held-out windows at the same
steps. Writes `gpu35m.md` (its table, beside the CPU experiment's README), `gpu35m.json` and
plots into `--results_dir`; `--report_only` regenerates them from the runs' own files.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import harness
from experiments.scaling import config, pool, progress, stages
from experiments.scaling import run as scaling_run

CORPUS_FILE = "corpus.json"
EVAL_WINDOWS = 256


def define_flags() -> None:
  flags.DEFINE_string("outdir", "runs/experiments/gpu35m", "Where the runs are kept.")
  flags.DEFINE_string("results_dir", os.path.dirname(os.path.abspath(__file__)),
                      "Where gpu35m.md, gpu35m.json and the plots are written.")
  flags.DEFINE_bool("report_only", False, "Regenerate the report; run nothing.")
  flags.DEFINE_string("preset", "m35", "Model preset (tiny for the CPU rehearsal).")
  flags.DEFINE_float("token_fraction", 1.0, "Share of the 20N budget to train (0 < f <= 1).")
  flags.DEFINE_integer("seq_len", 512, "Sequence length (bytes).")
  flags.DEFINE_integer("batch", 64, "Data-parallel batch; each of M learners takes batch / M.")
  flags.DEFINE_list("learners", ["2", "4"], "The values of M.")
  flags.DEFINE_string("diloco_setting", "outer 0.6/0.9",
                      "Synchronous DiLoCo's outer lr/momentum (the CPU sweep's pick at M = 2, 4).")
  flags.DEFINE_string("decoupled_setting", "overwrite outer 0.6/0.9",
                      "Decoupled's receipt and outer lr/momentum (default receipt, at the CPU "
                      "sweep's M = 4 pick for it: the same outer step as synchronous DiLoCo).")
  flags.DEFINE_string("data_source", "stdlib",
                      "data.source: stdlib (the embedded corpus) or a larger text corpus.")
  flags.DEFINE_string("data_path", "", "data.path of a non-stdlib source.")
  flags.DEFINE_string("only", "", "Run only the runs whose method contains this.")
  flags.DEFINE_integer("parallel", 1, "Runs at a time; keep 1 on one GPU (processes "
                       "time-slice it: five at once ran each about 6x slower).")
  flags.DEFINE_integer("devices", 1, "Emulated CPU devices per run (CPU rehearsal only).")
  flags.DEFINE_string("machine_label", "", "Names this machine in each run's provenance.")


def budget(preset: str, fraction: float, batch: int, seq_len: int) -> int:
  """Steps of `batch` x `seq_len` tokens that train `fraction` of 20N tokens."""
  if not 0 < fraction <= 1:
    raise ValueError(f"--token_fraction must be in (0, 1], got {fraction}")
  return max(1, round(fraction * config.TOKENS_PER_PARAM * config.params(preset)
                      / (batch * seq_len)))


def runs(preset: str, steps: int, batch: int, seq_len: int, learners, diloco_setting: str,
         decoupled_setting: str, data: tuple = ()) -> list[harness.Run]:
  """Data-parallel, then synchronous DiLoCo and Decoupled at each M, seed 0; ten
  evaluations per run on EVAL_WINDOWS windows, warmup 2% of the steps; `data` overrides
  (e.g. a larger corpus) go to every run, after the uncapped `data.max_bytes`."""
  data = (("data.max_bytes", 0),) + tuple(data)
  common = dict(preset=preset, seq_len=seq_len, eval_every=max(1, steps // 10),
                dp_batch=batch, eval_windows=EVAL_WINDOWS, warmup=max(1, steps // 50),
                extra=data)
  out = [config.dp(0, steps, batch, **common)]
  share = (("learners.share_devices", True),) + data
  for m in learners:
    if batch % m or EVAL_WINDOWS % (batch // m):
      raise ValueError(f"--batch={batch} must split over M={m} learners and EVAL_WINDOWS")
    for kind, setting in (("diloco", diloco_setting), ("decoupled", decoupled_setting)):
      receipt, outer = stages.parse_setting(setting)
      out.append(config.diloco(kind, m, outer, 0, steps, receipt,
                               **dict(common, extra=share)))
  return out


def corpus_tokens(source: str = "stdlib", path: str = "") -> int:
  """Tokens of the corpus with the byte tokenizer (its bytes), uncapped."""
  from diloco.train import corpus  # pylint: disable=import-outside-toplevel
  from diloco.train.data import DataConfig  # pylint: disable=import-outside-toplevel
  data = DataConfig(source=source, path=path, max_bytes=0)
  return sum(len(text) for _, text in corpus.documents(data))


def corpus_note(outdir: str, preset: str) -> str:
  """The corpus size recorded where the runs ran, and the epochs that 20N tokens make."""
  path = os.path.join(outdir, CORPUS_FILE)
  if not os.path.exists(path):
    return ""
  with open(path, encoding="utf-8") as f:
    recorded = json.load(f)
  tokens, source = recorded["tokens"], recorded.get("source", "stdlib")
  target = config.TOKENS_PER_PARAM * config.params(preset)
  return (f"Corpus: `{source}`, {tokens:,} byte tokens on the "
          f"machine that ran the runs (2% held out); 20N = {target:,} tokens is "
          f"{target / tokens:.1f} passes over it.")


def settings_note(outdir: str, diloco_setting: str, decoupled_setting: str) -> str:
  """The outer settings the runs in `outdir` used (read from their configs), else the
  flags' (no run yet)."""
  used = {}
  for r in progress.runs(outdir):
    if r["kind"] != "data-parallel":
      used.setdefault(r["kind"], set()).add(r["setting"])
  diloco = ", ".join(sorted(used.get("diloco", ()))) or diloco_setting
  decoupled = ", ".join(sorted(used.get("decoupled", ()))) or decoupled_setting
  return f"Settings: synchronous DiLoCo `{diloco}`, Decoupled `{decoupled}`."


def main(argv):
  del argv
  f = flags.FLAGS
  steps = budget(f.preset, f.token_fraction, f.batch, f.seq_len)
  if not f.report_only:
    os.makedirs(f.outdir, exist_ok=True)
    with open(os.path.join(f.outdir, CORPUS_FILE), "w", encoding="utf-8") as out:
      json.dump({"tokens": corpus_tokens(f.data_source, f.data_path),
                 "source": f.data_source + (f" {f.data_path}" if f.data_path else "")}, out)
    data = (("data.source", f.data_source),) + ((("data.path", f.data_path),)
                                                 if f.data_path else ())
    todo = [r for r in runs(f.preset, steps, f.batch, f.seq_len,
                            [int(m) for m in f.learners], f.diloco_setting,
                            f.decoupled_setting, data) if f.only in r.method]
    if f.parallel > 1 and f.preset == "m35":
      print(f"warning: --parallel={f.parallel} runs share one GPU by time-slicing it; on the "
            "lent H200 five at once ran each DiLoCo run ~6x slower than alone (usage.md)",
            flush=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # runs may share the GPU
    os.environ.setdefault("JAX_PLATFORMS", "" if f.preset == "m35" else "cpu")
    pool.run_parallel(todo, f.outdir, parallel=f.parallel, devices=f.devices,
                      label=f.machine_label)
  about = (f"{__doc__.strip()}\n\n{corpus_note(f.outdir, f.preset)}\n\n"
           f"{settings_note(f.outdir, f.diloco_setting, f.decoupled_setting)}")
  scaling_run.write_report(f.outdir, f.results_dir, prefix="gpu35m", readme="gpu35m.md",
                           command="python -m experiments.scaling.gpu35m", about=about)
  partial = progress.section(f.outdir, f.results_dir, "gpu35m")
  if partial:
    with open(os.path.join(f.results_dir, "gpu35m.md"), "a", encoding="utf-8") as out:
      out.write("\n\n" + "\n".join(partial))
  print(f"report: {os.path.join(f.results_dir, 'gpu35m.md')}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
