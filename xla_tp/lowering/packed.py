"""Packed projections (q/k/v or gate/up in one weight) laid out so each device holds its heads.

A packed weight split evenly over ``tp`` devices gives device 0 the first rows of q only. Re-laid
(``relayout``), its rows are permuted *device-major*: device ``d``'s contiguous shard holds its slice
of every block (``[q_d | k_d | v_d]``). The shape is unchanged, so the layout validates like any
other; ``state_dict()``/``load_state_dict()`` see the original order (hooks on the owning module,
whose handles ``relayout`` returns; ``unrelayout`` puts the original order back).
During the forward, xla_tp's lowering mode tags the projection's output (``tag``) and hands the
model's own slicing (``qkv[..., :E]``, ``split``, ``chunk``) the block it asked for, read from the
device-major layout without moving data (``block``); any other use gets the original order back
(``unpermute``). Example (q, k, v blocks of 4 rows over 2 devices):

>>> lin = nn.Linear(1, 12, bias=False)
>>> original = lin.weight.detach().clone()
>>> packing = Packing(dim=0, blocks=((0, 4), (4, 4), (8, 4)), tp=2)
>>> handles = relayout(lin, "weight", packing)
>>> lin.weight[:, 0].tolist() == original[[0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11], 0].tolist()  # [q0 k0 v0 | q1 k1 v1]
True
>>> torch.equal(lin.state_dict()["weight"], original)
True
>>> unrelayout(lin, "weight", packing, handles); torch.equal(lin.weight, original)
True
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..plan.packing import Packing
from ..state import ensure_param_state, param_state
from .tags import Tag
from .blocks import per_device
from .copies import copied_block, copied_head, merged

_TAG = Tag("packed_output")  # on a re-laid projection's output during a forward: its Packing


def permute(t: torch.Tensor, packing: Packing) -> torch.Tensor:
    """``t`` (original layout along ``packing.dim``) re-laid: device-major, padding zeros included."""
    order = packing.order()
    if not packing.padded:  # every position holds an original feature (copied blocks repeat some)
        return t.index_select(packing.dim, order.to(t.device))
    zero = torch.zeros_like(t.narrow(packing.dim, 0, 1))
    order = torch.where(order < 0, t.shape[packing.dim], order).to(t.device)
    return torch.cat([t, zero], packing.dim).index_select(packing.dim, order)


def restore(t: torch.Tensor, packing: Packing) -> torch.Tensor:
    """A re-laid ``t`` back in the original layout (padding dropped)."""
    return t.index_select(packing.dim, packing.inverse().to(t.device))


def as_written(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (``p``'s value or gradient) in the order of the model as written: put back if the layout re-laid
    ``p`` (packed projections, experts' gate and up: device-major)."""
    packing = packing_of(p)
    return t if packing is None else restore(t, packing)


def relayout(owner: nn.Module, name: str, packing: Packing) -> list[Any]:
    """Permute ``owner.<name>`` (in its original order) device-major in place, same Parameter object;
    the handles of the state-dict hooks that show and take the original order."""
    p = owner._parameters[name]
    ps = ensure_param_state(p)
    if ps.packing is not None:
        raise ValueError(f"{name!r} is re-laid already; unrelayout it first")
    with torch.no_grad():
        p.data = p.data if p.is_meta else permute(p.data, packing)
    ps.packing = packing
    return [owner.register_state_dict_post_hook(_save_original(name, packing)),
            owner.register_load_state_dict_pre_hook(_load_relaid(name, packing))]


def unrelayout(owner: nn.Module, name: str, packing: Packing, handles: list[Any]) -> None:
    """Put ``owner.<name>`` (re-laid as ``packing``) back in its original order and remove its state-dict
    hooks. A parameter with no record (``model.to("cpu")`` made a new one) still holds the re-laid values."""
    p = owner._parameters[name]
    ps = param_state(p)
    if ps is None or ps.packing is not None:
        with torch.no_grad():
            p.data = p.data if p.is_meta else restore(p.data, packing)
        if ps is not None:
            ps.packing = None
    for handle in handles:
        handle.remove()


