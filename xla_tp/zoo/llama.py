"""A small torchtitan-style Llama in pure PyTorch, plus torchtitan's TP plans.

Module names (``tok_embeddings``, ``layers.<i>.attention.wq``, ...,
``feed_forward.w1``, ``norm``, ``output``) match torchtitan's Llama so its
published tensor-parallel plan keys apply unchanged. The attention core uses
two ``torch.einsum`` calls, a finite causal mask and real-valued rotary
embeddings (no complex numbers, no SDPA) so it lowers cleanly on XLA SPMD.
For decoding, ``forward(tokens, cache=KVCache)`` reads and writes a static
key/value cache (torchtitan's model has none; torchchat's has one like it).

Example:
    >>> import torch
    >>> model = Llama(LlamaArgs())
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 128])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.placement_types import Replicate, Shard

__all__ = ["LlamaArgs", "RMSNorm", "Attention", "FeedForward", "TransformerBlock", "Llama", "KVCache",
           "precompute_rope", "apply_rope", "torchtitan_tp_plan", "megatron_tp_plan"]

_MASK_VALUE = -1e9  # large negative *finite* value: -inf can produce NaNs on XLA


@dataclass
class LlamaArgs:
    """Hyper-parameters of :class:`Llama` (tiny defaults suitable for tests)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 128
    multiple_of: int = 16
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64


def precompute_rope(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """Return a real rotary table of shape ``[max_seq_len, head_dim // 2, 2]`` holding (cos, sin)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of ``x`` ``[B, S, H, D]`` by ``rope`` ``[S, D // 2, 2]`` (or
    ``[B, S, D // 2, 2]``: a position per sequence)."""
    xf = x.float().unflatten(-1, (-1, 2))  # [B, S, H, D/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    rope = rope if rope.dim() == 4 else rope[None]
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


@dataclass
class KVCache:
    """A static key/value cache for :class:`Llama`: per layer ``[batch, length, n_kv_heads, head_dim]``.

    Before a call, ``at`` says where its tokens go: their cache slots ``[S]``, their rotary positions
    ``[B, S]`` and which slots hold a sequence's tokens (``valid`` ``[B, length]``, False for left
    padding); each layer writes its keys and values at those slots in place and attends to the
    valid slots up to each token's own. Example:

    >>> model = Llama(LlamaArgs())
    >>> cache = KVCache.empty(model.args, batch=1, length=8)
    >>> prompt = cache.at(torch.arange(3), torch.arange(3)[None], torch.ones(1, 8, dtype=torch.bool))
    >>> model(torch.tensor([[5, 6, 7]]), cache=prompt).shape
    torch.Size([1, 3, 128])
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    slots: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    attend: Optional[torch.Tensor] = field(default=None, repr=False)

    @classmethod
    def empty(cls, args: LlamaArgs, batch: int, length: int, dtype: torch.dtype = torch.float32,
              device: torch.device | None = None) -> KVCache:
        """Zeros for ``batch`` sequences of up to ``length`` tokens."""
        shape = (batch, length, args.n_kv_heads or args.n_heads, args.dim // args.n_heads)
        make = lambda: [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        return cls(make(), make())

    def at(self, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> KVCache:
        """The cache, set for a call on tokens written at ``slots`` (see the class docstring)."""
        ids = torch.arange(self.keys[0].shape[1], device=slots.device)
        self.slots, self.positions = slots, positions
        self.attend = valid[:, None, :] & (ids[None, None, :] <= slots[None, :, None])  # [B, S, length]
        return self

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``layer``'s new keys and values ``[B, S, kv, D]`` at the slots; the whole cache of it."""
        self.keys[layer].index_copy_(1, self.slots, k)
        self.values[layer].index_copy_(1, self.slots, v)
        return self.keys[layer], self.values[layer]


@dataclass(frozen=True)
class LayerCache:
    """One layer's view of a :class:`KVCache`."""

    cache: KVCache
    layer: int

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.layer, k, v)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learnable ``weight``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class Attention(nn.Module):
    """Causal multi-head (optionally grouped-query) attention with rotary embeddings."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        n_kv = args.n_kv_heads or args.n_heads
        assert args.n_heads % n_kv == 0 and args.dim % args.n_heads == 0
        self.head_dim = args.dim // args.n_heads
        self.n_rep = args.n_heads // n_kv
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 for heads: works whether or not the head dim is sharded across devices.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rope(xq, rope), apply_rope(xk, rope)
        if cache is None:
            mask = torch.triu(torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device), diagonal=1)
        else:
            xk, xv = cache.update(xk, xv)
            mask = ~cache.cache.attend[:, None]  # [B, 1, S, length]
        if self.n_rep > 1:
            xk = xk.repeat_interleave(self.n_rep, dim=2)
            xv = xv.repeat_interleave(self.n_rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", xq, xk).float() / math.sqrt(self.head_dim)
        probs = F.softmax(scores.masked_fill(mask, _MASK_VALUE), dim=-1).type_as(xv)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, xv)
        return self.wo(out.reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        hidden = int(2 * 4 * args.dim / 3)
        if args.ffn_dim_multiplier is not None:
            hidden = int(args.ffn_dim_multiplier * hidden)
        hidden = args.multiple_of * math.ceil(hidden / args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x), rope)``; ``h + feed_forward(ffn_norm(h))``."""

    def __init__(self, args: LlamaArgs, attention: type = Attention) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        normed = self.attention_norm(x)
        h = x + (self.attention(normed, rope) if cache is None else self.attention(normed, rope, cache=cache))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only Llama: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``."""

    attention: type = Attention  # the attention module each block builds

    def __init__(self, args: LlamaArgs | None = None) -> None:
        super().__init__()
        self.args = args = args or LlamaArgs()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, self.attention) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", self._compute_rope(), persistent=False)

    def _compute_rope(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.args
        return precompute_rope(a.dim // a.n_heads, a.max_seq_len, a.rope_theta, device=device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Recompute the (non-persistent) rotary buffer, e.g. after ``to_empty()`` from meta."""
        self.rope = self._compute_rope(device=self.rope.device)

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """Logits of ``tokens``; with ``cache`` (set by ``KVCache.at``), of tokens that follow it."""
        if cache is None:
            assert tokens.shape[1] <= self.args.max_seq_len, "sequence longer than max_seq_len"
            rope = self.rope[: tokens.shape[1]]
        else:
            rope = self.rope[cache.positions]
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, rope) if cache is None else layer(h, rope, cache=LayerCache(cache, i))
        return self.output(self.norm(h))


