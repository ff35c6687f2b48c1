"""torchtitan 0.2.0's DeepSeek-V3 and its parallelize functions, reproduced for the tests (torchtitan is
not installed: its package pulls datasets, tokenizers, torchdata, tyro and tensorboard).

What is reproduced is what xla_tp sees: the module tree and parameter shapes of
``torchtitan/models/deepseek_v3/model/model.py`` (MLA attention with ``wq_a``/``q_norm``/``wq_b``,
``wkv_a``/``kv_norm``/``wkv_b``, ``wo``, an SDPA ``inner_attention``; blocks with a dense first layer,
then ``moe``: ``router.gate``, ``reorderer``, ``experts`` (GroupedExperts ``w1``/``w2``/``w3``, the
for-loop implementation) and ``shared_experts``), the forward's math, and the exact plan dicts of
``apply_non_moe_tp`` (deepseek_v3/infra/parallelize.py) and ``apply_moe_ep_tp`` (llama4's), with
torchtitan's own style classes stood in by classes of the same module and name
(``torchtitan.distributed.NoParallel``, ``torchtitan.distributed.expert_parallel.TensorParallel``, ...).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from xla_tp import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel,
                    SequenceParallel, parallelize_module)

ARGS = SimpleNamespace(vocab_size=128, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_dense_layers=1,
                       n_heads=4, num_experts=8, num_shared_experts=1, top_k=2, q_lora_rank=32, kv_lora_rank=32,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_seq_len=64, rope_theta=10000.0)


def _style(name: str, module: str, **fields) -> type:
    def __init__(self, **kwargs):
        ParallelStyle.__init__(self)
        for key, default in fields.items():
            setattr(self, key, kwargs.get(key, default))
    return type(name, (ParallelStyle,), {"__module__": module, "__init__": __init__, "_apply": lambda s, m, mesh: m})


NoParallel = _style("NoParallel", "torchtitan.distributed", input_layout=Replicate(), output_layout=Replicate(),
                    use_local_output=True)
TensorParallel = _style("TensorParallel", "torchtitan.distributed.expert_parallel")
ExpertParallel = _style("ExpertParallel", "torchtitan.distributed.expert_parallel")
ExpertTensorParallel = type("ExpertTensorParallel", (ExpertParallel,),
                            {"__module__": "torchtitan.distributed.expert_parallel"})  # its subclass, as in torchtitan
ReordererSequenceParallel = _style("ReordererSequenceParallel", "torchtitan.distributed.expert_parallel")


def precompute_freqs_cis(a) -> torch.Tensor:
    dim = a.qk_rope_head_dim
    freqs = 1.0 / (a.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(a.max_seq_len), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    return torch.view_as_real(x * freqs_cis).flatten(3).to(dtype)


class ScaledDotProductAttentionWrapper(nn.Module):
    def forward(self, q, k, v, scale=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = a.n_heads, a.q_lora_rank, a.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.qk_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(a.q_lora_rank, eps=1e-5)
        self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(a.kv_lora_rank, eps=1e-5)
        self.wkv_b = nn.Linear(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.wo = nn.Linear(a.n_heads * a.v_head_dim, a.dim, bias=False)
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.inner_attention = ScaledDotProductAttentionWrapper()

    def forward(self, x, freqs_cis, attention_masks):
        bsz, seqlen, _ = x.size()
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis)], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(dim, hidden_dim, bias=False), nn.Linear(hidden_dim, dim, bias=False),
                                     nn.Linear(dim, hidden_dim, bias=False))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """torchtitan's experts: ``forward(x sorted by expert, num_tokens_per_expert)``, the for-loop form."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * 0.1)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) * 0.1)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * 0.1)

    def forward(self, x, num_tokens_per_expert):
        counts = num_tokens_per_expert.tolist()
        out = []
        for e, chunk in enumerate(torch.split(x[: int(sum(counts))], [int(c) for c in counts], dim=0)):
            h = F.silu(torch.matmul(chunk, self.w1[e].transpose(-2, -1))) * torch.matmul(chunk, self.w3[e].transpose(-2, -1))
            out.append(torch.matmul(h, self.w2[e].transpose(-2, -1)))
        return torch.cat(out, dim=0)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x, expert_bias=None):
        scores = F.softmax(self.gate(x).to(torch.float32), dim=1)
        if expert_bias is not None:
            _, selected = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
            top_scores = scores.gather(dim=1, index=selected)
        else:
            top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        counts = torch.histc(selected.view(-1), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts


class TokenReorderer(nn.Module):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, top_scores, selected):
        counts = torch.histc(selected.view(-1), bins=self.num_experts, min=0, max=self.num_experts)
        order = torch.argsort(selected.view(-1), stable=True)
        return top_scores.view(-1)[order], order // self.top_k, counts


