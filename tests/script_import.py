"""Importing a command-line script of `scripts/` into a test process, without its flags.

A script defines its absl flags when it is imported; left in the process's FLAGS they clash
with the flags a later test defines in the same pytest worker (an experiment runner's
`--seed` or `--preset`), so that test would fail or pass depending on which files the worker
ran before it. Every test that imports a script goes through `import_script`.
"""

import importlib
import os
import sys

from absl import flags

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def import_script(name: str):
  """The module `scripts/<name>.py`, with the flags its import defined removed again (its
  functions stay usable; its flag values do not)."""
  before = set(flags.FLAGS)
  sys.path.insert(0, SCRIPTS)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(SCRIPTS)
    for flag in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, flag)
