"""The families and widths the bench compares, built by ``xla_tp.zoo.registry``, with the plan users hold.

``build(family, width)`` -> ``(cpu model, example batch, HF-style plan)``. HF models use their own
``tp_plan`` where they have one (Llama, Qwen3); GPT-2, BERT, torch's encoder and the torchtitan
Llama have none, so the plan is the Megatron one a user would write. BERT is the base model (no
masked-LM head): the comparison is about the encoder. Example::

    model, batch, plan = build("llama", "tiny")
"""
from __future__ import annotations

import torch
from torch import nn

from xla_tp.plan.hf import hf_plan
from xla_tp.plan.styles import ShardParams
from xla_tp.zoo import registry

FAMILIES = ("titan_llama", "llama", "qwen3", "gpt2", "bert", "torch_encoder")
WIDTHS = tuple(registry.WIDTHS)  # ("tiny", "small"): hidden 64 and 128
BATCH, SEQ = 8, 16
BASE_MODEL = {"bert"}  # built without their task head

MEGATRON_PLANS = {
    "titan_llama": {**{f"layers.*.attention.{n}": "colwise" for n in ("wq", "wk", "wv")},
                    **{f"layers.*.feed_forward.{n}": "colwise" for n in ("w1", "w3")},
                    "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w2": "rowwise"},
    # GPT-2's Conv1D stores [in, out]: per-parameter specs, as a user writes them for mark_sharding
    "gpt2": {**{f"transformer.h.*.{n}": ShardParams({"weight": (None, "tp"), "bias": ("tp",)})
                for n in ("attn.c_attn", "mlp.c_fc")},
             **{f"transformer.h.*.{n}": ShardParams({"weight": ("tp", None)}) for n in ("attn.c_proj", "mlp.c_proj")}},
    "bert": {**{f"encoder.layer.*.attention.self.{n}": "colwise" for n in ("query", "key", "value")},
             "encoder.layer.*.attention.output.dense": "rowwise",
             "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise"},
    "torch_encoder": {"layers.*.linear1": "colwise", "layers.*.linear2": "rowwise",
                      "layers.*.self_attn.out_proj": "rowwise"},
}


def build(family: str, width: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, dict[str, str]]:
    """A fresh CPU model, an example batch and its plan (HF's own when it has one)."""
    torch.manual_seed(seed)
    model = registry.build(family, width, head=family not in BASE_MODEL)
    plan = MEGATRON_PLANS.get(family) or hf_plan(model)
    return model, registry.example_input(family, width, batch=BATCH, seq=SEQ), plan


def smallest(families: tuple[str, ...], width: str) -> str:
    """The family with the fewest parameters at ``width``: ``smallest(("llama", "bert"), "tiny") == "bert"``."""
    return min(families, key=lambda f: sum(p.numel() for p in build(f, width)[0].parameters()))
