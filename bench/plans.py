"""Plans as users hold them today, and the ways of applying them that the bench compares.

``hand_apply`` is what people write today on XLA: one ``xs.mark_sharding`` per weight from an
HF-style plan ({pattern: "colwise" | "rowwise" | ...}). ``to_torch_plan`` turns the same plan into
torch styles for xla_tp / ``parallelize_module``. Example::

    plan = xla_tp.plan.hf.hf_plan(model)      # {"model.layers.*.self_attn.q_proj": "colwise", ...}
    hand_apply(model.to(xla), plan, mesh)
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Replicate

from xla_tp.plan.match import match_keys

COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"}
ROWWISE = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "embedding_rowwise"}


def matches(plan: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """Module FQN -> plan value, matched by xla_tp's rules (``xla_tp.plan.match``: torch's per-segment fnmatch)."""
    found, _ = match_keys(plan, [fqn for fqn, _ in model.named_modules()])
    return {fqn: plan[key] for fqn, key in found.items()}


def weight_specs(module: nn.Module, style: str, axis: str = "model") -> dict[str, tuple]:
    """Parameter name -> partition spec for one HF style string on one module.

    ``weight_specs(nn.Linear(4, 8), "colwise") == {"weight": ("model", None), "bias": ("model",)}``.
    GPT-2's ``Conv1D`` stores ``[in, out]`` and an Embedding ``[vocab, dim]``, so their dims swap.
    Unknown styles replicate.
    """
    colwise, rowwise = style in COLWISE, style in ROWWISE
    transposed = type(module).__name__ == "Conv1D" or isinstance(module, nn.Embedding)
    out: dict[str, tuple] = {}
    if colwise or rowwise:
        out_dim = 1 if transposed else 0
        dim = out_dim if colwise else 1 - out_dim
        out["weight"] = tuple(axis if d == dim else None for d in range(2))
        if colwise and getattr(module, "bias", None) is not None:
            out["bias"] = (axis,)
    return out


def hand_apply(model: nn.Module, plan: dict[str, str], mesh: Any, axis: str = "model") -> nn.Module:
    """``xs.mark_sharding`` on each planned weight, as a user would write by hand (model on XLA)."""
    import torch_xla.distributed.spmd as xs
    for fqn, style in matches(plan, model).items():
        mod = model.get_submodule(fqn)
        for name, spec in weight_specs(mod, style, axis).items():
            xs.mark_sharding(getattr(mod, name), mesh, spec)
    return model


def to_torch_plan(plan: dict[str, str], model: nn.Module) -> dict[str, ParallelStyle]:
    """Torch styles for the Linear/Embedding modules of an HF-style plan (others are dropped)."""
    out: dict[str, ParallelStyle] = {}
    for fqn, style in matches(plan, model).items():
        mod = model.get_submodule(fqn)
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        if style in COLWISE:
            gather = style != "colwise" and style != "packed_colwise"
            out[fqn] = ColwiseParallel(output_layouts=Replicate()) if gather else ColwiseParallel()
        elif style in ROWWISE:
            out[fqn] = RowwiseParallel()
    return out
