"""The rewrites of torch functions in a parallelized forward: handlers of the lowering mode, owned by modules.

``HANDLERS`` maps a torch function to its rewrite; ``mode.Lowering`` calls it for that function while it
is entered, which is only around the modules that own a rewrite (``owners``: a module whose own forward
calls one of its ops on what the rewrite concerns, found in the model's trace), and an ``nn.Linear`` or
``nn.Embedding`` owner's lowered class calls ``linear`` or ``embedding.lookup`` itself. Outside, every torch
function is torch's own. A handler acts
only on what it concerns (XLA or torchax tensors, parameters xla_tp marked, inside a parallelized
forward: ``scope.lowering()``) and returns ``NotImplemented`` for anything else (the function then runs
as it is):

- ``scaled_dot_product_attention``, 4-D ``matmul``, ``multi_head_attention_forward``: attention with the
  head dimension visible to the compiler (``attention``); ``layer_norm`` spelled out (torch_xla's
  gathers a batch split over data);
- ``embedding``: a vocabulary-split table's per-device weight gradient (``embedding``, ``tied``);
- ``linear``, ``addmm``, ``x @ w.T``: column groups with one input gradient (``groups``), tied LM heads
  (``tied``), copied blocks (``copies``), and re-laid packed projections' outputs tagged for the model's
  own slicing (``mode``);
- ``where``, ``nonzero``: an expert's tokens chosen by value in an MoE module that loops over its
  experts: a static number of positions (``selection``);
- ``repeat`` along dimension 0: the tokens stacked experts are computed for, repeated once per expert
  (``dataflow.stacked``), or into new leading dims (Gemma 3n's AltUp), as a broadcast the partitioner keeps
  split (``owners``: the module repeating them);
- ``getitem``: torch_xla 2.9 raises ``Value out of range`` for a slice bound past a dimension
  (``x[..., -4095:, :]`` on 16 rows, which transformers' sliding-window caches do in the attention
  module), where the CPU clamps: retried clamped.

Three rewrites stay process-wide effects (``compat``), each where no module owns the call: ``histc`` (XLA
has no histogram of integers; routers' auxiliary losses count expert choices with it in the model's own
forward or in the user's loss), ``masked_scatter`` (multimodal models put image features in place with it
in their own forward, reached only by an image call) and ``keep_causal_mask`` (transformers reads the mask
on the host before any attention module runs); the features ``masked_scatter`` places are concatenated from
their pieces there too (``rejoin``). Example::

    with mode.active():                    # what an owner's hooks do around its forward
        F.scaled_dot_product_attention(q, k, v)    # inside a parallelized forward: two einsums
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..axes import spec_entry
from ..batch import batch_split, ways
from ..dataflow.indexing import indexed_dims
from ..state import param_state
from . import attention, context, copies, embedding as vocab, packed, scope, selection, slots, tied, transposed


GETITEM = torch._C.TensorBase.__getitem__  # x[i], as a mode sees it


def _is_xla(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type in ("xla", "jax")


def spelled_layer_norm(x: torch.Tensor, normalized_shape: Any, weight: Optional[torch.Tensor] = None,
                       bias: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` written out (same values)."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    y = y * weight if weight is not None else y
    return y + bias if bias is not None else y


def clamp_slices(index: Any, shape: tuple[int, ...]) -> Any:
    """``index`` with out-of-range slice bounds clamped to the dims they index; None if none is.

    >>> clamp_slices((Ellipsis, slice(-4095, None), slice(None)), (2, 16, 8))
    (Ellipsis, slice(-16, None, None), slice(None, None, None))
    """
    items = index if isinstance(index, tuple) else (index,)
    if not any(isinstance(i, slice) for i in items) or any(isinstance(i, torch.Tensor) for i in items):
        return None
    out, changed = [], False
    for i, d in zip(items, indexed_dims(items, len(shape))):
        if isinstance(i, slice) and d < len(shape):
            n = shape[d]
            start, stop = (None if b is None else max(-n, min(n, b)) for b in (i.start, i.stop))
            changed |= (start, stop) != (i.start, i.stop)
            i = slice(start, stop, i.step)
        out.append(i)
    if not changed:
        return None
    return tuple(out) if isinstance(index, tuple) else out[0]


def _when_lowering(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` inside a parallelized forward (``scope.lowering()``); NotImplemented elsewhere."""
    def lowered(*args: Any, **kwargs: Any) -> Any:
        return handler(*args, **kwargs) if scope.lowering() else NotImplemented
    return lowered


