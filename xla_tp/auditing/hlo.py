"""Read per-device facts out of compiled (post-SPMD-partitioning) HLO text.

Pure text parsing: nothing here imports torch at module level. Shapes in partitioned HLO are
per device, so every byte and FLOP count below is per device. Every instruction in the text is
counted once, wherever it sits (ENTRY, fused computation, while body); a while body is not
multiplied by its trip count.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_INSTR_RE = re.compile(  # "[ROOT] %name = shape opcode(operands), attributes"
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$",
    re.M,
)
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_BITS_RE = re.compile(r"[a-z]+?(\d+)")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LISTED_GROUPS_RE = re.compile(
    r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,\s]*\}|[\s,])*)\}"
)
_ONE_GROUP_RE = re.compile(r"\{([\d,\s]*)\}")
_LHS_CONTRACTING_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_KERNEL_LABELS_RE = re.compile(r"dim_labels=[^_\s]+_([^-\s]+)->")


@dataclass(frozen=True)
class Collective:
    """One collective in partitioned HLO.

    ``shape``/``dtype`` are those of the (first element of the) per-device result; ``bytes`` sums
    all result elements. ``replica_groups`` lists device ids; for collective-permute it holds the
    ``source_target_pairs``; ``()`` means one group of all devices.
    """

    kind: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    replica_groups: tuple[tuple[int, ...], ...]
    name: str


class _Instr(NamedTuple):
    name: str
    shape: str  # result shape text, e.g. "f32[4,16]{1,0}" or "(f32[2]{0}, s32[])"
    op: str
    rest: str  # everything after "op(": operands, then attributes


def _instructions(hlo_text: str) -> list[_Instr]:
    return [_Instr(*m.group("name", "shape", "op", "rest")) for m in _INSTR_RE.finditer(hlo_text)]


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Array shapes in a shape text, in order.

    >>> _arrays("(f32[4,1]{1,0}, bf16[<=8]{0}, s32[])")
    [('f32', (4, 1)), ('bf16', (8,)), ('s32', ())]
    """
    return [
        (dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY_RE.findall(shape_text)
    ]


def _nbytes(dtype: str, dims: Sequence[int]) -> int:
    """Bytes of one array; sub-byte types are packed. ``_nbytes("bf16", (4, 8)) == 64``."""
    match = _BITS_RE.match(dtype)
    bits = 8 if dtype == "pred" else int(match.group(1)) if match else 0  # token[] has no bytes
    return math.ceil(bits * math.prod(dims) / 8)


def _operands(rest: str) -> list[str]:
    """Split the operand list (up to the closing parenthesis) at top-level commas.

    >>> _operands("f32[2,2]{1,0} %a, (f32[2]{0}, s32[]) %b), dimensions={0}")
    ['f32[2,2]{1,0} %a', '(f32[2]{0}, s32[]) %b']
    """
    parts, depth, start = [], 0, 0
    for i, char in enumerate(rest):
        if char in "([{":
            depth += 1
        elif char in ")]}" and depth:
            depth -= 1
        elif char == ")" or (char == "," and depth == 0):
            parts.append(rest[start:i].strip())
            start = i + 1
            if char == ")":
                break
    return [part for part in parts if part]


def _operand_name(operand: str) -> str:
    return operand.split()[-1].lstrip("%")


def _operand_array(operand: str, shapes: dict[str, str]) -> tuple[str, tuple[int, ...]]:
    """Shape of an operand: printed inline, or looked up by name when operand shapes are omitted."""
    inline = _arrays(operand)
    return inline[0] if inline else _arrays(shapes[_operand_name(operand)])[0]


def _replica_groups(attributes: str) -> tuple[tuple[int, ...], ...]:
    """Device groups of a collective, from listed or iota (``[G,S]<=[dims]T(perm)``) form.

    >>> _replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}")
    ((0, 4), (1, 5), (2, 6), (3, 7))
    >>> _replica_groups("replica_groups={{0,1},{2,3}}, to_apply=%add")
    ((0, 1), (2, 3))
    """
    iota = _IOTA_GROUPS_RE.search(attributes)
    if iota:
        n_groups, group_size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        perm = [int(p) for p in iota.group(4).split(",")] if iota.group(4) else range(len(dims))
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(n_groups, group_size)
        return tuple(tuple(int(d) for d in row) for row in ids)
    listed = _LISTED_GROUPS_RE.search(attributes)
    if not listed:
        return ()
    return tuple(
        tuple(int(d) for d in group.split(",") if d.strip())
        for group in _ONE_GROUP_RE.findall(listed.group(1))
    )


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in the module, in text order; an async ``*-start``/``*-done`` pair is one.

    The result of an async start is taken from its matching ``*-done``.

    >>> text = ("%ar = f32[4,16]{1,0} all-reduce(f32[4,16]{1,0} %d), "
    ...         "replica_groups={{0,1}}, to_apply=%add")
    >>> parse_collectives(text)[0].bytes
    256
    """
    instrs = _instructions(hlo_text)
    done_shapes = {
        _operand_name(_operands(i.rest)[0]): i.shape for i in instrs if i.op.endswith("-done")
    }
    found = []
    for instr in instrs:
        kind = instr.op.removesuffix("-start")
        if kind not in KINDS:
            continue
        shape_text = instr.shape if kind == instr.op else done_shapes.get(instr.name)
        if shape_text is None:
            raise ValueError(f"{instr.op} %{instr.name} has no matching {kind}-done in the text")
        arrays = _arrays(shape_text)
        nbytes = sum(_nbytes(dtype, dims) for dtype, dims in arrays)
        (dtype, shape), groups = arrays[0], _replica_groups(instr.rest)
        found.append(Collective(kind, shape, dtype, nbytes, groups, instr.name))
    return found


def collective_summary(collectives: Iterable[Collective]) -> dict[str, dict]:
    """Count and total bytes per kind, in ``KINDS`` order, kinds that occur only.

    >>> c = Collective("all-gather", (8,), "f32", 32, (), "ag")
    >>> collective_summary([c, c])
    {'all-gather': {'count': 2, 'bytes': 64}}
    """
    summary: dict[str, dict] = {}
    for collective in sorted(collectives, key=lambda c: KINDS.index(c.kind)):
        entry = summary.setdefault(collective.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += collective.bytes
    return summary


def _dot_flops(instr: _Instr, shapes: dict[str, str]) -> int:
    result = _arrays(instr.shape)[0][1]
    lhs = _operand_array(_operands(instr.rest)[0], shapes)[1]
    contracting = _LHS_CONTRACTING_RE.search(instr.rest)
    dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
    return 2 * math.prod(result) * math.prod(lhs[d] for d in dims)


def _convolution_flops(instr: _Instr, shapes: dict[str, str]) -> int:
    """2 * output elements * kernel elements / output features (grouping is in the kernel)."""
    result = _arrays(instr.shape)[0][1]
    kernel = _operand_array(_operands(instr.rest)[1], shapes)[1]
    kernel_out = kernel[_KERNEL_LABELS_RE.search(instr.rest).group(1).index("o")]
    return 2 * math.prod(result) * math.prod(kernel) // kernel_out


def dot_flops(hlo_text: str) -> int:
    """FLOPs of every ``dot`` and ``convolution`` instruction, each counted once.

    A dot inside a fused computation is counted there; the ``fusion`` calling it adds nothing.

    >>> dot_flops("%d = f32[4,8]{1,0} dot(f32[4,16]{1,0} %a, f32[8,16]{1,0} %b), "
    ...           "lhs_contracting_dims={1}, rhs_contracting_dims={1}")
    1024
    """
    instrs = _instructions(hlo_text)
    shapes = {instr.name: instr.shape for instr in instrs}
    counters = {"dot": _dot_flops, "convolution": _convolution_flops}
    return sum(counters[i.op](i, shapes) for i in instrs if i.op in counters)


def mesh_axes_of_groups(
    replica_groups: Sequence[Sequence[int]],
    mesh_device_ids: np.ndarray,
    axis_names: tuple[str, ...],
) -> tuple[str, ...]:
    """Mesh axes along which the members of the groups differ, in mesh order.

    ``()`` groups mean all devices: every axis of size > 1.

    >>> ids = np.arange(8).reshape(2, 4)
    >>> mesh_axes_of_groups(((0, 1, 2, 3), (4, 5, 6, 7)), ids, ("data", "model"))
    ('model',)
    """
    ids = np.asarray(mesh_device_ids)
    if ids.ndim != len(axis_names):
        raise ValueError(f"mesh of shape {ids.shape} does not have the axes {axis_names}")
    if not replica_groups:
        return tuple(name for name, size in zip(axis_names, ids.shape) if size > 1)
    coordinates = {int(device): index for index, device in np.ndenumerate(ids)}
    varying = np.zeros(ids.ndim, dtype=bool)
    for group in replica_groups:
        missing = [d for d in group if d not in coordinates]
        if missing:
            raise ValueError(f"devices {missing} of group {tuple(group)} are not in the mesh")
        coords = np.array([coordinates[d] for d in group])
        varying |= (coords != coords[0]).any(axis=0)
    return tuple(name for name, varies in zip(axis_names, varying) if varies)
