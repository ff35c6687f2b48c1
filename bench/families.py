"""Rows for many model families: xla_tp "auto" beside the model's own HF plan applied by hand.

Each family is built tiny (``xla_tp.zoo.registry``, hidden 64, 2 layers) on a 2x4 (data x model)
mesh and called on a batch of token ids; the families of ``KEYWORD_FAMILIES`` (``xla_tp.zoo.keyword_models``)
on the call their users make by keyword: a vision-language model's image call, a diffusion transformer's
denoising call. The inputs that carry the batch are split over ``data`` (``xla_tp.batch``'s choice).
Route ``a_xla_tp`` is ``parallelize_xla(model, "auto")``; route ``b_hand_mark_sharding`` is the
family's published ``tp_plan`` (transformers' ``base_model_tp_plan``, a diffusers model's ``_tp_plan``)
applied with one ``mark_sharding`` per weight, what people write today; for families that publish no plan,
the plan a user would write by hand (``HAND_PLANS``: Megatron's column/row pairs on the obvious projections).
Metrics come from the forward audit of that call, as in every other row. Example::

    rows = family_rows(xla_tp.make_mesh(data=2, model=4))
"""
from __future__ import annotations

from typing import Any

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.utils._pytree import tree_map

import xla_tp
from xla_tp.auditing.run import audit_here, unsharded_dot_flops
from xla_tp import layout_of
from xla_tp.batch import batch_inputs
from xla_tp.plan.hf import hf_plan
from xla_tp.zoo import keyword_models, registry

from .plans import hand_apply, plan_layout
from .routes import mesh_name

FAMILIES = ("mistral", "qwen2", "gemma2", "phi3", "gpt_neox", "falcon", "mpt", "gptj", "starcoder2", "opt",
            "t5_encoder", "cuda_llama", "torch_encoder", "llama4", "mamba2", "falcon_h1", "qwen3_next", "gemma3n",
            "olmo2", "llava", "qwen2_vl", "flux", "sd3")
KEYWORD_FAMILIES = ("llava", "qwen2_vl", "flux", "sd3")  # measured on their users' call by keyword
KV_HEADS = {"falcon": 4, "mistral": 2, "llama4": 4, "falcon_h1": 4, "qwen3_next": 4, "gemma3n": 4}
HAND_PLANS = {  # what a user writes for a family that publishes no tp_plan
    "falcon": {"transformer.word_embeddings": "embedding_rowwise",
               "transformer.h.*.self_attention.query_key_value": "colwise",
               "transformer.h.*.self_attention.dense": "rowwise", "transformer.h.*.mlp.dense_h_to_4h": "colwise",
               "transformer.h.*.mlp.dense_4h_to_h": "rowwise"},
    "mamba2": {"backbone.embeddings": "embedding_rowwise", "backbone.layers.*.mixer.in_proj": "colwise",
               "backbone.layers.*.mixer.out_proj": "rowwise", "lm_head": "colwise_gather_output"},
    "torch_encoder": {"layers.*.linear1": "colwise", "layers.*.linear2": "rowwise"},
    "sd3": {**{f"transformer_blocks.*.attn.{name}": "colwise"
               for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")},
            "transformer_blocks.*.attn.to_out.0": "rowwise", "transformer_blocks.*.attn.to_add_out": "rowwise",
            "transformer_blocks.*.ff.net.0.proj": "colwise", "transformer_blocks.*.ff.net.2": "rowwise",
            "transformer_blocks.*.ff_context.net.0.proj": "colwise", "transformer_blocks.*.ff_context.net.2": "rowwise"},
}


def family_rows(mesh: Any, families: tuple[str, ...] = FAMILIES) -> list[dict]:
    """Route a and route b (or why it cannot run) for each family."""
    rows = []
    for family in families:
        plan = published_plan(build(family)[0])
        written = "published tp_plan" if plan else "hand-written plan"
        plan = plan or HAND_PLANS.get(family, {})
        unsharded: dict = {}
        for route in ("a_xla_tp", "b_hand_mark_sharding"):
            row = {"route": route, "family": family, "width": registry.WIDTHS["tiny"], "mesh": mesh_name(mesh)}
            if route == "b_hand_mark_sharding" and not plan:
                rows.append({**row, "status": "no published tp_plan to apply"})
                continue
            rows.append({**row, **_measure(family, route, plan, mesh, unsharded, written)})
    return rows


# diffusers' styles for a fused projection's blocks (Flux's single-stream proj_out reads cat([attention, MLP])):
# one mark_sharding per weight splits the packed dim evenly, what HF's packed styles mean
PACKED = {"PackedColwiseParallel": "packed_colwise", "PackedRowwiseParallel": "packed_rowwise"}


def published_plan(model: nn.Module) -> dict[str, Any]:
    """``model``'s published tp_plan (``hf_plan``) as one ``mark_sharding`` per weight applies it: a diffusers
    packed style read as HF's packed string (the blocks of a fused weight cannot be laid out by one mark)."""
    return {key: PACKED.get(type(style).__name__, style) for key, style in hf_plan(model).items()}


def build(family: str) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """The family's tiny model on the CPU and the call the row measures: ``(model, args, kwargs)``."""
    if family in KEYWORD_FAMILIES:
        model, kwargs = keyword_models.build(family)
        return model, (), kwargs
    torch.manual_seed(0)
    model = registry.build(family, kv_heads=KV_HEADS.get(family, registry.HEADS))
    return model, registry.positional_args(model, registry.example_input(family)), {}


def _on_mesh(model: nn.Module, args: tuple, kwargs: dict, mesh: Any) -> tuple[tuple, dict]:
    """The call's tensors on the XLA device, those that carry the batch split over ``data``."""
    moved: dict[int, torch.Tensor] = {}  # a tensor passed twice (self-attention's query, key, value) moved once
    args, kwargs = tree_map(lambda a: moved.setdefault(id(a), a.to(torch_xla.device()))
                            if isinstance(a, torch.Tensor) else a, (args, kwargs))
    for _, x in batch_inputs(args, kwargs, getattr(model, "main_input_name", None)):
        xs.mark_sharding(x, mesh, ("data",) + (None,) * (x.dim() - 1))
    return args, kwargs


def _measure(family: str, route: str, plan: dict, mesh: Any, unsharded: dict, written: str) -> dict[str, Any]:
    model, args, kwargs = build(family)
    args, kwargs = _on_mesh(model, args, kwargs, mesh)
    try:
        if route == "a_xla_tp":
            model = xla_tp.parallelize_xla(model, "auto", mesh=mesh)
            layout, how = layout_of(model), "auto"
        else:
            layout, how = plan_layout(model, plan, mesh), f"{written}, mark_sharding per weight"
            model = hand_apply(model.to(torch_xla.device()), plan, mesh)
        if "flops" not in unsharded:
            unsharded["flops"] = unsharded_dot_flops(model, args, False, kwargs)
        report = audit_here(model, args, mesh, False, layout, unsharded["flops"], kwargs=kwargs)
    except Exception as error:  # a route failing is a result, recorded as such
        return {"status": f"fails: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    data = report.to_dict()
    return {"status": "ok", "how": how, "all_gathers": report.count("all-gather"),
            **{k: data[k] for k in ("comm_ratio", "compute_balance", "param_memory_ratio", "collectives")}}
