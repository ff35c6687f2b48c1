"""Why a projection or an attention stays whole: the sentences ``plan.replicated`` and
``plan.whole_attention`` hold, from what stopped a region (``dataflow.regions``).

Example::

    whole_attention(graph, regions, covered, reasons)
    # ["'baddbmm' in transformer.h.0.self_attention on [[16, 1, 8], ...] (... merges the sharded dimension ...)"]
"""
from __future__ import annotations

from ..dataflow.graph import Graph, Node
from ..dataflow.regions import Region, describe, is_attention


def stop_reason(region: Region) -> str:
    if region.stop:
        return f"its output {region.stop} ({describe(region.stop_node)}), so it is computed whole"
    if region.reaches_output and not region.rows:
        return "its output leaves the model unsplit"
    return "no row-parallel partner"


def whole_attention(graph: Graph, regions: list[Region], covered: set[int], reasons: dict[int, str]) -> list[str]:
    """Attention that no block covers: computed whole on every device. What stopped each (first three)."""
    missed = [n for n in graph.nodes if is_attention(n) and n.index not in covered]
    by_output = {r.projection.node.outputs[0].index: r for r in regions}
    lines = []
    for node in missed[:3]:
        feeders = _feeders(node, by_output)
        why = "; ".join(f"{r.projection.name.rpartition('.')[0]}: "
                        f"{reasons.get(r.projection.node.index) or stop_reason(r)}" for r in feeders[:3])
        lines.append(f"{describe(node)} on {[list(v.shape) for v in node.tensors[:3]]}"
                     f" ({why or 'no projection feeds it'})")
    if len(missed) > 3:
        lines.append(f"+{len(missed) - 3} more")
    return lines


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
