"""Will it fit? Memory per chip of a training step, estimated before anything is allocated.

Per chip, from the plan's per-parameter specs on the mesh (parameters on ``meta``):

- parameters: each parameter's largest shard, in the run's precision (fp32: 4 bytes, bf16: 2);
- gradients: the same shards, same dtype;
- optimizer state: AdamW/Adam keep 2 states per parameter, SGD with momentum 1, plain SGD 0,
  each the parameter's shard and dtype;
- activations kept for the backward pass, per token on the chip (``batch * seq_len`` over the
  ``data x fsdp`` axes and, when it divides ``seq_len``, the ``context`` axis ``cp``), ``a`` bytes per
  activation element, ``tp`` the model axis:

  - per layer: two norms (fp32 input and normalised value, output: ``2 * h * (8 + a)``),
    rotated q plus the attention output (``2 * heads * head_dim * a / tp``), k and v repeated to every
    head, gathered over the context axis (``2 * cp * heads * head_dim * a / tp``: each chip holds the
    whole sequence's), softmax probabilities in fp32 and their cast copy (``heads * seq_len *
    (4 + a) / tp``: each query against every key), the MLP's gate, up, activation and product (``4 * intermediate * a / tp``); an MoE
    layer, dropless (the default), runs each token's rows, a row being the dispatched token and its
    expert's gate, up, activation and product (``(hidden + 4 * expert_intermediate) * a / tp``): on TPU
    (``moe_route="grouped"``: sorted by expert, grouped matmuls) ``top_k`` rows per token plus the
    kernel's tile padding (at most 15%), recomputed in the backward, so it keeps only each token's
    choices and weights (``top_k * 12`` bytes) and one layer's rows are live at a time; elsewhere (the
    slots route) a slot per token for every expert, ``experts`` rows, all kept; parameters and optimizer
    state count every expert, FLOPs per token (MFU) the active ones;
  - with activation checkpointing each layer keeps only its input (``h * a``) and one layer's
    activations are live again during its recomputation;
  - once: the embedding output (``h * a``) and the logits with their fp32 copy and softmax
    gradient for the loss (``vocab / tp * (a + 8)``);

- with an ``fsdp`` axis, the weights gathered for use: the largest block (a decoder layer, or
  a parameter outside the layers such as the embedding) gathered over ``fsdp``, still sharded
  over the other axes.

The total is compared with the topology's HBM minus a 10% reserve for XLA's scratch space and
fragmentation. It is an estimate of what the compiled program keeps, not a measurement: XLA may
fuse or rematerialise more. A run that will not fit is refused with the numbers and the changes
that would make it fit. Example::

    report = estimate(model_on_meta, planned.specs, mesh, shape, FitSettings("bf16", "adamw", 0.0, 8, 2048, True), topo)
    print(report.table()); report.fits
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional

import torch_xla.distributed.spmd as xs
from torch import nn

from ..axes import batch_ways, sequence_axes
from ..plan.layout import Spec
from ..plan.table import local_shape
from .model import ModelShape
from .topology import GiB, Topology

HBM_RESERVE = 0.10
GROUPED_PADDING = 1.15  # the grouped route's kernel tiles over its routed rows, at most (``lowering.ragged``)
BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class FitSettings:
    precision: str
    optimizer: str
    momentum: float
    batch: int
    seq_len: int
    activation_checkpointing: bool
    moe_route: str = "grouped"  # how MoE layers run: "grouped" (TPU) or "slots" (elsewhere)

    @property
    def optimizer_states(self) -> int:
        if self.optimizer in ("adamw", "adam"):
            return 2
        return 1 if self.momentum else 0


@dataclass(frozen=True)
class FitReport:
    """Bytes per chip of each part; ``usable`` is None when the topology has no HBM figure (CPU)."""

    settings: FitSettings
    mesh: dict[str, int]
    params: int
    grads: int
    optimizer: int
    activations: int
    gathered: int
    tokens_per_chip: int
    hbm: Optional[int]
    usable: Optional[int]

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered

    @property
    def fits(self) -> bool:
        return self.usable is None or self.total <= self.usable

    def table(self) -> str:
        """The small table the launcher prints."""
        s = self.settings
        ways = math.prod(self.mesh.values())
        remat = "checkpointed" if s.activation_checkpointing else "all kept"
        rows = [("parameters", f"{s.precision}, mesh {_mesh(self.mesh)} ({ways} chips)", self.params),
                ("gradients", s.precision, self.grads),
                ("optimizer state", f"{s.optimizer}: {s.optimizer_states} per parameter", self.optimizer),
                ("activations", f"{self.tokens_per_chip:,} tokens/chip, {remat}", self.activations),
                *([("gathered weights", "largest block, gathered over fsdp", self.gathered)] if self.gathered else []),
                ("total", "", self.total)]
        if self.usable is None:
            verdict = "no HBM limit (CPU emulation): not checked"
        else:
            rows.append(("usable HBM", f"{self.hbm / GiB:g} GiB less {HBM_RESERVE:.0%} reserve", self.usable))
            verdict = (f"fits ({self.total / self.usable:.0%} of usable HBM)" if self.fits
                       else f"DOES NOT FIT: {human(self.total)} > {human(self.usable)} usable")
        width = max(len(r[1]) for r in rows)
        lines = ["memory per chip (estimate)"] + [f"  {a:<16} {b:<{width}}  {human(c):>11}" for a, b, c in rows]
        return "\n".join(lines + [f"  => {verdict}"])


def human(n: float) -> str:
    """Bytes in the unit that reads best: ``human(3 << 20) == "3.0 MiB"``, ``human(54 << 30) == "54.0 GiB"``."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _mesh(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "1 chip"


