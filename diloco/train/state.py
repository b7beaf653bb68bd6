"""Training state as a plain pytree, created directly on a learner's devices.

`{"params": <pure dict>, "opt_state": <optax state>, "step": int32}`: pure dicts keep
checkpoint keys stable and let the learner address a fragment by path. State is
built abstractly first (`eval_shape`), its shardings come from the logical axis
names, and one jitted init with those `out_shardings` materialises it in place, so
no device ever holds an unsharded copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco.errors import ConfigError
from diloco.model import registry
from diloco.model.config import ModelConfig
from diloco.model.sharding import DEFAULT_RULES

PyTree = Any


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """Everything needed to build, restore or step a learner's state on one mesh."""
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh
  abstract: PyTree  # ShapeDtypeStructs carrying the target NamedShardings
  shardings: PyTree


def _new_model(cfg: ModelConfig, key) -> nnx.Module:
  with nnx.use_eager_sharding(False):
    return registry.build(cfg, nnx.Rngs(params=key))


def abstract_params(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and abstract parameter State (no memory allocated)."""
  with nnx.use_eager_sharding(False):
    abstract_model = nnx.eval_shape(lambda: _new_model(cfg, jax.random.key(0)))
  graphdef, state = nnx.split(abstract_model)
  _check_model(cfg, state)
  return graphdef, state


def _check_model(cfg: ModelConfig, state: nnx.State) -> None:
  """A registered model holds only annotated nnx.Params on known logical axes."""
  known = {name for name, _ in DEFAULT_RULES}
  for path, var in nnx.to_flat_state(state):
    where = "/".join(str(k) for k in path)
    if not isinstance(var, nnx.Param):
      raise ConfigError(f"model.arch={cfg.arch!r}: {where} is a {type(var).__name__}; a model "
                        "may only hold nnx.Param state (see diloco/model/registry.py)")
    names = var.get_metadata().get("out_sharding") or ()
    unknown = [n for n in names if n is not None and n not in known]
    if unknown:
      raise ConfigError(f"model.arch={cfg.arch!r}: parameter {where} names logical axes "
                        f"{unknown}; known: {sorted(known)} (diloco/model/sharding.py)")


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def optimizer_shardings(opt_state: PyTree, params: PyTree, param_shardings: PyTree,
                        other: NamedSharding) -> PyTree:
  """Each optimizer-state leaf placed as the parameter it belongs to (the one whose key path
  ends its own, shape for shape: AdamW's and Muon's moments), every other leaf (counts, Muon's
  coefficients) by `other`. Works for any optimizer's state, masked parts included (Muon's
  optax.partition leaves a parameter out of the part that does not take it)."""
  shapes = {_keys(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
  placed = {_keys(p): s for p, s in jax.tree_util.tree_leaves_with_path(param_shardings)}

  def place(path, leaf):
    keys = _keys(path)
    for start in range(len(keys)):
      if shapes.get(keys[start:]) == getattr(leaf, "shape", None):
        return placed[keys[start:]]
    return other
  return jax.tree_util.tree_map_with_path(place, opt_state)


def make_spec(cfg: ModelConfig, tx: optax.GradientTransformation,
              mesh: jax.sharding.Mesh) -> StateSpec:
  graphdef, abstract_state = abstract_params(cfg)
  with nnx.logical_axis_rules(DEFAULT_RULES):
    param_shardings = nnx.to_pure_dict(nnx.get_named_sharding(abstract_state, mesh))
  params = nnx.to_pure_dict(abstract_state)
  opt_state = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, P())
  opt_shardings = optimizer_shardings(opt_state, params, param_shardings, replicated)
  shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
  shapes = {"params": params, "opt_state": opt_state,
            "step": jax.ShapeDtypeStruct((), jnp.int32)}
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
  return StateSpec(graphdef=graphdef, tx=tx, mesh=mesh, abstract=abstract, shardings=shardings)


def partition_specs(spec: StateSpec) -> PyTree:
  """The state's PartitionSpecs: its shardings without their devices. A program whose outputs
  are placed by these resolves them on the mesh it is lowered under (`jax.set_mesh`), so one
  traced program serves every mesh of the same axes (`island.build_learner`)."""
  return jax.tree.map(lambda s: s.spec, spec.shardings)


def make_init(cfg: ModelConfig, spec: StateSpec, out_shardings: PyTree = None):
  """A jitted `init(key) -> state` that materialises the state with its shardings
  (`out_shardings`: `partition_specs(spec)` for a program lowered under any mesh of spec's
  axes)."""

  def init(key):
    params = nnx.to_pure_dict(nnx.state(_new_model(cfg, key)))
    return {"params": params, "opt_state": spec.tx.init(params),
            "step": jnp.zeros((), jnp.int32)}

  return jax.jit(init, out_shardings=spec.shardings if out_shardings is None else out_shardings)


def create(cfg: ModelConfig, spec: StateSpec, key: jax.Array) -> PyTree:
  """Fresh parameters and optimizer state, initialised directly with their shardings."""
  with jax.set_mesh(spec.mesh):
    return make_init(cfg, spec)(key)
