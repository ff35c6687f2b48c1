"""Roles from dataflow: which parameter is column-parallel, row-parallel, vocab-parallel or replicated.

From a traced forward (``xla_tp.dataflow``), for a model axis of ``tp`` devices:

1. Every projection's region is explored (``regions.explore``). Regions that reach the same
   tensor split the same way are one group (q, k and v meet in attention; gate and up meet in
   their product). Groups are taken in call order; a projection belongs to the first that takes it.
2. A group is column -> row if its regions end in row projections and nothing needs the whole
   feature dimension. Sizes the split must respect (heads, packed blocks) must divide ``tp``; a
   member that fails (key/value heads fewer than ``tp``) is left replicated, the rest stays split.
   Packed projections whose consumers slice them into blocks (``qkv[..., :E]``) are re-laid so each
   device holds its part of every block.
3. A projection whose features only reach the model's output is an output head (vocab-parallel);
   an embedding looked up with the model's input ids is vocab-parallel; torch's MultiheadAttention
   is its own group. Everything else is replicated, with the reason.
4. Attention that no group splits is a ``PlanError`` naming it and what stopped it.

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
from enum import Enum
from typing import Optional

from ..dataflow.graph import Graph, Node, Value
from ..dataflow.regions import Projection, Region, describe, explore, is_attention, projections
from ..errors import PlanError
from ..plan.packing import Packing

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
    natural: str = ""  # "shard" (column/head) or "partial" (row/vocab embedding): the module's own output
    packing: Optional[Packing] = None

    def __post_init__(self) -> None:
        self.kind = Role(self.kind)


@dataclass
class Roles:
    """Every parameter's role by (first) FQN, plus the facts behind them (for explanations)."""

    params: dict[str, ParamRole] = field(default_factory=dict)
    groups: list[list[str]] = field(default_factory=list)  # column members of each split group
    sites: set[str] = field(default_factory=set)  # modules that slice a packed projection's blocks
    natural: dict[str, str] = field(default_factory=dict)  # module FQN -> what its own output is (a tied
    # weight is an embedding in one module and an output head in another)

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


def decide(graph: Graph, tp: int, routed: frozenset[int] = frozenset()) -> Roles:
    """See the module docstring. ``routed``: nodes that multiply tokens by routed expert weights (not
    attention: ``planners.experts``)."""
    roles = Roles()
    projs = projections(graph)
    regions = [explore(graph, p) for p in projs]
    taken: dict[int, str] = {}  # projection node index -> role kind
    reasons: dict[int, str] = {}  # projection node index -> why it is not split
    covered: set[int] = set(routed)
    for group in _groups(regions):
        _apply_group(group, tp, roles, taken, reasons, covered)
    _mha(graph, tp, roles, covered)
    vocab = _embeddings(graph, roles)
    for region in regions:
        node = region.projection.node
        if node.index in taken:
            continue
        if _is_head(region, vocab, tp):
            _set_column(roles, region.projection, "head", "vocab", "output head: vocab-parallel, its features only "
                        "reach the model's output (logits stay split, ready for a loss-parallel cross-entropy)")
            taken[node.index] = "head"
        else:
            why = reasons.get(node.index) or _stop_reason(region)
            roles.set(region.projection.weight, _replicated(region.projection.weight, why))
            if region.projection.bias is not None:
                roles.set(region.projection.bias, _replicated(region.projection.bias, why))
    _check_attention(graph, regions, covered, reasons)
    return roles


def _stop_reason(region: Region) -> str:
    if region.stop:
        return f"its output {region.stop} ({describe(region.stop_node)}), so it is computed whole"
    if region.reaches_output and not region.rows:
        return "its output leaves the model unsplit"
    return "no row-parallel partner"


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


def _apply_group(group: list[Region], tp: int, roles: Roles, taken: dict[int, str], reasons: dict[int, str],
                 covered: set[int]) -> None:
    members = [r for r in group if r.projection.node.index not in taken]
    rows = {i: row for r in members for i, row in r.rows.items()}
    if not members or any(i in taken for i in rows):
        for r in members:
            reasons.setdefault(r.projection.node.index, "its partner projection is already split by another group")
        return
    split, dropped = [], []
    for r in members:
        why = _granule_problem(r, tp) or _packing_problem(r, tp)
        (dropped if why else split).append((r, why))
    for r, why in dropped:
        reasons[r.projection.node.index] = why
    split_regions = [r for r, _ in split]
    reached = {i for r in split_regions for i in r.rows}
    if not split_regions or reached != set(rows):
        for r in members:
            reasons.setdefault(r.projection.node.index, dropped[0][1] if dropped else "no row-parallel partner")
        return
    attention = any(r.attention for r in split_regions)
    for r in split_regions:
        p = r.projection
        what = f"{_granule_text(r)}" if r.granules else f"{p.size} features"
        _set_column(roles, p, "column", "heads" if attention else "mlp",
                    f"column-parallel: {what} split {tp} ways, read by {_row_names(rows)}",
                    packing=_packing(r, tp))
        taken[p.node.index] = "column"
        covered |= r.attention
        if r.windows:
            roles.sites |= r.slicers
    for r, why in dropped:
        roles.set(r.projection.weight, _replicated(r.projection.weight, why))
        if r.projection.bias is not None:
            roles.set(r.projection.bias, _replicated(r.projection.bias, why))
        taken[r.projection.node.index] = "replicated"
    for index, (node, param, dim) in rows.items():
        axes = ["embed"] * len(param.shape)
        axes[dim] = "heads" if attention else "mlp"
        cols = ", ".join(r.projection.name.rpartition(".")[0] for r in split_regions)
        roles.set(param, ParamRole("row", tuple(axes), f"row-parallel: contracts the split features of {cols}; "
                                   f"one all-reduce of its output", "partial"), node.module)
        bias = _row_bias(node, param)
        if bias is not None:
            roles.set(bias, _replicated(bias, "bias of a row-parallel projection: added once, after the reduction"))
        taken[index] = "row"
    roles.groups.append([r.projection.name for r in split_regions])


