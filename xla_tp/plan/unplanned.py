"""Which parameters a plan leaves replicated over the tensor-parallel axis, and why.

Example:

>>> from torch.distributed.tensor.parallel import ColwiseParallel
>>> from xla_tp.plan.normalize import build_layout
>>> mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
>>> unplanned_parameters(mlp, build_layout(mlp, {"0": ColwiseParallel()}, {"model": 4}, "model"))
{'2.weight': "no plan key matches module '2' or parameter '2.weight'"}
"""
from __future__ import annotations

from torch import nn

from .layout import Layout, uses_axis


def unplanned_parameters(module: nn.Module, layout: Layout) -> dict[str, str]:
    """Parameter FQN -> reason, for every parameter not sharded over ``layout.tp_axis``.

    Reasons: no key matched its module; its module's style does not shard it (e.g. a child's
    parameter, or an HF style that only moves activations); or the style replicates it
    explicitly (``SequenceParallel``, ``"replicate"``). Tied parameters appear once.
    """
    out: dict[str, str] = {}
    for name, _ in module.named_parameters():
        spec = layout.params.get(name)
        if spec is not None and uses_axis(spec, layout.tp_axis):
            continue
        owner, _, local = name.rpartition(".")
        ml = layout.modules.get(owner)
        if ml is None:
            out[name] = f"no plan key matches module {owner or '<root>'!r} or parameter {name!r}"
        elif local not in ml.params:
            out[name] = f"style {ml.style} (key {ml.source!r}) on module {owner or '<root>'!r} does not shard it"
        else:
            out[name] = f"style {ml.style} (key {ml.source!r}) replicates it"
        if spec is not None and any(a is not None for a in spec):
            out[name] += f" (sharded over {spec} only)"
    return out

