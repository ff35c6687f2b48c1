"""What a model's lowering needs: its packed-output sites, its column groups (from a trace), its tables.

- **sites**: the modules that slice a re-laid packed projection's output (a planner names them) and
  the parents of re-laid projections. The packed-output mode runs only inside them (``scope``).
- **groups**: ``nn.Linear``s split on their output rows (column-parallel in the layout, rows
  divisible by the model axis) that read the same activation in a traced forward: q, k and v; gate
  and up. Each group gets one fused input gradient (``groups``). ``find_groups`` reads a forward of
  the outermost parallelized module traced on fake tensors (the planner's, or one on a synthesised
  input), with the layout of every ``parallelize`` call on it merged (``layout_of``): the torch idiom
  of one call for the root and one per block gets the same groups as one call.
- **tables**: ``nn.Embedding``s split on their vocabulary over the model axis (``embedding``), and the
  batch replicas a tied one's weight is read on (``batch_replicas``, ``tied``). Example::

    packed_sites(model, slicers)                              # {'transformer.h.0.attn', ...}
    find_groups(model, layout, tp=4, graph=trace(model, (ids,)))
    # [['model.layers.0.self_attn.q_proj', '...k_proj', '...v_proj'], ['...mlp.gate_proj', '...up_proj'], ...]
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..dataflow.graph import Graph
from ..dataflow.regions import Projection, projections
from ..state import ParamSharding, record_of
from ..plan.layout import Layout, spec_axes
from .embedding import lowerable
from .groups import groupable
from .packed import packing_of


def packed_sites(model: nn.Module, slicers: frozenset[str] = frozenset()) -> set[str]:
    """``slicers`` and the parent of every module holding a re-laid packed parameter."""
    return set(slicers) | {fqn.rpartition(".")[0] for fqn, m in model.named_modules()
                           if any(packing_of(p) is not None for p in m.parameters(recurse=False))}


def find_groups(model: nn.Module, layout: Layout, tp: int, graph: Graph) -> list[list[str]]:
    """Column-parallel Linears of ``model`` reading one activation in ``graph``, two or more each."""
    modules = dict(model.named_modules())
    by_input: dict[int, list[str]] = {}
    for p in projections(graph):
        fqn = p.node.module
        if not _reads_rows(p) or not groupable(modules.get(fqn), tp) or not _rows_split(layout, fqn):
            continue
        members = by_input.setdefault(p.node.tensors[0].index, [])
        if fqn not in members:
            members.append(fqn)
    return [g for g in by_input.values() if len(g) > 1]


def _reads_rows(p: Projection) -> bool:
    """``F.linear(x, w)``, or ``x @ w.T`` (Falcon's ``FalconLinear``), which the lowering takes as one."""
    return p.node.op == "linear" or (p.node.op == "matmul" and p.out_dims == (0,) and p.in_dims == (1,))


def vocab_tables(model: nn.Module, layout: Layout, tp: int) -> list[tuple[str, nn.Embedding, ParamSharding]]:
    """The ``nn.Embedding``s of ``model`` split on their rows (the vocabulary) over the model axis,
    each with its FQN and its weight's sharding record (mesh and spec)."""
    return [(fqn, m, record) for fqn, m in model.named_modules()
            if lowerable(m, tp) and _rows_split(layout, fqn) and (record := record_of(m.weight)) is not None]


def batch_replicas(layout: Layout, mesh: Any, spec: tuple) -> tuple[Any, int]:
    """The batch axes (spec entry) a weight laid out as ``spec`` is replicated over, and how many
    replicas they make; ``(None, 1)`` when some batch axis splits the weight (FSDP) or there is none."""
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    used = {a for entry in spec for a in spec_axes(entry)}
    axes = tuple(a for a in layout.batch_axes if sizes.get(a, 1) > 1)
    if not axes or used & set(axes):
        return None, 1
    return (axes[0] if len(axes) == 1 else axes), math.prod(sizes[a] for a in axes)


def _rows_split(layout: Layout, fqn: str) -> bool:
    """The module's weight rows are split over the model axis alone (device-major blocks), nothing else
    over it."""
    spec = layout.params.get(f"{fqn}.weight" if fqn else "weight")
    return (spec is not None and spec_axes(spec[0]) == (layout.tp_axis,)
            and all(layout.tp_axis not in spec_axes(a) for a in spec[1:]))
