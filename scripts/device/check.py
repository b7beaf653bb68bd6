"""The device bundle's runner: a priority-ordered plan of measurements under one time budget.

Device time is lent in short loans, so the plan is ordered by what each figure is worth: the
environment first, then the largest costs of the learner step. Every item runs as its own
process with a deadline (the budget left, at most its own limit); an item whose estimate no
longer fits is skipped and says so. Benches print JSON lines as they go, so a killed item keeps
what it finished. Writes, into --out, at most eight files: results.jsonl (one line per JSON
line any item printed, tagged with the item, plus one status line per item), results.md (the
table), logs.tar.gz (every item's output) and traces.tar.gz (profiles, when an item wrote any).

  bash scripts/device/check.sh                     # the GPU plan, 7.5 minutes
  bash scripts/device/check.sh --plan=tiny --budget_s=240   # the CPU rehearsal
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
BENCH = os.path.join("scripts", "bench_train_step.py")
OVERHEAD = os.path.join("scripts", "bench_learner_overhead.py")
_EXIT_GRACE_S = 15.0

# Printed by the environment item: what the figures were measured with.
_ENV_SNIPPET = """
import json, os, platform, sys
import jax, jaxlib, flax, optax
devices = jax.devices()
print(json.dumps({"bench": "env", "python": platform.python_version(), "jax": jax.__version__,
    "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
    "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
    "devices": len(devices), "platform_version": devices[0].client.platform_version,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")}))
"""


@dataclasses.dataclass(frozen=True)
class Item:
  """One measurement: a command, what it is expected to take and the most it may take."""
  name: str
  argv: tuple[str, ...]
  estimate_s: float
  limit_s: float
  # Appended to argv with the seconds this item may use, so a bench can stop starting variants.
  budget_flag: str = ""


def _bench(*flags: str) -> tuple[str, ...]:
  return (PY, BENCH, *flags)


# The learner speed switches against the path before them, in the order they are worth measuring.
# Each entry: (global batch, switches). The first of each list is the reference path.
M35_VARIANTS = (
    (64, "embed_impl=gather,head_grad_dtype=float32"),  # before the switches
    (64, "embed_impl=auto,head_grad_dtype=compute"),  # the defaults: one-hot embedding
    (64, "embed_impl=gather_f32,head_grad_dtype=compute"),
)
GEMMA_VARIANTS = (
    # Measured on an H200 (BUILD_NOTES.md): 0.350 s at batch 4 under the dots policy, the best
    # so far, so it leads as this run's reference; then what the last loan's budget skipped.
    (4, "remat=dots_with_no_batch_dims_saveable"),  # keeps the projections (H200 memory)
    (8, "remat=dots_with_no_batch_dims_saveable"),
    (8, "remat=full"),
    (4, "remat=save_dots_and_attention"),
    (2, "remat=none"),
    (4, "remat=full"),  # the defaults under full remat
    (4, "remat=full,embed_impl=gather,head_grad_dtype=float32,loss_chunk=4096"),  # before
)


def _variants(entries, batch: int = 0) -> str:
  """The `--variants` flag: each entry at its own global batch, or all at `batch`."""
  return ";".join(f"batch_size={batch or own},{switches}" for own, switches in entries)


def plan(name: str, out: str) -> list[Item]:
  """The items of plan `name`, most valuable first. "tiny" runs the same items and variants
  as "gpu" at sizes a CPU runs in seconds, so a rehearsal catches what would fail on a loan."""
  env = Item("env", (PY, "-c", _ENV_SNIPPET), 15, 60)
  traces = os.path.join(out, "traces")
  hlo = f"--hlo_dir={os.path.join(traces, 'hlo')}"
  if name not in ("gpu", "tiny"):
    raise SystemExit(f"check.py: unknown --plan {name!r}; known: gpu, tiny")
  gpu = name == "gpu"
  # The CPU rehearsal runs every variant at batch 8, a row per emulated device of the tests:
  # variants that differ only in batch then share one program, which the persistent compilation
  # cache (the tests set one) compiles once, and the profile reuses the sweep's first program.
  batch = 0 if gpu else 8
  accel = ("--dtype=bfloat16", "--scan_layers=true", "--attention_impl=auto")
  # One layer: the rehearsal checks that every switch is accepted, compiles and runs; it is too
  # shallow to scan (the model scans two groups or more), as the 3 layers before it were.
  small = () if gpu else ("--seq_len=16", "--matmul_size=32", "--num_layers=1")
  m35 = ("--preset=m35", "--seq_len=512", "--steps=20") if gpu else ("--preset=tiny", "--steps=2")
  gemma = (("--preset=gemma_2b", "--seq_len=2048", "--steps=6") if gpu else
           ("--preset=tiny", "--steps=2"))
  overhead = (("--model=small", "--devices=1", "--batch_size=64", "--seq_len=1024",
               "--dtype=bfloat16") if gpu else
              ("--model=tiny", "--devices=1", "--steps=8", "--repeats=1"))
  return [
      env,
      Item("m35_sweep", _bench(*m35, *small, "--data=corpus",
                               f"--variants={_variants(M35_VARIANTS, batch)}"),
           90 if gpu else 60, 150 if gpu else 240, budget_flag="--time_budget_s"),
      Item("gemma_2b_sweep", _bench(*gemma, *small, *accel, "--data=corpus", hlo,
                                    f"--variants={_variants(GEMMA_VARIANTS, batch)}"),
           150 if gpu else 90, 420 if gpu else 300, budget_flag="--time_budget_s"),
      Item("learner_overhead", (PY, OVERHEAD, *overhead), 90 if gpu else 60, 150 if gpu else 240),
      Item("profile_gemma_2b", _bench(*gemma, *small, *accel, "--data=corpus",
                                      "--batch_size=4" if gpu else "--batch_size=8",
                                      "--remat=dots_with_no_batch_dims_saveable", "--steps=2",
                                      f"--profile_dir={traces}"),
           80 if gpu else 40, 120 if gpu else 240),
  ]


def _is_final(record: dict) -> bool:
  """A bench's last line: a variant sweep's summary, or a single run's only line."""
  return "bench" in record and ("variants" in record or "variant" not in record)


def _run(item: Item, seconds: float, log_path: str) -> tuple[str, int | None, list[dict]]:
  """Runs `item` for at most `seconds`; (status, exit code, the JSON lines it printed).

  A process that has printed its final JSON line gets `_EXIT_GRACE_S` to exit and is then
  killed with status "ok" (seen on an H200: the bench printed its line and then hung at exit
  until the deadline, which cost the items after it)."""
  argv = list(item.argv)
  if item.budget_flag:
    argv.append(f"{item.budget_flag}={max(1, int(seconds - 10))}")
  records: list[dict] = []
  final_at: list[float] = []
  with open(log_path, "w") as log:
    log.write("$ " + shlex.join(argv) + "\n")
    log.flush()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)

    def read():
      for line in proc.stdout:
        log.write(line)
        log.flush()
        text = line.strip()
        if text.startswith("{"):
          try:
            record = json.loads(text)
          except json.JSONDecodeError:
            continue
          records.append(record)
          if _is_final(record):
            final_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + seconds
    status = None
    while proc.poll() is None:
      now = time.monotonic()
      if final_at and now > final_at[0] + _EXIT_GRACE_S:
        status = "ok"
        break
      if now > deadline:
        status = "timeout"
        break
      time.sleep(0.2)
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      log.write(f"\n[check.py: killed ({status}) after its deadline or its final line]\n")
    proc.wait()
    reader.join(timeout=5)
  if status is None:
    status = "ok" if proc.returncode == 0 else "failed"
  return status, proc.returncode, list(records)


# The columns of results.md, in order, where a record has them.
_COLUMNS = ("variant", "batch_size", "seq_len", "remat", "step_s", "step_s_p90", "tokens_per_s",
            "mfu", "mfu_full_attention", "hfu", "compile_s", "peak_bytes_in_use",
            "attention_resolved", "ratio", "error")


def _table(rows: list[dict]) -> str:
  lines = ["| item | status | wall s | " + " | ".join(_COLUMNS) + " |",
           "|---" * (len(_COLUMNS) + 3) + "|"]
  for row in rows:
    cells = [str(row.get(c, "")) for c in _COLUMNS]
    lines.append(f"| {row['item']} | {row.get('status', '')} | {row.get('wall_s', '')} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--plan", default="gpu")
  parser.add_argument("--budget_s", type=float, default=450.0)
  parser.add_argument("--only", default="", help="comma-separated item names to run")
  args = parser.parse_args()
  os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
  items = plan(args.plan, args.out)
  if args.only:
    wanted = args.only.split(",")
    unknown = sorted(set(wanted) - {i.name for i in items})
    if unknown:
      raise SystemExit(f"check.py: --only names unknown items {unknown}")
    items = [i for i in items if i.name in wanted]
  deadline = time.monotonic() + args.budget_s
  rows, lines = [], []
  for item in items:
    left = deadline - time.monotonic()
    if item.estimate_s > left:
      status = {"item": item.name, "status": "skipped", "reason": f"{left:.0f} s left, "
                f"needs about {item.estimate_s:.0f}"}
      rows.append(status)
      lines.append(status)
      print(json.dumps(status), flush=True)
      continue
    start = time.monotonic()
    status, code, records = _run(item, min(left, item.limit_s),
                                 os.path.join(args.out, "logs", item.name + ".log"))
    wall = round(time.monotonic() - start, 1)
    summary = {"item": item.name, "status": status, "exit_code": code, "wall_s": wall,
               "records": len(records)}
    print(json.dumps(summary), flush=True)
    tagged = [{"item": item.name, **r} for r in records]
    lines.extend(tagged)
    lines.append(summary)
    # The table shows a bench's per-variant lines, not its closing summary line.
    shown = [r for r in tagged if "variants" not in r] or [{"item": item.name}]
    for r in shown:
      rows.append({**r, "status": status, "wall_s": wall})
  with open(os.path.join(args.out, "results.jsonl"), "w") as f:
    f.writelines(json.dumps(line) + "\n" for line in lines)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(f"# Device bundle, plan {args.plan}\n\n" + _table(rows))
  _pack(args.out, "logs", "logs.tar.gz")
  _pack(args.out, "traces", "traces.tar.gz")
  print(open(os.path.join(args.out, "results.md")).read())
  return 0 if all(r.get("status") in ("ok", None) for r in rows) else 1


def _pack(out: str, folder: str, name: str) -> None:
  """Packs out/folder into out/name and removes the folder (the device tool brings back at
  most eight files, none deeper than two folders)."""
  path = os.path.join(out, folder)
  if not os.path.isdir(path) or not os.listdir(path):
    return
  with tarfile.open(os.path.join(out, name), "w:gz") as tar:
    tar.add(path, arcname=folder)
  subprocess.run(["rm", "-rf", path], check=False)


if __name__ == "__main__":
  sys.exit(main())