def _save_original(name: str, packing: Packing) -> Any:
    def hook(owner: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        if prefix + name in state_dict:
            state_dict[prefix + name] = restore(state_dict[prefix + name], packing)
    return hook


def _load_relaid(name: str, packing: Packing) -> Any:
    """The pre-hook that re-lays a loaded tensor of the parameter's shape (a state dict, or an
    optimizer state swapped in for the parameter: ``checkpoint.layout.swapped``)."""
    def hook(owner: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        key, p = prefix + name, owner._parameters.get(name)
        if key in state_dict and p is not None and original_shape(p) == state_dict[key].shape:
            state_dict[key] = permute(state_dict[key], packing)
    return hook


def original_shape(p: torch.Tensor) -> torch.Size:
    """The shape ``p`` has in the model as written (a padded or copied re-laid weight is larger)."""
    packing = packing_of(p)
    if packing is None:
        return p.shape
    return torch.Size(packing.size if d == packing.dim else n for d, n in enumerate(p.shape))


def packing_of(t: Any) -> Optional[Packing]:
    """The packing ``t`` (a parameter, or a tensor given its ``ParamState``) was re-laid with, else None."""
    return getattr(param_state(t), "packing", None)


def tag(y: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Mark ``y`` as a re-laid projection's output (features in ``packing``'s device-major order)."""
    return _TAG.put(y, packing)


def tag_of(t: Any) -> Optional[Packing]:
    """The packing ``tag`` marked ``t`` with, else None (any object: cheap enough for every op argument)."""
    return _TAG.of(t)


def block(y: torch.Tensor, packing: Packing, index: int) -> torch.Tensor:
    """Block ``index`` of a re-laid output ``y`` (features last): each device reads its own part (a
    padded block with its zero features). A copied block: ``[..., tp, size]``, device ``d`` reading copy ``d``."""
    tp, sizes = packing.tp, packing.sizes
    offset = sum(sizes[:index]) // tp
    n = sizes[index] // tp
    part = per_device(y, tp)[..., offset:offset + n]
    return part if index in packing.whole else part.flatten(-2)


def blocks_view(y: torch.Tensor, packing: Packing, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    """``y.view(*lead, n, *rest)`` in the original order, read in place: the features split into the ``n`` equal
    blocks of the packing, then each block's own dims (ModernBERT's ``qkv.view(b, s, 3, heads, d)``), when
    ``tp`` divides the first of them (whole heads per device). None if ``shape`` is not such a view."""
    lead, n = y.dim() - 1, len(packing.blocks)
    sizes = {size for _, size in packing.blocks}
    if (packing.padded or packing.whole or len(sizes) != 1 or len(shape) < lead + 3
            or tuple(shape[:lead]) != tuple(y.shape[:lead]) or shape[lead] != n):
        return None
    rest, (size,) = tuple(shape[lead + 1:]), sizes
    if math.prod(rest) != size or rest[0] % packing.tp:
        return None
    blocks = y.unflatten(-1, (packing.tp, n, size // packing.tp)).transpose(-3, -2)  # [..., n, tp, size / tp]
    return blocks.reshape(*shape[:lead], n, *rest)


@dataclass(frozen=True)
class Heads:
    """The tag of a re-laid output viewed as heads of ``head`` features (``heads_view``)."""

    packing: Packing
    head: int


def heads_view(y: torch.Tensor, packing: Packing, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
    """``y.view(*lead, heads, head)`` in the original order (Falcon's multi-query ``qkv.view(b, s, heads + 2, d)``),
    kept device-major as ``[..., laid / head, head]`` and tagged ``Heads`` for the slicing of its heads
    (``heads_piece``); None if ``shape`` is not such a view (each block and each device's share whole heads,
    nothing padded)."""
    lead = y.dim() - 1
    if packing.padded or len(shape) != lead + 2 or tuple(shape[:lead]) != tuple(y.shape[:lead]):
        return None
    head = shape[-1]
    if shape[-2] * head != packing.size or any(n % head for _, n in packing.blocks) or (packing.laid_size // packing.tp) % head:
        return None
    return _TAG.put(y.unflatten(-1, (packing.laid_size // head, head)), Heads(packing, head))


def heads_piece(y: torch.Tensor, heads: Heads, start: int, stop: int) -> Optional[torch.Tensor]:
    """Heads ``[start, stop)`` of a ``heads_view`` (original numbering) if they are whole blocks, read in place;
    a copied block of one head as ``[..., 1, head]`` carrying its copies (``copies.copied_head``)."""
    packing, d = heads.packing, heads.head
    flat = y.flatten(-2)
    i = next((i for i, b in enumerate(packing.blocks) if b == (start * d, (stop - start) * d)), None)
    if i in packing.whole and stop - start == 1:
        return copied_head(block(flat, packing, i))
    got = pieces(flat, packing, [(start * d, stop * d)])
    return None if got is None else got[0].unflatten(-1, (-1, d))


def unpermute(y: torch.Tensor, packing: Packing | Heads) -> torch.Tensor:
    """A re-laid output back in the original feature order, padding dropped (moves data: only for uses
    xla_tp cannot see)."""
    if isinstance(packing, Heads):
        return unpermute(y.flatten(-2), packing.packing).unflatten(-1, (-1, packing.head))
    return torch.cat([merged(block(y, packing, i), packing.groups_of(i)) if i in packing.whole
                      else block(y, packing, i)[..., :n] for i, (_, n) in enumerate(packing.blocks)], dim=-1)


def pieces(y: torch.Tensor, packing: Packing, ranges: list[tuple[int, int]]) -> Optional[list[torch.Tensor]]:
    """The slices ``[start, stop)`` of the original features, if each is a run of whole blocks: a block read
    in place (a copied one as ``copies.copied_block``), several as one re-laid output of their own (``run``)."""
    starts = {start: i for i, (start, _) in enumerate(packing.blocks)}
    ends = {start + n: i for i, (start, n) in enumerate(packing.blocks)}
    out = []
    for start, stop in ranges:
        if start not in starts or stop not in ends:
            return None
        indices = range(starts[start], ends[stop] + 1)
        if len(indices) > 1:  # several blocks: still re-laid, as one output of their own
            out.append(run(y, packing, indices))
        else:
            i = indices[0]
            out.append(copied_block(block(y, packing, i), packing.groups_of(i)) if i in packing.whole
                       else block(y, packing, i))
    return out


def run(y: torch.Tensor, packing: Packing, indices: range) -> torch.Tensor:
    """Blocks ``indices`` of a re-laid output ``y`` as one re-laid output of their own (each
    device's parts side by side, tagged with the packing of just these blocks): Mamba2's ``[x | B | C]``, split
    again after a convolution over its channels (``channels``)."""
    tp, sizes = packing.tp, packing.sizes
    offset = sum(sizes[:indices[0]]) // tp
    n = sum(sizes[i] for i in indices) // tp
    first = packing.blocks[indices[0]][0]
    blocks = tuple((start - first, size) for start, size in packing.blocks[indices[0]:indices[-1] + 1])
    whole = frozenset(i - indices[0] for i in indices if i in packing.whole)
    padded = tuple(packing.padded[i] for i in indices) if packing.padded else ()
    groups = tuple(packing.groups[i] for i in indices) if packing.groups else ()
    part = per_device(y, tp)[..., offset:offset + n].flatten(-2)
    return tag(part, Packing(packing.dim, blocks, tp, padded, whole, groups))


def packed_blocks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """A packed weight's ``n`` equal blocks along dim 0 (re-laid or not), each ``[size / n, ...]``."""
    return [b.movedim(-1, 0) for b in output_blocks(t.movedim(0, -1), packing_of(t), n)]


def output_blocks(y: torch.Tensor, packing: Optional[Packing], n: int) -> list[torch.Tensor]:
    """The ``n`` equal blocks of ``y``'s last dim, the output of a packed projection re-laid as ``packing`` (or
    in its original order: None), each read in place."""
    return list(y.chunk(n, -1)) if packing is None else [block(y, packing, i) for i in range(n)]
