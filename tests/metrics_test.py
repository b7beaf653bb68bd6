"""Metric records, resumed-run de-duplication, TensorBoard events, the loss plot, progress."""

import json
import os
import subprocess
import sys

from diloco.observe import metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_writer_records_and_tensorboard(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), role="dp", tensorboard=True)
  writer.write(1, {"train/loss": 3.0})
  writer.write(2, {"train/loss": 2.0, "eval/loss": 2.5})
  writer.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2]
  assert json.loads(lines[1])["eval/loss"] == 2.5 and json.loads(lines[0])["role"] == "dp"
  events = [f for _, _, fs in os.walk(tmp_path / "tensorboard") for f in fs]
  assert any(f.startswith("events.out.tfevents") for f in events)


def test_tensorboard_writer_leaves_torch_unloaded(tmp_path):
  """tensorboardX is imported without torch (~1.5 s a process); later imports of torch are
  left alone (no finder stays behind)."""
  code = ("import sys\n"
          "from diloco.observe import metrics\n"
          f"w = metrics.MetricWriter({str(tmp_path)!r}, role='dp', tensorboard=True)\n"
          "w.write(1, {'train/loss': 3.0}); w.close()\n"
          "print('torch' in sys.modules)\n"
          "print(sorted(type(f).__name__ for f in sys.meta_path if 'Torch' in type(f).__name__))\n")
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
  assert out.stdout.split() == ["False", "[]"], out.stdout + out.stderr


def test_torn_line_and_resumed_steps(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "train/loss": 3.0}\n{"step": 2, "train/loss": 2.0}\n'
                  '{"step": 2, "train/loss": 1.5}\n{"step": 3, "train/lo')
  records = metrics.read_metrics(str(path))
  assert len(records) == 3
  assert metrics.last_per_step(records, "train/loss") == ([1, 2], [3.0, 1.5])


def test_loss_plot_is_written(tmp_path):
  records = [{"step": s, "train/loss": 5.0 / s} for s in range(1, 30)]
  records += [{"step": 10, "eval/loss": 0.6}, {"step": 20, "eval/loss": 0.3}]
  out = tmp_path / "loss.png"
  metrics.plot_loss(records, str(out), title="test")
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5_000


def test_progress_line():
  progress = metrics.Progress(total_steps=100, every_s=1e9, start_step=0)
  assert progress.update(1, 1000.0, 2.5) is None     # rate-limited
  line = progress.update(50, 1000.0, 2.25, force=True)
  assert line.startswith("step 50/100 (50%)") and "tok/s" in line and "loss 2.2500" in line
  assert "ETA" in line
