"""``ParallelStyle`` subclasses other libraries define: a registration says what each means under SPMD.

A style torch does not define (torchtitan's ``NoParallel``, its MoE styles, your own) is looked up
here by its class or any base class, given as the class itself or as its qualified name
(``"torchtitan.distributed.NoParallel"``: the library need not be installed). A registration is a
function ``(style, module) -> Style`` (an xla_tp style, usually ``ShardParams``) called for each
module the plan key matches. Torchtitan 0.2's styles are registered here:

================================================  ==============================================
torchtitan style                                  under SPMD
================================================  ==============================================
``NoParallel``                                    parameters replicated; input -> Replicate,
                                                  output as its ``output_layout``
``expert_parallel.TensorParallel``                experts' ``w1``/``w3`` split on dim 1, ``w2`` on
                                                  dim 2 (expert-tensor-parallel); output Partial
``expert_parallel.ExpertParallel``               every own parameter split on the expert dim 0
                                                  (expert-parallel over the model axis)
``expert_parallel.ExpertTensorParallel``          on its ``[ep, tp]`` slice: the experts split over
                                                  the expert axis, ``w1``/``w3`` dim 1 and ``w2``
                                                  dim 2 over the model axis; output Partial
``expert_parallel.ReordererSequenceParallel``     nothing (a per-rank token split)
================================================  ==============================================

Example::

    register_style(MyStyle, lambda style, module: ShardParams({"weight": ("tp", None)}))
    parallelize_xla(model, {"proj": MyStyle()}, mesh=mesh)
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate

from ..axes import EXPERT, TP
from .layout import chain
from .styles import ShardParams, Style

Lowering = Callable[[Any, nn.Module], Style]
_REGISTRY: dict[str, Lowering] = {}


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_style(style_class: Union[type, str], lower: Lowering) -> None:
    """Lower every instance of ``style_class`` (a class or its qualified name) and its subclasses
    with ``lower(style, module)`` -> an xla_tp ``Style``."""
    _REGISTRY[style_class if isinstance(style_class, str) else _name(style_class)] = lower


def registered(style: Any) -> Optional[Lowering]:
    """The lowering registered for ``style``'s class or its nearest registered base, if any."""
    return next((_REGISTRY[_name(c)] for c in type(style).__mro__ if _name(c) in _REGISTRY), None)


def _replicated(module: nn.Module) -> dict[str, tuple]:
    return {n: (None,) * p.dim() for n, p in module.named_parameters(recurse=False)}


def _no_parallel(style: Any, module: nn.Module) -> Style:
    return ShardParams(_replicated(module), inputs=(chain(getattr(style, "input_layout", None), Replicate()),),
                       outputs=(chain(getattr(style, "output_layout", None)),))


def _split_experts(expert_axis: Optional[str]) -> Lowering:
    """torchtitan's grouped experts (``w1``/``w3`` ``[E, I, D]``, ``w2`` ``[E, D, I]``) split on their
    features over the model axis (``TensorParallel``), and on their experts over ``expert_axis`` too
    (``ExpertTensorParallel``); their output Partial."""
    def lower(style: Any, module: nn.Module) -> Style:
        specs = {"w1": (expert_axis, TP, None), "w3": (expert_axis, TP, None), "w2": (expert_axis, None, TP)}
        own = dict(module.named_parameters(recurse=False))
        return ShardParams({n: s for n, s in specs.items() if n in own and own[n].dim() == 3},
                           natural_output=Partial(), input_grad=True)
    return lower


def _expert_parallel(style: Any, module: nn.Module) -> Style:
    return ShardParams({n: (TP, *[None] * (p.dim() - 1)) for n, p in module.named_parameters(recurse=False)},
                       natural_output=Partial(), input_grad=True)


_TITAN = "torchtitan.distributed"
register_style(f"{_TITAN}.NoParallel", _no_parallel)
register_style(f"{_TITAN}.expert_parallel.TensorParallel", _split_experts(None))
register_style(f"{_TITAN}.expert_parallel.ExpertParallel", _expert_parallel)
register_style(f"{_TITAN}.expert_parallel.ExpertTensorParallel", _split_experts(EXPERT))
register_style(f"{_TITAN}.expert_parallel.ReordererSequenceParallel", lambda style, module: ShardParams())
