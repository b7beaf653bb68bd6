"""Config files by name or by path: `--config=decoupled:tiny` or `--config=configs/decoupled.py:tiny`.

The repository's `configs/` folder ships inside the package as `diloco.configs` (a link in the
checkout, copied by `pip install`), so an installed `diloco` finds its presets from any
directory. A spec whose file exists is used as it is; otherwise a bare name (`decoupled`) or
the repository path of a shipped file (`configs/decoupled.py`) means the shipped file.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from diloco.errors import ConfigError

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def names() -> list[str]:
  """The shipped config files, by name (`decoupled`, `dp`, ...)."""
  if not os.path.isdir(SHIPPED):
    return []
  return sorted(f[:-3] for f in os.listdir(SHIPPED)
                if f.endswith(".py") and not f.startswith("_"))


def _shipped(path: str) -> str | None:
  """The shipped file that `path` names (`dp`, `dp.py`, `configs/dp.py`), if any."""
  head, base = os.path.split(os.path.normpath(path))
  if head not in ("", "configs"):
    return None
  name = base[:-3] if base.endswith(".py") else base
  return os.path.join(SHIPPED, f"{name}.py") if name in names() else None


def resolve(spec: str) -> str:
  """`spec` (`FILE.py[:PRESET]` or `NAME[:PRESET]`) with its file made a path that exists;
  ConfigError naming the file and the shipped names otherwise."""
  path, sep, preset = spec.partition(":")
  if not path:
    raise ConfigError(f"--config={spec}: give a config file or name, e.g. decoupled:tiny "
                      f"(shipped: {', '.join(names())})")
  if os.path.isfile(path):
    return spec
  if os.path.isdir(path):
    raise ConfigError(f"--config: {path!r} is a directory, not a config file")
  shipped = _shipped(path)
  if shipped is None:
    raise ConfigError(f"--config: config file {path!r} does not exist; give a file path or a "
                      f"shipped config: {', '.join(names())}")
  return shipped + sep + preset


def load(spec: str) -> ml_collections.ConfigDict:
  """`get_config(preset)` of the file `spec` names (see `resolve`); every failure of the file
  or its preset (e.g. an unknown preset) is a one-line ConfigError naming the file."""
  path, _, preset = resolve(spec).partition(":")
  shown = spec.partition(":")[0]
  try:
    module_spec = importlib.util.spec_from_file_location("_diloco_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except  (any error of a user's file)
    raise ConfigError(f"--config: {shown} fails to load: {type(e).__name__}: {e}") from None
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(f"--config: {shown} defines no get_config(preset) function")
  try:
    return module.get_config(preset) if preset else module.get_config()
  except Exception as e:  # pylint: disable=broad-except
    message = str(e) if isinstance(e, (ValueError, ConfigError)) else f"{type(e).__name__}: {e}"
    raise ConfigError(f"--config={spec}: {message}") from None
