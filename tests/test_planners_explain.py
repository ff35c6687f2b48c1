"""plan_for structure detection, fallbacks with reasons, and Plan.explain()."""
import copy

import pytest
import torch
from torch import nn

import xla_tp
from xla_tp.planners import plan_for
from xla_tp.zoo.registry import BUILDERS, build


@pytest.mark.parametrize("name,family", [("llama", "hf_decoder"), ("gemma", "hf_decoder"), ("gpt2", "gpt2"),
                                         ("roberta", "bert"), ("torch_encoder", "torch_transformer"),
                                         ("mlp", "mlp"), ("titan_llama", "titan_llama")])
def test_family_detected_by_structure(name, family):
    assert plan_for(build(name), mesh=xla_tp.make_mesh(data=2, model=4)).family == family


def test_gqa_and_indivisible_fall_back_with_reasons():
    mesh = xla_tp.make_mesh(data=2, model=4)
    plan = plan_for(build("qwen2", kv_heads=2), mesh=mesh)
    assert "model.layers.*.self_attn.k_proj" not in plan and "model.layers.*.self_attn.q_proj" in plan
    assert "key/value heads" in plan.replicated["model.layers.0.self_attn.k_proj.weight"]
    odd = plan_for(nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8)), mesh=mesh)
    assert dict(odd) == {} and "partner" in odd.replicated["0.weight"]


def test_explain_lists_rules_shapes_totals_and_replicated():
    mesh = xla_tp.make_mesh(model=4, data=2)
    model = build("llama", kv_heads=2)
    text = plan_for(model, mesh=mesh).explain(model, mesh)
    assert "family: hf_decoder" in text
    assert "model.layers.0.self_attn.q_proj.weight  <- model.layers.*.self_attn.q_proj" in text
    assert "(16, 64)" in text and "per device:" in text and "total" in text
    assert "model.norm.weight: norm" in text
    assert "model.layers.1.self_attn.v_proj.weight: 2 key/value heads" in text


def test_registry_names():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "bert", "roberta", "torch_encoder",
            "torch_mha", "mlp", "titan_llama"} <= set(BUILDERS)
    assert build("llama", width="small").config.hidden_size == 128


def test_auto_on_an_indivisible_stack_moves_it_replicated():
    """A recognised model whose dimensions do not divide the axis is not an error: it stays
    replicated (the reasons are in plan.replicated) and still computes the same thing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
    ref = copy.deepcopy(model)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(model=8))
    x = torch.randn(4, 8)
    assert model[0].weight.device.type == "xla"
    assert (model(x.to(model[0].weight.device)).cpu() - ref(x)).abs().max() < 1e-5
