"""Features viewed as groups, read group by group: whether a split may cut through a group.

A view of split features as ``[..., groups, n]`` makes ``groups`` a size the model axis must divide (each
device whole groups), unless what reads the view keeps the groups apart in a way the compiler splits
further for a small price:

- ``per_group``: only a statistic per group reads it, until it is viewed back (Mamba2's gated norm over
  groups of heads, ``x.view(b, s, groups, n)``, ``pow(2).mean(-1, keepdim=True)``, the scaling, the view back).
  On more devices than groups, each group's features are split too and each statistic is summed over the
  devices holding its group (one all-reduce of ``[..., groups, 1]``).
- ``repeated``: the model repeats each group for its heads (Mamba2's ``B.view(b, s, groups, n)`` then
  ``repeat_interleave(heads // groups, dim=2)``): each group can be copied to the devices whose heads read it.

Example (``Value`` stand-ins: a view's output read by ``pow``, ``mean`` over the last dim, ``mul``, a view back)::

    per_group(graph.nodes[i].outputs[0])   # True for MambaRMSNormGated's view
"""
from __future__ import annotations

from .graph import Value

# ops computed on each element (or each group's statistic) alone, whatever their operands' broadcast
ELEMENTWISE = frozenset({"pow", "add", "sub", "mul", "div", "rsqrt", "sqrt", "neg", "exp", "to", "float", "type_as",
                         "contiguous", "silu", "sigmoid"})
STATISTICS = frozenset({"mean", "sum"})
SAME = frozenset({"float", "to", "type_as", "contiguous"})  # ops that give the same values, maybe another dtype


def per_group(value: Value) -> set[int]:
    """The values read per group from ``value`` (``[..., groups, n]``, itself included) when it is read only by
    element-wise ops and statistics over its last dim (kept), each path ending in a view back to
    ``[..., groups * n]``; else an empty set."""
    shape = tuple(value.shape)
    if len(shape) < 2:
        return set()
    merged, stat = (*shape[:-2], shape[-2] * shape[-1]), (*shape[:-1], 1)
    work, seen, values, back = [value], set(), {value.index}, False
    while work:
        for node, _ in work.pop().consumers:
            if node.index in seen:
                continue
            seen.add(node.index)
            out = tuple(node.outputs[0].shape) if len(node.outputs) == 1 else None
            if node.op in ("view", "reshape") and out == merged:
                back = True
                continue
            if out not in (shape, stat) or node.op not in ELEMENTWISE | STATISTICS:
                return set()
            if node.op in STATISTICS and (out != stat or node.arg(1, "dim") not in (-1, len(shape) - 1, (-1,), [-1])):
                return set()
            values.add(node.outputs[0].index)
            work.append(node.outputs[0])
    return values if back else set()


def repeated(value: Value, dim: int) -> bool:
    """Whether every use of ``value`` repeats each entry of ``dim`` (``repeat_interleave`` along it), after ops
    that keep its values."""
    if not value.consumers:
        return False
    for node, _ in value.consumers:
        if node.op in SAME and len(node.outputs) == 1:
            if not repeated(node.outputs[0], dim):
                return False
            continue
        at = node.arg(2, "dim")
        if node.op != "repeat_interleave" or not isinstance(at, int) or at % len(value.shape) != dim:
            return False
    return True
