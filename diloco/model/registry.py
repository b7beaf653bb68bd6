"""Models by name: the built-in transformer, and any Flax NNX model a user registers.

```python
from diloco.model import registry

class MyLM(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs): ...
  def __call__(self, tokens_BL):  # int32 [B, L] -> float logits [B, L, V] (or (logits, aux))
    ...

registry.register("my_lm", MyLM, embedding_paths=("embed/embedding",))
```
then `--config.model.arch=my_lm --config.model.module=my_pkg.my_lm` (or a .py file path).

What a model must provide, so that the fragment plan, the sharding rules, checkpoints and the
syncer work unchanged:
- `factory(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module`, creating its parameters from
  `rngs.params()` (the learner's seed goes there).
- `model(tokens_BL) -> logits_BLV` or `(logits_BLV, aux_loss)`: `aux_loss` (a scalar) is added
  to the training loss; cross-entropy and the z-loss are computed outside the model.
- Only `nnx.Param` state (no BatchStat, RNG counters or caches): the parameters are the model.
- Every parameter annotated with logical axis names, `nnx.Param(x, out_sharding=("embed",
  "mlp"))` (or `nnx.with_partitioning`), drawn from `diloco.model.sharding.DEFAULT_RULES`
  (`vocab`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `expert`, `layers`, ...); `None`
  for a replicated dimension; no annotation means replicated.
- `embedding_paths`: the "/"-joined paths of the token embedding and a tied output head, which
  the syncer merges by the weighted mean instead of RDA (empty: none).
- Optionally per-layer parameters under `layers/<int>/` (an `nnx.List` attribute `layers`), which
  the `layer` fragment scheme groups by.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from flax import nnx

from diloco import user_code
from diloco.errors import ConfigError
from diloco.model.config import ModelConfig

Factory = Callable[..., nnx.Module]


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """A registered model: how to build it and which parameters are its embedding."""
  name: str
  factory: Factory
  embedding_paths: tuple[str, ...]


_LOCK = threading.Lock()
_REGISTRY: dict[str, ModelEntry] = {}


def register(name: str, factory: Factory, *, embedding_paths=("embedder/embedding",),
             overwrite: bool = False) -> ModelEntry:
  """Registers `factory(cfg, *, rngs)` as model `name`.

  Registering the same factory again is a no-op (a module imported twice); another factory
  under a taken name raises unless `overwrite`.
  """
  if not name or not isinstance(name, str):
    raise ValueError(f"model name must be a non-empty string, got {name!r}")
  if not callable(factory):
    raise ValueError(f"model {name!r}: factory must be callable, got {factory!r}")
  entry = ModelEntry(name, factory, tuple(embedding_paths))
  with _LOCK:
    old = _REGISTRY.get(name)
    same = old is not None and (_qualname(old.factory), old.embedding_paths) == (
        _qualname(factory), entry.embedding_paths)
    if old is not None and not overwrite and not same:
      raise ValueError(f"model {name!r} is already registered ({_qualname(old.factory)}); "
                       "pass overwrite=True to replace it")
    _REGISTRY[name] = entry
  return entry


def _qualname(factory) -> str:
  return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def names() -> list[str]:
  with _LOCK:
    return sorted(_REGISTRY)


def import_module(spec: str) -> None:
  """Imports `spec`, a dotted module name or a .py file, so that it can register models."""
  if spec:
    user_code.load(spec, "model.module")


def get(cfg: ModelConfig) -> ModelEntry:
  """The entry of `cfg.arch`, after importing `cfg.module`."""
  import_module(cfg.module)
  with _LOCK:
    entry = _REGISTRY.get(cfg.arch)
    known = sorted(_REGISTRY)
  if entry is None:
    hint = "" if cfg.module else "; set model.module to the module that registers it"
    raise ConfigError(f"model.arch: unknown model {cfg.arch!r}; registered: {known}{hint}")
  return entry


def build(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """A new model of `cfg.arch`."""
  return get(cfg).factory(cfg, rngs=rngs)


def _transformer(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  from diloco.model import transformer  # pylint: disable=import-outside-toplevel
  return transformer.Transformer(cfg, rngs=rngs)


register("transformer", _transformer, embedding_paths=("embedder/embedding",))
