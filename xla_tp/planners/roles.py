"""Roles from dataflow: which parameter is column-parallel, row-parallel, vocab-parallel or replicated.

From a traced forward (``xla_tp.dataflow``), for a model axis of ``tp`` devices:

1. Every projection's region is explored (``regions.explore``). Regions that reach the same
   tensor split the same way are one group (q, k and v meet in attention; gate and up meet in
   their product). Groups are taken in call order; a projection belongs to the first that takes it.
2. A group is column -> row if its regions end in row projections and nothing needs the whole
   feature dimension. Sizes the split must respect (heads, packed blocks) must divide ``tp``; a
   block where they do not (key/value heads fewer than ``tp``, 28 heads on 8 devices) takes the
   cheapest valid alternative (``alternatives``: some members whole, a sub-axis, an uneven split,
   the block whole). Packed projections whose consumers slice them into blocks (``qkv[..., :E]``)
   are re-laid so each device holds its part of every block.
3. A projection whose features only reach the model's output is an output head (vocab-parallel);
   an embedding looked up with the model's input ids is vocab-parallel; torch's MultiheadAttention
   is its own group. A square projection left whole by a stop (Gemma 3n's AltUp projections, hidden -> hidden)
   is row-parallel alone: split over its input features, its whole input sliced on each device, its output
   all-reduced (its input's gradient all-gathered in the backward). Everything else is replicated, with the
   reason.
4. Attention that no group splits is computed whole, listed with what stopped it (``whole_attention``).

Module names are never read: they only label explanations. Example:

>>> from torch import nn
>>> from xla_tp.dataflow.trace import trace
>>> roles = decide(trace(nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))), tp=4)
>>> {name: (role.kind.value, role.axes) for name, role in roles.params.items()}
... # doctest: +NORMALIZE_WHITESPACE
{'1.weight': ('column', ('mlp', 'embed')), '1.bias': ('column', ('mlp',)), '3.weight': ('row', ('embed', 'mlp')),
 '3.bias': ('replicated', (None,)), '0.weight': ('vocab', ('vocab', 'embed'))}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from enum import Enum
from typing import Mapping, Optional, Sequence

from ..dataflow.concats import offsets
from ..dataflow.graph import Graph, Node, Value
from ..dataflow.patches import patches
from ..dataflow.regions import Projection, Region, describe, explored, within
from ..plan.packing import Packing
from ..plan.subaxis import sub_axis
from .alternatives import Block, Choice, Pick, blocks_of, choose
from .prices import Price
from .reasons import stop_reason, whole_attention

Axes = tuple[Optional[str], ...]


class Role(str, Enum):
    """What a parameter does in the dataflow, hence how it is split (a ``str``: ``Role.ROW == "row"``)."""

    COLUMN = "column"  # its output features are split: they feed attention heads or an MLP's chain
    ROW = "row"  # it contracts split features back into the residual stream: one all-reduce
    VOCAB = "vocab"  # an embedding looked up with the input ids: rows split
    HEAD = "head"  # an output head: vocab rows split, logits stay split
    EXPERTS = "experts"  # a routed experts weight ``[E, ...]``: split by experts or by their features
    REPLICATED = "replicated"

    @property
    def text(self) -> str:
        """``Role.HEAD.text == "vocab-parallel output head"``."""
        return {"column": "column-parallel", "row": "row-parallel", "vocab": "vocab-parallel embedding",
                "head": "vocab-parallel output head", "experts": "routed experts",
                "replicated": "replicated"}[self.value]


@dataclass
class ParamRole:
    """One parameter's decision: its ``Role`` and logical axes, and why."""

    kind: Role
    axes: Axes
    why: str
    natural: str = ""  # "shard" (column/head), "partial" (row/vocab embedding), "whole input" (a row alone: partial,
    # its input held whole) or "rows" (stacked experts split by
    # experts: their rows of [E * tokens, ...]): the module's own output
    packing: Optional[Packing] = None

    def __post_init__(self) -> None:
        self.kind = Role(self.kind)


