"""torchtitan-style grouped experts: rows already sorted by expert, with a count per expert.

torchtitan's ``GroupedExperts.forward(x, num_tokens_per_expert)`` receives the routed rows sorted by
expert and how many each expert has, then runs a ragged grouped matmul (``torch._grouped_mm`` behind a
padding kernel) or a loop over ``num_tokens_per_expert.tolist()``: shapes that depend on the routing,
so XLA would compile a program per routing, or fail. Here each row's expert comes from comparing its
position with the counts' running sum, and the rows run through the same static slots as any MoE
layer (``experts.run`` with one choice per row), split as the weights ``w1``/``w3`` ``[E, I, D]`` and
``w2`` ``[E, D, I]`` are (torchtitan's ``TensorParallel``: expert-tensor-parallel; ``ExpertParallel``:
expert-parallel). The rows are routed as one group: torchtitan sorts the whole batch's tokens together.

A module whose plan says its own math is an experts layer (``ModuleLayout.input_grad``, as the
registered torchtitan styles say) with those three weights is marked; its forward is replaced on the
instance (not the class) while the model is parallelized, and computes the original outside a
parallelized forward. Example::

    marked = install_grouped(model, state, layout)     # ['layers.1.moe.experts']
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..axes import EXPERT
from ..plan.layout import Layout
from ..state import ModelState
from . import scope
from .experts import ExpertSet, even, run

WEIGHTS = ("w1", "w2", "w3")


def grouped_weights(module: nn.Module) -> bool:
    """torchtitan's experts contract: own 3-D ``w1``/``w3`` ``[E, I, D]`` and ``w2`` ``[E, D, I]``."""
    own = dict(module.named_parameters(recurse=False))
    if not all(own.get(n) is not None and own[n].dim() == 3 for n in WEIGHTS):
        return False
    w1, w2, w3 = (own[n] for n in WEIGHTS)
    return w1.shape == w3.shape and tuple(w2.shape) == (w1.shape[0], w1.shape[2], w1.shape[1])


def rows_forward(module: nn.Module, es: ExpertSet, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.forward(x, num_tokens_per_expert)`` in static slots (padding rows give zeros)."""
    experts = module.w1.shape[0]
    ends = counts.to(torch.int64).cumsum(0)
    expert = (torch.arange(x.shape[0], device=x.device).unsqueeze(-1) >= ends).sum(-1)  # rows past the counts: E
    weights = (expert < experts).to(x.dtype).unsqueeze(-1)
    up, ids = torch.stack([module.w1, module.w3], 1), expert.clamp(max=experts - 1).unsqueeze(-1)
    capacity = None
    if not scope.lowering():  # the audit's unsharded reference
        es, capacity = even(es, x.shape[0], 1, experts)
    return run(es, x, ids, weights, lambda g, u: F.silu(g) * u, up, module.w2, capacity=capacity).to(x.dtype)


class InstanceForward:
    """A module's ``forward`` set on the instance (not the class) while it is parallelized;
    ``remove()`` leaves the class's again."""

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)
        module.forward = self

    def remove(self) -> None:
        module = self.module()
        if module is not None and module.__dict__.get("forward") is self:
            del module.forward


class GroupedForward(InstanceForward):
    """A marked grouped-experts module's ``forward``: its rows in static slots inside a parallelized model."""

    def __init__(self, module: nn.Module, es: ExpertSet):
        super().__init__(module)
        self.es = es

    def __call__(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        module = self.module()
        if scope.inside() and x.device.type == "xla":
            return rows_forward(module, self.es, x, num_tokens_per_expert)
        return type(module).forward(module, x, num_tokens_per_expert)


def install_grouped(root: nn.Module, state: ModelState, layout: Layout, kind_of: Callable[[tuple, str], str],
                    sets: Any) -> list[str]:
    """Mark ``root``'s grouped-experts modules (see the module docstring); their FQNs. ``kind_of(spec of
    w1, tp axis)`` names the layout (its expert dim 0, features dim 1); ``sets``: module -> ``ExpertSet``."""
    marked = []
    for fqn, ml in layout.modules.items():
        module = root.get_submodule(fqn) if fqn else root
        if not ml.input_grad or module in sets or not grouped_weights(module):
            continue
        spec = layout.params.get(f"{fqn}.w1" if fqn else "w1", (None, None, None))
        kind = kind_of(spec, layout.tp_axis)
        from ..backends.annotate import XlaSharder  # grouped experts run on torch_xla (install_experts checks)
        es = ExpertSet(kind, state.tp if kind != "replicated" else 1, layout.tp_axis, XlaSharder(state.mesh),
                       options=state.moe_options, ep_axis=EXPERT if kind_of(spec, EXPERT) == "expert-parallel" else None)
        sets[module] = es
        state.handles.append(GroupedForward(module, es))
        marked.append(fqn)
    return marked