def _sdpa(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    return attention.sdpa(query, *args, **kwargs) if _is_xla(query) else NotImplemented


def _matmul(a: Any, b: Any = None, **kwargs: Any) -> Any:
    b = kwargs.get("other", b)
    if "out" in kwargs or not (_is_xla(a) and _is_xla(b)):
        return NotImplemented
    if a.dim() >= 4 and b.dim() >= 4:
        return attention.matmul_4d(a, b)
    weight = transposed.parameter_of(b)
    # ``x @ w.T`` (Falcon's ``FalconLinear``) is ``F.linear(x, w)``: the same groups, packings and copies
    if weight is None:
        return NotImplemented
    out = linear(a, weight)
    return F.linear(a, weight) if out is NotImplemented else out


def _mha(*args: Any, **kwargs: Any) -> Any:
    bound = dict(zip(attention.MHA_ARGS, args), **kwargs)
    if not _is_xla(bound["query"]) or not attention.mha_supported(bound):
        return NotImplemented
    return attention.mha(**bound)


def _layer_norm(x: Any, *args: Any, **kwargs: Any) -> Any:
    return spelled_layer_norm(x, *args, **kwargs) if _is_xla(x) else NotImplemented


def _histc(x: Any, bins: int = 100, min: float = 0, max: float = 0, **kwargs: Any) -> Any:
    return slots.histogram(x, bins, min, max) if _is_xla(x) and not kwargs else NotImplemented


def histc(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.histc`` (a ``compat`` effect): inside a parallelized model, its unsharded reference (the
    audit's) included, XLA tensors counted by comparisons; anywhere else the original."""
    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        out = _histc(*args, **kwargs) if scope.inside() else NotImplemented
        return original(*args, **kwargs) if out is NotImplemented else out
    return counted


def placed(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``x.masked_scatter(mask, source)`` in static shapes: the k-th True of ``mask`` (row-major) takes the
    k-th element of ``source``. torch_xla lowers ``masked_scatter`` through ``nonzero``, whose dynamic shape
    GSPMD refuses on a batch split over devices (multimodal models put image features in place with it).
    When each row (batch entry), or else each block of rows of the batch split, holds the same share of
    ``source`` (``row_groups``: an image per row, or images of different sizes whose features the tower
    made in the rows' order), each reads its own block of ``source``, which stays on the devices of its
    batch shard; otherwise the k-th True counts across the whole batch.

    >>> placed(torch.zeros(2, 3), torch.tensor([[True, False, True], [False, True, False]]), torch.arange(1., 4.))
    tensor([[1., 0., 2.],
            [0., 3., 0.]])
    """
    rows = mask.expand_as(x).reshape(x.shape[0] if x.dim() > 1 else 1, -1)  # a row per batch entry, kept split
    groups = row_groups(rows, source, batch_ways(rows.shape[0]))
    if groups:
        return placed_in_groups(x, mask, source, groups)
    within = rows.to(torch.int32).cumsum(1)
    before = within[:, -1].cumsum(0) - within[:, -1]  # Trues of the rows before: one number per row moves
    order = (within + before[:, None] - 1).clamp(0, max(source.numel() - 1, 0))
    return torch.where(rows, source.reshape(-1)[order].to(x.dtype), x.reshape(rows.shape)).view(x.shape)


def row_groups(rows: torch.Tensor, source: torch.Tensor, ways: int = 1) -> int:
    """How many groups of consecutive rows of the mask ``rows`` (one per batch entry) each hold exactly their
    equal share of ``source``'s elements (then group ``g``'s Trues take block ``g`` of ``source``, as they would
    counting across the batch): every row, else the ``ways`` blocks of rows of the batch split; 0 when neither.
    The counts are read on the host (transformers reads their total on the host already, to check it).

    >>> row_groups(torch.tensor([[True, False, True], [True, True, False]]), torch.arange(4.))
    2
    >>> row_groups(torch.tensor([[True, True, True], [False, True, False]]), torch.arange(4.))
    0
    >>> row_groups(torch.tensor([[True, True, True], [False, True, False], [True, True, False], [True, True, False]]),
    ...            torch.arange(8.), ways=2)
    2
    """
    n, b = source.numel(), rows.shape[0]
    if n == 0 or torch.compiler.is_compiling():
        return 0
    counts = rows.sum(1)
    for groups in (b, ways):
        if groups > 1 and b % groups == 0 and n % groups == 0 and bool((counts.view(groups, -1).sum(1) == n // groups).all()):
            return groups
    return b if b == 1 and int(counts.sum()) == n else 0


def batch_ways(b: int) -> int:
    """Devices the running model splits a batch of ``b`` rows over (1 outside a parallelized forward): its batch
    axes that ``b`` divides (``batch.batch_split``)."""
    state = scope.current() if scope.lowering() else None
    sharder = getattr(state, "sharder", None)
    if sharder is None:
        return 1
    return ways(batch_split(b, tuple(state.layout.batch_axes), sharder.sizes), sharder.sizes)


def placed_in_groups(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, groups: int) -> torch.Tensor:
    """``placed`` where each of ``groups`` groups of rows takes its own block of ``source`` (``row_groups``): a
    gather within each group, of whole feature vectors where the mask is broadcast over ``x``'s last dimension
    (transformers' ``[batch, tokens, 1]`` mask), which keeps the rows' batch split."""
    width = x.shape[-1] if x.dim() > 1 and mask.shape[-1] == 1 else 1  # elements placed together
    if source.numel() % (groups * width):
        width = 1
    cells = _split_rows(x.reshape(groups, -1, width))
    chosen = mask.expand_as(x).reshape(cells.shape)[..., 0]  # [groups, cells]: all or none of a cell's elements
    blocks = _split_rows(_split_rows(source).reshape(groups, -1, width).to(x.dtype))  # split before and after
    order = _split_rows((chosen.to(torch.int32).cumsum(1) - 1).clamp(0, blocks.shape[1] - 1).long())
    found = blocks.gather(1, order[..., None].expand(-1, -1, width))
    return torch.where(chosen[..., None], found, cells).view(x.shape)


def _split_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a row per batch entry) split over the running model's batch axes on its rows, where they divide
    them (no running model, or a reference run of the plain computation: ``t``)."""
    state = scope.current() if scope.lowering() else None
    sharder = getattr(state, "sharder", None)
    if sharder is None or not sharder.applies(t):
        return t
    batch = batch_split(t.shape[0], tuple(state.layout.batch_axes), sharder.sizes)
    return sharder.constrain(t, (spec_entry(batch), *[None] * (t.dim() - 1)))


def masked_scatter(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.masked_scatter`` (a ``compat`` effect): inside a parallelized model, XLA tensors placed in
    static shapes (``placed``); anywhere else the original."""
    @functools.wraps(original)
    def scattered(x: Any, mask: Any, source: Any) -> Any:
        if scope.inside() and _is_xla(x) and source.numel() > 0:
            return placed(x, mask, source)
        return original(x, mask, source)
    return scattered


def _projected(y: torch.Tensor, packing: Optional[packed.Packing], out_dim: int) -> torch.Tensor:
    """A projection's output; a re-laid packed one's tagged for the packed-output mode, or (outside
    the modules that slice it, where nothing would read the tag) put back in the original order. A
    weight re-laid along the features it contracts (a row projection's zero inputs), or padded in one
    block at its end, gives an output in its plain order: no tag. ``packing``: the weight's."""
    if packing is None or not packing.relays_output(out_dim):
        return y
    if scope.in_site():
        return packed.tag(y, packing)  # the mode sees the tag on the handler's output
    warnings.warn("xla_tp: a re-laid packed projection is read outside the module that slices it; its "
                  "output is put back in the original order, which moves data between devices", stacklevel=3)
    return packed.unpermute(y, packing)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Any:
    """``F.linear`` of a parallelized parameter: column groups, tied heads, copies and packed outputs."""
    ps = param_state(weight)
    if ps is None or not scope.lowering():  # a projection of a sequence split over a context axis keeps it
        return context.linear(x, weight, bias) if ps is None and context.splits_sequence(x) else NotImplemented
    out = ps.group.output(x, weight, bias) if ps.group is not None else None
    if out is None and ps.tie is not None:
        out = tied.head(x, weight, bias)
    if out is None:  # copied blocks' copies get the sum of their gradients
        w, b = copies.summed(weight, ps.packing), copies.summed(bias, packed.packing_of(bias))
        out = context.linear(x, w, b) if context.splits_sequence(x) else F.linear(x, w, b)
    return _projected(out, ps.packing, 0)


def _addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``torch.addmm(bias, x, weight)`` (HF ``Conv1D``) of a parallelized parameter: packed outputs."""
    ps = param_state(mat2)
    if ps is None or "out" in kwargs or not scope.lowering():
        return NotImplemented
    summed = copies.summed(input, packed.packing_of(input)), copies.summed(mat2, ps.packing)
    return _projected(torch.addmm(summed[0], mat1, summed[1], *args, **kwargs), ps.packing, 1)


def _getitem(self: torch.Tensor, index: Any) -> Any:
    """``x[index]``, retried with clamped slice bounds where torch_xla refuses them."""
    if torch.compiler.is_compiling():  # dynamo records ``x[index]`` itself (and cannot call the builtin)
        return NotImplemented
    try:
        return GETITEM(self, index)
    except RuntimeError as error:
        if not (scope.inside() and _is_xla(self) and "out of range" in str(error)):
            raise
        fixed = clamp_slices(index, tuple(self.shape))
        if fixed is None:
            raise
        return GETITEM(self, fixed)


def _repeat(x: Any, *sizes: Any) -> Any:
    """``x.repeat(n, 1, ...)`` (copies along dimension 0 only) as a broadcast and a reshape, and
    ``x.repeat(n, 1, ..., 1)`` that stacks copies in new leading dims (Gemma 3n's AltUp:
    ``innovation.repeat(2, 1, 1, 1)``) as the broadcast it is: the same values. torch_xla lowers ``repeat``
    to a concatenation, which GSPMD lays out with all-to-alls when the copies are split over one axis and
    their rows over another (the tokens of stacked experts, ``dataflow.stacked``), or when ``x``'s batch is
    split (AltUp)."""
    sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else sizes
    new = len(sizes) - x.dim() if isinstance(x, torch.Tensor) else -1
    if not _is_xla(x) or x.dim() == 0 or new < 0 or any(int(s) != 1 for s in sizes[new + (new == 0):]):
        return NotImplemented
    if new:
        return x.expand(*sizes[:new], *x.shape).clone()
    n = int(sizes[0])
    return x.unsqueeze(0).expand(n, *x.shape).reshape(n * x.shape[0], *x.shape[1:])


def keep_causal_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``_ignore_causal_mask_sdpa``: False for XLA tensors (the mask is kept, as when
    tracing), without reading them; the same result either way, the mask being causal."""
    @functools.wraps(original)
    def unread(padding_mask: Any, q_length: int, kv_length: int, q_offset: Any, *args: Any, **kwargs: Any) -> bool:
        if scope.inside() and (_is_xla(padding_mask) or _is_xla(q_offset)):
            return False
        return original(padding_mask, q_length, kv_length, q_offset, *args, **kwargs)
    return unread


def gqa_in_sdpa(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``use_gqa_in_sdpa``: True for XLA tensors inside a parallelized forward (xla_tp's SDPA
    takes grouped keys and values with any mask, repeating them after a context split's gather); with a mask
    transformers would repeat them first (``repeat_kv``), a reshape GSPMD lays out with all-to-alls when the
    sequence is split over a context axis."""
    @functools.wraps(original)
    def grouped(attention_mask: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> bool:
        if scope.inside() and _is_xla(key) and key.shape[-1] == value.shape[-1]:
            return True
        return original(attention_mask, key, value, *args, **kwargs)
    return grouped


_MATMUL = _when_lowering(_matmul)
HANDLERS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.scaled_dot_product_attention: _when_lowering(_sdpa),
    torch.matmul: _MATMUL, torch.Tensor.matmul: _MATMUL, torch.Tensor.__matmul__: _MATMUL,
    F.multi_head_attention_forward: _when_lowering(_mha),
    F.layer_norm: _when_lowering(_layer_norm),
    F.embedding: _when_lowering(vocab.lookup),
    F.linear: linear, torch.addmm: _addmm,
    torch.where: _when_lowering(selection.where),
    torch.nonzero: _when_lowering(selection.nonzero), torch.Tensor.nonzero: _when_lowering(selection.nonzero),
    GETITEM: _getitem, torch.Tensor.repeat: _when_lowering(_repeat),
}
# the trace's names of the calls a module owns a rewrite for (``owners``)
ATTENTION_OPS = frozenset({"scaled_dot_product_attention", "multi_head_attention_forward", "layer_norm", "where",
                           "nonzero"})
WEIGHT_OPS = frozenset({"linear", "addmm", "matmul", "embedding"})
REPEAT = "repeat"  # owned where it stacks copies in new leading dims (``_repeat``), or of stacked experts' tokens
