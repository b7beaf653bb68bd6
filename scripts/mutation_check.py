"""The trust checks broken one at a time: each must make the suite fail.

A test that still passes with its check deleted proves nothing about that check, so a faster
suite must still catch every one of these mutants. Each mutant replaces one snippet of the
package (exactly once) in a scratch copy of the tracked files and runs the test files that
guard it there; "caught" means pytest reported failing tests (exit code 1). The unmutated copy
runs the same files first (once per set), as the baseline: they must pass.

  python scripts/mutation_check.py            # every mutant: one JSON line each, then a summary
  python scripts/mutation_check.py --only=unearned_steps,lease_expiry
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
  """One check deleted: `old` (found exactly once in `path`) becomes `new`."""
  name: str
  path: str
  old: str
  new: str
  tests: tuple[str, ...]


MUTANTS = (
    Mutant("unearned_steps", "diloco/sync/intake.py",
           "if payload.steps > payload.local_step:", "if False:", ("tests/trust_test.py",)),
    Mutant("unearned_tokens", "diloco/sync/intake.py",
           "and payload.tokens > payload.steps * limits.tokens_per_step):", "and False):",
           ("tests/trust_test.py",)),
    Mutant("replay_ledger", "diloco/sync/ledger.py",
           "return newest is not None and local_step <= newest", "return False",
           ("tests/trust_test.py",)),
    Mutant("departed_learner", "diloco/sync/ledger.py",
           "return incarnation < self._floor.get(learner, 0)", "return False",
           ("tests/trust_test.py",)),
    Mutant("future_heartbeat", "diloco/sync/intake.py",
           "return min(t, float(now))", "return t", ("tests/trust_test.py",)),
    Mutant("canonical_names", "diloco/distributed/store/names.py",
           'return f"(0|[1-9][0-9]{{0,{digits - 1}}})"', 'return "([0-9]+)"',
           ("tests/trust_test.py",)),
    Mutant("symlinked_folder", "diloco/distributed/store/blob_io.py",
           "if self.local and os.path.islink(folder):", "if False:", ("tests/trust_test.py",)),
    Mutant("symlinked_shard", "diloco/distributed/store/__init__.py",
           "if os.path.islink(base / rel):", "if False:", ("tests/store_layout_test.py",)),
    Mutant("lease_expiry", "diloco/distributed/store/lease.py",
           "if (expires is None or not math.isfinite(expires)", "if (expires is None",
           ("tests/trust_test.py",)),
    Mutant("slurm_syncer_quoting", "diloco/deploy/slurm.py",
           'shlex.join(["srun", "--kill-on-bad-exit=1", _python(s), *args])',
           '" ".join(["srun", "--kill-on-bad-exit=1", _python(s), *args])',
           ("tests/slurm_scripts_test.py",)),
    Mutant("slurm_learner_quoting", "diloco/deploy/slurm.py",
           "program = shlex.join(args) + ", 'program = " ".join(args) + ',
           ("tests/slurm_scripts_test.py",)),
    Mutant("export_overwrite_manifest", "diloco/artifacts/hf_format.py",
           "  stray = sorted(present - files - {MANIFEST})", "  stray = []",
           ("tests/hf_export_test.py",)),
    Mutant("export_out_symlink", "diloco/artifacts/hf_format.py",
           "  if os.path.islink(out_dir):", "  if False:", ("tests/hf_export_test.py",)),
)


def _copy(dest: str) -> None:
  """The tracked files and the untracked ones git does not ignore, as the suite sees them."""
  names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
  for name in filter(None, names):
    src, dst = os.path.join(ROOT, name), os.path.join(dest, name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.islink(src):  # a tracked link (diloco/configs) stays a link
      os.symlink(os.readlink(src), dst)
    elif os.path.isfile(src):
      shutil.copy2(src, dst)


def _pytest(copy: str, tests: tuple[str, ...]) -> tuple[int, float]:
  start = time.monotonic()
  # `python -m pytest` puts the copy first on sys.path: its `diloco` shadows the installed one.
  rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                       *tests], cwd=copy, capture_output=True, check=False).returncode
  return rc, round(time.monotonic() - start, 1)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="comma-separated mutant names")
  args = parser.parse_args()
  known = {m.name: m for m in MUTANTS}
  chosen = [n for n in args.only.split(",") if n] or list(known)
  unknown = [n for n in chosen if n not in known]
  if unknown:
    raise SystemExit(f"mutation_check: unknown --only {','.join(unknown)}; known: "
                     f"{', '.join(known)}")
  results, baselines = [], {}
  with tempfile.TemporaryDirectory(prefix="diloco-mutants-") as copy:
    _copy(copy)
    for name in chosen:
      m = known[name]
      path = os.path.join(copy, m.path)
      with open(path) as f:
        original = f.read()
      if original.count(m.old) != 1:
        raise SystemExit(f"mutation_check: mutant {name}: {m.old!r} is not in {m.path} "
                         "exactly once (the check moved: update MUTANTS)")
      if m.tests not in baselines:
        baselines[m.tests] = _pytest(copy, m.tests)[0]
      baseline = baselines[m.tests]
      with open(path, "w") as f:
        f.write(original.replace(m.old, m.new))
      try:
        rc, seconds = _pytest(copy, m.tests)
      finally:
        with open(path, "w") as f:
          f.write(original)
      row = {"mutant": name, "path": m.path, "tests": list(m.tests), "baseline_rc": baseline,
             "rc": rc, "caught": baseline == 0 and rc == 1, "s": seconds}
      results.append(row)
      print(json.dumps(row), flush=True)
  caught = sum(r["caught"] for r in results)
  print(json.dumps({"bench": "mutation_check", "mutants": len(results), "caught": caught}))
  return 0 if caught == len(results) else 1


if __name__ == "__main__":
  sys.exit(main())
