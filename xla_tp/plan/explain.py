"""``explain(model, plan, mesh)``: what a plan does to every parameter, and why, as text.

Parameters are grouped by pattern (layer indices as ``*``): the role and its reason (for a plan of
"auto"; the plan key and style otherwise), then why the rest stays replicated, the blocks "auto" could
not split the optimal way with every alternative and its price (the chosen one marked ``*``), then per group the
shape, spec, per-device shape and bytes, and the totals against the ideal ``total / model-axis
size``, with the padding uneven dimensions cost. Nothing is mutated. Example::

    print(explain(model, plan_for(model, mesh=mesh), mesh))
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

from torch import nn

from ..axes import canonical_axis, sizes_of
from .layout import spec_axes
from .normalize import build_layout
from .subaxis import axis_size
from .table import ParamRow, format_table, local_shape
from .unplanned import unplanned_parameters

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$|[ ,)'])")


def _pattern(text: str) -> str:
    return _INDEX.sub("*", text)


def _grouped(lines: dict[str, str]) -> list[str]:
    """``{name: text}`` -> one line per (pattern, text) pair, in first-seen order."""
    seen: dict[tuple[str, str], None] = {}
    for name, text in lines.items():
        seen.setdefault((_pattern(name), _pattern(text)), None)
    width = max((len(n) for n, _ in seen), default=0)
    return [f"  {n:<{width}}  {t}" for n, t in seen]


def _choices(plan: Mapping, tp: int) -> list[str]:
    """The blocks "auto" could not split the optimal way: every alternative with its price, the
    chosen one first (marked ``*``); attention computed whole. One entry per layer pattern."""
    lines: list[str] = []
    seen: set[str] = set()
    for choice in getattr(plan, "choices", ()):
        head = _pattern(f"  {choice.block}: {choice.why}")
        if head in seen:
            continue
        seen.add(head)
        lines += [head, *(f"    {'*' if i == choice.picked else ' '} {alt.name}: {alt.price.text(tp)}"
                          for i, alt in enumerate(choice.alternatives)),
                  *(f"      not valid: {_pattern(text)}" for text in choice.invalid)]
    whole = list(dict.fromkeys(f"  {_pattern(line)}" for line in getattr(plan, "whole_attention", ())))
    out = ["off the optimum (each block takes the cheapest valid split; prices per block):", *lines] if lines else []
    return out + (["attention computed whole:", *whole] if whole else [])


def explain(model: nn.Module, plan: Mapping, mesh: Any, tp_axis: str = "model") -> str:
    """The roles, the replicated parameters with reasons, the grouped sharding table and totals, on
    ``mesh`` (a mesh or axis sizes)."""
    axes = sizes_of(mesh)
    tp_axis = canonical_axis(tp_axis)
    layout = build_layout(model, plan, axes, tp_axis, strict=False)
    roles = getattr(plan, "roles", None)
    keys = {f"{fqn}.{n}" if fqn else n: f"{ml.source} -> {ml.style}"
            for fqn, ml in layout.modules.items() for n in ml.params}
    names = [n for n, _ in model.named_parameters()]
    unplanned = unplanned_parameters(model, layout)
    replicated = getattr(plan, "replicated", None) or unplanned
    split = {n: (roles[n].why if roles is not None and n in roles else keys.get(n, "")) for n in names
             if n not in unplanned}
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        spec = layout.params.get(name) or (None,) * p.dim()
        groups.setdefault(_pattern(name), []).append((p, spec))
    rows, padding = [], 0
    for pattern, members in groups.items():
        p, spec = members[0]
        loc = local_shape(tuple(p.shape), spec, axes)
        per_device = math.prod(loc) * p.element_size() * len(members)
        ways = math.prod(axis_size(axes, a) for entry in spec for a in spec_axes(entry))
        padding += (math.prod(loc) * ways - p.numel()) * p.element_size() * len(members)
        label = f"{pattern} (x{len(members)})" if len(members) > 1 else pattern
        rows.append(ParamRow(label, tuple(p.shape), spec, loc, per_device))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tp = axes.get(tp_axis, 1)
    per_device = sum(r.local_bytes for r in rows)
    mesh_text = " x ".join(f"{a}={s}" for a, s in axes.items())
    lines = [f"plan for {type(model).__name__} on mesh {mesh_text}",
             "split:" if split else "split: nothing", *_grouped(split),
             "replicated:" if replicated else "replicated: nothing",
             *_grouped({n: replicated.get(n, "") for n in names if n in replicated}),
             *_choices(plan, axes.get(tp_axis, 1)),
             *_context_lines(plan, axes),
             "parameters:", format_table(rows),
             f"per device: {per_device} bytes of {total} total (ideal total/{tp} = {total // tp}; ratio "
             f"{per_device / max(total / tp, 1):.2f}); padding of uneven dimensions: {padding} bytes over all devices"]
    return "\n".join(lines)


def _context_lines(plan: Mapping, axes: Mapping[str, int]) -> list[str]:
    """What a context axis does, which no parameter's spec shows, and what each block moves per device for the
    traced input (the planner's prices: Megatron's all-reduces of each device's tokens and the keys and values
    gathered over the axis; the audit's minimum counts the same, plus the embedding's all-reduce)."""
    ways = axes.get("context", 1)
    if ways == 1:
        return []
    lines = [f"context: the sequence split {ways} ways over the context axis (a length it divides); attention "
             f"gathers keys and values over it, each device's queries against all of them; weights replicated "
             f"over it, their gradients reduced over it"]
    prices = getattr(plan, "prices", ())
    if not prices:
        return lines
    blocks: dict[str, list] = {}
    for block, price in prices:
        blocks.setdefault(_pattern(block), []).append(price)
    lines.append("  bytes moved per device by each block, for the traced input (Megatron + key/value gathers):")
    for block, found in blocks.items():
        p = found[0]
        count = f" (x{len(found)})" if len(found) > 1 else ""
        lines.append(f"    {block}{count}: {p.comm - p.gathers:,.0f} + {p.gathers:,.0f} = {p.comm:,.0f}")
    lines.append(f"  blocks total: {sum(p.comm for _, p in prices):,.0f} bytes/device")
    return lines
