"""float32 <-> int32 bit reinterpretation that torch_xla traces.

``Tensor.view(dtype)`` on an XLA tensor is not traced by torch_xla 2.9: every call executes the
pending graph first (a device round trip, and the program is cut in two). XLA's ``BitcastConvert``,
registered as a lazy op, keeps the computation one program. Other devices use ``view``. Example:

>>> f32_as_i32(torch.tensor([1.0, -2.0])).tolist()
[1065353216, -1073741824]
>>> i32_as_f32(torch.tensor([1065353216], dtype=torch.int32)).tolist()
[1.0]
"""
from __future__ import annotations

import torch
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_op_registry as xor

_F32_AS_I32 = xor.register("xla_tp_f32_as_i32", lambda x: x.bitcast(xb.Type.S32))
_I32_AS_F32 = xor.register("xla_tp_i32_as_f32", lambda x: x.bitcast(xb.Type.F32))


def f32_as_i32(x: torch.Tensor) -> torch.Tensor:
    """The bits of float32 ``x`` as int32."""
    return _F32_AS_I32(x) if x.device.type == "xla" else x.view(torch.int32)


def i32_as_f32(x: torch.Tensor) -> torch.Tensor:
    """int32 ``x``'s bits as float32."""
    return _I32_AS_F32(x) if x.device.type == "xla" else x.view(torch.float32)