class MoE(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.experts = GroupedExperts(a.dim, a.moe_inter_dim, a.num_experts)
        self.router = TokenChoiceTopKRouter(a.dim, a.num_experts, a.top_k)
        self.reorderer = TokenReorderer(a.num_experts, a.top_k)
        self.shared_experts = FeedForward(a.dim, a.moe_inter_dim * a.num_shared_experts)
        self.score_before_experts = False
        self.register_buffer("expert_bias", torch.zeros(a.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(a.num_experts, dtype=torch.float32), persistent=False)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected, counts = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        top_scores_sorted, token_indices, counts = self.reorderer(top_scores, selected)
        token_indices = token_indices.reshape(-1, 1).expand(-1, dim)
        routed_output = self.experts(torch.gather(x, dim=0, index=token_indices), counts)
        out = self.shared_experts(x)
        routed_output = (routed_output.to(torch.float32) * top_scores_sorted.reshape(-1, 1)).to(x.dtype)
        return out.scatter_add(dim=0, index=token_indices, src=routed_output).reshape(bs, slen, dim)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, a):
        super().__init__()
        self.attention = Attention(a)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(a.dim, eps=1e-5), nn.RMSNorm(a.dim, eps=1e-5)
        self.moe_enabled = layer_id >= a.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(a)
        else:
            self.feed_forward = FeedForward(a.dim, a.inter_dim)

    def forward(self, x, freqs_cis, attention_masks):
        x = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks)
        return x + (self.moe(self.ffn_norm(x)) if self.moe_enabled else self.feed_forward(self.ffn_norm(x)))


class DeepSeekV3Model(nn.Module):
    def __init__(self, a=ARGS):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(a), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens, attention_masks=None):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis, attention_masks)
        return self.output(self.norm(h))


def apply_non_moe_tp(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    """deepseek_v3/infra/parallelize.py's, with ``use_flex_attn=False`` and no float8."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })
    attention_kernel_plan = PrepareModuleInput(input_layouts=(Shard(1), Shard(1), Shard(1)),
                                               desired_input_layouts=(Shard(1), Shard(1), Shard(1)),
                                               use_local_output=True)
    for transformer_block in model.layers.values():
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), Replicate(), None),
                                            desired_input_layouts=(Replicate(), Replicate(), None)),
            "attention.wkv_a": NoParallel(use_local_output=False),
            "attention.wkv_b": ColwiseParallel(use_local_output=False),
            "attention.kv_norm": NoParallel(use_local_output=False),
            "attention.inner_attention": attention_kernel_plan,
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if transformer_block.attention.q_lora_rank == 0:
            layer_plan["attention.wq"] = ColwiseParallel(use_local_output=False)
        else:
            layer_plan.update({"attention.wq_a": NoParallel(use_local_output=False),
                               "attention.wq_b": ColwiseParallel(use_local_output=False),
                               "attention.q_norm": NoParallel(use_local_output=False)})
        if not transformer_block.moe_enabled:
            layer_plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            })
        parallelize_module(module=transformer_block, device_mesh=tp_mesh, parallelize_plan=layer_plan)


def apply_moe_ep_tp(model: nn.Module, tp_mesh, ep_mesh, ep_tp_mesh, etp_enabled: bool) -> None:
    """llama4/infra/parallelize.py's."""
    for transformer_block in model.layers.values():
        if not transformer_block.moe_enabled:
            continue
        if tp_mesh is not None:
            moe_layer_plan = {
                "moe": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                use_local_input=True, output_layouts=(Partial(),),
                                                desired_output_layouts=(Shard(1),)),
                "moe.router.gate": NoParallel(),
            }
            if ep_mesh is not None and not etp_enabled:
                moe_layer_plan.update({"moe.reorderer": ReordererSequenceParallel()})
            if transformer_block.moe.shared_experts is not None:
                moe_layer_plan.update({"moe.shared_experts.w1": ColwiseParallel(),
                                       "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
                                       "moe.shared_experts.w3": ColwiseParallel()})
            parallelize_module(module=transformer_block, device_mesh=tp_mesh, parallelize_plan=moe_layer_plan)
        if ep_mesh is None:
            experts_mesh, experts_plan = tp_mesh, TensorParallel()
        elif tp_mesh is None or not etp_enabled:
            experts_mesh, experts_plan = ep_mesh, ExpertParallel()
        else:
            experts_mesh, experts_plan = ep_tp_mesh, ExpertTensorParallel()
        parallelize_module(module=transformer_block.moe.experts, device_mesh=experts_mesh, parallelize_plan=experts_plan)


def int_histc(original):
    """The CPU reference's ``torch.histc``: torchtitan counts integer expert ids with it, which CUDA does
    and the CPU does not."""
    def histc(x, bins=100, min=0, max=0):
        return original(x.float(), bins, min, max).to(x.dtype) if not x.is_floating_point() else original(x, bins, min, max)
    return histc


__all__ = ["ARGS", "DeepSeekV3Model", "apply_moe_ep_tp", "apply_non_moe_tp", "int_histc"]