def shard_bytes(model: nn.Module, specs: Mapping[str, Spec], mesh: xs.Mesh, itemsize: int) -> int:
    """Bytes of the largest shard of every parameter (tied ones once) at ``itemsize`` per element."""
    total = 0
    for name, p in model.named_parameters():
        spec = specs.get(name, (None,) * p.dim())
        total += math.prod(local_shape(tuple(p.shape), spec, mesh)) * itemsize
    return total


def gathered_bytes(model: nn.Module, specs: Mapping[str, Spec], mesh: xs.Mesh, itemsize: int) -> int:
    """Largest block's bytes per chip once gathered over ``fsdp`` (0 without an fsdp axis).

    A block is a decoder layer (parameters under ``...layers.N``) or a parameter outside the layers.
    """
    if dict(zip(mesh.axis_names, mesh.mesh_shape)).get("fsdp", 1) == 1:
        return 0
    blocks: dict[str, int] = {}
    for name, p in model.named_parameters():
        spec = tuple(_without(a, "fsdp") for a in specs.get(name, (None,) * p.dim()))
        parts = name.split(".")
        block = next((".".join(parts[:i + 1]) for i, part in enumerate(parts) if part.isdigit()), name)
        blocks[block] = blocks.get(block, 0) + math.prod(local_shape(tuple(p.shape), spec, mesh)) * itemsize
    return max(blocks.values(), default=0)


def _without(axis, name: str):
    """A spec entry with mesh axis ``name`` taken out: ``_without(("fsdp", "model"), "fsdp") == "model"``."""
    if isinstance(axis, tuple):
        rest = tuple(a for a in axis if a != name)
        return rest[0] if len(rest) == 1 else (rest or None)
    return None if axis == name else axis


def activation_bytes(shape: ModelShape, settings: FitSettings, mesh: Mapping[str, int]) -> tuple[int, int]:
    """(activation bytes per chip, tokens per chip), by the formula in the module docstring."""
    a = BYTES[settings.precision]
    tp, cp = mesh.get("model", 1), context_ways(mesh, settings.seq_len)
    tokens = settings.batch * settings.seq_len // (batch_ways(mesh) * cp)
    attn = shape.heads * shape.head_dim
    mlp, live = 4 * shape.intermediate * a / tp, 0.0
    if shape.experts:  # the rows of its tokens: each a dispatched token and its gate, up, activation and product
        row = (shape.hidden + 4 * shape.expert_intermediate) * a / tp
        if settings.moe_route == "grouped":  # recomputed in the backward: the choices kept, one layer's rows live
            mlp, live = shape.top_k * 12, shape.top_k * GROUPED_PADDING * row
        else:
            mlp = shape.experts * row
    layer = 2 * shape.hidden * (8 + a) + (2 + 2 * cp) * attn * a / tp + shape.heads * settings.seq_len * (4 + a) / tp + mlp
    layers = shape.layers * shape.hidden * a + layer if settings.activation_checkpointing else shape.layers * layer
    once = shape.hidden * a + shape.vocab / tp * (a + 8) + live
    return int(tokens * (layers + once)), tokens


def context_ways(mesh: Mapping[str, int], seq_len: int) -> int:
    """How many ways a sequence of ``seq_len`` tokens is split: the context axis where it divides it."""
    return math.prod(mesh[a] for a in sequence_axes(mesh, seq_len))


def estimate(model: nn.Module, specs: Mapping[str, Spec], mesh: xs.Mesh, shape: ModelShape,
             settings: FitSettings, topology: Topology) -> FitReport:
    """The fit report of ``model`` (any device, ``meta`` included) sharded by ``specs`` on ``mesh``."""
    sizes = {str(n): int(s) for n, s in zip(mesh.axis_names, mesh.mesh_shape)}
    params = shard_bytes(model, specs, mesh, BYTES[settings.precision])
    gathered = gathered_bytes(model, specs, mesh, BYTES[settings.precision])
    acts, tokens = activation_bytes(shape, settings, sizes)
    usable = None if topology.hbm_bytes is None else int(topology.hbm_bytes * (1 - HBM_RESERVE))
    return FitReport(settings, sizes, params, params, params * settings.optimizer_states, acts, gathered, tokens,
                     topology.hbm_bytes, usable)


