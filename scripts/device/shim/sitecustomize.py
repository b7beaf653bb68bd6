"""Lets a GPU image's newer flax import under its older JAX (on PYTHONPATH only when needed).

Seen on a lent H200 image (JAX 0.11.2 with a flax built for a later JAX): flax names types
of `jax.experimental.hijax` (`HiPrimitive` among them) that this JAX lacks, so `import flax`
fails. diloco never uses the flax objects built on them, so plain stand-in classes for the
missing names are enough. check.sh puts this folder on PYTHONPATH only when `import flax.nnx`
fails without it (the bundle normally carries flax 0.12.8, which needs no shim).
"""

import importlib

try:
  _hijax = importlib.import_module("jax.experimental.hijax")
except ImportError:  # a JAX without the module: its flax does not name it either
  _hijax = None


def _stand_in(name: str):
  if name.startswith("__"):
    raise AttributeError(name)
  cls = type(name, (), {"__init__": lambda self, *args, **kwargs: None})
  setattr(_hijax, name, cls)
  return cls


if _hijax is not None:
  _hijax.__getattr__ = _stand_in
