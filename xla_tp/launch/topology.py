"""TPU slice descriptions (``tpu_configs/*.yaml``): what a slice has, read and checked.

Each file describes one slice type people rent (``v5p-64``, ``v6e-8``, ...) or the CPU emulation
(``cpu-8``): chips, TPU VM hosts, chips per host, HBM and peak bf16 TFLOP/s per chip, ICI bandwidth,
the physical topology, the default ``data``/``fsdp``/``model`` mesh, and where the figures come
from. A multi-slice topology (``v5e-256x2``) says ``slices: N``: its chips and hosts count every slice,
its physical topology is one slice's, and its mesh's ``data`` axis (the one crossing slices, over DCN)
is a multiple of N (``slices.py``). Example::

    topo = load_topology("v5p-64")
    topo.chips, topo.hosts, topo.mesh        # 32, 8, {'fsdp': 8, 'model': 4}
    topo.hbm_bytes                           # 95 GiB in bytes
    load_topology("v5p-65")                  # LaunchError listing the known topologies
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..axes import AXIS_ORDER
from .schema import LaunchError, build, did_you_mean, find_yaml, read_yaml, shipped_names

TOPOLOGY_DIR = Path(__file__).resolve().parents[2] / "tpu_configs"
GiB = 1 << 30


@dataclass(frozen=True)
class Topology:
    """One slice type. ``hosts`` counts TPU VM workers (one process each); figures are per chip."""

    accelerator: str                      # gcloud --accelerator-type (v5litepod-8, v5p-64) or "cpu"
    generation: str                       # v4 | v5e | v5p | v6e | cpu
    chips: int                            # XLA devices of the slice (one per chip, megacore on v4/v5p)
    hosts: int
    chips_per_host: int
    hbm_gib_per_chip: Optional[float]     # None: no fixed HBM (CPU emulation)
    peak_bf16_tflops_per_chip: Optional[float]
    ici_gbytes_per_s_per_chip: Optional[float]   # bidirectional; None when the vendor does not state it
    physical_topology: Optional[str]      # "2x4x4" as the vendor writes it
    mesh: dict[str, int]                  # default mesh, axes from data/fsdp/model
    source: str                           # where the figures come from
    slices: int = 1                       # identical slices joined over DCN (multi-slice); chips and hosts count all
    env: dict[str, str] = field(default_factory=dict)   # environment a run needs (CPU emulation)
    name: str = ""                        # the file's stem, set by the loader

    @property
    def is_tpu(self) -> bool:
        return self.generation != "cpu"

    @property
    def hbm_bytes(self) -> Optional[int]:
        return None if self.hbm_gib_per_chip is None else int(self.hbm_gib_per_chip * GiB)


def topology_names() -> list[str]:
    """Names of the shipped topologies (file stems of ``tpu_configs/``), sorted."""
    return shipped_names(TOPOLOGY_DIR)


def load_topology(name_or_path: Union[str, Path]) -> Topology:
    """A shipped topology by name (``"v5e-8"``) or a YAML file path, validated."""
    path = find_yaml(name_or_path, TOPOLOGY_DIR, "topology")
    topo = build(Topology, {**(read_yaml(path) or {}), "name": path.stem}, str(path))
    check_topology(topo, str(path))
    return topo


def check_topology(topo: Topology, where: str) -> None:
    """Cross-field consistency: hosts x chips per host, physical shape, mesh axes and product."""
    for key in ("chips", "hosts", "chips_per_host"):
        if getattr(topo, key) < 1:
            raise LaunchError(f"{where}: {key} must be >= 1, got {getattr(topo, key)}")
    if topo.hosts * topo.chips_per_host != topo.chips:
        raise LaunchError(f"{where}: hosts x chips_per_host = {topo.hosts} x {topo.chips_per_host} "
                          f"!= chips = {topo.chips}")
    if topo.slices < 1 or topo.hosts % topo.slices:
        raise LaunchError(f"{where}: slices={topo.slices} must be >= 1 and divide hosts={topo.hosts}")
    if topo.physical_topology is not None:
        dims = parse_shape(topo.physical_topology, f"{where}: physical_topology")
        if math.prod(dims) * topo.slices != topo.chips:
            raise LaunchError(f"{where}: physical_topology {topo.physical_topology} has {math.prod(dims)} "
                              f"chips, not {topo.chips // topo.slices}" + (" per slice" if topo.slices > 1 else ""))
    check_mesh(topo.mesh, topo.chips, f"{where}: mesh")
    if topo.slices > 1:
        from .slices import hybrid_shapes
        hybrid_shapes(topo.mesh, topo.slices)
    if topo.is_tpu and (topo.hbm_gib_per_chip is None or topo.peak_bf16_tflops_per_chip is None):
        raise LaunchError(f"{where}: a TPU topology needs hbm_gib_per_chip and peak_bf16_tflops_per_chip")


def check_mesh(mesh: dict[str, int], chips: int, where: str) -> None:
    """Axes from ``data``/``fsdp``/``model``, positive sizes, product equal to ``chips``."""
    for axis, size in mesh.items():
        if axis not in AXIS_ORDER:
            raise LaunchError(f"{where}: unknown axis {axis!r}{did_you_mean(axis, AXIS_ORDER)}; "
                              f"axes are {', '.join(AXIS_ORDER)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise LaunchError(f"{where}: axis {axis!r} has size {size!r}; sizes are positive integers")
    if math.prod(mesh.values()) != chips:
        raise LaunchError(f"{where}: {mesh} multiplies to {math.prod(mesh.values())}, but the slice has "
                          f"{chips} chips")


def parse_shape(text: str, where: str) -> tuple[int, ...]:
    """``parse_shape("2x4x4", ...) == (2, 4, 4)``."""
    try:
        dims = tuple(int(d) for d in str(text).lower().split("x"))
    except ValueError:
        raise LaunchError(f"{where}: {text!r} is not a shape like 2x4 or 2x2x4") from None
    if any(d < 1 for d in dims):
        raise LaunchError(f"{where}: {text!r} has a dimension below 1")
    return dims
