"""Projections and the regions their output features flow through.

A projection is a contraction of one activation with one parameter (``nn.Linear``, HF ``Conv1D``,
``x @ W``, an einsum with a weight, a convolution over its channels). Its ``region`` is everything its output features reach when
they are split over devices: followed op by op (``ops.step``) until each path ends in another
projection that contracts them (a ``row``: Megatron's row-parallel layer), dies, reaches the
model's output, or meets an op that needs the whole feature dimension (a ``stop``). A projection
whose region has no stop and ends in rows is column-parallel material. A block of a packed projection
that meets a stop (the one key/value head of multi-query attention, whose head dimension attention
contracts) is ``copied`` instead: every device computes all of it, the other blocks stay split. Example:

>>> from torch import nn
>>> from xla_tp.dataflow.trace import trace
>>> graph = trace(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.LayerNorm(16)))
>>> for p in projections(graph):
...     r = explore(graph, p)
...     print(p.name, r.stop or [param.name for _, param, _ in r.rows.values()])
0.weight ['2.weight']
2.weight layer_norm normalises over the sharded dimension
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

from .contract import contraction
from .graph import Graph, Node, Value
from .ops import Step, step, trace_param
from .shapes import Factor, Features

ATTENTION_OPS = ("scaled_dot_product_attention", "multi_head_attention_forward")
PROJECTION_OPS = ("linear", "addmm", "mm", "matmul", "rmatmul", "einsum", "conv1d", "conv2d", "conv3d")


@dataclass(eq=False)
class Projection:
    """One contraction of an activation with a parameter: where its features and its weight's dims are."""

    node: Node
    weight: Value  # the parameter
    out_dims: tuple[int, ...]  # weight dims holding the output features, major -> minor
    in_dims: tuple[int, ...]  # weight dims contracted with the activation
    features: Features  # where the output features sit in node.outputs[0]
    bias: Optional[Value] = None  # a 1-D parameter added over the output features

    @property
    def name(self) -> str:
        return self.weight.name

    @property
    def size(self) -> int:
        return int(self.features.span)


def projections(graph: Graph) -> list[Projection]:
    """Every activation x parameter contraction, in call order."""
    found = []
    for node in graph.nodes:
        spec = contraction(node) if node.op in PROJECTION_OPS else None
        if spec is None or len(spec.operands) != 2:
            continue
        acts = [(v, l) for v, l in spec.operands if v.dynamic]
        weights = [(trace_param(v), l) for v, l in spec.operands if not v.dynamic]
        if len(acts) != 1 or len(weights) != 1 or weights[0][0] is None:
            continue
        (param, dims), labels = weights[0]
        kept = [(i, c) for i, c in enumerate(labels) if c in spec.output]
        if not kept:
            continue
        factors, stride = [], Fraction(1)
        for i, c in reversed(kept):
            factors.insert(0, Factor(spec.output.index(c), param.shape[dims[i]], stride))
            stride *= param.shape[dims[i]]
        bias = next((v for v, l in spec.extras if v.kind == "param" and len(v.shape) == 1), None)
        found.append(Projection(node, param, tuple(dims[i] for i, _ in kept),
                                tuple(dims[i] for i, c in enumerate(labels) if c not in spec.output),
                                Features(tuple(factors)), bias))
    return found


@dataclass
class Region:
    """Where one projection's sharded features go (see the module docstring)."""

    projection: Projection
    values: dict[int, Features] = field(default_factory=dict)  # Value.index -> its features
    rows: dict[int, tuple[Node, Value, int]] = field(default_factory=dict)  # node index -> (node, param, dim)
    stop: str = ""
    stop_node: Optional[Node] = None
    reaches_output: bool = False
    attention: set[int] = field(default_factory=set)  # attention nodes (by index) the features pass through
    granules: dict[int, Node] = field(default_factory=dict)  # sizes that must divide the axis (heads, blocks)
    windows: set[tuple[Fraction, Fraction]] = field(default_factory=set)  # blocks of a packed projection
    slicers: set[str] = field(default_factory=set)  # modules whose forward slices those blocks
    merges: set[str] = field(default_factory=set)  # modules where the features are merged with the batch
    ends: dict[int, str] = field(default_factory=dict)  # node index -> how a split loss reduces the features
    reductions: dict[int, Node] = field(default_factory=dict)  # statistics over all the split features
    row_windows: dict[int, tuple[Fraction, Fraction]] = field(default_factory=dict)  # row node -> block it reads
    copied: dict[tuple[Fraction, Fraction], str] = field(default_factory=dict)  # blocks every device copies, why
    granule_windows: dict[int, tuple[Fraction, Fraction]] = field(default_factory=dict)  # granule -> its block

    @property
    def ok(self) -> bool:
        return not self.stop


def is_attention(node: Node) -> bool:
    """SDPA, torch's MHA, or a contraction of two activations (q @ k^T, probs @ v)."""
    if node.op in ATTENTION_OPS:
        return True
    spec = contraction(node) if node.op in ("matmul", "rmatmul", "bmm", "baddbmm", "einsum") else None
    return spec is not None and sum(1 for v, _ in spec.operands if v.dynamic) >= 2


