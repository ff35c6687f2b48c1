"""Marks the lowering leaves on activations it makes inside a parallelized forward.

A mark is an attribute on the tensor, not a table keyed by ``id(t)``: dynamo (``torch.compile``)
traces attribute stores on tensors it creates, but not ``id()`` of them. Reading one is cheap enough
for every argument of every op (any object: the answer is None). Example::

    PACKED = Tag("packed_output")
    y = PACKED.put(y, packing)
    PACKED.of(y) is packing, PACKED.of(3)        # (True, None)
"""
from __future__ import annotations

from typing import Any

import torch


class Tag:
    """One kind of mark (its attribute ``_xla_tp_<name>``)."""

    def __init__(self, name: str) -> None:
        self.attr = f"_xla_tp_{name}"

    def put(self, t: torch.Tensor, value: Any) -> torch.Tensor:
        setattr(t, self.attr, value)
        return t

    def of(self, t: Any) -> Any:
        return getattr(t, self.attr, None)
