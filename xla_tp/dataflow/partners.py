"""Parameters applied feature by feature to split features, split with them: a gated norm's weight, a
state-space layer's per-head decay, skip and time-step bias, a depthwise convolution's kernel.

An element-wise op (or a convolution with one group per channel, which mixes positions, never channels)
whose other operand comes from a parameter that holds one entry per feature of the split dimension pairs
each feature with its own entries: the parameter can be split like the features, with no communication.
``partners`` finds such parameters through what made the operand (casts, ``neg``/``exp``, views that only
add or drop unit dims); ``depthwise`` is the convolution's step (registered with ``ops.step``). Example
(Mamba2's ``dt + dt_bias`` on 8 heads):

>>> import torch
>>> from xla_tp.dataflow.trace import trace
>>> class Bias(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.dt_bias = torch.nn.Parameter(torch.zeros(8))
...     def forward(self, dt):
...         return dt + self.dt_bias.to(dt.dtype)
>>> node = trace(Bias(), (torch.zeros(2, 5, 8),)).nodes[-1]
>>> [(p.name, dim) for p, dim in partners(node, 0, Features.whole(2, 8))]
[('dt_bias', 0)]
"""
from __future__ import annotations

import math
from typing import Optional, Union

from .graph import Node, Value
from .ops import POINTWISE, Step, register
from .shapes import Features, Stop

CONVOLUTIONS = ("conv1d", "conv2d", "conv3d")
_THROUGH = POINTWISE | {"squeeze", "unsqueeze", "view", "reshape", "getitem", "to", "float", "contiguous"}


def is_depthwise(node: Node) -> bool:
    """A convolution with one group per input channel and one output channel per group."""
    x, w = node.arg(0, "input"), node.arg(1, "weight")
    if node.op not in CONVOLUTIONS or not isinstance(x, Value) or not isinstance(w, Value) or len(x.shape) < 3:
        return False
    groups = node.arg(6, "groups", 1)
    return isinstance(groups, int) and groups > 1 and groups == x.shape[1] == w.shape[0] and w.shape[1] == 1


def depthwise(node: Node, pos: int, feats: Features) -> Union[Step, Stop]:
    """A depthwise convolution's step: features on the channels stay on them (each channel is convolved
    alone); on the positions it slides over, they stop. Other convolutions: read as contractions."""
    from .ops import _contract
    if not is_depthwise(node):
        return _contract(node, pos, feats)
    if pos != 0:
        return Step()
    if feats.dims() != {1} or feats.lead.outer > 1:
        return f"'{node.op}' slides over the sharded dimension"
    return Step([(0, feats)])


def partners(node: Node, pos: int, feats: Features) -> list[tuple[Value, int]]:
    """The parameters ``node`` applies one entry per split feature (see the module docstring), each with its
    dim that runs along the features; ``node.tensors[pos]`` holds them as ``feats``."""
    if not node.outputs or feats.lead.outer > 1:
        return []
    if node.op in CONVOLUTIONS:
        if pos != 0 or not is_depthwise(node):
            return []
        kernel = [_source(v, 0) for v in (node.arg(1, "weight"), node.arg(2, "bias")) if isinstance(v, Value)]
        return [p for p in kernel if p is not None]
    if node.op not in POINTWISE:
        return []
    me, out = node.tensors[pos], node.outputs[0]
    dim = feats.lead.dim + len(out.shape) - len(me.shape)
    size = out.shape[dim]
    if size != feats.lead.size or math.prod(me.shape) == 0:
        return []
    found = []
    for v in node.tensors:
        if v is me or v.dynamic:
            continue
        at = dim - (len(out.shape) - len(v.shape))
        if at < 0 or v.shape[at] != size or math.prod(v.shape) != size:
            continue
        source = _source(v, at)
        if source is not None:
            found.append(source)
    return found


def _source(v: Value, dim: int) -> Optional[tuple[Value, int]]:
    """The parameter ``v`` is made from, entry for entry along ``dim`` (its only dim longer than one, or a
    kernel's channels), and that dim of the parameter; None if ``v`` mixes anything else in."""
    while v.kind != "param":
        node = v.producer
        if node is None or node.op not in _THROUGH or len(node.tensors) != 1:
            return None
        src = node.tensors[0]
        if node.op in ("getitem", "view", "reshape", "squeeze", "unsqueeze") and \
                sorted(n for n in src.shape if n != 1) != sorted(n for n in v.shape if n != 1):
            return None
        dim = _matching(src, v, dim)
        if dim is None:
            return None
        v = src
    return v, dim


def _matching(src: Value, out: Value, dim: int) -> Optional[int]:
    """The dim of ``src`` that becomes ``out``'s ``dim`` when the op between them only adds or drops unit
    dims (or keeps the shape): the dims longer than one keep their order."""
    if src.shape == out.shape:
        return dim
    long_out = [d for d, n in enumerate(out.shape) if n != 1]
    long_src = [d for d, n in enumerate(src.shape) if n != 1]
    if dim not in long_out or len(long_out) != len(long_src):
        return None
    return long_src[long_out.index(dim)]


register({op: depthwise for op in CONVOLUTIONS})

__all__ = ["depthwise", "is_depthwise", "partners"]
