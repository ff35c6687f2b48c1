"""Zero heads, checked before they are chosen: the model must run with its weights padded.

The planner's zero-heads alternative (``planners.alternatives``) grows weights along their head dimension. A model
that reshapes with ``-1`` heads runs unchanged; one that names its head count (``view(b, s, 12, d)``),
adds a per-head table (ALiBi slopes, a relative position bias) or repeats key/value heads by a
fixed factor does not. ``padding_problem`` traces the model once more on fake tensors with the
padded weights, under the lowering's packed-output mode (``Relaid``: which reads a padded packed
projection's blocks where the model slices it), and says what failed, or "" when it runs and its outputs keep
their shapes. Example::

    why = padding_problem(model, plan, graph)       # "" or "RuntimeError: shape '[2, 8, 12, 8]' is invalid ..."
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..dataflow.graph import Graph
from ..dataflow.trace import trace
from ..errors import PlanError
from ..state import ensure_param_state
from . import packed
from .mode import Lowering


class Relaid(Lowering):
    """The packed-output mode with the projections' outputs tagged as ``entry`` tags them in a parallelized
    forward (a trace is none)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites(True)  # the whole trace is one site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        linear, addmm = func is F.linear, func is torch.addmm
        if linear or addmm:
            weight = args[1] if linear else args[2]
            packing = packed.packing_of(weight)
            if packing is not None and packing.relays_output(0 if linear else 1):
                return self.tag(func(*args, **kwargs), packing)
        return super().__torch_function__(func, types, args, kwargs)


def padding_problem(model: nn.Module, packings: Mapping[str, packed.Packing], graph: Graph,
                    example_inputs: Optional[Sequence[Any]] = None,
                    example_kwargs: Optional[Mapping[str, Any]] = None) -> str:
    """Why ``model`` cannot run with the padded ``packings`` applied ("" if it can, or none is padded)."""
    padded = {name: p for name, p in packings.items() if p.padded}
    if not padded:
        return ""

    def swap(name: str, fake: torch.Tensor) -> torch.Tensor:
        packing = padded.get(name)
        if packing is None:
            return fake
        laid = packed.permute(fake, packing)
        ensure_param_state(laid).packing = packing
        return laid

    try:
        again = trace(model, example_inputs, example_kwargs, swap=swap, modes=(Relaid(),))
    except PlanError as e:
        cause = e.__cause__
        return f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    shapes, want = [v.shape for v in again.outputs], [v.shape for v in graph.outputs]
    return "" if shapes == want else f"its outputs change shape ({want} -> {shapes})"
