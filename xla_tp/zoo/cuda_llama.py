"""A Llama written the way CUDA training code writes it: SDPA, ``view(b, s, -1, head_dim)``, complex rotary.

Nothing in it is XLA-aware: ``F.scaled_dot_product_attention`` with ``is_causal``, grouped-query
attention through ``repeat_interleave``, rotary embeddings as complex multiplication
(``torch.view_as_complex`` / ``torch.polar``). Module names follow torchtitan's, so its tensor-parallel
plan (``xla_tp.zoo.llama.torchtitan_tp_plan``) applies, and ``sp_plan_calls`` gives that plan the way
torch code applies it: one ``parallelize_module`` call for the root, then one per block. Example::

    model = CudaLlama(LlamaArgs(n_kv_heads=2))
    for module, plan in sp_plan_calls(model):
        xla_tp.parallelize_module(module, mesh, plan)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.placement_types import Replicate, Shard

from . import llama
from .llama import Llama


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Complex rotations ``[max_seq_len, head_dim // 2]``."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of ``x`` ``[B, S, H, D]`` by complex ``rope`` ``[S, D // 2]``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rope[None, :, None, :]).flatten(3).type_as(x)


class Attention(llama.Attention):
    """Causal grouped-query attention through ``F.scaled_dot_product_attention`` (the same projections)."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary(xq, rope), apply_rotary(xk, rope)
        xk = xk.repeat_interleave(self.n_rep, dim=2)
        xv = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class CudaLlama(Llama):
    """``forward(tokens [B, S]) -> logits [B, S, vocab]``; torchtitan's names, CUDA-style attention and rotary."""

    attention = Attention

    def _compute_rope(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.args
        return rope_table(a.dim // a.n_heads, a.max_seq_len, a.rope_theta).to(device)


def sp_plan_calls(model: CudaLlama) -> list[tuple[nn.Module, dict[str, ParallelStyle]]]:
    """torchtitan's sequence-parallel plan as torch code applies it: the root, then each block."""
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return [(model, root)] + [(layer, block) for layer in model.layers.values()]