@dataclass
class Roles:
    """Every parameter's role by (first) FQN, plus the facts behind them (for explanations)."""

    params: dict[str, ParamRole] = field(default_factory=dict)
    groups: list[list[str]] = field(default_factory=list)  # column members of each split group
    blocks: list[frozenset[str]] = field(default_factory=list)  # every weight of a block the planner decided
    # together (projections meeting in one tensor and the rows contracting them), split or whole
    choices: list[Choice] = field(default_factory=list)  # blocks off the optimum: their priced alternatives
    prices: list[tuple[str, Price]] = field(default_factory=list)  # each block (its projections) and its price
    whole_attention: list[str] = field(default_factory=list)  # attention no block splits, and why
    sites: set[str] = field(default_factory=set)  # modules that slice a packed projection's blocks or merge
    # heads with the batch
    concats: dict[tuple[int, ...], int] = field(default_factory=dict)  # the sizes of concatenations along split
    # features laid device-major (the row reading one is re-laid, or ops on each channel alone) -> over how many devices
    tagged_concats: set[tuple[int, ...]] = field(default_factory=set)  # those read channel by channel and split
    # back into their pieces (``dataflow.concats``): tagged as a re-laid output
    natural: dict[str, str] = field(default_factory=dict)  # module FQN -> what its own output is (a tied
    # weight is an embedding in one module and an output head in another)

    def copy(self) -> "Roles":
        """A copy with containers of its own (planners set entries; a ``ParamRole`` is never changed)."""
        return Roles(params=dict(self.params), groups=[list(g) for g in self.groups], blocks=list(self.blocks),
                     choices=list(self.choices), prices=list(self.prices), whole_attention=list(self.whole_attention),
                     sites=set(self.sites), natural=dict(self.natural), concats=dict(self.concats),
                     tagged_concats=set(self.tagged_concats))

    def set(self, weight: Value, role: ParamRole, module: Optional[str] = None) -> None:
        if module is not None and role.natural:
            self.natural[module] = role.natural
        old = self.params.get(weight.name)
        if old is not None and old.kind != "replicated" and (old.axes, old.packing) != (role.axes, role.packing):
            self.params[weight.name] = ParamRole("replicated", (None,) * len(weight.shape),
                                                 f"used as {old.kind} and as {role.kind}: the uses disagree")
            return
        if old is not None and old.kind != "replicated" and old.kind != role.kind:  # a tied weight, same split
            role = ParamRole(old.kind, old.axes, f"{old.why}; tied, also the {role.why}", old.natural, old.packing)
        self.params[weight.name] = role


def decide(graph: Graph, tp: int, padding: str = "", pick: Optional[Pick] = None, copies: bool = True,
           routed: frozenset[int] = frozenset(), sizes: Optional[Mapping[str, int]] = None) -> Roles:
    """See the module docstring. ``sizes``: the mesh's axis sizes, for the blocks' prices (``Roles.prices``:
    a context axis splits their tokens and gathers keys and values); ``padding``: why no block may add zero
    heads (``alternatives``);
    ``pick``: which alternative a block off the optimum takes (default: the cheapest); ``copies``: whether
    a packed block may be copied to every device (``Region.copied``; not for a model on meta); ``routed``:
    nodes that multiply tokens by routed expert weights (not attention: ``planners.experts``)."""
    roles = Roles()
    regions = explored(graph)
    for r in regions:
        if r.copied and not copies:  # a model on meta: its own init would make the copies differ
            r.stop = f"a block of it ({next(iter(r.copied.values()))}) would be copied to every device, which " \
                     f"its own init on meta would make differ"
        elif counted := _counts_copies(r):  # a statistic over the split features would count the copies
            r.stop = f"a block of it ({next(iter(r.copied.values()))}) would be copied to every device, and " \
                     f"{describe(counted)} reduces all its features"
    taken: dict[int, str] = {}  # projection node index -> role kind
    reasons: dict[int, str] = {}  # projection node index -> why it is not split
    covered: set[int] = set(routed)
    for group in _groups(regions):
        _apply_group(graph, group, tp, roles, taken, reasons, covered, padding, pick, sizes)
    _mha(graph, tp, roles, covered)
    vocab = _embeddings(graph, roles)
    for region in regions:
        node = region.projection.node
        if node.index in taken:
            continue
        if _is_head(region, vocab, tp):
            loss = next(iter(region.ends.values()), "")
            _set_column(roles, region.projection, "head", "vocab", "output head: vocab-parallel, " + (
                f"the loss in the forward reduces its logits split ({loss}, as Megatron's vocab-parallel "
                f"cross-entropy)" if loss else "its features only reach the model's output (logits stay split, "
                "ready for a loss-parallel cross-entropy)"))
            taken[node.index] = "head"
        elif patches(region.projection):
            _set_patches(roles, region.projection, tp)
            taken[node.index] = "row"
        elif region.stop and node.index not in reasons and _square(region.projection, tp):
            _set_alone(roles, region)
            taken[node.index] = "row"
        else:
            why = reasons.get(node.index) or stop_reason(region)
            roles.set(region.projection.weight, _replicated(region.projection.weight, why))
            if region.projection.bias is not None:
                roles.set(region.projection.bias, _replicated(region.projection.bias, why))
    _whole_blocks(roles)
    roles.whole_attention = whole_attention(graph, regions, covered, reasons)
    return roles