def explored(graph: Graph) -> list[Region]:
    """``explore`` of every projection of ``graph``, in call order: computed once per graph (the planner
    prices each mesh a launcher considers on the same trace), each call handed its own copies (a
    planner may set a copy's ``stop``)."""
    if "regions" not in graph.derived:
        graph.derived["regions"] = [explore(graph, p) for p in projections(graph)]
    return [dataclasses.replace(r) for r in graph.derived["regions"]]


def explore(graph: Graph, proj: Projection) -> Region:
    """Follow ``proj``'s output features until every path ends (see the module docstring)."""
    region = Region(proj)
    start = proj.node.outputs[0]
    region.values[start.index] = proj.features
    work = [(start.index, start)]  # in call order, so a stop names the first op that needs the whole dim
    outputs = {v.index for v in graph.outputs}
    whole = (proj.features.base, proj.features.span)
    while work:
        _, value = heapq.heappop(work)
        feats = region.values.get(value.index)
        if feats is None:  # in a block copied since it was queued
            continue
        window = (feats.base, feats.span)
        if window != whole:
            region.windows.add(window)
        if value.index in outputs:
            region.reaches_output = True
        for node, pos in value.consumers:
            if is_attention(node):
                region.attention.add(node.index)
            s = step(node, pos, feats)
            if s.reduces and window != whole:  # a statistic over one block of a packed output: not a partial sum
                s = Step(stop=f"reduces ({node.op}) over one block of a packed projection's split features")
            if s.stop and window != whole and _copy(region, window, s.stop, node):
                break  # a packed block that cannot stay split: every device gets a copy of it
            if s.stop:
                region.stop, region.stop_node = s.stop, node
                return region
            if s.row is not None:
                region.rows[node.index] = (node, *s.row)
                region.row_windows[node.index] = window
                continue
            if s.ends:
                region.ends.setdefault(node.index, s.ends)
                continue
            if s.reduces:
                region.reductions[node.index] = node
                continue
            for i, f in s.outputs:
                out = node.outputs[i]
                seen = region.values.get(out.index)
                if seen is None:
                    region.values[out.index] = f
                    if (f.base, f.span) != (feats.base, feats.span):
                        region.slicers.add(node.module)
                    if f.hard and not _split_per_block(out, f):
                        region.granules.setdefault(f.lead.size, node)
                        region.granule_windows.setdefault(f.lead.size, (f.base, f.span))
                    if any(x.outer > 1 for x in f.factors):
                        region.merges.add(node.module)
                    heapq.heappush(work, (out.index, out))
                elif seen.lead.dim != f.lead.dim:
                    why = "meets itself split along two different dimensions"
                    other = (seen.base, seen.span)  # the smaller block is copied (a key/value head, not the queries)
                    if other != whole and other[1] < window[1] and _copy(region, other, why, node):
                        region.values[out.index] = f
                        heapq.heappush(work, (out.index, out))
                        continue
                    if window != whole and _copy(region, window, why, node):
                        break
                    region.stop, region.stop_node = why, node
                    return region
    if region.reductions and not region.attention:  # a residual stream split by its hidden size: not this plan's
        node = next(iter(region.reductions.values()))
        region.stop, region.stop_node = f"reduces ({node.op}) over the sharded dimension", node
    return region


def _split_per_block(value: Value, feats: Features) -> bool:
    """Whether every consumer of ``value`` takes its leading factor apart one index at a time (ModernBERT's
    ``qkv.view(b, s, 3, heads, d).unbind(-3)``): then that factor is a packing of blocks, not a number of
    heads the axis must divide; each block's own heads are its granules."""
    block = feats.span / feats.lead.size
    steps = [step(node, pos, feats) for node, pos in value.consumers]
    return bool(steps) and all(not s.stop and s.row is None and s.outputs and all(f.span == block for _, f in s.outputs)
                               for s in steps)


def _copy(region: Region, window: tuple[Fraction, Fraction], why: str, node: Node) -> bool:
    """Take the block ``window`` (and everything derived from it) out of the split, to be copied to every
    device; False if it cannot be (a row projection already contracts part of it)."""
    base, span = window
    inside = lambda w: base <= w[0] and w[0] + w[1] <= base + span  # noqa: E731
    if any(inside(w) for w in region.row_windows.values()):
        return False
    region.copied.setdefault(window, f"{why} ({describe(node)})")
    for index in [i for i, f in region.values.items() if inside((f.base, f.span))]:
        del region.values[index]
    for size in [n for n, w in region.granule_windows.items() if inside(w)]:
        del region.granules[size], region.granule_windows[size]
    return True


def describe(node: Optional[Node]) -> str:
    """``"'view' in model.layers.0.self_attn"`` for explanations."""
    if node is None:
        return "?"
    return f"'{node.op}' in {node.module or '<root>'}"
