"""Dropless MoE at the routed FLOPs: tokens sorted by expert, the experts as grouped matmuls.

``run(es, hidden, ids, weights, gate, gate_up, down)`` computes what ``experts.run`` computes, dropless,
another way. In each routing group (a batch shard) every assignment (a token and one of its ``k``
choices) becomes a row; the rows are sorted by expert (stably: token order within an expert), so each
expert's rows are contiguous, and the expert MLP runs as two grouped matmuls over those groups of rows
(``gmm(rows [m, H], gate_up [E, 2I, H], group_sizes [E])``), then each row goes back to its token,
weighted by the router (a scatter-add). No expert gets a row it does not use: the kernel runs the row
tiles each group spans, at most one partial tile more per expert than the routed rows (``tile_flops``).

The grouped matmul is TPU's Pallas megablox kernel (``torch_xla.experimental.custom_kernel.gmm`` and
``tgmm``), which the SPMD partitioner cannot split: it runs on each device's own shard inside a
manual-sharding region (``xs.enable_manual_sharding``). The region is an autograd Function; its
backward enters the region again, recomputes the layer's forward there (activation checkpointing of
the layer: its intermediates are never kept) and differentiates it, the grouped matmuls through
``gmm`` (rows) and ``tgmm`` (experts). As in ``experts.run`` the computation carries a chunk
dimension ``t`` over the model axis: expert-tensor-parallel gives chunk ``t`` every expert's slice
``t`` of the intermediate features, expert-parallel its experts ``t*E/N ..`` (the kernel's
``group_offset``: rows of other experts come out zero); the one cross-device step is the sum over
``t``, one all-reduce of ``[tokens, hidden]`` per layer (and of the tokens' gradient in the backward),
a dense MLP's minimum.

Off TPU, or without jax and torchax, the same region runs ``ReferenceKernel``: the kernel's contract
(shapes, ``group_offset``, padding rows) in torch ops, every local expert over every row and masked
(exact; ``E`` times the routed FLOPs): what the tests run, and what a CPU run asking for
``route="grouped"`` gets. Every call is checked against the kernel's contract first (``check_call``).
Example::

    y = run(es, hidden, ids, weights, lambda g, u: F.silu(g) * u, gate_up, down)     # [T, H], dropless
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Protocol

import torch

from ..axes import spec_entry

Gate = Callable[..., torch.Tensor]  # (gate rows' output, up rows' output); one argument when not gated
TILE_K = TILE_N = 512  # the kernel's tiles of the contracted and output features (it masks a ragged last tile)
OVERHEAD = 0.15  # the share of rows a choice of row tile may add to the routed ones (one partial tile per expert)


def tile_rows(rows: int, experts: int) -> int:
    """The kernel's row tile for ``rows`` routed rows over ``experts`` local experts: the largest power of two
    from 16 to 512 whose one partial tile per expert adds at most ``OVERHEAD`` of the rows (16 when none does).

    >>> tile_rows(8192, 8), tile_rows(32768, 256), tile_rows(64, 8)
    (128, 16, 16)
    """
    tm = 512
    while tm > 16 and (experts - 1) * tm > OVERHEAD * rows:
        tm //= 2
    return tm


def tile_flops(group_sizes: list[int], tm: int, contracted: int, out: int, groups: Optional[range] = None) -> int:
    """FLOPs the kernel runs for one grouped matmul of the ``groups`` it computes (default: all; a device of an
    expert-parallel layout computes its own, ``group_offset`` on): every ``tm``-row tile a group spans, whole
    (a tile shared by two groups runs for each).

    >>> tile_flops([3, 5], tm=4, contracted=2, out=1), tile_flops([3, 5], 4, 2, 1, groups=range(1, 2))
    (48, 32)
    """
    tiles, start = 0, 0
    for g, size in enumerate(group_sizes):
        if size and (groups is None or g in groups):
            tiles += (start + size - 1) // tm - start // tm + 1
        start += size
    return 2 * tiles * tm * contracted * out


class Kernel(Protocol):
    """Grouped matmuls over contiguous groups of rows (megablox's contract)."""

    def gmm(self, lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, tiling: tuple[int, int, int],
            group_offset: torch.Tensor, transpose_rhs: bool) -> torch.Tensor:
        """``[m, n]``: rows of group ``offset + j`` times ``rhs[j]`` (``[e, k, n]``, or ``[e, n, k]`` transposed);
        rows of other groups zero; rows past every group unspecified."""

    def tgmm(self, lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, tiling: tuple[int, int, int],
             group_offset: torch.Tensor, num_actual_groups: int) -> torch.Tensor:
        """``[num_actual_groups, k, n]``: for group ``offset + j``, ``lhs[:, its rows] @ rhs[its rows]``."""


def check_call(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, tiling: tuple[int, int, int],
               group_offset: torch.Tensor) -> None:
    """``ValueError`` naming what breaks the kernel's contract: rows a multiple of the row tile, a 3-D ``rhs``,
    ``group_sizes`` 1-D int32, ``group_offset`` 0-d int32."""
    problems = []
    if lhs.dim() != 2 or lhs.shape[0] % tiling[0]:
        problems.append(f"lhs {tuple(lhs.shape)} must be 2-D with rows a multiple of the row tile {tiling[0]}")
    if rhs is not None and rhs.dim() != 3:
        problems.append(f"rhs {tuple(rhs.shape)} must be [groups, k, n]")
    if group_sizes.dim() != 1 or group_sizes.dtype != torch.int32:
        problems.append(f"group_sizes must be 1-D int32, got {group_sizes.dtype} {tuple(group_sizes.shape)}")
    if group_offset.dim() != 0 or group_offset.dtype != torch.int32:
        problems.append(f"group_offset must be a 0-d int32 tensor, got {group_offset.dtype} {tuple(group_offset.shape)}")
    if problems:
        raise ValueError("xla_tp grouped matmul: " + "; ".join(problems))


def _row_groups(group_sizes: torch.Tensor, rows: int, offset: torch.Tensor) -> torch.Tensor:
    """Each row's local group (``group - offset``; out of ``[0, e)`` for another device's groups and padding)."""
    ends = group_sizes.to(torch.int64).cumsum(0)
    group = (torch.arange(rows, device=ends.device).unsqueeze(-1) >= ends).sum(-1)
    return group - offset.to(torch.int64)


class ReferenceKernel:
    """The kernel's contract in torch ops, for any device: every local group over every row, masked."""

    def gmm(self, lhs, rhs, group_sizes, tiling, group_offset, transpose_rhs):
        check_call(lhs, rhs, group_sizes, tiling, group_offset)
        local = _row_groups(group_sizes, lhs.shape[0], group_offset)
        every = torch.einsum("mk,enk->emn" if transpose_rhs else "mk,ekn->emn", lhs, rhs)
        mine = (local.unsqueeze(0) == torch.arange(rhs.shape[0], device=lhs.device).unsqueeze(-1)).unsqueeze(-1)
        return torch.where(mine, every, torch.zeros((), dtype=every.dtype, device=every.device)).sum(0)

    def tgmm(self, lhs, rhs, group_sizes, tiling, group_offset, num_actual_groups):
        check_call(lhs.t(), None, group_sizes, tiling, group_offset)
        local = _row_groups(group_sizes, lhs.shape[1], group_offset)
        mine = (local.unsqueeze(-1) == torch.arange(num_actual_groups, device=lhs.device)).to(lhs.dtype)
        return torch.einsum("km,me,mn->ekn", lhs, mine, rhs)


class PallasKernel:
    """torch_xla's Pallas megablox kernels (TPU only)."""

    def __init__(self) -> None:
        from torch_xla.experimental import custom_kernel
        self.kernels = custom_kernel

    def gmm(self, lhs, rhs, group_sizes, tiling, group_offset, transpose_rhs):
        check_call(lhs, rhs, group_sizes, tiling, group_offset)
        return self.kernels.gmm(lhs, rhs, group_sizes, tiling=tiling, group_offset=group_offset,
                                transpose_rhs=transpose_rhs)

    def tgmm(self, lhs, rhs, group_sizes, tiling, group_offset, num_actual_groups):
        check_call(lhs.t(), None, group_sizes, tiling, group_offset)
        return self.kernels.tgmm(lhs, rhs, group_sizes, tiling=tiling, group_offset=group_offset,
                                 num_actual_groups=num_actual_groups)


@functools.lru_cache(maxsize=None)
def device_kernel() -> Optional[Kernel]:
    """The Pallas kernel where it runs (a TPU, with jax and torchax importable), else None."""
    try:
        import torch_xla.runtime as xr
        if xr.device_type() != "TPU":
            return None
        from ..backends.torchax import import_torchax
        import_torchax()
        return PallasKernel()
    except ImportError:
        return None


class _LocalGMM(torch.autograd.Function):
    """``kernel.gmm`` on one device's rows, differentiable: ``gmm`` for the rows' gradient, ``tgmm`` for the
    experts'. Rows outside this device's groups (``valid`` false) are zero, value and gradient."""

    @staticmethod
    def forward(ctx: Any, lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor, offset: torch.Tensor,
                valid: torch.Tensor, kernel: Kernel, tiling: tuple[int, int, int]) -> torch.Tensor:
        ctx.save_for_backward(lhs, rhs, sizes, offset, valid)
        ctx.kernel, ctx.tiling = kernel, tiling
        return _masked(kernel.gmm(lhs, rhs, sizes, tiling, offset, True), valid)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        lhs, rhs, sizes, offset, valid = ctx.saved_tensors
        grad = _masked(grad, valid)
        d_lhs = _masked(ctx.kernel.gmm(grad, rhs, sizes, ctx.tiling, offset, False), valid)
        d_rhs = ctx.kernel.tgmm(grad.t().contiguous(), lhs, sizes, ctx.tiling, offset, rhs.shape[0])
        return d_lhs, d_rhs, None, None, None, None, None


def _masked(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` where ``valid``, zeros elsewhere (not a product: the kernel leaves padding rows unset)."""
    return torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _local(kernel: Kernel, gate: Gate, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
           up: torch.Tensor, down: torch.Tensor, offset: torch.Tensor, experts: int,
           biases: Optional[tuple[torch.Tensor, torch.Tensor]], halves: int = 2) -> torch.Tensor:
    """One device's layer: ``x [Tg, H]``, ``ids``/``weights [Tg, k]``, its experts' ``up [e, 2i, H]`` (gate rows,
    then up rows; ``halves`` 1: up rows only) and ``down [e, H, i]`` (from ``offset``), ``biases`` ``[e, 2i]``, ``[e, H]``; its partial
    output ``[Tg, H]``."""
    tokens, width = x.shape
    k, local, inter = ids.shape[-1], up.shape[0], up.shape[1] // halves
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    routed = flat.shape[0]
    tm = tile_rows(routed, local)
    rows = -(-routed // tm) * tm
    pad = rows - routed
    sizes = (flat.unsqueeze(-1) == torch.arange(experts, device=flat.device)).sum(0).to(torch.int32)
    token = torch.cat([order // k, torch.full((pad,), tokens, dtype=order.dtype, device=order.device)])
    expert = torch.cat([flat[order], torch.full((pad,), experts, dtype=flat.dtype, device=flat.device)]) - offset
    valid = (expert >= 0) & (expert < local)
    tiling = (tm, min(TILE_K, max(width, inter)), min(TILE_N, max(width, halves * inter)))
    xs = torch.cat([x, x.new_zeros(1, width)])[token]  # padding rows read a zero row
    h = _LocalGMM.apply(xs, up, sizes, offset, valid, kernel, tiling)  # [rows, 2i]
    slot = expert.clamp(0, local - 1)
    if biases is not None:
        h = h + _masked(biases[0][slot], valid).to(h.dtype)
    a = _masked(gate(h[:, :inter], h[:, inter:]) if halves == 2 else gate(h), valid)
    y = _LocalGMM.apply(a.to(h.dtype), down, sizes, offset, valid, kernel, tiling)  # [rows, H]
    if biases is not None:
        y = y + _masked(biases[1][slot], valid).to(y.dtype)
    share = torch.cat([weights.reshape(-1)[order], weights.new_zeros(pad)])
    y = y * share.unsqueeze(-1).to(y.dtype)
    return x.new_zeros(tokens + 1, width, dtype=y.dtype).index_add(0, token, y)[:tokens]


class _Region(torch.autograd.Function):
    """The layer on every device's own shard (a manual-sharding region), and its gradient (the region again)."""

    @staticmethod
    def forward(ctx: Any, plan: "_Plan", x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, offsets: torch.Tensor, up_bias: Optional[torch.Tensor],
                down_bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.plan = plan
        ctx.save_for_backward(x, ids, weights, up, down, offsets, up_bias, down_bias)
        with torch.no_grad():
            return plan.leave(plan.layer(*plan.enter(x, ids, weights, up, down, offsets, up_bias, down_bias)),
                              plan.out_spec, x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        plan = ctx.plan
        saved = ctx.saved_tensors
        local = [t.detach().requires_grad_(t.is_floating_point() and ctx.needs_input_grad[i + 1]) if t is not None
                 else None for i, t in enumerate(plan.enter(*saved))]
        with torch.enable_grad():
            out = plan.layer(*local)
        wrt = [i for i, t in enumerate(local) if t is not None and t.requires_grad]
        found = torch.autograd.grad(out, [local[i] for i in wrt], plan.local(grad, plan.out_spec))
        grads: list[Optional[torch.Tensor]] = [None] * len(local)
        for i, g in zip(wrt, found):
            grads[i] = plan.leave_grad(i, g, saved[i].shape)
        return (None, *grads)


class _Plan:
    """Where each tensor of one layer's call lives on the mesh, and the layer on local shards."""

    def __init__(self, es: Any, kernel: Kernel, gate: Gate, experts: int, halves: int) -> None:
        self.mesh, self.kernel, self.gate, self.experts, self.halves = es.sharder.mesh, kernel, gate, experts, halves
        head = es.axis if es.chunks > 1 else None
        batch = spec_entry(es.batch)
        self.out_spec = (head, batch, None, None)
        self.specs = (self.out_spec, (batch, None, None), (batch, None, None), (head, None, None, None),
                      (head, None, None, None), (head,), (head, None, None), (head, None, None))
        self.batch, self.head = batch, head

    def local(self, t: torch.Tensor, spec: tuple) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs
        return xs.enable_manual_sharding(t, spec, mesh=self.mesh).global_tensor

    def enter(self, *tensors: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        return [None if t is None else self.local(t, spec) for t, spec in zip(tensors, self.specs)]

    def leave(self, t: torch.Tensor, spec: tuple, shape: torch.Size) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs
        return xs.disable_manual_sharding(t, spec, tuple(shape), mesh=self.mesh).global_tensor

    def layer(self, x, ids, weights, up, down, offsets, up_bias, down_bias) -> torch.Tensor:
        biases = None if up_bias is None else (up_bias[0], down_bias[0])
        y = _local(self.kernel, self.gate, x[0, 0], ids[0], weights[0], up[0], down[0], offsets[0], self.experts,
                   biases, self.halves)
        return y.unsqueeze(0).unsqueeze(0)

    def leave_grad(self, index: int, grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """A local gradient as the global one: the routing weights' is partial over the chunks (summed over
        ``t``), the experts' over the batch shards (summed over them), the tokens' is the input's own."""
        if index == 0:
            return self.leave(grad, self.out_spec, shape)
        if index == 2:  # [1, Tg, k] per chunk and batch shard
            chunks = math.prod(int(s) for a, s in zip(self.mesh.axis_names, self.mesh.mesh_shape) if a == self.head)
            return self.leave(grad.unsqueeze(0), (self.head, self.batch, None, None), (chunks, *shape)).sum(0)
        shards = math.prod(int(s) for a, s in zip(self.mesh.axis_names, self.mesh.mesh_shape)
                           if a in ((self.batch,) if isinstance(self.batch, str) else (self.batch or ())))
        spec = self.specs[index]
        return self.leave(grad.unsqueeze(1), (spec[0], self.batch, *spec[1:]), (shape[0], shards, *shape[1:])).sum(1)


def supports(es: Any, tokens: int) -> bool:
    """Whether ``es``'s layer can take the grouped route for ``tokens`` tokens: a torch_xla mesh, no expert axis
    (its all-to-all dispatch belongs to the slots route), one routing group per batch shard."""
    return es.sharder is not None and es.ep_axis is None and tokens % max(es.groups, 1) == 0


def run(es: Any, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: Gate, up: torch.Tensor,
        down: torch.Tensor, kernel: Kernel, experts: int,
        biases: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (see the module docstring), from the chunked weights ``up``
    ``[t, e, 2, i, H]``, ``down [t, e, H, i]`` and ``biases`` ``[t, e, 2, i]``, ``[t, e, H]`` (``experts``'
    ``_chunked_*``) of ``experts`` experts in all."""
    tokens, width = hidden.shape
    groups, k = es.groups, ids.shape[-1]
    chunks, local = up.shape[0], up.shape[1]
    first = local if es.layout == "expert-parallel" else 0
    offsets = (torch.arange(chunks, dtype=torch.int32) * first).to(hidden.device)
    x = hidden.reshape(groups, tokens // groups, width).unsqueeze(0).expand(chunks, groups, tokens // groups, width)
    shaped = [t.reshape(groups, tokens // groups, k) for t in (ids, weights)]
    up_bias, down_bias = (biases[0].flatten(2), biases[1]) if biases is not None else (None, None)
    plan = _Plan(es, kernel, gate, experts, halves=up.shape[2])  # gate and up rows, or up rows alone
    out = _Region.apply(plan, x, *shaped, up.flatten(2, 3).to(hidden.dtype), down.to(hidden.dtype), offsets, up_bias,
                        down_bias)
    es.last = {"routed": tokens * k, "dropped": torch.zeros((), dtype=torch.int64, device=hidden.device),
               "route": "grouped", "kernel": type(kernel).__name__}
    return out.sum(0).reshape(tokens, width)
