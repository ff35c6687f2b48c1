"""torch ``ParallelStyle`` objects -> ``ModuleLayout``.

Checks are ``isinstance``, so subclasses (float8 styles, a user's own) lower like their base.
What each style means under SPMD, where every activation is one global value:

===========================  ===================================  ==============================
style                        parameters (over the TP axis)        activation constraints
===========================  ===================================  ==============================
ColwiseParallel              Linear weight/bias Shard(0),         in: input_layouts -> Replicate
                             Embedding weight Shard(1)            out: output_layouts (Shard(-1))
RowwiseParallel              Linear weight Shard(1), bias         in: input_layouts -> Shard(-1)
                             Replicate; Embedding weight Shard(0)     (Embedding: -> Replicate)
                                                                  out: output_layouts (Replicate)
SequenceParallel             every parameter replicated           in/out: Shard(sequence_dim)
PrepareModuleInput           -                                    in: input_layouts -> desired
PrepareModuleOutput          -                                    out: output_layouts -> desired
PrepareModuleInputOutput     -                                    both
===========================  ===================================  ==============================

Other subclasses of ``ParallelStyle`` (torchtitan's ``NoParallel`` and MoE styles, your own) are
lowered by a registration (``registered``). ``use_local_output`` and ``use_local_input`` are
accepted and have no effect: they choose between a DTensor and its local
shard, and under SPMD a module's output is always the plain global tensor (the compiler keeps
the shards), so there is no local tensor to hand back.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..errors import PlanError
from .layout import ModuleLayout, chain
from .registered import registered


def lower_torch_style(style: ParallelStyle, fqn: str, module: nn.Module, key: str,
                      tp_axis: str) -> ModuleLayout:
    """Lower one torch style applied to ``module`` (at ``fqn``, matched by plan ``key``)."""
    out = ModuleLayout(fqn=fqn, source=key, style=repr(style))
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        _lower_linear_style(style, module, out, tp_axis)
    elif isinstance(style, SequenceParallel):
        seq = style.sequence_sharding
        out.params = {n: (None,) * p.dim() for n, p in module.named_parameters()}
        out.inputs = (chain(*seq),)
        out.outputs = (chain(*seq),)
    elif isinstance(style, PrepareModuleInputOutput):
        _lower_prepare_input(style.prepare_module_input, out)
        _lower_prepare_output(style.prepare_module_output, out)
    elif isinstance(style, PrepareModuleInput):
        _lower_prepare_input(style, out)
    elif isinstance(style, PrepareModuleOutput):
        _lower_prepare_output(style, out)
    elif registered(style) is not None:
        lowered = registered(style)(style, module).lower(fqn, module, key, tp_axis)
        lowered.style = repr(style)
        return lowered
    else:
        raise PlanError(f"plan key {key!r}: style {type(style).__name__} is not supported by xla_tp; use "
                        f"ColwiseParallel, RowwiseParallel, SequenceParallel or PrepareModule*, or say what it means "
                        f"under SPMD: xla_tp.register_style({type(style).__name__}, lambda style, module: "
                        f"ShardParams(...))")
    return out


def _lower_linear_style(style: ParallelStyle, module: nn.Module, out: ModuleLayout, tp_axis: str) -> None:
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        if colwise:
            out.params = {"weight": (tp_axis, None), "bias": (tp_axis,)}
            desired = Replicate()
        else:
            out.params = {"weight": (None, tp_axis), "bias": (None,)}
            desired = Shard(-1)
    elif isinstance(module, nn.Embedding):
        out.params = {"weight": (None, tp_axis) if colwise else (tp_axis, None)}
        desired = Replicate()
    else:
        raise PlanError(f"plan key {out.source!r}: {type(style).__name__} shards nn.Linear and "
                        f"nn.Embedding, but module {out.fqn!r} is a {type(module).__name__}; "
                        f"point the key at its Linear/Embedding children")
    out.params = {n: s for n, s in out.params.items() if getattr(module, n, None) is not None}
    out.inputs = (chain(style.input_layouts[0], desired),)
    out.outputs = (chain(style.output_layouts[0]),)
    out.natural_output = Shard(-1) if colwise else Partial()


def _lower_prepare_input(style: PrepareModuleInput, out: ModuleLayout) -> None:
    if style.input_layouts is not None:
        out.inputs = tuple(chain(a, b) for a, b in zip(style.input_layouts, style.desired_input_layouts))
    out.kwarg_inputs = {k: chain(v, style.desired_input_kwarg_layouts.get(k))
                        for k, v in style.input_kwarg_layouts.items()}


def _lower_prepare_output(style: PrepareModuleOutput, out: ModuleLayout) -> None:
    out.outputs = tuple(chain(a, b) for a, b in zip(style.output_layouts, style.desired_output_layouts))
