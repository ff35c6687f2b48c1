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
import itertools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Optional

from . import concats
from .view_groups import per_group, repeated
from .contract import contraction
from .graph import Copy, Graph, Node, Value
from .ops import Step, step, trace_param
from .partners import partners
from .repeats import rename
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
    granule_blocks: set[tuple[tuple[Fraction, Fraction], int]] = field(default_factory=set)  # (block, granule) each
    # blocks of a packed projection viewed as groups the model repeats for its heads (Mamba2's B and C): (block,
    # groups); a planner may copy each group to the devices whose heads read it where the axis does not divide them
    repeated: set[tuple[tuple[Fraction, Fraction], int]] = field(default_factory=set)
    # features viewed as groups only a statistic per group reads (Mamba2's gated norm over groups of heads):
    # groups -> the view; an axis they do not divide splits the groups too (one small all-reduce per statistic)
    statistics: dict[int, Node] = field(default_factory=dict)
    # parameters applied one entry per split feature (``partners``): param index -> (param, its dim, block)
    partners: dict[int, tuple[Value, int, tuple[Fraction, Fraction]]] = field(default_factory=dict)
    reduction_windows: dict[int, tuple[Fraction, Fraction]] = field(default_factory=dict)  # reduction -> block
    # concatenations along the split dimension (``indexing._piece``): their output's value index -> (the cat,
    # where the features sit in it: offset, size); each row projection reading one -> (offset, size, the cat)
    concats: dict[int, tuple[Node, int, int]] = field(default_factory=dict)
    row_blocks: dict[int, tuple[int, int, Node]] = field(default_factory=dict)
    # concatenations read channel by channel and split back into their pieces (``concats``): cat node index ->
    # the cat; the parameters applied one entry per channel of one (a depthwise kernel): param index ->
    # (param, its dim, the cat)
    laid: dict[int, Node] = field(default_factory=dict)
    laid_partners: dict[int, tuple[Value, int, Node]] = field(default_factory=dict)

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
        graph.derived["regions"] = _explore_all(graph)
    return [dataclasses.replace(r) for r in graph.derived["regions"]]


def _explore_all(graph: Graph) -> list[Region]:
    """``explore`` of every projection; in a block copied from another (``graph.copies``), the region of
    the same projection there, moved over (``_moved``), when neither leaves its block."""
    copies = {i: c for c in graph.copies for i in range(c.node0 + c.node_shift, c.node1 + c.node_shift)}
    found: dict[int, Region] = {}
    rests: Rests = {}
    for p in projections(graph):
        copy = copies.get(p.node.index)
        source = found.get(p.node.index - copy.node_shift) if copy is not None else None
        found[p.node.index] = (source is not None and _moved(graph, source, copy, p)) or explore(graph, p, rests)
    return list(found.values())


def _moved(graph: Graph, region: Region, copy: Copy, proj: Projection) -> Optional[Region]:
    """``region`` of a projection in ``copy.source`` as the region of its copy ``proj``: what ``explore``
    finds, when the features stay in the block (every op they reach, and every reader of them, is in it
    in both); None otherwise."""
    inside = lambda i: copy.node0 <= i < copy.node1  # noqa: E731
    nodes = [*region.rows, *region.attention, *region.ends, *region.reductions,
             *(n.index for n in (*region.granules.values(), *region.statistics.values())),
             *([region.stop_node.index] if region.stop_node else [])]
    if region.copied or region.reaches_output or not all(inside(i) for i in nodes):
        return None
    outputs = {v.index for v in graph.outputs}
    for index in region.values:
        was, now = graph.values[index], graph.values[index + copy.value_shift]
        if (was.producer is None or not inside(was.producer.index) or now.index in outputs
                or len(was.consumers) != len(now.consumers) or not all(inside(n.index) for n, _ in was.consumers)
                or not all(copy.holds(n.index) for n, _ in now.consumers)):
            return None
    node = lambda n: graph.nodes[n.index + copy.node_shift]  # noqa: E731
    partners_of, laid_partners = {}, {}
    for found, (param, dim, at) in [*((partners_of, p) for p in region.partners.values()),
                                    *((laid_partners, (p, d, node(cat))) for p, d, cat in region.laid_partners.values())]:
        other = graph.params.get(rename(param.name, copy.source, copy.target))
        if other is None:
            return None
        found[other.index] = (other, dim, at)
    moved = lambda d: {i + copy.node_shift: v for i, v in d.items()}  # noqa: E731
    rows = {}
    for i, (row, param, dim) in region.rows.items():
        pos = next(k for k, v in enumerate(row.tensors) if v is param)
        rows[i + copy.node_shift] = (node(row), node(row).tensors[pos], dim)
    return dataclasses.replace(
        region, projection=proj, values={i + copy.value_shift: f for i, f in region.values.items()}, rows=rows,
        stop_node=node(region.stop_node) if region.stop_node else None,
        attention={i + copy.node_shift for i in region.attention},
        granules={size: node(n) for size, n in region.granules.items()}, windows=set(region.windows),
        statistics={size: node(n) for size, n in region.statistics.items()},
        slicers={rename(m, copy.source, copy.target) for m in region.slicers},
        merges={rename(m, copy.source, copy.target) for m in region.merges}, ends=moved(region.ends),
        reductions={i + copy.node_shift: node(n) for i, n in region.reductions.items()},
        row_windows=moved(region.row_windows), copied={}, granule_windows=dict(region.granule_windows),
        partners=partners_of, reduction_windows=moved(region.reduction_windows),
        concats={i + copy.value_shift: (node(n), *at) for i, (n, *at) in region.concats.items()},
        row_blocks={i + copy.node_shift: (*at, node(n)) for i, (*at, n) in region.row_blocks.items()},
        laid={i + copy.node_shift: node(n) for i, n in region.laid.items()}, laid_partners=laid_partners)


