"""What a way of splitting one block costs, in the audit's own terms, from the traced shapes alone.

A block is a group of column projections (q/k/v, gate/up), the attention between them and the row
projections that contract them back (``roles``). For one way of splitting it (``alternatives``),
``Price`` holds per device: dot FLOPs, bytes moved by collectives, parameter bytes; and for the
whole block: unsharded FLOPs and Megatron's communication (one all-reduce of each row projection's
output). ``cost`` turns them into one number, FLOP-equivalents on a reference TPU: FLOPs per device,
plus the bytes moved beyond Megatron's minimum times the chip's FLOPs per byte of interconnect (the
minimum itself is the same for every valid split, and a plan that moves less does not gain: its
collectives are not what bounds it), plus a fixed cost per collective beyond Megatron's. Prices are
for the traced input's tokens: FLOPs and bytes grow with them, the fixed cost does not. On a mesh with a
context axis each device holds its part of the tokens (FLOPs and activation bytes divided by the axis) and
attention gathers the keys and values over it (``gathers``, in ``comm`` and ``minimum`` alike: the same for
every split, as ``lowering.context`` lays them out whatever the block's). Example:

>>> from torch import nn
>>> from xla_tp.dataflow.trace import trace
>>> import torch
>>> graph = trace(nn.Linear(16, 64), (torch.zeros(2, 8, 16),))
>>> dot_flops(graph.nodes[0])           # 2 x 16 tokens x 16 x 64
32768
>>> p = Price(flops=4096.0, comm=0.0, params=1024.0, whole_flops=32768, minimum=0.0)
>>> p.balance(8), p.cost
(1.0, 4096.0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..dataflow.contract import contraction
from ..dataflow.graph import Node, Value

# Cloud TPU v5e: 197 TFLOP/s (bf16) per chip over 400 GB/s of inter-chip interconnect per chip
# (tpu_configs/v5e-8.yaml): a byte moved costs the time of about 490 FLOPs.
FLOPS_PER_BYTE = 197e12 / 400e9
# A collective Megatron's layout does not need (a reshard inside a block) also waits for the devices and
# the links: assumed 10 us (no vendor figure), about 2 GFLOPs of a v5e chip.
FLOPS_PER_COLLECTIVE = 197e12 * 10e-6


def dot_flops(node: Node) -> int:
    """FLOPs of one contraction node (2 per multiply-add), 0 for anything else."""
    if node.op == "scaled_dot_product_attention":
        q, k, v = (node.arg(i, n) for i, n in enumerate(("query", "key", "value")))
        batch = math.prod(node.outputs[0].shape[:-2])
        return 2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    if node.op in ("conv1d", "conv2d", "conv3d"):
        weight = node.arg(1, "weight")  # [out, in / groups, *kernel]: each output element reads in x kernel
        return 2 * math.prod(node.outputs[0].shape) * math.prod(weight.shape[1:])
    spec = contraction(node)
    if spec is None or len(spec.operands) < 2:
        return 0
    sizes: dict[str, int] = {}
    for value, labels in spec.operands:
        for label, size in zip(labels, value.shape):
            sizes[label] = max(sizes.get(label, 1), int(size))
    return 2 * math.prod(sizes.values())


def nbytes(v: Value) -> int:
    """Bytes of one traced tensor."""
    return math.prod(v.shape) * v.dtype.itemsize


@dataclass(frozen=True)
class Price:
    """One way of splitting a block: per device ``flops``, ``comm`` bytes and ``params`` bytes; the
    block's unsharded ``whole_flops`` and Megatron's ``minimum`` bytes."""

    flops: float
    comm: float
    params: float
    whole_flops: int
    minimum: float
    reshards: int = 0  # collectives beyond Megatron's (an uneven split's gathers), estimated
    gathers: float = 0.0  # of ``comm`` and ``minimum``: keys and values gathered over a context axis

    def balance(self, devices: int) -> float:
        """The audit's compute balance of the block: FLOPs per device x devices / unsharded FLOPs."""
        return self.flops * devices / max(self.whole_flops, 1)

    @property
    def cost(self) -> float:
        """FLOP-equivalents per device (see the module docstring)."""
        return (self.flops + FLOPS_PER_BYTE * max(0.0, self.comm - self.minimum)
                + FLOPS_PER_COLLECTIVE * self.reshards)

    def text(self, devices: int) -> str:
        reshards = f" in {self.reshards} more collectives" if self.reshards else ""
        gathers = f" + key/value gathers over the context axis {self.gathers:,.0f}" if self.gathers else ""
        return (f"cost {self.cost:,.0f}; balance {self.balance(devices):.2f}, {self.comm:,.0f} bytes moved/device"
                f"{reshards} (Megatron {self.minimum - self.gathers:,.0f}{gathers}), parameters "
                f"{self.params:,.0f} bytes/device")
