"""Mixture-of-experts layers on XLA: static shapes, split over the model axis, one reduction of the tokens.

``run(experts, hidden, ids, weights, gate)`` computes a routed expert MLP (``gate_up [E, 2I, H]``,
``down [E, H, I]``) for ``hidden [T, H]`` whose router chose ``ids [T, k]`` with ``weights [T, k]``.
Dropless (the default, ``MoeOptions``) it takes the grouped route where its kernel runs (TPU:
``ragged``, tokens sorted by expert into grouped matmuls); otherwise, and with a capacity factor, the
slots route below: tokens go to fixed-size slots (``slots``), each slot's token is gathered, every
expert runs on its slots as one batched contraction, and each slot's output is added back to its token.

The computation carries an explicit chunk dimension ``t`` of the model axis's size, split over that
axis, so every step is local to a device and the one cross-device step is the final sum over ``t``:
GSPMD compiles it to one all-reduce of ``[tokens, hidden]`` per layer (and one in the backward,
where the tokens' gradient is summed over ``t``), a dense MLP's minimum. What ``t`` splits is the
layout (``ExpertSet.layout``):

- ``expert-parallel``: chunk ``t`` holds experts ``t*E/N .. (t+1)*E/N`` whole and their slots;
- ``expert-tensor-parallel``: chunk ``t`` holds every expert's slice ``t`` of the intermediate
  dimension (``gate_up`` re-laid device-major, so gate and up rows of a slice sit together) and
  every slot;
- ``replicated``: one chunk, everything on every device.

Both split layouts move the same bytes; expert-parallel holds ``1/N`` of the slots per device, so
its dispatched activations take ``1/N`` of the memory. On a mesh with an expert axis (``ep_axis``)
the experts are also split over it, an axis the batch is split over: each batch shard fills its
slots for every expert, then the slots change hands, from split by batch shard to split by expert
(one all-to-all), the experts run on the slots they hold, and the outputs go back the same way
(another): the dispatch of expert parallelism, written as two layouts of one tensor for the
compiler to connect. Tokens are routed within each batch shard
(``groups``): routing never crosses the data axes. ``MoeOptions`` sets the capacity factor and
``dropless``; each forward's routed and dropped assignments are kept (``ExpertSet.last``). Example::

    es = ExpertSet("expert-parallel", chunks=4, axis="model", sharder=XlaSharder(mesh), batch=("data",), groups=2)
    y = run(es, hidden, ids, weights, gate=lambda g, u: F.silu(g) * u, gate_up=w13, down=w2)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..axes import spec_entry
from . import ragged, slots as slotting

Gate = Callable[..., torch.Tensor]  # (gate rows' output, up rows' output) -> activation; one argument when not gated
LAYOUTS = ("expert-parallel", "expert-tensor-parallel", "replicated")


ROUTES = ("auto", "grouped", "slots")


@dataclass
class MoeOptions:
    """How a parallelized model's MoE layers run. By default ``dropless``: every routed token reaches its
    experts, so the outputs are the model's own. ``route``: ``"grouped"`` sorts the tokens by expert and
    runs the experts as grouped matmuls (``lowering.ragged``: the routed FLOPs, on TPU's Pallas kernel);
    ``"slots"`` gives every expert fixed slots (``dropless``: one per token of the group, ``E / k`` times
    the routed FLOPs); ``"auto"`` takes ``"grouped"`` where its kernel runs (TPU) and the layout allows it
    (no expert axis), else ``"slots"``. With ``dropless=False`` (token dropping: a training recipe's
    choice) each expert takes ``capacity_factor`` x its even share of a group's assignments and the rest
    are dropped (counted: ``moe_report``)."""

    capacity_factor: float = 1.25
    dropless: bool = True
    route: str = "auto"

    def __post_init__(self) -> None:
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}; 1.25 is the usual value")
        if self.route not in ROUTES:
            raise ValueError(f"route={self.route!r}: pass one of {', '.join(ROUTES)}")


@dataclass
class ExpertSet:
    """How one experts module runs (``ParamState.experts`` of its weights)."""

    layout: str
    chunks: int  # model-axis devices the layout splits over (1: replicated)
    axis: Optional[str] = None  # the model axis
    sharder: Any = None  # an ``XlaSharder`` (None: no constraints, e.g. on the CPU)
    batch: tuple[str, ...] = ()  # mesh axes of the batch: one routing group per shard
    groups: int = 1
    relaid: bool = False  # gate_up re-laid device-major (expert-tensor-parallel)
    ep_axis: Optional[str] = None  # a batch axis that also splits the experts (slots routed per batch shard move
    # to them by all-to-all; one group of the whole batch, as torchtitan sorts it, is left to the compiler)
    weights: tuple = ()  # (gate_up name, stored [E, in, out], down name, stored [E, in, out]) on its module
    options: MoeOptions = field(default_factory=MoeOptions)
    last: dict[str, Any] = field(default_factory=dict)  # the last forward's "routed" (int) and "dropped" (tensor)

    def constrain(self, x: torch.Tensor, chunked: bool = True) -> torch.Tensor:
        """``x`` (``[t, G, ...]``, or ``[G, ...]`` unless ``chunked``) split over the model axis on ``t``
        and over the batch axes on ``G``: routing tables stay whole on the model axis."""
        if self.sharder is None:
            return x
        head = (self.axis if self.chunks > 1 else None,) if chunked else ()
        return self.sharder.constrain(x, (*head, spec_entry(self.batch), *[None] * (x.dim() - 1 - len(head))))

    def to_experts(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots ``[t, G, e, C, H]``, filled where their tokens are (``G`` split over the batch axes),
        moved to the devices of their experts (``e`` split over the expert axis, ``G`` over the other
        batch axes): one all-to-all. Without an expert axis, ``slots`` as they are."""
        return slots if self.ep_axis is None or not self.batch else self._at_experts(self.constrain(slots))

    def from_experts(self, y: torch.Tensor) -> torch.Tensor:
        """The experts' outputs ``[t, G, e, C, H]`` back to their tokens' devices as ``[t, G, e*C, H]``
        (the all-to-all of ``to_experts`` the other way)."""
        if self.ep_axis is None or not self.batch:
            return y.flatten(2, 3)
        return self.constrain(self._at_experts(y).flatten(2, 3))

    def _at_experts(self, x: torch.Tensor) -> torch.Tensor:
        rest = tuple(a for a in self.batch if a != self.ep_axis)
        head = self.axis if self.chunks > 1 else None
        return self.sharder.constrain(x, (head, spec_entry(rest), self.ep_axis, *[None] * (x.dim() - 3)))


def routing_groups(axis_sizes: dict[str, int], batch_axes: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """The batch axes of a mesh that split it (size > 1) and the routing groups they make (one per shard).

    >>> routing_groups({"data": 2, "fsdp": 1, "model": 4}, ("data", "fsdp"))
    (('data',), 2)
    """
    batch = tuple(a for a in batch_axes if axis_sizes.get(a, 1) > 1)
    return batch, math.prod(axis_sizes[a] for a in batch)


def _chunked_weights(es: ExpertSet, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up`` (``[E, 2I, H]`` packed, or ``[E, j, I, H]`` stacked: ``j`` 1 for experts with no gate) as
    ``[t, e, j, i, H]`` and ``down`` as ``[t, e, H, i]`` for the layout's chunks."""
    experts, hidden, c = gate_up.shape[0], gate_up.shape[-1], es.chunks
    j = gate_up.shape[1] if gate_up.dim() == 4 else 2
    inter = gate_up.shape[2] if gate_up.dim() == 4 else gate_up.shape[1] // 2
    if es.layout == "expert-tensor-parallel":
        up = (gate_up.reshape(experts, c, 2, inter // c, hidden).transpose(0, 1) if es.relaid and gate_up.dim() == 3
              else gate_up.reshape(experts, j, c, inter // c, hidden).permute(2, 0, 1, 3, 4))
        return up, down.reshape(experts, hidden, c, inter // c).permute(2, 0, 1, 3)
    return (gate_up.reshape(c, experts // c, j, inter, hidden), down.reshape(c, experts // c, hidden, inter))


def _chunked_biases(es: ExpertSet, up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The up bias (``[E, 2I]`` packed, or ``[E, j, I]`` stacked) as ``[t, e, j, i]`` and the down bias
    ``[E, H]`` as ``[t, e, H]``: under expert-tensor-parallel every chunk adds a partial down projection,
    so the down bias goes to chunk 0 only (the sum over ``t`` adds it once)."""
    experts, hidden, c = up.shape[0], down.shape[-1], es.chunks
    j = up.shape[1] if up.dim() == 3 else 2
    up = up.reshape(experts, j, -1)
    if es.layout == "expert-tensor-parallel":
        first = (torch.arange(c, device=down.device) == 0).to(down.dtype)
        return (up.reshape(experts, j, c, -1).permute(2, 0, 1, 3), first[:, None, None] * down.unsqueeze(0))
    return up.reshape(c, experts // c, j, -1), down.reshape(c, experts // c, hidden)


def _chunked_slots(es: ExpertSet, table: torch.Tensor) -> torch.Tensor:
    """A ``[G, E*C]`` slot table as ``[t, G, slots of chunk t]``."""
    if es.layout == "expert-tensor-parallel":
        return table.unsqueeze(0).expand(es.chunks, *table.shape)
    groups, n = table.shape
    return table.view(groups, es.chunks, n // es.chunks).transpose(0, 1)


def _chunked_weights_of_slots(es: ExpertSet, s: slotting.Slots, weights: torch.Tensor) -> torch.Tensor:
    """The routing weight of each slot of each chunk, ``[t, G, slots of chunk t]``. Expert-parallel: chunk ``t``
    scatters the weights of the assignments its own slots take, so the weights' gradient is each chunk's
    partial sum (one all-reduce of ``[G, Tg*k]``), not the whole slot table gathered on every device."""
    if es.layout != "expert-parallel":
        return _chunked_slots(es, es.constrain(s.weight, chunked=False))
    groups, n = s.weight.shape
    per = n // es.chunks
    first = torch.arange(es.chunks, device=s.slot.device).view(-1, 1, 1) * per
    local = s.slot.unsqueeze(0) - first  # [t, G, A]: the slot within chunk t
    local = torch.where((local >= 0) & (local < per), local, per)
    shares = es.constrain(weights.unsqueeze(0).expand(es.chunks, *weights.shape))
    return weights.new_zeros(es.chunks, groups, per + 1).scatter(2, local, shares)[..., :per]


def _groups(es: ExpertSet, tokens: int) -> int:
    """Routing groups for ``tokens`` tokens: one per batch shard, or one in all where they do not divide."""
    return es.groups if tokens % es.groups == 0 else 1


def even(es: ExpertSet, tokens: int, top_k: int, experts: int) -> tuple[ExpertSet, int]:
    """The unsharded reference of ``es`` (the audit's, lowering suspended) and its capacity: an even
    routing, whose expert FLOPs are the model's active-expert FLOPs."""
    groups = _groups(es, tokens)
    return ExpertSet("replicated", 1, groups=groups, weights=es.weights), max(1, math.ceil(tokens // groups * top_k / experts))


def dispatched_numel(es: ExpertSet, tokens: int, top_k: int, experts: int, width: int, sizes: dict[str, int]) -> int:
    """Elements per device that one all-to-all of ``run`` moves (0 without an expert axis): every slot of
    the device's routing groups, ``G / batch shards x E x C x H``."""
    if es.ep_axis is None:
        return 0
    groups = _groups(es, tokens)
    slots = slotting.capacity(tokens // groups, top_k, experts, es.options.capacity_factor, es.options.dropless)
    shards = math.prod(sizes.get(a, 1) for a in es.batch)
    return max(1, groups // shards) * experts * slots * width


def grouped_kernel(es: ExpertSet, tokens: int) -> Optional[ragged.Kernel]:
    """The grouped matmul ``es``'s layer runs on, or None for the slots route (see ``MoeOptions.route``)."""
    options = es.options
    if not options.dropless or options.route == "slots" or not ragged.supports(es, tokens):
        return None
    kernel = ragged.device_kernel()
    return kernel if kernel is not None or options.route == "auto" else ragged.ReferenceKernel()


def run(es: ExpertSet, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Gate,
        gate_up: torch.Tensor, down: torch.Tensor, capacity: Optional[int] = None,
        biases: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (see the module docstring); ``capacity`` overrides the
    options' slots per expert; ``biases``: the up projection's (``[E, 2I]``, or ``[E, 2, I]`` as ``gate_up``
    is stacked) and the down projection's (``[E, H]``)."""
    tokens, width = hidden.shape
    experts, k = gate_up.shape[0], ids.shape[-1]
    kernel = grouped_kernel(es, tokens) if capacity is None else None
    if kernel is not None:
        up, dn = _chunked_weights(es, gate_up, down)
        chunked = _chunked_biases(es, *biases) if biases is not None else None
        return ragged.run(es, hidden, ids, weights, gate, up, dn, kernel, experts, chunked)
    groups = _groups(es, tokens)
    per_group = tokens // groups
    if capacity is None:
        capacity = slotting.capacity(per_group, k, experts, es.options.capacity_factor, es.options.dropless)
    ids, weights = (es.constrain(t.reshape(groups, per_group, k), chunked=False) for t in (ids, weights))
    s = slotting.route(ids, weights, experts, capacity)
    es.last = {"routed": tokens * k, "dropped": s.dropped, "route": "slots", "slots": experts * capacity * groups}
    up, dn = _chunked_weights(es, gate_up, down)
    c, local = up.shape[0], up.shape[1]
    x = F.pad(hidden.reshape(groups, per_group, width), (0, 0, 0, 1))  # the zero row empty slots read
    x = es.constrain(x.unsqueeze(0).expand(c, *x.shape))
    token = _chunked_slots(es, es.constrain(s.token, chunked=False))
    where = token.unsqueeze(-1).expand(*token.shape, width)
    dispatched = es.to_experts(torch.gather(x, 2, where).view(c, groups, local, capacity, width))
    h = torch.einsum("tgech,tejih->tgecji", dispatched, up.to(dispatched.dtype))
    if biases is not None:
        up_bias, down_bias = _chunked_biases(es, *biases)
        h = h + up_bias[:, None, :, None].to(h.dtype)
    h = gate(*torch.unbind(h, -2))
    y = torch.einsum("tgeci,tehi->tgech", h, dn.to(h.dtype))
    if biases is not None:
        y = y + down_bias[:, None, :, None].to(y.dtype)
    y = es.from_experts(y)
    y = y * _chunked_weights_of_slots(es, s, weights.reshape(groups, per_group * k)).unsqueeze(-1).to(y.dtype)
    out = es.constrain(torch.zeros(c, groups, per_group + 1, width, dtype=y.dtype, device=y.device).scatter_add(2, where, y))
    return out[:, :, :per_group].sum(0).reshape(tokens, width)  # the empty slots' row cut before the reduction
