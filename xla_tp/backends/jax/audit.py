"""``JaxModel.audit``: the ``AuditReport`` of the program JAX compiles, read with the same parsers.

The HLO is ``jax.jit(f).lower(...).compile().as_text()`` (per-device, after partitioning), read by
``xla_tp.auditing.hlo``; the communication minimum comes from the same layout rules as the torch_xla
audit, recorded on a fake-tensor forward of the torch module (no compute); the unsharded FLOPs
from the same function compiled for one device without the layout's constraints. Nothing runs.
Example::

    report = jm.audit(tokens)
    report.count("all-gather"), report.comm_ratio, report.compute_balance
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as torch_pytree

from ...auditing.hlo import dot_flops
from ...auditing.minimum import ActivationRecorder
from ...auditing.report import AuditReport
from ...auditing.figures import report_from_hlo, set_minimum
from ...constraints import Constrainer, register_hooks
from ...dataflow.routing import batched_experts
from ...lowering.context import ambient, context_split
from ...plan.layout import Layout
from .mesh import partition_ids
from .program import Outputs, call_module
from .runtime import shardy, to_torch, torchax_tracing


def audit_jax(jm: Any, args: tuple, kwargs: dict, backward: bool) -> AuditReport:
    """Compile ``jm(*args, **kwargs)`` (with ``backward``: and the gradients of the summed float
    outputs w.r.t. the trainable parameters) and report what the program communicates."""
    text = compiled_hlo(jm, args, kwargs, backward)
    unsharded = dot_flops(compiled_hlo(jm, args, kwargs, backward, sharded=False))
    report, found = report_from_hlo(text, partition_ids(jm.mesh), tuple(jm.mesh.axis_names), backward, unsharded)
    report.param_bytes_per_device = sum(_shard_numel(a) * a.dtype.itemsize for a in jm.params.values())
    report.param_bytes_total = sum(a.size * a.dtype.itemsize for a in jm.params.values())
    calls, gathers = record_calls(jm.module, jm.layout, args, kwargs, dict(jm.mesh.shape))
    set_minimum(report, calls, jm.module, jm.layout, found, lambda name, p: _shard_numel(jm.params[name]),
                gathers=gathers)
    report.notes.append("compiled by JAX through torchax (Shardy partitioner)")
    return report


def compiled_hlo(jm: Any, args: tuple, kwargs: dict, backward: bool, sharded: bool = True) -> str:
    """The per-device HLO JAX compiles for ``jm(*args, **kwargs)`` (and its backward); with
    ``sharded=False``, the same program on one device without the layout's constraints."""
    arrays, static = jm.inputs(args, kwargs)
    operands = (*jm.split_params(jm.params), jm.buffers, arrays)
    if not sharded:
        operands = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), operands)
    fn = jax.jit(_program(jm, backward, sharded), static_argnames=("static",))
    with shardy():
        return fn.lower(*operands, static=static).compile().as_text()


def _program(jm: Any, backward: bool, constrained: bool) -> Callable:
    """``f(trainable, frozen, buffers, arrays, static)``: the forward's flat outputs, and with
    ``backward`` the gradients of their float sum."""
    def forward(trainable: dict, frozen: dict, buffers: dict, arrays: tuple, static: Any):
        args, kwargs = static.merge(arrays)
        out = jm.program.run(call_module, {**trainable, **frozen, **buffers}, args, kwargs, constrained)
        return Outputs.split(out)[0]

    def summed(trainable: dict, frozen: dict, buffers: dict, arrays: tuple, static: Any):
        flat = forward(trainable, frozen, buffers, arrays, static)
        floats = [a.astype("float32").sum() for a in flat if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]
        return sum(floats), flat

    if not backward:
        return forward
    return lambda *operands, static: jax.value_and_grad(summed, has_aux=True)(*operands, static)


def _shard_numel(a: jax.Array) -> int:
    return math.prod(a.sharding.shard_shape(a.shape))


class _CopySharder:
    """Each constraint step a new tensor, as on the real backends (the recorder tells constrained
    inputs from the arguments as given by identity); nothing is laid out. ``sizes``: the mesh's, for what
    depends on them (a context axis: the key/value gathers attention records)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes

    def applies(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def constrain(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        return x.clone()


class _Gathers(TorchFunctionMode):
    """Each SDPA call's keys and values, recorded as the gathers a context axis needs (``context_split`` under
    the ``ambient`` copy sharder lays nothing out); the call itself runs as written."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and len(args) >= 3:
            context_split(*args[:3])
        return func(*args, **(kwargs or {}))


def record_calls(module: torch.nn.Module, layout: Layout, args: tuple, kwargs: dict,
                 sizes: dict[str, int]) -> tuple[list, list]:
    """The planned modules' calls (inputs, outputs) in a forward on fake tensors: shapes, dtypes
    and ``requires_grad`` as in the real forward (experts layers through ``batched_mm``, as the jitted
    program runs them), no compute; and the keys and values attention gathers over a context axis of the
    mesh ``sizes`` (the lowering's context split, recorded: Shardy lays the program out alike)."""
    args, kwargs = jax.tree.map(lambda x: to_torch(x) if isinstance(x, jax.Array) else x, (args, kwargs))
    sharder = _CopySharder(sizes)
    with FakeTensorMode() as mode, torchax_tracing(), torch.enable_grad(), batched_experts(module), \
            ambient(sharder, layout.batch_axes, layout.tp_axis), _Gathers():
        state = {n: mode.from_tensor(t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
        args, kwargs = torch_pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        handles = register_hooks(module, layout, Constrainer(sharder, layout))  # first, as on the real backends
        try:
            with ActivationRecorder(module, layout) as recorder:
                functional_call(module, state, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()
    return recorder.calls, recorder.gathers