def _row_names(rows: dict[int, tuple[Node, Value, int]]) -> str:
    return ", ".join(sorted({param.name.rpartition(".")[0] for _, param, _ in rows.values()}))


def _row_bias(node: Node, weight: Value) -> Optional[Value]:
    return next((v for v in node.tensors if v.kind == "param" and v is not weight and len(v.shape) == 1), None)


def _granule_text(r: Region) -> str:
    unit = "heads" if r.attention else "blocks"
    blocks = _blocks(r)
    packed = f" (packed blocks {[n for _, n in blocks]}, re-laid device-major)" if blocks else ""
    return f"{min(r.granules)} {unit}{packed}"


def _granule_problem(r: Region, tp: int) -> str:
    bad = sorted(s for s in r.granules if s % tp)
    if not bad:
        return ""
    node = r.granules[bad[0]]
    return (f"its output splits into {bad[0]} heads/blocks ({describe(node)}), which the model axis ({tp}) does "
            f"not divide: computed whole on every device (no communication)")


def _packing(r: Region, tp: int) -> Optional[Packing]:
    blocks = _blocks(r)
    if blocks is None:
        return None
    return Packing(r.projection.out_dims[0], blocks, tp)


def _blocks(r: Region) -> Optional[tuple[tuple[int, int], ...]]:
    """The blocks consumers slice a packed projection into, covering all its outputs; None if unpacked."""
    if not r.windows:
        return None
    size = r.projection.size
    cuts = {0, size}
    for base, span in r.windows:
        cuts |= {int(base), int(base + span)}
    edges = sorted(cuts)
    return tuple((a, b - a) for a, b in zip(edges, edges[1:]))


def _packing_problem(r: Region, tp: int) -> str:
    if any(base.denominator != 1 or span.denominator != 1 for base, span in r.windows):
        return "its packed output is sliced at positions that are not whole features"
    blocks = _blocks(r)
    if blocks and any(size % tp for _, size in blocks):
        sizes = [s for _, s in blocks]
        return (f"its packed output is sliced into blocks of {sizes}, which the model axis ({tp}) does not "
                f"all divide: computed whole on every device")
    return ""


def _set_column(roles: Roles, p: Projection, kind: str, logical: str, why: str,
                packing: Optional[Packing] = None) -> None:
    axes = ["embed"] * len(p.weight.shape)
    axes[p.out_dims[0]] = logical
    for d in p.out_dims[1:]:
        axes[d] = None
    roles.set(p.weight, ParamRole(kind, tuple(axes), why, "shard", packing), p.node.module)
    if p.bias is not None:
        bias_pack = Packing(0, packing.blocks, packing.tp) if packing else None
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
    """``v`` is a model input, reshaped or cast at most (token ids, not positions computed from them)."""
    while v.kind != "input":
        node = v.producer
        if node is None or node.op not in ("view", "reshape", "flatten", "to", "long", "int", "contiguous",
                                            "clone", "detach", "unsqueeze", "squeeze") or not node.tensors:
            return False
        v = node.tensors[0]
    return True


def _is_head(region: Region, vocab: dict[str, int], tp: int) -> bool:
    """An output head worth splitting: features reach only the output, more of them than devices."""
    if not region.ok or region.rows or region.attention or not region.reaches_output:
        return False
    p = region.projection
    return p.weight.name in vocab or p.size in vocab.values() or -(-p.size // tp) < p.size


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


def _check_attention(graph: Graph, regions: list[Region], covered: set[int], reasons: dict[int, str]) -> None:
    """Attention that no split group covers cannot be sharded: refuse instead of guessing."""
    missed = [n for n in graph.nodes if is_attention(n) and n.index not in covered]
    if not missed:
        return
    by_output = {r.projection.node.outputs[0].index: r for r in regions}
    lines = []
    for node in missed[:3]:
        feeders = _feeders(node, by_output)
        why = "; ".join(f"{r.projection.name.rpartition('.')[0]}: "
                        f"{reasons.get(r.projection.node.index) or _stop_reason(r)}" for r in feeders[:3])
        lines.append(f"{describe(node)} on {[list(v.shape) for v in node.tensors[:3]]}"
                     f" ({why or 'no projection feeds it'})")
    raise PlanError("plan 'auto' cannot shard the attention of this model: " + " | ".join(lines)
                    + (f" (+{len(missed) - 3} more)" if len(missed) > 3 else "")
                    + ". Pass a plan dict, or a mesh whose model axis divides the heads")


def _feeders(node: Node, by_output: dict[int, Region]) -> list[Region]:
    """The projections whose outputs reach ``node`` (nearest first)."""
    found, seen, work = [], set(), list(node.tensors)
    while work:
        v = work.pop(0)
        if v.index in seen:
            continue
        seen.add(v.index)
        if v.index in by_output:
            found.append(by_output[v.index])
        elif v.producer is not None and v.dynamic:
            work.extend(v.producer.tensors)
    return found


__all__ = ["Packing", "ParamRole", "Role", "Roles", "decide"]
