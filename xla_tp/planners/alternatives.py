"""When a block cannot be split the optimal way, the valid ways it can be split, priced; the cheapest wins.

A block (``roles``: column projections, the attention between them, the row projections after
them) whose heads or packed blocks the model axis (``tp`` devices) does not divide has these
alternatives, each priced from the traced shapes (``prices``):

- **split over k**, for each divisor ``k >= 2`` of ``tp``: the projections whose heads/blocks ``k``
  divides are split ``k`` ways, the others computed whole (k = ``tp``: key/value heads fewer than
  devices stay whole, the query heads split). ``k < tp`` is a sub-axis (``plan.subaxis``): the block
  is split over groups of ``k`` devices and replicated across the groups, so grouped-query models
  keep each key/value head with its query heads.
- **uneven split over tp**: every projection split ``tp`` ways as it is; XLA pads the rows, and a
  device's rows are not whole heads, so the compiler reshards the outputs (estimated: each such
  output all-gathered, one more collective each).
- **zero heads**: as many zero heads added to q, k and v (and zero inputs to the row projection) as
  make ``tp`` divide the heads, by re-laying the weights (``lowering.packed``; ``state_dict()`` keeps
  the original shapes). Zero heads add zeros to the output, so the model computes the same function.
  Offered when every projection of the block has the same heads (not grouped-query: the model's own
  key/value repetition would no longer match) and the model is not on ``meta`` (its init would fill
  the padding); ``padding`` says why not otherwise. The planner checks that the model runs padded.
- **whole**: the block computed on every device (no communication), the rest of the model still split.

Example (Qwen2-7B's heads, 28 query / 4 key-value, on 8 devices: split over 4 of them)::

    choice = choose(graph, members, rows, tp=8, problem=problem)
    choice.chosen.name      # 'split over 4 of 8 devices (sub-axis)'
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from ..axes import sequence_axes
from ..batch import ways
from ..dataflow.graph import Graph, Node, Value
from ..dataflow.regions import Region, describe
from .prices import Price, dot_flops, nbytes

Rows = dict[int, tuple[Node, Value, int]]  # row projection node index -> (node, parameter, contracted dim)
Problem = Callable[[Region, int], str]  # why a region cannot split ``ways`` ways ("" if it can)


@dataclass(frozen=True)
class Alternative:
    """One way to split a block: ``ways`` devices share it (1: whole); ``split`` are the projections
    split (the rest of the block's projections whole); ``relaid``: packed weights re-laid per device."""

    name: str
    ways: int
    split: tuple[Region, ...]
    price: Price
    relaid: bool = True
    padded: tuple[int, int] = (0, 0)  # (heads, padded heads) of the zero-heads alternative


@dataclass
class Choice:
    """The alternatives of one block, cheapest first; ``chosen`` is the one taken (the cheapest unless a
    ``Pick`` said otherwise)."""

    block: str  # the modules of the block's projections, for explanations
    why: str  # what keeps the block from the optimum
    alternatives: list[Alternative] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # alternatives that cannot apply, with the reason
    picked: int = 0

    @property
    def chosen(self) -> Alternative:
        return self.alternatives[self.picked]


Pick = Callable[[Choice], Alternative]  # which alternative a block takes (``plan_for(pick=...)``)


def choose(graph: Graph, members: list[Region], rows: Rows, tp: int, problem: Problem, why: str,
           padding: str = "", sizes: Optional[Mapping[str, int]] = None) -> Choice:
    """Every valid alternative for the block, priced, cheapest first (ties: less memory per device).
    ``padding``: why zero heads may not be added (empty: they may, where the block allows); ``sizes``: the
    mesh's axis sizes (a context axis splits the tokens and gathers keys and values, ``Block``)."""
    block = Block(graph, members, rows, tp, sizes)
    choice = Choice(", ".join(r.projection.name.rpartition(".")[0] for r in members), why)
    for k in sorted((k for k in range(2, tp + 1) if tp % k == 0), reverse=True):
        split = tuple(r for r in members if not problem(r, k))
        reached = {i for r in split for i in r.rows}
        name = f"split over {k}" + (f" of {tp} devices (sub-axis)" if k < tp else " devices")
        whole = [r for r in members if r not in split]
        if whole:
            name += f", {_names(whole)} whole"
        if not split or reached != set(rows):
            choice.invalid.append(f"{name}: {problem(next(iter(whole)), k) if whole else 'no row partner'}")
            continue
        choice.alternatives.append(Alternative(name, k, split, block.price(k, split)))
    misaligned = [r for r in members if problem(r, tp)]
    if misaligned:
        extra = sum(nbytes(r.projection.node.outputs[0]) for r in misaligned)
        choice.alternatives.append(Alternative(
            f"uneven split over {tp} devices (XLA pads; outputs not in whole heads are resharded)", tp,
            tuple(members), block.price(tp, tuple(members), extra, reshards=len(misaligned)), relaid=False))
    if block.heads and block.heads % tp:
        padded = _padded(block, tp, padding)
        if isinstance(padded, str):
            choice.invalid.append(f"zero heads: {padded}")
        else:
            choice.alternatives.append(padded)
    choice.alternatives.append(Alternative("computed whole on every device", 1, (), block.price(1, ())))
    choice.alternatives.sort(key=lambda a: (round(a.price.cost, 6), a.price.params))
    return choice


def _padded(block: "Block", tp: int, padding: str):
    """The zero-heads alternative, or why it does not apply."""
    heads = {heads_of(r) for r in block.members}
    reduced = next((n for r in block.members for n in r.reductions.values()), None)
    if reduced is not None:  # zero features would enter the statistic (a mean over more features)
        return f"its features are reduced whole ({describe(reduced)}): zero heads would change the result"
    if padding or len(heads) > 1:
        return padding or f"the projections have different heads {sorted(heads)} (grouped-query attention)"
    h = block.heads
    sizes = [n for r in block.members for _, n in blocks_of(r)] + [p.shape[d] for _, p, d in block.rows]
    if any(n % h for n in sizes):
        return f"features {sizes} are not whole heads of {h}"
    hp = -(-h // tp) * tp
    return Alternative(f"split over {tp} devices, {h} heads padded to {hp} with zero heads", tp, tuple(block.members),
                       block.price(tp, tuple(block.members), heads=hp), padded=(h, hp))


def heads_of(r: Region) -> int:
    """How many heads (or packed blocks) a projection's output splits into: its smallest granule."""
    return min(r.granules, default=0)


def blocks_of(r: Region) -> tuple[tuple[int, int], ...]:
    """The blocks consumers slice ``r``'s projection into (one block if unpacked)."""
    size = r.projection.size
    cuts = {0, size} | {int(x) for base, span in r.windows for x in (base, base + span)}
    edges = sorted(cuts)
    return tuple((a, b - a) for a, b in zip(edges, edges[1:]))


def _names(regions: list[Region]) -> str:
    return ", ".join(r.projection.name.rpartition(".")[0].rpartition(".")[2] for r in regions)


class Block:
    """The costs of one block's parts, read once from the graph: unsharded, except that a context axis in
    ``sizes`` (one that divides the traced sequence) splits the tokens, so FLOPs and activation bytes are
    each device's part of them, and attention gathers each key and value over it (per device: the whole
    sequence, its heads split over the ``tp`` devices where they divide them, as
    ``lowering.context.context_split`` lays them out whatever the block's split: the same for every
    alternative)."""

    def __init__(self, graph: Graph, members: list[Region], rows: Rows, tp: int,
                 sizes: Optional[Mapping[str, int]] = None):
        self.members = members
        self.rows = list(rows.values())
        self.attention = [graph.nodes[i] for i in sorted({i for r in members for i in r.attention})]
        self.heads = max((heads_of(r) for r in members if r.attention), default=0)
        self.queries = next((r for r in members if r.attention and heads_of(r) == self.heads), None)
        out = self.rows[0][0].outputs[0].shape if self.rows else ()
        self.tokens = ways(sequence_axes(sizes or {}, out[1]), sizes or {}) if len(out) >= 3 else 1
        self.minimum = float(sum(nbytes(node.outputs[0]) for node, _, _ in self.rows)) / self.tokens
        self.gathers = float(sum(_gathered(n, tp) for n in self.attention)) if self.tokens > 1 else 0.0
        self.whole = (sum(dot_flops(r.projection.node) for r in members) + sum(dot_flops(n) for n, _, _ in self.rows)
                      + sum(dot_flops(n) for n in self.attention)) / self.tokens

    def price(self, ways: int, split: tuple[Region, ...], extra: float = 0.0, heads: int = 0,
              reshards: int = 0) -> Price:
        """``heads``: the padded head count of the zero-heads alternative (each device holds
        ``heads / ways`` heads of the ``self.heads`` real ones)."""
        padded = heads / ways / self.heads if heads else None
        flops = params = 0.0
        for r in self.members:
            share = (padded or _share(r.projection.size, ways)) if r in split else 1.0
            flops += dot_flops(r.projection.node) * share
            params += _param_bytes(r) * share
        for node, param, dim in self.rows:
            share = (padded or _share(param.shape[dim], ways)) if split else 1.0
            flops += dot_flops(node) * share
            params += nbytes(param) * share
        attn_share = (padded or _share(self.heads, ways)) if self.queries in split and self.heads else 1.0
        flops += sum(dot_flops(n) for n in self.attention) * attn_share
        comm = (self.minimum if split else 0.0) + extra / self.tokens + self.gathers
        return Price(flops / self.tokens, comm, params, self.whole, self.minimum + self.gathers, reshards, self.gathers)


def _gathered(node: Node, tp: int) -> int:
    """Bytes per device of the key and value an SDPA ``node`` gathers over a context axis: whole, their heads
    (dimension 1) split over ``tp`` devices where ``tp`` divides them."""
    if node.op != "scaled_dot_product_attention":
        return 0
    kv = [node.arg(1, "key"), node.arg(2, "value")]
    return sum(nbytes(t) // (tp if len(t.shape) == 4 and tp > 1 and t.shape[1] % tp == 0 else 1) for t in kv)


def _share(n: int, ways: int) -> float:
    """The part of ``n`` items one device holds when they are split ``ways`` ways (XLA pads)."""
    return math.ceil(n / ways) / n if n else 1.0


def _param_bytes(r: Region) -> float:
    p = r.projection
    return float(nbytes(p.weight) + (nbytes(p.bias) if p.bias is not None else 0))
