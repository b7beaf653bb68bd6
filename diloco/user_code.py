"""A user's own code named in a config field (`model.module`, `log.hooks`): a dotted module
name or a .py file path, imported once per process, every failure one ConfigError naming
the field, since that code runs inside training and its errors are the user's to read."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import types

from diloco.errors import ConfigError


def load(spec: str, field: str) -> types.ModuleType:
  """The module `spec` names (a file is imported under a name derived from its absolute
  path, so two files of one name stay apart and a second load is the first's module)."""
  try:
    if not (spec.endswith(".py") or os.sep in spec):
      return importlib.import_module(spec)
    path = os.path.abspath(spec)
    if not os.path.isfile(path):
      raise ConfigError(f"{field}: file {spec!r} does not exist")
    name = f"_diloco_user_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if name in sys.modules:
      return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
      module_spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[name]
      raise
    return module
  except ConfigError:
    raise
  except Exception as e:  # any error of the user's code, one line
    raise ConfigError(f"{field}: cannot import {spec!r}: {type(e).__name__}: {e}") from e
