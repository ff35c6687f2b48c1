"""Hugging Face ``tp_plan`` style strings (every transformers era) -> ``ModuleLayout``.

Under SPMD the program is global: every activation is one logical tensor and the compiler
inserts the communication. So each string is lowered to what it *means* for the layout, never to
what HF's eager hooks do to local shards:

=================================  ==========================  ================================
string (aliases)                   parameters (TP axis)        activation constraints
=================================  ==========================  ================================
colwise                            weights dim -2, bias -1     in Replicate, out Shard(-1)
colwise_rep, colwise_gather_output as colwise                  in Replicate, out Replicate
rowwise                            weights dim -1, bias repl.  in Shard(-1), out Replicate
rowwise_rep, rowwise_split_input   as rowwise                  in Replicate -> Shard(-1), out Rep.
local_colwise / local_rowwise      as colwise / rowwise        none
packed_colwise                     packed dim -2, bias -1      in Replicate
packed_rowwise, local_packed_rowwise  packed dim -1, bias repl. none
embedding_rowwise / _colwise       Embedding weight dim 0 / 1  in Replicate, out Replicate
grouped_gemm                       expert dim 0                none
sequence_parallel                  replicated                  in/out Shard(1)
gather, all_reduce, moe_tp_experts untouched                   out Replicate
replicate, replicated_with_grad_allreduce, local, isolated     replicated, none
local_params, ep_router, ep_dispatch_experts, moe_identity_expert, mla_kv_a_proj   nothing
=================================  ==========================  ================================

"Weights dim -2 / -1" is HF's own rule: colwise shards the second-to-last dimension of every
parameter (a Linear's ``out_features``, an MoE ``[E, in, out]`` tensor's ``in``), rowwise the last.

- ``local_*`` / ``local`` / ``isolated``: in eager HF the module computes on its local shard and the
  plan author wrote the communication by hand; ``local`` even divides parameters by the mesh size
  so that a later all-reduce sums them back. Under SPMD there are no local shards: the weights are
  sharded exactly like the non-local style and NEVER divided (dividing would corrupt the global
  weights); no hand-written communication is needed, so no constraint is added.
- Packed (``[gate; up]`` concatenated on the packed dim): we shard the packed dimension evenly
  (plain ``Shard``), not HF's strided shard. Numerics are exact because the program is global,
  and memory is balanced, but device i holds a slice of gate *or* up, not one of each: the
  ``chunk`` after the projection costs a re-layout. A head-aligned layout needs the rows
  permuted, which is a planner's job (split the projection), not a plan string's.
- Gradient styles (``replicated_with_grad_allreduce``, ``moe_identity_expert``, ``mla_kv_a_proj``)
  fix partial gradients or double counting of eager local compute; a global program has neither.
- ``grouped_gemm`` never rewrites ``module.num_experts``: the program still sees every expert.
- MoE experts (``[E, 2I, H]`` under ``packed_colwise``, ``[E, H, I]`` under ``rowwise``, or the expert
  dim 0 under ``grouped_gemm``) run as xla_tp's experts lowering does for that layout
  (expert-tensor-parallel, expert-parallel); the packed one is re-laid as HF's strided shard lays it
  (``expert_packings``).

Example:

>>> ml = lower_hf_style("colwise", "layers.0.q_proj", nn.Linear(8, 16), "layers.*.q_proj", "model")
>>> ml.params, ml.inputs, ml.outputs
({'weight': ('model', None), 'bias': ('model',)}, ((Replicate(),),), ((Shard(dim=-1),),))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from torch import nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..errors import PlanError
from .layout import Chain, ModuleLayout, Spec
from .match import match_keys
from .packing import Packing

ParamRule = Callable[[str, int, str], Spec]  # (parameter name, ndim, tp axis) -> spec


def _on_dim(dim: int, ndim: int, tp_axis: str) -> Spec:
    spec: list = [None] * ndim
    spec[dim % ndim] = tp_axis
    return tuple(spec)


def colwise_spec(name: str, ndim: int, tp_axis: str) -> Spec:
    """HF colwise: dim -2 of a weight, dim -1 of a 1-D tensor. ``colwise_spec("weight", 2, "model") == ("model", None)``"""
    return _on_dim(-2 if ndim > 1 else -1, ndim, tp_axis) if ndim else ()


def rowwise_spec(name: str, ndim: int, tp_axis: str) -> Spec:
    """HF rowwise: dim -1; the bias is added after the reduction, so it stays replicated."""
    if ndim == 0 or name == "bias":
        return (None,) * ndim
    return _on_dim(-1, ndim, tp_axis)


def expert_spec(name: str, ndim: int, tp_axis: str) -> Spec:
    """``grouped_gemm``: the expert dimension (0) of ``[E, ...]`` tensors."""
    return _on_dim(0, ndim, tp_axis) if ndim > 1 else (None,) * ndim


def replicated_spec(name: str, ndim: int, tp_axis: str) -> Spec:
    return (None,) * ndim


def embedding_spec(dim: int) -> ParamRule:
    """``embedding_rowwise`` shards the vocabulary (dim 0), ``embedding_colwise`` the hidden dim (1)."""
    return lambda name, ndim, tp_axis: _on_dim(dim, ndim, tp_axis) if ndim == 2 else (None,) * ndim


@dataclass(frozen=True)
class HfStyle:
    """The SPMD meaning of one HF style string: a parameter rule and activation chains."""

    params: Optional[ParamRule] = None
    inputs: Chain = ()
    outputs: Chain = ()
    natural: Optional[Placement] = None  # ModuleLayout.natural_output


_R, _S, _P = Replicate(), Shard(-1), Partial()
_COL = HfStyle(colwise_spec, (_R,), (_S,), _S)
_COL_REP = HfStyle(colwise_spec, (_R,), (_R,), _S)
_ROW = HfStyle(rowwise_spec, (_S,), (_R,), _P)
_ROW_REP = HfStyle(rowwise_spec, (_R, _S), (_R,), _P)
_GATHER = HfStyle(outputs=(_R,))
_REPLICATED = HfStyle(replicated_spec)
_NOTHING = HfStyle()

HF_STYLES: Mapping[str, HfStyle] = {
    "colwise": _COL, "colwise_rep": _COL_REP, "colwise_gather_output": _COL_REP,
    "rowwise": _ROW, "rowwise_rep": _ROW_REP, "rowwise_split_input": _ROW_REP,
    "local_colwise": HfStyle(colwise_spec, natural=_S), "local_rowwise": HfStyle(rowwise_spec, natural=_P),
    "packed_colwise": HfStyle(colwise_spec, (_R,), natural=_S), "packed_rowwise": HfStyle(rowwise_spec, natural=_P),
    "local_packed_rowwise": HfStyle(rowwise_spec, natural=_P),
    "embedding_rowwise": HfStyle(embedding_spec(0), (_R,), (_R,), _P),
    "embedding_colwise": HfStyle(embedding_spec(1), (_R,), (_R,), _S),
    "grouped_gemm": HfStyle(expert_spec),
    "sequence_parallel": HfStyle(replicated_spec, (Shard(1),), (Shard(1),)),
    "gather": _GATHER, "all_reduce": _GATHER, "moe_tp_experts": _GATHER,
    "replicate": _REPLICATED, "replicated_with_grad_allreduce": _REPLICATED,
    "local": _REPLICATED, "isolated": _REPLICATED,
    "local_params": _NOTHING, "ep_router": _NOTHING, "ep_dispatch_experts": _NOTHING,
    "moe_identity_expert": _NOTHING, "mla_kv_a_proj": _NOTHING,
}


def hf_style(name: str, key: str) -> HfStyle:
    """The ``HfStyle`` for a string, or ``PlanError`` naming the key and listing valid strings."""
    style = HF_STYLES.get(name)
    if style is None:
        raise PlanError(f"plan key {key!r}: {name!r} is not a Hugging Face tp_plan style; valid strings: "
                        f"{', '.join(sorted(HF_STYLES))}")
    return style


def lower_hf_style(name: str, fqn: str, module: nn.Module, key: str, tp_axis: str) -> ModuleLayout:
    """Lower HF string ``name`` on ``module``: its own parameters (not its children's, as in HF).

    A key naming a parameter is handled by ``normalize``: it lowers the style on the owning
    module and keeps that parameter's spec only, like HF's per-parameter ``shard_param``.
    """
    style = hf_style(name, key)
    out = ModuleLayout(fqn=fqn, source=key, style=repr(name))
    if style.params is not None:
        own = module.named_parameters(recurse=False)
        out.params = {n: style.params(n, p.dim(), tp_axis) for n, p in own}
    out.inputs = (style.inputs,) if style.inputs else ()
    out.outputs = (style.outputs,) if style.outputs else ()
    out.natural_output = style.natural if out.params else None
    return out


def expert_packings(model: nn.Module, plan: Mapping[str, Any], tp: int) -> dict[str, Packing]:
    """``packed_colwise`` on a routed experts weight (``[E, 2I, H]``, gate and up packed): HF shards each
    half (a strided shard), which is this re-layout, device-major, so each device holds its slice of
    both: parameter FQN -> ``Packing``. (A 2-D packed projection keeps the even split above.)

    >>> from transformers import MixtralConfig, MixtralForCausalLM
    >>> moe = MixtralForCausalLM(MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1,
    ...                          num_attention_heads=2, num_key_value_heads=2, vocab_size=32, num_local_experts=4))
    >>> expert_packings(moe, hf_plan(moe), 2)["model.layers.0.mlp.experts.gate_up_proj"].blocks
    ((0, 8), (8, 8))
    """
    params = dict(model.named_parameters())
    found, _ = match_keys([k for k, v in plan.items() if v == "packed_colwise"], list(params))
    half = {name: params[name].shape[1] // 2 for name in found if params[name].dim() == 3}
    return {name: Packing(1, ((0, n), (n, n)), tp) for name, n in half.items() if n % tp == 0}


def hf_plan(model: nn.Module) -> dict[str, str]:
    """The model's full HF tensor-parallel plan: FQN pattern -> style string.

    Merges, later entries winning: ``config.base_model_tp_plan`` (keys relative to the base model,
    prefixed with ``base_model_prefix`` when ``model`` wraps one), each child's ``_tp_plan``
    (prefixed with the child's name), then the model's own ``_tp_plan`` (e.g. ``lm_head``). Keys that
    name no module or parameter of ``model`` are left out, as HF leaves them unused: a plan covers its
    family's variants (Qwen3-MoE's dense MLP, absent when every layer is MoE). Example:

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> plan = hf_plan(LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                            num_attention_heads=2, vocab_size=32)))
    >>> plan["model.layers.*.self_attn.q_proj"], plan["lm_head"]
    ('colwise', 'colwise_gather_output')
    """
    plan: dict[str, str] = {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    wraps_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    config = getattr(model, "config", None)
    _merge(plan, getattr(config, "base_model_tp_plan", None), prefix if wraps_base else "")
    for name, child in model.named_children():
        _merge(plan, getattr(child, "_tp_plan", None), name)
    _merge(plan, getattr(type(model), "_tp_plan", None), "")
    _merge(plan, getattr(model, "_tp_plan", None), "")
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    _, unused = match_keys(plan, names)
    return {k: v for k, v in plan.items() if k not in unused}


def _merge(plan: dict[str, str], extra: Optional[Mapping[str, Any]], prefix: str) -> None:
    for key, style in (extra or {}).items():
        plan[f"{prefix}.{key}" if prefix and key else (key or prefix)] = style


__all__ = ["HF_STYLES", "HfStyle", "hf_plan", "hf_style", "lower_hf_style", "colwise_spec", "rowwise_spec"]
