"""Packed projections laid out head-aligned: a parameter viewed with its packing made explicit.

A packed q/k/v weight (GPT-2 ``c_attn`` ``[in, 3E]``, ``nn.MultiheadAttention.in_proj_weight``
``[3E, E]``) split on its packed dimension gives device i a slice of q only, which GSPMD repairs
with collective-permutes or all-gathers. Re-registered as a view with the packing as its own
dimension (``[in, 3, E]``, ``[3, E, E]``), the E (heads) dimension can be sharded: each device holds
its heads of q, k and v. ``state_dict()``/``load_state_dict()`` keep the original shapes, so
checkpoints stay compatible. ``PackedStyle`` lowers to the head-aligned specs once the module is
re-laid and to a plain (memory-equivalent) split before, so a plan built from the original module
lowers and validates in either state. Example::

    relayout_param(mha, "in_proj_weight", (3, 64, 64))    # mha.in_proj_weight.shape == (3, 64, 64)
    mha.state_dict()["in_proj_weight"].shape              # torch.Size([192, 64])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..plan.layout import ModuleLayout
from ..plan.styles import ShardParams
from .plan import Plan
from .table import pattern

PACKED = "_xla_tp_packed"  # on the owner module: parameter name -> original shape


def is_packed(module: nn.Module) -> bool:
    """True once ``relayout_param`` re-laid a parameter of ``module`` or of one of its children."""
    return any(getattr(m, PACKED, None) for m in module.modules())


def relayout_param(owner: nn.Module, name: str, shape: Sequence[int]) -> bool:
    """Re-register ``owner.<name>`` as a view of ``shape``; False if it already is (idempotent).

    Example: ``relayout_param(gpt2_attn.c_attn, "weight", (64, 3, 64))``.
    """
    packed: dict[str, torch.Size] = owner.__dict__.setdefault(PACKED, {})
    p = owner._parameters.get(name)
    if p is None or name in packed:
        return False
    if not packed:
        owner.register_state_dict_post_hook(_save_original_shapes)
        owner.register_load_state_dict_pre_hook(_load_original_shapes)
    packed[name] = p.shape
    owner._parameters[name] = nn.Parameter(p.detach().view(*shape), requires_grad=p.requires_grad)
    return True


def _save_original_shapes(owner: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for name, shape in getattr(owner, PACKED, {}).items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = state_dict[prefix + name].reshape(shape)


def _load_original_shapes(owner: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for name in getattr(owner, PACKED, {}):
        key, p = prefix + name, owner._parameters.get(name)
        if key in state_dict and p is not None and state_dict[key].numel() == p.numel():
            state_dict[key] = state_dict[key].reshape(p.shape)


@dataclass(frozen=True)
class PackedStyle:
    """``packed`` specs once the module is re-laid (``is_packed``), ``plain`` specs before.

    Parameters the module lacks (``bias=False``) are left out. Example::

        PackedStyle(ShardParams({"in_proj_weight": (None, "tp", None)}),
                    ShardParams({"in_proj_weight": ("tp", None)}))
    """

    packed: ShardParams
    plain: ShardParams

    def lower(self, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
        chosen = self.packed if is_packed(module) else self.plain
        own = dict(module.named_parameters())
        params = {n: s for n, s in chosen.params.items() if n in own}
        style = ShardParams(params, chosen.inputs, chosen.outputs, chosen.kwarg_inputs, chosen.natural_output)
        return style.lower(fqn, module, key, tp_axis)


def attach_relayout(plan: Plan, relayout: Callable[[nn.Module], bool]) -> Plan:
    """Give ``plan`` a ``relayout(model)`` that applies ``relayout`` to every module the plan gives a
    ``PackedStyle`` (api.py calls it before building the layout). Example: ``attach_relayout(plan, pack_mha)``."""

    def relayout_planned(model: nn.Module) -> None:
        for fqn, mod in model.named_modules():
            if isinstance(plan.get(pattern(fqn)), PackedStyle):
                relayout(mod)

    plan.relayout = relayout_planned
    return plan
