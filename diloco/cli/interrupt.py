"""Ctrl-C (SIGINT) and SIGTERM on a training run: a clean stop and one line on how to resume.

The first signal raises `Interrupted` in the main thread, so the runtime's `finally` blocks
close its writers and wait for the checkpoint being written; the learner threads still
running are then abandoned (their errors after that point are consequences of the stop,
not news, so they are not printed). `stopped_line` says where the run stopped, read from its
own files, and that rerunning the same command resumes it from its last checkpoint (both
runtimes resume from the newest one in the workdir, docs/design.md 2.5). A second signal exits at
once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from diloco.observe import accounting

# Where each runtime keeps the checkpoints it resumes from (data-parallel, single-controller).
CHECKPOINT_DIRS = ("checkpoints", "run_checkpoints")


class Interrupted(BaseException):
  """Raised in the main thread by SIGINT or SIGTERM (a BaseException, like KeyboardInterrupt,
  so that no `except Exception` of the runtime swallows it)."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _on_signal(signum, frame):  # pylint: disable=unused-argument
  if getattr(_on_signal, "seen", False):
    os._exit(128 + signum)  # a second signal: do not wait for the checkpoint
  _on_signal.seen = True
  # Threads that fail from here on fail because the run is stopping.
  logging.disable(logging.CRITICAL)
  threading.excepthook = lambda args: None
  raise Interrupted(signum)


def _on_unraisable(unraisable) -> None:
  """An `Interrupted` raised where Python cannot propagate it (the handler ran inside a gc
  callback, such as jax's, or a `__del__`) is printed and dropped, and the stop would be lost.
  The signal is sent again instead, from another thread a moment later (sent from here, its
  handler would run inside this hook, where raising is dropped too), so the handler raises in
  the main thread once it is out of the callback."""
  error = unraisable.exc_value
  if isinstance(error, Interrupted):
    _on_signal.seen = False
    threading.Timer(_RESEND_AFTER_S, os.kill, (os.getpid(), error.signum)).start()
    return
  _default_unraisable_hook(unraisable)


_RESEND_AFTER_S = 0.01


_default_unraisable_hook = sys.unraisablehook


def install() -> None:
  """Routes SIGINT and SIGTERM of this (main) thread to `Interrupted`, also when the signal
  lands inside a callback that cannot raise."""
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, _on_signal)
  sys.unraisablehook = _on_unraisable


def _last_checkpoint(workdir: str) -> str | None:
  for name in CHECKPOINT_DIRS:
    directory = os.path.join(workdir, name)
    steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(
        directory) else []
    if steps:
      return os.path.join(directory, str(max(steps)))
  return None


def _progress(workdir: str) -> str:
  """"round R, step S" (or "step S") from the run's tape and metrics, "" before any step."""
  steps = [r.get("step", 0) for r in accounting.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
           if any(k.startswith("train/") for k in r)]
  rounds = accounting.read_jsonl(os.path.join(workdir, accounting.TAPE_FILE))
  parts = ([f"round {len(rounds)}"] if rounds else []) + ([f"step {max(steps)}"] if steps else [])
  return ", ".join(parts)


def stopped_line(workdir: str, signame: str) -> str:
  """One line: the signal, where the run stopped, and how to resume it."""
  where = _progress(workdir)
  head = f"stopped by {signame}" + (f" at {where}" if where else " before the first step")
  checkpoint = _last_checkpoint(workdir)
  if checkpoint is None:
    return head + "; no checkpoint yet: the same command starts the run again from the beginning"
  return head + f"; rerun the same command to resume from its last checkpoint ({checkpoint})"


def exit_stopped(workdir: str, error: Interrupted) -> None:
  """Prints `stopped_line` and ends the process with 128 + the signal's number, without waiting
  for learner threads that are still running."""
  print(stopped_line(workdir, str(error)), file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(128 + error.signum)