def torchtitan_tp_plan(
    model: Llama, *, loss_parallel: bool = True, sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """torchtitan's published Llama TP plan as one flat ``{fqn_pattern: style}`` dict.

    ``sequence_parallel=True`` (torchtitan's default): activations between blocks
    are ``Shard(1)`` (sharded on sequence); the embedding emits ``Shard(1)``, the
    norms run as ``SequenceParallel``, ``PrepareModuleInput`` all-gathers to
    ``Replicate`` before ``attention``/``feed_forward`` (the rotary table, 2nd arg,
    is left alone), and ``wo``/``w2`` reduce-scatter back to ``Shard(1)``.
    ``sequence_parallel=False``: plain Megatron TP with replicated activations
    (no SequenceParallel norms, no PrepareModuleInput, default rowwise outputs).
    ``loss_parallel=True``: ``output`` keeps logits vocab-sharded (``Shard(-1)``,
    returned as a DTensor) for a loss-parallel cross-entropy; ``False`` gathers
    them to ``Replicate`` and returns a plain local tensor.

    ``model`` is accepted for API parity; keys use ``layers.*`` so any depth works.

    Example:
        >>> plan = torchtitan_tp_plan(Llama(LlamaArgs()), loss_parallel=False)
        >>> sorted(plan)[:2]
        ['layers.*.attention', 'layers.*.attention.wk']
    """
    del model
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        plan["layers.*.attention_norm"] = SequenceParallel()
        plan["layers.*.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        )
        plan["layers.*.ffn_norm"] = SequenceParallel()
        plan["layers.*.feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{name}"] = ColwiseParallel()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{name}"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    return plan


def megatron_tp_plan() -> dict[str, ParallelStyle]:
    """Plain Megatron plan: q/k/v/w1/w3 colwise, wo/w2 rowwise, nothing else.

    Example:
        >>> len(megatron_tp_plan())
        7
    """
    plan: dict[str, ParallelStyle] = {
        f"layers.*.{n}": ColwiseParallel()
        for n in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
    }
    plan.update({f"layers.*.{n}": RowwiseParallel() for n in ("attention.wo", "feed_forward.w2")})
    return plan
