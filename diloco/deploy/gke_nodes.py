"""What one learner occupies on GKE: a TPU slice or a group of GPU nodes, checked from flags.

`scripts/make_jobset.py` names the learner's devices by TPU type (v5p-128, v6e-16, ...) or GPU
label and node count; this turns them into the node selectors, resource requests, tolerations
and host layout that each learner's pods get, and refuses a shape GKE has no nodes for.
"""

from __future__ import annotations

import dataclasses
import math
import re

# GKE node label value per TPU generation, and how the number in the type name counts:
# v5p-N counts TensorCores (2 per chip), v5litepod-N and v6e-N count chips.
_GENERATIONS = {
    "v5p": ("tpu-v5p-slice", 2),
    "v5litepod": ("tpu-v5-lite-podslice", 1),
    "v5e": ("tpu-v5-lite-podslice", 1),
    "v6e": ("tpu-v6e-slice", 1),
}
# Default topology per chip count (Cloud TPU v5p and v5e configuration tables); other shapes
# need --topology.
_TOPOLOGY_3D = {4: "2x2x1", 8: "2x2x2", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
                512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16",
                6144: "16x16x24"}
_TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
                256: "16x16"}
# Chips per GKE node: v5p nodes (ct5p-hightpu-4t) always have 4; v5e/v6e slices of up to 8
# chips fit one node (1t/4t/8t machine types), larger ones use 4-chip nodes.
_MULTI_HOST_CHIPS = 4
_MAX_SINGLE_HOST_CHIPS = 8


class FlagError(ValueError):
  """A bad flag value; the message starts with the flag's name."""


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  accelerator: str
  topology: str
  chips: int
  chips_per_host: int
  flag = "--tpu_type"
  platform = "tpu"

  @property
  def hosts(self) -> int:
    return self.chips // self.chips_per_host

  def node_selector(self) -> dict:
    return {"cloud.google.com/gke-tpu-accelerator": self.accelerator,
            "cloud.google.com/gke-tpu-topology": self.topology}

  def resources(self) -> dict:
    return {"google.com/tpu": self.chips_per_host}

  def tolerations(self) -> list:
    return []  # GKE adds the TPU taint's toleration to pods that request google.com/tpu

  def describe(self, name: str) -> str:
    return (f"a {name} slice ({self.topology}: {self.hosts} host(s) x {self.chips_per_host} "
            "chips)")


@dataclasses.dataclass(frozen=True)
class GpuHosts:
  """One learner's GPU nodes: `hosts` nodes of `accelerator` with `chips_per_host` GPUs."""
  accelerator: str
  hosts: int
  chips_per_host: int
  flag = "--gpu_type"
  platform = "cuda"

  @property
  def chips(self) -> int:
    return self.hosts * self.chips_per_host

  def node_selector(self) -> dict:
    return {"cloud.google.com/gke-accelerator": self.accelerator}

  def resources(self) -> dict:
    return {"nvidia.com/gpu": self.chips_per_host}

  def tolerations(self) -> list:
    return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

  def describe(self, name: str) -> str:
    return f"{self.hosts} {name} host(s) x {self.chips_per_host} GPUs"


def tpu_slice(tpu_type: str, topology: str | None = None,
              chips_per_host: int | None = None) -> TpuSlice:
  """GKE node selectors and host layout of one slice of `tpu_type` (e.g. v5p-128)."""
  m = re.fullmatch(r"(v5p|v5litepod|v5e|v6e)-(\d+)", tpu_type or "")
  if not m:
    raise FlagError(f"--tpu_type: unknown TPU type {tpu_type!r}; expected v5p-N, v5litepod-N "
                    "(or v5e-N) or v6e-N, e.g. v5p-128, v5litepod-256")
  generation, count = m.group(1), int(m.group(2))
  accelerator, cores_per_chip = _GENERATIONS[generation]
  if count < 1 or count % cores_per_chip:
    raise FlagError(f"--tpu_type: {tpu_type} is not a whole number of chips "
                    f"({generation}-N counts {cores_per_chip} TensorCores per chip)")
  chips = count // cores_per_chip
  dims = 3 if generation == "v5p" else 2
  if topology is None:
    topology = (_TOPOLOGY_3D if dims == 3 else _TOPOLOGY_2D).get(chips)
    if topology is None:
      raise FlagError(f"--topology: no default topology for {tpu_type} ({chips} chips); pass "
                      f"one with {dims} dimensions whose product is {chips}")
  else:
    sizes = topology.split("x")
    if len(sizes) != dims or not all(s.isdigit() and int(s) > 0 for s in sizes):
      raise FlagError(f"--topology: {topology!r} is not {dims} positive sizes joined by 'x' "
                      f"(as {generation} slices have)")
    if math.prod(int(s) for s in sizes) != chips:
      raise FlagError(f"--topology: {topology} has {math.prod(int(s) for s in sizes)} chips, "
                      f"but {tpu_type} has {chips}")
  if chips_per_host is None:
    if generation == "v5p" or chips > _MAX_SINGLE_HOST_CHIPS:
      chips_per_host = min(_MULTI_HOST_CHIPS, chips)
    else:
      chips_per_host = chips
  elif chips_per_host < 1 or chips % chips_per_host or chips_per_host > _MAX_SINGLE_HOST_CHIPS:
    raise FlagError(f"--chips_per_host: {chips_per_host} must divide the {chips} chips of "
                    f"{tpu_type} and be at most {_MAX_SINGLE_HOST_CHIPS}")
  return TpuSlice(accelerator, topology, chips, chips_per_host)


def gpu_hosts(gpu_type: str, gpus_per_host: int, hosts: int) -> GpuHosts:
  """GKE node selector and layout of one GPU learner (e.g. nvidia-h100-80gb, 8 per node)."""
  if not re.fullmatch(r"nvidia-[a-z0-9]+(-[a-z0-9]+)*", gpu_type or ""):
    raise FlagError(f"--gpu_type: {gpu_type!r} is not a GKE GPU accelerator label such as "
                    "nvidia-h100-80gb, nvidia-h200-141gb, nvidia-a100-80gb or nvidia-l4")
  if gpus_per_host not in (1, 2, 4, 8, 16):
    raise FlagError(f"--gpus_per_host: GKE GPU nodes have 1, 2, 4, 8 or 16 GPUs, got "
                    f"{gpus_per_host}")
  if hosts < 1:
    raise FlagError(f"--gpu_hosts: a learner needs at least one host, got {hosts}")
  return GpuHosts(gpu_type, hosts, gpus_per_host)


# One learner's devices, whichever kind (`jobset.accelerator` picks from the flags).
Devices = TpuSlice | GpuHosts
