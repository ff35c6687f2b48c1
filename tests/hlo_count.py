"""A second reading of partitioned HLO text, written apart from ``xla_tp.auditing.hlo``: the suite checks the
audit's figures against it (an instrument checked by another one).

Each instruction is one line ``%name = <result shape> <op>(<operands>), <attributes>``; per-device shapes.
Matmul FLOPs: a ``dot`` is 2 x result elements x the left operand's contracted sizes; a ``convolution`` is
2 x result elements x the kernel's elements per output feature. Collectives: one per instruction, bytes of
its result. Example::

    flops, collectives = matmul_flops(text), collectives_of(text)     # {"all-reduce": (count, bytes), ...}
"""
from __future__ import annotations

import re

_LINE = re.compile(r"=\s*(?P<result>\(?[a-z0-9]+\[[^=]*?)\s(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _lines(text: str):
    for line in text.splitlines():
        m = _LINE.search(line)
        if m:
            yield m.group("op"), m.group("result"), m.group("rest")


def matmul_flops(text: str) -> int:
    """FLOPs of every dot and convolution in ``text``."""
    total = 0
    for op, result, rest in _lines(text):
        if op == "dot":
            out = _dims(_ARRAY.search(result).group(2))
            lhs = _dims(_ARRAY.search(rest).group(2))
            contracted = _dims(re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1))
            total += 2 * _product(out) * _product([lhs[d] for d in contracted])
        elif op == "convolution":
            out = _dims(_ARRAY.search(result).group(2))
            kernel = _dims(_ARRAY.findall(rest)[1][1])
            labels = re.search(r"dim_labels=\w+_(\w+)->", rest).group(1)
            total += 2 * _product(out) * _product(kernel) // kernel[labels.index("o")]
    return total


def collectives_of(text: str) -> dict[str, tuple[int, int]]:
    """Kind -> (count, bytes of their results), kinds that occur only."""
    out: dict[str, tuple[int, int]] = {}
    for op, result, _ in _lines(text):
        kind = op.removesuffix("-start")
        if kind in KINDS:
            size = sum(_BYTES[dtype] * _product(_dims(dims)) for dtype, dims in _ARRAY.findall(result))
            count, total = out.get(kind, (0, 0))
            out[kind] = (count + 1, total + size)
    return out