_ASSIGNED = ("values", "rows", "row_windows", "reductions", "reduction_windows", "concats", "row_blocks", "laid",
             "laid_partners")  # a dict entry set again takes
# the new item
_FIRST = ("ends", "granules", "granule_windows", "partners", "statistics")  # a dict entry set again keeps the first item
_MEMBERS = ("windows", "attention", "slicers", "merges", "granule_blocks", "repeated")  # a set's members


class _Log:
    """Every change a walk made to its region, per field of ``Region`` in order (``reaches_output``: one
    entry per output reached; ``stop``: the stop that ended it), then the log whose rest it did again."""

    def __init__(self) -> None:
        self.fields: dict[str, list] = {n: [] for n in (*_ASSIGNED, *_FIRST, *_MEMBERS, "reaches_output", "stop")}
        self.then: Optional[tuple["_Log", dict[str, int]]] = None

    def at(self) -> dict[str, int]:
        """Where the log is now."""
        return {n: len(entries) for n, entries in self.fields.items()}

    def change(self, region: "Region", name: str, key: Any, item: Any = None) -> None:
        """Log one change and make it in ``region``."""
        self.fields[name].append((key, item))
        _apply(region, name, [(key, item)])

    def redo(self, region: "Region", at: dict[str, int]) -> None:
        """The changes from ``at`` on (and those of the logs it continues into) made in ``region``."""
        log: Optional[_Log] = self
        while log is not None:
            for name, entries in log.fields.items():
                if len(entries) > at[name]:
                    _apply(region, name, itertools.islice(entries, at[name], None))
            log, at = log.then if log.then is not None else (None, at)


def _apply(region: "Region", name: str, entries: Any) -> None:
    if name == "stop":
        region.stop, region.stop_node = next(iter(entries))
    elif name == "reaches_output":
        region.reaches_output = True
    elif name in _MEMBERS:
        getattr(region, name).update(key for key, _ in entries)
    elif name in _FIRST:
        target = getattr(region, name)
        for key, item in entries:
            target.setdefault(key, item)
    else:
        getattr(region, name).update(entries)


# (value index, features, whole window) -> (a walk's log, where the rest after that value starts)
Rests = dict[tuple, tuple[_Log, dict[str, int]]]


