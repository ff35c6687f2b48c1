"""Sharding annotations on torch_xla tensors: the torch_xla side of the ``Sharder`` interface.

``XlaSharder(mesh)`` constrains activations (value and gradient: a plain ``mark_sharding`` inside a
forward constrains the value only) and annotates copies (forward only). It cannot use
``xs.mark_sharding`` on a copy of device data (a fresh input: "Existing annotation must be cleared
first"), so it annotates the copy through torch_xla's custom-sharding call; under ``torch.compile``
the same annotation is the custom op ``xla_tp::constrain`` (``dynamo``). Example::

    sharder = XlaSharder(xla_tp.make_mesh(data=2, model=4))
    y = sharder.constrain(x, ("data", None, "model"))      # y = x, laid out so; dy too
"""
from __future__ import annotations

from typing import Any

import torch
import torch_xla.distributed.spmd as xs

from .. import dynamo


class ShardingConstraint(torch.autograd.Function):
    """``y = x`` laid out as ``spec``; ``dy`` laid out as ``spec`` too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sharder: "XlaSharder", spec: tuple) -> torch.Tensor:
        ctx.sharder, ctx.spec = sharder, spec
        return sharder.annotate(x, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        return ctx.sharder.annotate(grad, ctx.spec), None, None


class XlaSharder:
    """Annotations on torch_xla tensors over one ``xs.Mesh`` (the ``Sharder`` of ``constraints``)."""

    def __init__(self, mesh: xs.Mesh):
        self.mesh = mesh
        self.name = str(mesh)  # read here, not while dynamo traces (str reads numpy)
        self.sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.mesh_shape)))

    def applies(self, x: Any) -> bool:
        """Whether ``x`` is a tensor this sharder annotates: an XLA tensor."""
        return isinstance(x, torch.Tensor) and x.device.type == "xla"

    def constrain(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        """``x`` laid out as ``spec``, its gradient too."""
        return ShardingConstraint.apply(x, self, tuple(spec))

    def annotate(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        """A copy of ``x`` laid out as ``spec`` (forward only)."""
        if torch.compiler.is_compiling():
            return dynamo.constrain(x, self.name, tuple(spec))
        return dynamo.annotated(x, self.mesh.get_op_sharding(tuple(spec)))
