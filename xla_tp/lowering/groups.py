"""Column-parallel projections that read the same input, with one gradient reduction between them.

q, k and v (or gate and up) read the same activation ``x``. Each one's input gradient ``dy_i @ W_i``
contracts its split output dimension, so it is a partial sum; GSPMD all-reduces each of them before
adding them up: three all-reduces of ``x``'s size where Megatron needs one. Members of one shape (gate
and up; q, k and v without grouped-query heads) are computed as one contraction with their weights
stacked (``stacked_linear``): autograd's input gradient contracts the member and feature dims at once,
one partial sum, one all-reduce, and the stacked weights take one weight gradient. Members of different
shapes go through ``GroupedLinear``: the forwards as usual and, in backward, the input gradient as ONE
contraction over the members' split rows laid side by side device-major (each device's rows of q, k and
v next to each other, so nothing moves). The stacked form is the cheaper to trace: no Python backward,
no re-laid blocks.

A group is found by its members' weights: ``F.linear(x, W, b)`` inside a parallelized forward
(``entry``'s ``F.linear`` handler, in the member that owns it) with ``W`` a member's weight asks the group, whose first member called with some
``x`` computes every member for that ``x``; a member called with the same ``x`` object gets its
cached output; a member called with another ``x`` computes alone (a speculative output nobody reads
is dead code the compiler drops). Subclasses that add to ``F.linear`` (LoRA) keep their additions.
Example::

    install_group([attn.q_proj, attn.k_proj, attn.v_proj], tp=4)
    q = attn.q_proj(x)        # computes q, k and v
    k = attn.k_proj(x)        # the cached k
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..state import drop_implied_output, ensure_param_state, param_state
from . import context, copies, scope
from .blocks import laid, per_device
from .packed import packing_of


class GroupedLinear(torch.autograd.Function):
    """``(x, W_1, b_1, ..., W_k, b_k) -> (x W_1^T + b_1, ...)`` with one fused input gradient."""

    @staticmethod
    def forward(ctx: Any, tp: int, x: torch.Tensor, *params: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        weights, biases = params[0::2], params[1::2]
        ctx.tp, ctx.biased, ctx.keep_dims = tp, [b is not None for b in biases], context.splits_sequence(x)
        ctx.save_for_backward(x, *weights)
        if ctx.keep_dims:
            return tuple(context.linear(x, w, b) for w, b in zip(weights, biases))
        return tuple(torch._C._nn.linear(x, w, b) for w, b in zip(weights, biases))  # not the lowered F.linear

    @staticmethod
    def backward(ctx: Any, *dys: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        x, *weights = ctx.saved_tensors
        live = [(dy, w) for dy, w in zip(dys, weights) if dy is not None]
        dx = None
        if live and ctx.needs_input_grad[1]:  # [..., tp * S] @ [tp * S, in]: each device's rows of every member
            rows = laid(*(dy for dy, _ in live), tp=ctx.tp)
            mats = laid(*(w for _, w in live), tp=ctx.tp, dim=0)
            dx = torch.einsum("...k,ki->...i", rows, mats) if ctx.keep_dims else torch.matmul(rows, mats)
        x2 = x if ctx.keep_dims else x.reshape(-1, x.shape[-1])  # a sequence split over a context axis: no reshape
        grads: list[Optional[torch.Tensor]] = []
        for i, (dy, biased) in enumerate(zip(dys, ctx.biased)):
            wants_w, wants_b = ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i]
            dy2 = None if dy is None else dy if ctx.keep_dims else dy.reshape(-1, dy.shape[-1])
            if dy2 is not None and wants_w:
                grads.append(torch.einsum("...o,...i->oi", dy2, x2) if ctx.keep_dims else dy2.t().mm(x2))
            else:
                grads.append(None)
            grads.append(dy2.reshape(-1, dy2.shape[-1]).sum(0) if dy2 is not None and biased and wants_b else None)
        return (None, dx, *grads)


class ColumnGroup:
    """Members (``nn.Linear``s split on their output rows over ``tp`` devices) and the last call's outputs."""

    def __init__(self, members: Sequence[nn.Linear], tp: int):
        self.members = [weakref.ref(m) for m in members]
        self.tp = tp
        self._x: Optional[torch.Tensor] = None
        self._outputs: dict[int, tuple[Any, ...]] = {}  # id(weight) -> (weight, bias, output)

    def output(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The output of the member whose weight (and bias) these are, for ``x``; None when no member
        has them (a tensor swapped in for the call), ``x`` is on no device the group computes on, or no
        gradient will be taken on XLA (the grouping is for the backward; JAX differentiates the forward)."""
        if x.device.type not in ("xla", "jax") or (x.device.type == "xla" and not torch.is_grad_enabled()):
            return None  # without a backward (inference, generation) each member is its own F.linear
        if self._x is not x:
            mods = [m() for m in self.members]
            if any(m is None for m in mods):
                return None
            pairs = [(m.weight, m.bias) for m in mods]
            if not any(w is weight and b is bias for w, b in pairs):
                return None
            self._compute(x, pairs)
        hit = self._outputs.pop(id(weight), None)
        return hit[2] if hit is not None and hit[0] is weight and hit[1] is bias else None

    def _compute(self, x: torch.Tensor, pairs: list[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> None:
        if x.device.type == "xla":
            params = [copies.summed(t, packing_of(t)) for pair in pairs for t in pair]  # copied blocks
            weights, biases = params[0::2], params[1::2]
            outputs = (stacked_linear(self.tp, x, weights, biases) if stackable(weights, biases)
                       else GroupedLinear.apply(self.tp, x, *params))
        else:  # torchax: JAX differentiates the forward, so the forward itself is one contraction
            outputs = stacked_linear(self.tp, x, [w for w, _ in pairs], [b for _, b in pairs])
        self._x, self._outputs = x, {id(w): (w, b, y) for (w, b), y in zip(pairs, outputs)}
        scope.on_exit(self.clear)  # the outputs are held until the outermost parallelized forward ends

    def clear(self) -> None:
        """Forget the last call (its tensors are held until then)."""
        self._x, self._outputs = None, {}

    def stacks(self) -> bool:
        """Whether the members are computed stacked (``stackable``): their weights (and biases) then take one
        gradient, reduced over the batch axes as one tensor."""
        mods = [m() for m in self.members]
        return all(m is not None for m in mods) and stackable([m.weight for m in mods], [m.bias for m in mods])


def stacked_gradients(model: nn.Module) -> dict[int, tuple[int, str]]:
    """``id(parameter) -> key`` for the weights and biases of ``model``'s groups computed stacked: parameters of
    one key take one gradient, reduced as one tensor (the ids are for the caller's loop, not to be kept)."""
    keys = {}
    for m in model.modules():
        ps = param_state(m.weight) if isinstance(m, nn.Linear) else None
        if ps is not None and ps.group is not None and ps.group.stacks():
            keys.update({id(p): (id(ps.group), kind) for kind, p in (("weight", m.weight), ("bias", m.bias))
                         if p is not None})
    return keys


def stackable(weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether the members stack as they are: one weight shape, and biases on all of them or on none."""
    return len({w.shape for w in weights}) == 1 and len({b is None for b in biases}) == 1


def _stacked(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``params`` stacked on a new leading dim, each gradient its own tensor: ``torch.stack``'s backward hands each
    parameter a view of one stacked gradient, which autograd keeps as the parameter's ``.grad``, and accumulating
    into such views traces another program every step; an ``expand``'s backward sums over the new dim instead."""
    return torch.cat([p.expand(1, *p.shape) for p in params])


def stacked_linear(tp: int, x: torch.Tensor, weights: Sequence[torch.Tensor],
                   biases: Sequence[Optional[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The members' outputs from one contraction; differentiating it gives one input gradient. Members that
    ``stackable`` calls so are stacked on a new leading dim (each member's split rows where they are);
    others have their rows laid device-major (each device's rows of every member side by side: nothing moves).

    >>> ws, bs = [torch.randn(4, 3), torch.randn(4, 3)], [None, None]
    >>> x = torch.randn(2, 3)
    >>> all(torch.allclose(y, x @ w.t()) for y, w in zip(stacked_linear(2, x, ws, bs), ws))
    True
    """
    if stackable(weights, biases):
        y = torch.einsum("...i,mfi->m...f", x, _stacked(weights))       # [members, ..., out]
        if biases[0] is not None:
            y = y + _stacked(biases).view(len(biases), *[1] * (x.dim() - 1), -1)
        return torch.unbind(y, 0)  # not ``Tensor.unbind``, whose ``rejoin`` effect would remember the pieces
    stacked = torch.cat([per_device(w, tp, 0) for w in weights], dim=1)       # [tp, S, in]
    y = torch.einsum("...i,tsi->...ts", x, stacked)
    outputs, start = [], 0
    for w, b in zip(weights, biases):
        rows = w.shape[0] // tp
        out = y[..., start:start + rows].flatten(-2)
        outputs.append(out if b is None else out + b)
        start += rows
    return tuple(outputs)


def groupable(module: nn.Module, tp: int) -> bool:
    """An ``nn.Linear`` whose output rows ``tp`` divides (the group lays them out device-major; a re-laid packed
    weight's as laid out)."""
    return isinstance(module, nn.Linear) and module.weight.shape[0] % tp == 0


def install_group(members: Sequence[nn.Linear], tp: int) -> ColumnGroup:
    """Make ``members`` one group (their weights' ``ParamState.group``); returns it."""
    group = ColumnGroup(members, tp)
    for m in members:
        ensure_param_state(m.weight).group = group
        drop_implied_output(m)  # its output stays inside the program: the weights' split says it all
    return group


def uninstall_groups(model: nn.Module) -> None:
    """Take every parameter of ``model`` out of its group."""
    for p in model.parameters():
        ps = param_state(p)
        if ps is not None:
            ps.group = None