def _whole_blocks(roles: Roles) -> None:
    """Every weight of a block one of whose weights stays replicated because its uses disagree (Gemma 3n's
    ``altup.modality_router``, split before ``prediction_coefs`` in one use, whole in another) replicated too:
    a row projection contracting a replicated input would only pad it and all-reduce what each device has."""
    for block in roles.blocks:
        whole = next((n for n in sorted(block) if roles.params[n].why.endswith("the uses disagree")), None)
        if whole is None:
            continue
        for name in block - {whole}:
            role = roles.params[name]
            if role.kind != "replicated":
                roles.params[name] = ParamRole("replicated", (None,) * len(role.axes),
                                               f"in one block with {whole}, whose uses disagree: computed whole")
        roles.groups = [g for g in roles.groups if not set(g) & block]


def _replicated(v: Value, why: str) -> ParamRole:
    return ParamRole("replicated", (None,) * len(v.shape), why)


def _groups(regions: list[Region]) -> list[list[Region]]:
    """Split-ready regions that meet (same tensor, same split dim) are one group; in call order."""
    parent = list(range(len(regions)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[tuple[int, int], int] = {}
    for i, r in enumerate(regions):
        if not r.ok or not r.rows:
            continue
        for index, feats in r.values.items():
            j = owner.setdefault((index, feats.lead.dim), i)
            parent[find(i)] = find(j)
    groups: dict[int, list[Region]] = {}
    for i, r in enumerate(regions):
        if r.ok and r.rows:
            groups.setdefault(find(i), []).append(r)
    return sorted(groups.values(), key=lambda g: g[0].projection.node.index)


def _apply_group(graph: Graph, group: list[Region], tp: int, roles: Roles, taken: dict[int, str],
                 reasons: dict[int, str], covered: set[int], padding: str, pick: Optional[Pick],
                 sizes: Optional[Mapping[str, int]]) -> None:
    members = [r for r in group if r.projection.node.index not in taken]
    rows = {i: row for r in members for i, row in r.rows.items()}
    if not members or any(i in taken for i in rows):
        for r in members:
            reasons.setdefault(r.projection.node.index, "its partner projection is already split by another group")
        return
    roles.blocks.append(frozenset([*(r.projection.weight.name for r in members), *(p.name for _, p, _ in rows.values())]))
    ways, split_regions, relaid, pad, chosen = tp, members, True, (0, 0), ""
    problems = [why for r in members if (why := _problem(r, tp))]
    concats = _concatenations(members, rows, tp)
    if isinstance(concats, str) or concats and problems:  # no alternative lays a concatenation out
        _whole(roles, members, rows, taken, reasons, covered, concats if isinstance(concats, str) else problems[0])
        return
    label = ", ".join(r.projection.name.rpartition(".")[0] for r in members)
    if problems:  # off the optimum: the cheapest valid alternative (alternatives.py)
        choice = choose(graph, members, rows, tp, _problem, problems[0], padding, sizes)
        if pick is not None:
            choice.picked = choice.alternatives.index(pick(choice))
        roles.choices.append(choice)
        alt = choice.chosen
        ways, split_regions, relaid, pad = alt.ways, list(alt.split), alt.relaid, alt.padded
        chosen = f" ({'cheapest' if choice.picked == 0 else 'picked'} of {len(choice.alternatives)} ways to split " \
                 f"this block: {alt.name})"
        roles.prices.append((label, alt.price))
    else:
        roles.prices.append((label, Block(graph, members, rows, tp, sizes).price(tp, tuple(members))))
    dropped = [r for r in members if r not in split_regions]
    for r in dropped:
        _replicate(roles, r, (_problem(r, tp) or "the block is computed whole") + chosen, taken, reasons)
    if not split_regions:
        _whole(roles, [], rows, taken, reasons, covered, chosen, members)
        return
    attention = any(r.attention for r in split_regions)
    logical = "heads" if attention else "mlp"
    logical = logical if ways == tp else sub_axis(logical, ways)
    for r in split_regions:
        p = r.projection
        what = f"{_granule_text(r, ways)}" if r.granules else f"{p.size} features"
        packing = _padding(p.out_dims[0], blocks_of(r), ways, pad) if pad[0] else _packing(r, ways) if relaid else None
        _set_column(roles, p, "column", logical, f"column-parallel: {what} split {ways} ways, read by "
                    f"{_row_names(rows)}{chosen}{_statistics(r, ways)}", packing=packing)
        taken[p.node.index] = "column"
        covered |= r.attention
        if r.windows and relaid:
            roles.sites |= r.slicers
        if not pad[0]:
            _set_partners(roles, r, packing, ways, logical)
            _set_laid(roles, r, ways, logical)
        roles.sites |= r.merges  # heads merged with the batch: kept 4-D there (lowering.bmm)
    for index, (node, param, dim) in rows.items():
        axes = ["embed"] * len(param.shape)
        axes[dim] = logical
        cols = ", ".join(r.projection.name.rpartition(".")[0] for r in split_regions)
        packing = _padding(dim, ((0, param.shape[dim]),), ways, pad) if pad[0] else None
        laid = ""
        if index in concats:
            packing, cat = Packing(dim, concats[index][0], ways), concats[index][1]
            roles.concats[tuple(n for _, n in packing.blocks)] = ways
            roles.sites.add(cat.module)
            laid = f" (its input, concatenated along the split features by {describe(cat)}, is laid device-major " \
                   f"as each device's parts side by side, blocks {[n for _, n in packing.blocks]}: its input " \
                   f"columns re-laid the same way)"
        roles.set(param, ParamRole("row", tuple(axes), f"row-parallel: contracts the split features of {cols}{laid}; "
                                   f"one all-reduce of its output", "partial", packing), node.module)
        bias = _row_bias(node, param)
        if bias is not None:
            roles.set(bias, _replicated(bias, "bias of a row-parallel projection: added once, after the reduction"))
        taken[index] = "row"
    roles.groups.append([r.projection.name for r in split_regions])


def _replicate(roles: Roles, r: Region, why: str, taken: dict[int, str], reasons: dict[int, str]) -> None:
    reasons[r.projection.node.index] = why
    roles.set(r.projection.weight, _replicated(r.projection.weight, why))
    if r.projection.bias is not None:
        roles.set(r.projection.bias, _replicated(r.projection.bias, why))
    taken[r.projection.node.index] = "replicated"


def _whole(roles: Roles, dropped: list[Region], rows: dict[int, tuple[Node, Value, int]], taken: dict[int, str],
           reasons: dict[int, str], covered: set[int], why: str, members: Sequence[Region] = ()) -> None:
    """A block computed whole: ``dropped`` replicated for ``why``, the rows contracting it too, the attention
    of ``members`` left whole by choice."""
    for r in dropped:
        _replicate(roles, r, why, taken, reasons)
    covered |= {i for r in members for i in r.attention}
    for index, (_, param, _) in rows.items():
        roles.set(param, _replicated(param, f"contracts a block computed whole{why if not dropped else ''}"))
        taken[index] = "replicated"


def _concatenations(members: list[Region], rows: dict[int, tuple[Node, Value, int]],
                    tp: int) -> "dict[int, tuple[tuple[tuple[int, int], ...], Node]] | str":
    """The rows of a block that read a concatenation of its split features (``Region.row_blocks``): row node
    index -> (the blocks of its input, the cat), when they tile the row's input and ``tp`` divides each; why
    not otherwise."""
    found: dict[int, tuple[set[tuple[int, int]], Node]] = {}
    for r in members:
        for index, (offset, size, cat) in r.row_blocks.items():
            found.setdefault(index, (set(), cat))[0].add((offset, size))
    out = {}
    for index, (blocks, cat) in found.items():
        node, param, dim = rows[index]
        ordered = tuple(sorted(blocks))
        ends = [0, *(start + n for start, n in ordered)]
        if [start for start, _ in ordered] != ends[:-1] or ends[-1] != param.shape[dim]:
            return f"concatenates along the sharded dimension ({describe(cat)}) with features no split block " \
                   f"computes"
        if any(n % tp for _, n in ordered):
            return f"concatenates along the sharded dimension ({describe(cat)}) blocks of " \
                   f"{[n for _, n in ordered]}, which {tp} devices do not all divide"
        out[index] = (ordered, cat)
    return out


def _statistics(r: Region, tp: int) -> str:
    """What the statistics over ``r``'s split features cost (a gated norm's variance over all its heads, or over
    groups of heads that ``tp`` devices split further)."""
    groups = sorted(s for s in r.statistics if s % tp)
    shared = f"; {describe(r.statistics[groups[0]])} views them as {groups[0]} groups, which {tp} devices do not " \
             f"divide: each group split over {tp // groups[0]} devices, its statistic summed over them (one small " \
             f"all-reduce per token)" if groups else ""
    if not r.reductions:
        return shared
    nodes = ", ".join(describe(n) for n in list(r.reductions.values())[:2])
    return f"; {nodes} reduces over its split features: one small all-reduce of the statistic per token{shared}"


def _counts_copies(r: Region) -> Optional[Node]:
    """A reduction over features of ``r`` that copied blocks would be counted in (its block holds one)."""
    def overlaps(a: tuple[Fraction, Fraction], b: tuple[Fraction, Fraction]) -> bool:
        return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]

    return next((r.reductions[i] for i, w in r.reduction_windows.items() if any(overlaps(w, c) for c in r.copied)),
                None)


def _set_partners(roles: Roles, r: Region, packing: Optional[Packing], ways: int, logical: str) -> None:
    """The parameters applied one entry per split feature of ``r`` (``Region.partners``), split with them: laid
    like the blocks they meet when those are several blocks of a re-laid projection (a convolution over
    ``[x | B | C]``, its copied blocks copied too); left whole when the features they meet are not split
    evenly in their order (a block of a packed projection that is not re-laid)."""
    name = r.projection.name.rpartition(".")[0]
    whole = (Fraction(0), Fraction(r.projection.size))
    for param, dim, (base, span) in r.partners.values():
        inside = [(i, (start, n)) for i, (start, n) in enumerate(packing.blocks) if base <= start < base + span] \
            if packing is not None else []
        if packing is None and (base, span) != whole:
            continue
        axes: list[Optional[str]] = [None] * len(param.shape)
        axes[dim] = logical
        laid = None
        if len(inside) > 1:
            laid = Packing(dim, tuple((int(start - base), n) for _, (start, n) in inside), ways,
                           whole=frozenset(k for k, (i, _) in enumerate(inside) if i in packing.whole),
                           groups=tuple(packing.groups_of(i) for i, _ in inside) if packing.groups else ())
        copies = " (its copied blocks' entries copied too)" if laid is not None and laid.whole else ""
        roles.set(param, ParamRole("column", tuple(axes), f"split with the features of {name} it is applied to, "
                                   f"one entry per feature or head{copies}", "", laid))


def _set_laid(roles: Roles, r: Region, ways: int, logical: str) -> None:
    """The concatenations of ``r``'s features read channel by channel (``Region.laid``), laid device-major over
    ``ways`` devices, and the kernels applied one entry per channel of one, re-laid the same way."""
    for cat in r.laid.values():
        sizes = tuple(n for _, n in offsets(cat))
        roles.concats[sizes] = ways
        roles.tagged_concats.add(sizes)
        roles.sites.add(cat.module)
    for param, dim, cat in r.laid_partners.values():
        axes: list[Optional[str]] = [None] * len(param.shape)
        axes[dim] = logical
        blocks = tuple(offsets(cat))
        roles.set(param, ParamRole("column", tuple(axes), f"split with the channels of {describe(cat)} it is applied "
                                   f"to, one entry per channel, re-laid device-major like them (blocks "
                                   f"{[n for _, n in blocks]})", "", Packing(dim, blocks, ways)))


def _laid_problem(r: Region, tp: int) -> str:
    bad = next((cat for cat in r.laid.values() if any(n % tp for _, n in offsets(cat))), None)
    if bad is None:
        return ""
    return f"concatenates along the split features ({describe(bad)}) blocks of {[n for _, n in offsets(bad)]}, " \
           f"which {tp} devices do not all divide"


def _padding(dim: int, blocks: tuple[tuple[int, int], ...], tp: int, pad: tuple[int, int]) -> Packing:
    """Each block of ``pad[0]`` heads grown to ``pad[1]`` heads with zero heads, laid device-major."""
    heads, padded = pad
    return Packing(dim, blocks, tp, tuple(n // heads * padded for _, n in blocks))


def _problem(r: Region, ways: int) -> str:
    """Why ``r`` cannot split ``ways`` ways as the optimum does ("" if it can)."""
    return _granule_problem(r, ways) or _packing_problem(r, ways) or _laid_problem(r, ways)


def _row_names(rows: dict[int, tuple[Node, Value, int]]) -> str:
    return ", ".join(sorted({param.name.rpartition(".")[0] for _, param, _ in rows.values()}))


def _row_bias(node: Node, weight: Value) -> Optional[Value]:
    return next((v for v in node.tensors if v.kind == "param" and v is not weight and len(v.shape) == 1), None)


def _granule_text(r: Region, tp: int) -> str:
    unit = "heads" if r.attention else "blocks"
    blocks = _blocks(r)
    copied = f"; blocks {[int(n) for _, n in sorted(r.copied)]} copied to every device: " \
             f"{next(iter(r.copied.values()))}" if r.copied else ""
    grouped = _grouped(r, tp)
    if grouped:
        copied += f"; blocks {[int(n) for _, n in sorted(grouped)]} hold {max(grouped.values())} groups the model " \
                  f"repeats for its heads, which {tp} devices do not divide: each group copied to the devices whose " \
                  f"heads read it"
    packed = f" (packed blocks {[n for _, n in blocks]}, re-laid device-major{copied})" if blocks else ""
    return f"{min((s for w, s in r.granule_blocks if w not in grouped), default=min(r.granules))} {unit}{packed}"


def _granule_problem(r: Region, tp: int) -> str:
    grouped = _grouped(r, tp)
    bad = sorted({s for w, s in r.granule_blocks if s % tp and w not in grouped} |
                 {s for s in r.statistics if s % tp and tp % s})
    if not bad:
        return ""
    node = r.granules.get(bad[0]) or r.statistics[bad[0]]
    return f"its output splits into {bad[0]} heads/blocks ({describe(node)}), which {tp} devices do not divide"


def _grouped(r: Region, tp: int) -> dict[tuple[Fraction, Fraction], int]:
    """Blocks of a packed projection viewed as fewer groups than ``tp`` devices, which the model repeats for its
    heads (``Region.repeated``: Mamba2's B and C of 2 groups on 4 devices), when ``tp`` is a multiple of them:
    block -> its groups, each group copied to the devices whose heads read it."""
    blocks = set(_blocks(r) or ())
    return {w: g for w, g in r.repeated if g % tp and tp % g == 0 and (int(w[0]), int(w[1])) in blocks
            and not any(within(v, w) for v in r.row_windows.values())}


def _packing(r: Region, tp: int) -> Optional[Packing]:
    blocks = _blocks(r)
    if blocks is None:
        return None
    grouped = {(int(w[0]), int(w[1])): g for w, g in _grouped(r, tp).items()}
    groups = tuple(grouped.get(b, 1) for b in blocks) if grouped else ()
    return Packing(r.projection.out_dims[0], blocks, tp, whole=_copied(r, blocks) | {
        i for i, b in enumerate(blocks) if b in grouped}, groups=groups)


def _copied(r: Region, blocks: tuple[tuple[int, int], ...]) -> frozenset[int]:
    """The blocks every device gets a copy of (``Region.copied``)."""
    return frozenset(i for i, b in enumerate(blocks) if b in r.copied)


def _blocks(r: Region) -> Optional[tuple[tuple[int, int], ...]]:
    """The blocks consumers slice a packed projection into, covering all its outputs; None if unpacked."""
    return blocks_of(r) if r.windows else None


def _packing_problem(r: Region, tp: int) -> str:
    if any(base.denominator != 1 or span.denominator != 1 for base, span in r.windows):
        return "its packed output is sliced at positions that are not whole features"
    blocks = _blocks(r)
    copied = _copied(r, blocks) if blocks else frozenset()
    if blocks and any(size % tp for i, (_, size) in enumerate(blocks) if i not in copied):
        sizes = [s for _, s in blocks]
        return f"its packed output is sliced into blocks of {sizes}, which {tp} devices do not all divide"
    return ""


def _set_column(roles: Roles, p: Projection, kind: str, logical: str, why: str,
                packing: Optional[Packing] = None) -> None:
    axes = ["embed"] * len(p.weight.shape)
    axes[p.out_dims[0]] = logical
    for d in p.out_dims[1:]:
        axes[d] = None
    roles.set(p.weight, ParamRole(kind, tuple(axes), why, "shard", packing), p.node.module)
    if p.bias is not None:
        bias_pack = packing.for_bias() if packing else None
        roles.set(p.bias, ParamRole(kind, (logical,), f"bias of a {why.split(':')[0]} projection: split with "
                                                      f"its outputs", "shard", bias_pack))


def _embeddings(graph: Graph, roles: Roles) -> dict[str, int]:
    """Embedding tables looked up with the model's input: vocab-parallel. Returns name -> vocab size."""
    vocab: dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "embedding":
            continue
        ids, weight = node.arg(0, "input"), node.arg(1, "weight")
        if not isinstance(weight, Value) or weight.kind != "param":
            continue
        if _is_input(ids):
            roles.set(weight, ParamRole("vocab", ("vocab", "embed"), f"vocab-parallel embedding: its "
                                        f"{weight.shape[0]} rows split, looked up with the model's input ids",
                                        "partial"), node.module)
            vocab[weight.name] = weight.shape[0]
        else:
            roles.set(weight, _replicated(weight, "position/type embedding: looked up with computed "
                                                  "indices, small, replicated"))
    return vocab


def _is_input(v: Value) -> bool:
    """``v`` is a model input, reshaped or cast at most, or masked (token ids, not positions computed from
    them): ``torch.where(ids < n, ids, 0)`` keeps the ids of a table of ``n`` rows (Gemma 3n's per-layer
    table), every id still one row of it."""
    while v.kind != "input":
        node = v.producer
        if node is None or not node.tensors:
            return False
        if node.op == "where":
            kept = [t for t in node.tensors[1:] if t.dynamic]
            if len(node.tensors) < 2 or len(kept) != 1 or node.arg(1, "input") is not kept[0]:
                return False
            v = kept[0]
            continue
        if node.op not in ("view", "reshape", "flatten", "to", "long", "int", "contiguous", "clone", "detach",
                           "unsqueeze", "squeeze"):
            return False
        v = node.tensors[0]
    return True


def _is_head(region: Region, vocab: dict[str, int], tp: int) -> bool:
    """An output head worth splitting: features reach only the output (or a loss over them, ``vocab``),
    more of them than devices."""
    if not region.ok or region.rows or region.attention or not (region.reaches_output or region.ends):
        return False
    p = region.projection
    return p.weight.name in vocab or p.size in vocab.values() or -(-p.size // tp) < p.size


def _set_patches(roles: Roles, p: Projection, tp: int) -> None:
    """A patch embedding (``patches``): split over its kernel rows, like a vocabulary-parallel embedding; the
    first kernel dimension ``tp`` divides (Qwen2-VL's 2 frames x 14 x 14: its rows), else the first, padded."""
    kernel = p.weight.shape[2:]
    at = 2 + next((i for i, k in enumerate(kernel) if k % tp == 0), 0)
    axes = tuple("kernel" if d == at else None for d in range(len(p.weight.shape)))
    roles.set(p.weight, ParamRole("row", axes, f"patch embedding: a convolution over non-overlapping "
                                  f"{'x'.join(map(str, p.weight.shape[2:]))} patches, split over its kernel rows "
                                  f"(each device sums its rows of every patch); one all-reduce of its output",
                                  "partial"), p.node.module)
    if p.bias is not None:
        roles.set(p.bias, _replicated(p.bias, "bias of a row-parallel projection: added once, after the reduction"))
    roles.sites.add(p.node.module)  # where the lowering writes the convolution as an einsum (its patchify)


def _square(p: Projection, tp: int) -> bool:
    """A linear map of the hidden size to itself (Gemma 3n's AltUp projections), ``tp`` dividing it."""
    weight = p.weight
    return (p.node.op == "linear" and len(weight.shape) == 2 and weight.shape[0] == weight.shape[1]
            and weight.shape[1] % tp == 0 and p.bias is None)


def _set_alone(roles: Roles, region: Region) -> None:
    """A square projection whose output must stay whole (``region`` stopped), split over its input features
    (torch's ``RowwiseParallel(input_layouts=Replicate())``): each device contracts its part of the whole input,
    one all-reduce of the output; in the backward its input's gradient, split likewise, is one all-gather. Its
    weight and FLOPs split 1/tp, where computing it whole would hold and compute all of it on every device."""
    p = region.projection
    axes = ["embed"] * len(p.weight.shape)
    axes[p.in_dims[0]] = "mlp"
    why = (f"row-parallel alone: its {p.weight.shape[p.in_dims[0]]} input features split, each device contracting "
           f"its part of the whole input; one all-reduce of its output, one all-gather of its input's gradient in "
           f"the backward (column-parallel, its output {region.stop} ({describe(region.stop_node)}))")
    roles.set(p.weight, ParamRole("row", tuple(axes), why, "whole input"), p.node.module)


def _mha(graph: Graph, tp: int, roles: Roles, covered: set[int]) -> None:
    """torch's ``multi_head_attention_forward`` (``nn.MultiheadAttention``): packed q/k/v + out_proj."""
    for node in graph.nodes:
        if node.op != "multi_head_attention_forward":
            continue
        heads = node.arg(4, "num_heads")
        in_w, in_b = node.arg(5, "in_proj_weight"), node.arg(6, "in_proj_bias")
        out_w, out_b = node.arg(11, "out_proj_weight"), node.arg(12, "out_proj_bias")
        extras = node.arg(7, "bias_k") is not None or node.arg(9, "add_zero_attn")
        if not isinstance(in_w, Value) or extras or heads % tp:
            why = (f"{heads} attention heads do not divide the model axis ({tp})" if heads % tp else
                   "MultiheadAttention with separate q/k/v sizes, bias_k/bias_v or add_zero_attn")
            for v in (in_w, in_b, out_w, out_b):
                if isinstance(v, Value):
                    roles.set(v, _replicated(v, why))
            continue
        e = in_w.shape[0] // 3
        pack = Packing(0, ((0, e), (e, e), (2 * e, e)), tp)
        why = f"column-parallel: packed q/k/v of {heads} heads split {tp} ways (each device holds its heads)"
        roles.set(in_w, ParamRole("column", ("heads", "embed"), why, "partial", pack), node.module)
        if isinstance(in_b, Value):
            roles.set(in_b, ParamRole("column", ("heads",), "bias of packed q/k/v", "shard", pack))
        roles.set(out_w, ParamRole("row", ("embed", "heads"), "row-parallel: attention output projection", "partial"),
                  node.module)
        if isinstance(out_b, Value):
            roles.set(out_b, _replicated(out_b, "bias of a row-parallel projection: added once, after the reduction"))
        covered.add(node.index)


__all__ = ["Packing", "ParamRole", "Role", "Roles", "decide"]
