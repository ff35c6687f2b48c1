"""``Plan``: the dict a planner returns, with the reasons behind it.

A ``Plan`` is an ordinary plan dict (FQN pattern -> style) that also remembers which family
produced it, which parameters it leaves replicated and why, and how to prepare the model's
forward for XLA (einsum attention, ...). Example::

    plan = xla_tp.plan_for(model, mesh=mesh)
    plan.family                 # 'hf_decoder'
    plan.replicated             # {'model.norm.weight': 'norm: replicated (Megatron layout)', ...}
    print(plan.explain(model, mesh))
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn


class Plan(dict):
    """FQN pattern -> style, plus ``family`` and ``replicated`` (param -> reason)."""

    def __init__(self, *args: Any, family: str = "none",
                 prepare: Optional[Callable[[nn.Module], None]] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.family = family
        self.replicated: dict[str, str] = {}
        self._prepare = prepare

    def prepare(self, model: nn.Module) -> None:
        """Swap in XLA-friendly forwards the plan relies on (numerics unchanged); idempotent."""
        if self._prepare is not None:
            self._prepare(model)

    def explain(self, model: nn.Module, mesh: Any = None, tp_axis: str = "model") -> str:
        """Text: per parameter the rule, spec, per-device shape and bytes; totals; what stays replicated."""
        from ..plan.explain import explain
        return explain(model, self, mesh, tp_axis)

    def __repr__(self) -> str:
        return f"Plan(family={self.family!r}, {dict.__repr__(self)})"
