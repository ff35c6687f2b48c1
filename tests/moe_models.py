"""Tiny mixture-of-experts models of transformers families (hidden 64, 8 experts, top-2; one layer, DeepSeek-V3
two: a dense one, then an MoE one; gpt-oss's experts have biases and interleave gate and up; NemotronH's have no
gate)."""
import copy

import torch
import torch_xla
import transformers

import xla_tp
from xla_tp.lowering.packed import as_written

from .helpers import grads

COMMON = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
              router_aux_loss_coef=0.01)


def configs(experts: int = 8) -> dict:
    return {
        "mixtral": transformers.MixtralConfig(intermediate_size=32, num_local_experts=experts, num_experts_per_tok=2,
                                              **COMMON),
        "qwen3_moe": transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=experts,
                                                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                                 head_dim=16, **COMMON),
        "olmoe": transformers.OlmoeConfig(intermediate_size=32, num_experts=experts, num_experts_per_tok=2, **COMMON),
        "deepseek_v3": transformers.DeepseekV3Config(
            intermediate_size=128, moe_intermediate_size=32, n_routed_experts=experts, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, **{**COMMON, "num_hidden_layers": 2}),
        "gpt_oss": transformers.GptOssConfig(intermediate_size=32, num_local_experts=experts, num_experts_per_tok=2,
                                             head_dim=16, layer_types=["full_attention"], **COMMON),
        # experts with no gate: relu^2 of the up rows alone
        "nemotron_h": transformers.NemotronHConfig(
            hidden_size=64, layers_block_type=["full_attention", "moe"], num_attention_heads=4, num_key_value_heads=4, head_dim=16,
            vocab_size=128, n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32),
        # sparsemixer: two top-1 choices; it samples while training, so it is compared in eval mode
        "phimoe": transformers.PhimoeConfig(intermediate_size=32, num_local_experts=experts, num_experts_per_tok=2,
                                            **COMMON),
    }


def build(name: str, experts: int = 8):
    """The CPU model, computing with transformers' eager experts (the reference)."""
    model = transformers.AutoModelForCausalLM.from_config(configs(experts)[name])
    model.set_experts_implementation("eager")
    with torch.no_grad():  # experts' biases start at zero: make them count
        for fqn, p in model.named_parameters():
            if "experts" in fqn and fqn.endswith("_bias"):
                p.normal_(0, 0.1)
    return model


def _step(model, ids):
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out


def trained(name: str, mesh, plan="auto"):
    """(CPU model, its step's output, the model under ``plan`` dropless, its step's output)."""
    torch.manual_seed(0)
    cpu = build(name)
    model = copy.deepcopy(cpu)
    ids = torch.randint(0, 128, (4, 16))
    ref = _step(cpu, ids)
    xla_tp.parallelize_xla(model, plan, mesh=mesh)  # default options: dropless, the model's own results
    return cpu, ref, model, _step(model, ids.to(torch_xla.device()))


def original_grads(model) -> dict:
    """Every gradient on the CPU, a re-laid weight's (gate and up device-major) in the original order."""
    return {name: as_written(model.get_parameter(name), g) for name, g in grads(model).items()}