def explore(graph: Graph, proj: Projection, rests: Optional[Rests] = None) -> Region:
    """Follow ``proj``'s output features until every path ends (see the module docstring).

    ``rests``: what earlier walks of the same graph did after a value they reached alone (nothing else
    queued), kept by this walk too. A walk that reaches that value alone, with the same features and
    whole window, does it again from the record instead of stepping each op (the rest of an 80-layer
    residual stream is walked once, not once per projection). Every change a walk makes to its region
    is logged (``_Log``). The rest after such a value depends on nothing before it: the values it
    reaches come later in the call order than everything walked before, and a record with a block
    copied (``_copy``: it takes values walked before out of the split) is not kept."""
    region = Region(proj)
    start = proj.node.outputs[0]
    region.values[start.index] = proj.features
    work = [(start.index, start)]  # in call order, so a stop names the first op that needs the whole dim
    outputs = {v.index for v in graph.outputs}
    whole = (proj.features.base, proj.features.span)
    log = _Log()
    marks: list[tuple[tuple, dict[str, int]]] = []  # values reached alone: (their key in rests, where the log was)
    statistic: set[int] = set()  # values read per group for a statistic (``groups.per_group``)

    def change(name: str, key: Any, item: Any = None) -> None:
        log.change(region, name, key, item)

    def stopped(why: str, node: Node) -> Region:
        change("stop", why, node)
        return _kept(rests, marks, log, region)

    def copied(window: tuple[Fraction, Fraction], why: str, node: Node) -> bool:
        done = _copy(region, window, why, node)
        if done:  # what follows depends on the values it took out: no record of a rest before here
            marks.clear()
        return done

    while work:
        _, value = heapq.heappop(work)
        feats = region.values.get(value.index)
        if feats is None:  # in a block copied since it was queued
            continue
        window = (feats.base, feats.span)
        if rests is not None and not work and window == whole:
            key = (value.index, feats, whole)
            if key in rests:
                log.then = rests[key]
                log.then[0].redo(region, log.then[1])
                if region.stop:
                    return _kept(rests, marks, log, region)
                break
            marks.append((key, log.at()))
        if window != whole:
            change("windows", window)
        concat = region.concats.get(value.index)
        if value.index in outputs:
            if concat is not None:
                return stopped("concatenates along the sharded dimension into an output of the model", concat[0])
            change("reaches_output", True)
        for node, pos in value.consumers:
            if is_attention(node):
                change("attention", node.index)
            s = step(node, pos, feats)
            carried = None  # the concatenation the outputs still hold, laid device-major
            if concat is not None and s.row is None and not s.stop:
                s, carried = _laid_step(region, node, pos, feats, s, concat[0])
                if carried is not None:
                    for param, dim in partners(node, pos, feats):
                        change("laid_partners", param.index, (param, dim, carried))
                elif not s.stop:
                    change("laid", concat[0].index, concat[0])
            if s.reduces and window != whole and not region.attention:  # a statistic over one block of a packed
                # output with no heads between (a norm of one block of a residual stream's width): not a partial sum
                s = Step(stop=f"reduces ({node.op}) over one block of a packed projection's split features")
            if s.stop and window != whole and copied(window, s.stop, node):
                break  # a packed block that cannot stay split: every device gets a copy of it
            if s.stop:
                return stopped(s.stop, node)
            if s.row is not None:
                change("rows", node.index, (node, *s.row))
                change("row_windows", node.index, window)
                if concat is not None:
                    change("row_blocks", node.index, (*concat[1:], concat[0]))
                continue
            if s.ends:
                change("ends", node.index, s.ends)
                continue
            if s.reduces:
                change("reductions", node.index, node)
                change("reduction_windows", node.index, window)
                continue
            for param, dim in partners(node, pos, feats) if carried is None else ():
                change("partners", param.index, (param, dim, window))
            for i, f in s.outputs:
                out = node.outputs[i]
                seen = region.values.get(out.index)
                if seen is None:
                    change("values", out.index, f)
                    if s.concat is not None:
                        change("concats", out.index, (node, *s.concat))
                    elif carried is not None:
                        change("concats", out.index, concat)
                    if (f.base, f.span) != (feats.base, feats.span):
                        change("slicers", node.module)
                    hard = f.hard and out.index not in statistic and not _split_per_block(out, f)
                    span = per_group(out) if hard else None
                    if span:
                        change("statistics", f.lead.size, node)
                        statistic |= span
                    elif hard:
                        change("granules", f.lead.size, node)
                        change("granule_windows", f.lead.size, (f.base, f.span))
                        change("granule_blocks", ((f.base, f.span), f.lead.size))
                        if (f.base, f.span) != whole and repeated(out, f.lead.dim):
                            change("repeated", ((f.base, f.span), f.lead.size))
                    if any(x.outer > 1 for x in f.factors):
                        change("merges", node.module)
                    heapq.heappush(work, (out.index, out))
                elif seen.lead.dim != f.lead.dim:
                    why = "meets itself split along two different dimensions"
                    other = (seen.base, seen.span)  # the smaller block is copied (a key/value head, not the queries)
                    if other != whole and other[1] < window[1] and copied(other, why, node):
                        change("values", out.index, f)
                        heapq.heappush(work, (out.index, out))
                        continue
                    if window != whole and copied(window, why, node):
                        break
                    return stopped(why, node)
    _kept(rests, marks, log, region)
    if region.reductions and not region.attention:  # a residual stream split by its hidden size: not this plan's
        node = next(iter(region.reductions.values()))
        region.stop, region.stop_node = f"reduces ({node.op}) over the sharded dimension", node
    return region