def with_settings(report: FitReport, shape: ModelShape, **changes) -> FitReport:
    """The same report with other settings (precision, batch, checkpointing) on the same mesh and plan."""
    settings = replace(report.settings, **changes)
    scale = BYTES[settings.precision] / BYTES[report.settings.precision]
    params = int(report.params * scale)
    acts, tokens = activation_bytes(shape, settings, report.mesh)
    return replace(report, settings=settings, params=params, grads=params, gathered=int(report.gathered * scale),
                   optimizer=params * settings.optimizer_states, activations=acts, tokens_per_chip=tokens)


def suggest(report: FitReport, shape: ModelShape, chips: int,
            remesh: Callable[[dict[str, int]], FitReport], slices: int = 1) -> list[str]:
    """Recipe overrides that would make a run fit, each with its estimate; the last resort is a bigger slice.

    ``remesh(mesh)`` re-plans the model on another mesh of the same chips and estimates it. Over ``slices``
    slices (multi-slice) every mesh tried keeps ``data = slices`` across them and splits each slice's chips.
    """
    tries: list[tuple[str, FitReport]] = []
    if report.settings.precision == "fp32":
        tries.append(("precision=bf16", with_settings(report, shape, precision="bf16")))
    if not report.settings.activation_checkpointing:
        tries.append(("activation_checkpointing=true", with_settings(report, shape, activation_checkpointing=True)))
    best_mesh = _best_mesh(report, shape, chips, remesh, slices)
    if best_mesh is not None:
        tries.append((f"mesh={_flow(best_mesh.mesh)}", best_mesh))
    dp = batch_ways(report.mesh)
    batch, smaller = report.settings.batch, None
    while batch % 2 == 0 and (batch // 2) % dp == 0:
        batch //= 2
        smaller = with_settings(report, shape, batch=batch)
        if smaller.fits:
            break
    if smaller is not None:
        tries.append((f"batch={batch}", smaller))
    lines = [f"{override}: {human(r.total)} per chip{' (fits)' if r.fits else ''}" for override, r in tries]
    if any(r.fits for _, r in tries):
        return lines
    combined = best_mesh or report
    combined = with_settings(combined, shape, precision="bf16", activation_checkpointing=True,
                             batch=batch_ways(combined.mesh))
    if combined.fits:
        return lines + [f"all of these together (smallest batch): {human(combined.total)} per chip (fits)"]
    state = (combined.params + combined.grads + combined.optimizer) * chips
    need = math.ceil(state / combined.usable) if combined.usable else chips
    rest = state // chips + combined.gathered  # per chip: what is not activations
    if combined.usable and rest <= combined.usable < rest + combined.activations:  # the activations do not fit
        return lines + [f"nothing fits {chips} chips: at seq_len={combined.settings.seq_len} the activations alone "
                        f"are {human(combined.activations)} per chip on mesh {_flow(combined.mesh)} at the smallest "
                        f"batch; use a shorter seq_len, or a larger slice for a larger context axis"]
    return lines + [f"nothing fits {chips} chips: parameters, gradients and optimizer state alone are "
                    f"{human(state)} in bf16, {need} or more chips of this type before any activation; use a larger slice"]


def _best_mesh(report: FitReport, shape: ModelShape, chips: int,
               remesh: Callable[[dict[str, int]], FitReport], slices: int = 1) -> Optional[FitReport]:
    """The lowest-memory ``fsdp x context x model`` mesh over all chips (of each slice, with ``data = slices``
    across them): the model axis dividing the heads, the context axis the sequence, the fsdp axis the batch.
    A context axis only cuts activations: it is tried when they are most of the memory (each mesh tried is
    planned)."""
    best = None
    seq, batch = report.settings.seq_len, report.settings.batch // slices
    chips //= slices
    long = report.activations > report.params + report.grads + report.optimizer
    for model in (m for m in range(1, chips + 1) if chips % m == 0 and shape.heads % m == 0):
        for context in (c for c in range(1, (chips // model if long else 1) + 1)
                        if (chips // model) % c == 0 and seq % c == 0):
            fsdp = chips // (model * context)
            mesh = {k: v for k, v in (("data", slices), ("fsdp", fsdp), ("context", context), ("model", model)) if v > 1}
            if mesh == report.mesh or batch % fsdp:
                continue
            candidate = remesh(mesh or {"model": 1})
            if best is None or candidate.total < best.total:
                best = candidate
    return best if best is not None and best.total < report.total else None


def _flow(mesh: Mapping[str, int]) -> str:
    """``{fsdp: 4, model: 8}`` (axes of size 1 left out), as a command-line override value."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.items() if v > 1) + "}"