def _laid_step(region: Region, node: Node, pos: int, feats: Features, s: Step,
               cat: Node) -> tuple[Step, Optional[Node]]:
    """``s`` for a concatenation along the split features read by another op than a row projection: the op
    keeps it laid device-major (``concats.channelwise``: ``s`` and the cat the outputs still hold), or splits
    it back into its pieces (their own features, found on the cat's inputs), or stops."""
    if concats.channelwise(node, pos, feats.lead.dim):  # the channels hold every piece: one factor over them
        outs = [(i, Features((Factor(f.lead.dim, n, feats.span / n),), feats.base))
                for i, f in s.outputs for n in [node.outputs[i].shape[f.lead.dim]]]
        return Step(outs), cat
    got = concats.pieces(node, feats.lead.dim, cat)
    if got is not None:
        outs = []
        for i, j in got:
            piece = cat.arg(0, "tensors")[j]
            f = region.values.get(piece.index)
            if f is None or piece.shape != node.outputs[i].shape:
                return Step(stop=f"concatenates along the sharded dimension ({describe(cat)}) features no split "
                                 f"block computes, split back by {describe(node)}"), None
            outs.append((i, f))
        return Step(outs), None
    return Step(stop=f"concatenates along the sharded dimension ({describe(cat)}), which only a row projection "
                     f"or ops on each channel alone, split back into its pieces, may read, for another op"), None


def _kept(rests: Optional[Rests], marks: list[tuple[tuple, dict[str, int]]], log: _Log, region: Region) -> Region:
    """``region``, its walk done: the rest after each value it reached alone kept in ``rests``."""
    if rests is not None:
        for key, at in marks:
            rests.setdefault(key, (log, at))
    return region


def _split_per_block(value: Value, feats: Features) -> bool:
    """Whether every consumer of ``value`` takes a part of its leading factor (ModernBERT's
    ``qkv.view(b, s, 3, heads, d).unbind(-3)``, Falcon's multi-query ``qkv.view(b, s, heads + 2, d)[..., :-2, :]``
    and ``[..., [-2], :]``), after moving it if need be (Qwen2-VL's tower's
    ``.reshape(s, 3, heads, d).permute(1, 0, 2, 3).unbind(0)``): then that factor is a packing of blocks,
    not a number of heads the axis must divide; each block's own heads are its granules."""
    def apart(node: Node, pos: int) -> bool:
        s = step(node, pos, feats)
        if s.stop or s.row is not None or not s.outputs:
            return False
        return all(f.span < feats.span or f.lead.size == feats.lead.size and f.span == feats.span and
                   _split_per_block(node.outputs[i], f) for i, f in s.outputs)
    return bool(value.consumers) and all(apart(node, pos) for node, pos in value.consumers)


def _copy(region: Region, window: tuple[Fraction, Fraction], why: str, node: Node) -> bool:
    """Take the block ``window`` (and everything derived from it) out of the split, to be copied to every
    device; False if it cannot be (a row projection already contracts part of it). A half of a block sliced
    off the packed output (the halves of Falcon's key head that rotary embeddings take) copies that whole
    block; a block that is a smaller part of the one it was sliced with (Mamba2's B of ``[x | B | C]``) is
    copied alone."""
    whole = (region.projection.features.base, region.projection.features.span)
    outer = min((w for w in region.windows if w not in (whole, window) and within(window, w)), key=lambda w: w[1],
                default=window)
    window = outer if outer[1] <= 2 * window[1] else window
    inside = lambda w: within(w, window)  # noqa: E731
    if any(inside(w) for w in region.row_windows.values()):
        return False
    region.copied.setdefault(window, f"{why} ({describe(node)})")
    region.windows -= {w for w in region.windows if w != window and inside(w)}
    for index in [i for i, f in region.values.items() if inside((f.base, f.span))]:
        del region.values[index]
    for size in [n for n, w in region.granule_windows.items() if inside(w)]:
        del region.granules[size], region.granule_windows[size]
    region.granule_blocks = {(w, n) for w, n in region.granule_blocks if not inside(w)}
    for index in [i for i, (_, _, w) in region.partners.items() if inside(w)]:
        del region.partners[index]
    for index in [i for i, w in region.reduction_windows.items() if inside(w)]:
        del region.reductions[index], region.reduction_windows[index]
    return True


def within(w: tuple[Fraction, Fraction], outer: tuple[Fraction, Fraction]) -> bool:
    return outer[0] <= w[0] and w[0] + w[1] <= outer[0] + outer[1]


def describe(node: Optional[Node]) -> str:
    """``"'view' in model.layers.0.self_attn"`` for explanations."""
    if node is None:
        return "?"
    return f"'{node.op}' in {node.module or '<root>'}"
