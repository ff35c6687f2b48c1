"""Every Hugging Face tp_plan style string: parameter placement, activation constraints, hf_plan merging,
and a tiny LlamaForCausalLM under its own plan matching the CPU model."""
import copy

import pytest
import torch
import torch_xla
import transformers
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard

import xla_tp
from xla_tp import PlanError
from xla_tp.plan.hf import HF_STYLES, hf_plan
from xla_tp.plan.normalize import build_layout
from xla_tp.plan.unplanned import unplanned_parameters

from .. import moe_models
from ..helpers import MLP, expected_sharding, max_err, sharding
from .test_errors import assert_unchanged, snapshot

AXES = {"data": 2, "fsdp": 1, "model": 4}
M = "model"


class Experts(nn.Module):
    """MoE experts as HF writes them: gate_up_proj [E, 2I, H] ([gate; up] packed on dim 1), down_proj [E, H, I]."""

    def __init__(self, e: int = 4, h: int = 16, i: int = 16):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.randn(e, h, i))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.emb = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.experts = Experts()


COL = {"lin.weight": (M, None), "lin.bias": (M,)}
ROW = {"lin.weight": (None, M), "lin.bias": (None,)}
REP = {"lin.weight": (None, None), "lin.bias": (None,)}
# style string -> (plan key, expected spec of every parameter it touches; all others stay unannotated)
CASES = {
    "colwise": ("lin", COL), "colwise_rep": ("lin", COL), "colwise_gather_output": ("lin", COL),
    "rowwise": ("lin", ROW), "rowwise_rep": ("lin", ROW), "rowwise_split_input": ("lin", ROW),
    "local_colwise": ("lin", COL), "local_rowwise": ("lin", ROW), "packed_colwise": ("lin", COL),
    "packed_rowwise": ("experts.gate_up_proj", {"experts.gate_up_proj": (None, None, M)}),
    "local_packed_rowwise": ("experts.gate_up_proj", {"experts.gate_up_proj": (None, None, M)}),
    "embedding_rowwise": ("emb", {"emb.weight": (M, None)}),
    "embedding_colwise": ("emb", {"emb.weight": (None, M)}),
    "grouped_gemm": ("experts", {"experts.gate_up_proj": (M, None, None), "experts.down_proj": (M, None, None)}),
    "sequence_parallel": ("norm", {"norm.weight": (None,), "norm.bias": (None,)}),
    "replicate": ("lin", REP), "replicated_with_grad_allreduce": ("lin", REP), "local": ("lin", REP),
    "isolated": ("lin", REP),
    **{s: ("experts", {}) for s in ("gather", "all_reduce", "moe_tp_experts", "local_params", "ep_router",
                                    "ep_dispatch_experts", "moe_identity_expert", "mla_kv_a_proj")},
}


def test_every_hf_style_string_has_a_case():
    assert set(CASES) == set(HF_STYLES)


@pytest.mark.parametrize("style", sorted(CASES))
def test_hf_style_places_parameters(style):
    key, expected = CASES[style]
    torch.manual_seed(0)
    model = Toy()
    ref = copy.deepcopy(model)
    mesh = xla_tp.make_mesh(data=2, model=4)
    xla_tp.parallelize_xla(model, {key: style}, mesh=mesh)
    torch_xla.sync()
    for name, p in model.named_parameters():
        if name in expected:
            assert sharding(p) == expected_sharding(p.shape, mesh, expected[name]), (style, name)
        else:
            assert sharding(p) in ("", "{replicated}"), (style, name, sharding(p))
        # local / isolated styles must never divide weights by the mesh size (HF eager does)
        assert torch.equal(p.cpu(), ref.get_parameter(name)), (style, name)


@pytest.mark.parametrize("style, inputs, outputs", [
    ("colwise", ((Replicate(),),), ((Shard(-1),),)),
    ("colwise_rep", ((Replicate(),),), ((Replicate(),),)),
    ("rowwise", ((Shard(-1),),), ((Replicate(),),)),
    ("rowwise_split_input", ((Replicate(), Shard(-1)),), ((Replicate(),),)),
    ("local_colwise", (), ()),
    ("local_rowwise", (), ()),
    ("packed_colwise", ((Replicate(),),), ()),
    ("sequence_parallel", ((Shard(1),),), ((Shard(1),),)),
    ("gather", (), ((Replicate(),),)),
    ("moe_tp_experts", (), ((Replicate(),),)),
    ("local", (), ()),
])
def test_hf_style_activation_constraints(style, inputs, outputs):
    ml = build_layout(Toy(), {"lin": style}, AXES, M).modules["lin"]
    assert (ml.inputs, ml.outputs) == (inputs, outputs)


@pytest.mark.parametrize("first, second", [("colwise", "rowwise"), ("colwise_rep", "rowwise_rep"),
                                           ("local_colwise", "local_rowwise"), ("packed_colwise", "rowwise")])
def test_hf_style_pairs_keep_numerics(first, second):
    torch.manual_seed(0)
    model = MLP(16, 32)
    ref = copy.deepcopy(model)
    xla_tp.parallelize_xla(model, {"fc1": first, "fc2": second}, mesh=xla_tp.make_mesh(data=2, model=4))
    x = torch.randn(4, 16)
    assert max_err(model(x.to(torch_xla.device())), ref(x)) < 1e-5


def test_parameter_key_shards_one_parameter_and_beats_module_key():
    model = Toy()
    plan = {"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise",
            "lin": "colwise", "lin.bias": "replicate"}
    layout = build_layout(model, plan, AXES, M)
    assert layout.params == {"experts.gate_up_proj": (None, M, None), "lin.weight": (M, None), "lin.bias": (None,)}
    assert layout.modules["experts"].outputs == ((Replicate(),),)   # the module rule still constrains


def test_unknown_hf_string_lists_valid_ones_and_leaves_model_unchanged():
    model = Toy()
    snap = snapshot(model)
    with pytest.raises(PlanError) as info:
        xla_tp.parallelize_xla(model, {"lin": "colwise_gathered"}, mesh=xla_tp.make_mesh(data=2, model=4))
    msg = str(info.value)
    assert "'lin'" in msg and "'colwise_gathered'" in msg and "colwise_gather_output" in msg and "rowwise_rep" in msg
    assert_unchanged(model, snap)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128)
    return LlamaForCausalLM(cfg).eval()


def test_hf_plan_merges_base_plan_with_prefix_and_model_plan():
    plan = hf_plan(_llama())
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert not any(k.startswith("layers.") for k in plan)


def test_hf_plan_old_era_without_merged_instance_plan():
    class Config:
        base_model_tp_plan = {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"}

    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([MLP(16, 32)])

    class ForLM(nn.Module):
        base_model_prefix = "transformer"
        _tp_plan = {"lm_head": "colwise_rep"}

        def __init__(self):
            super().__init__()
            self.config, self.transformer, self.lm_head = Config(), Base(), nn.Linear(16, 32)

    assert hf_plan(ForLM()) == {"transformer.layers.*.fc1": "colwise", "transformer.layers.*.fc2": "rowwise",
                                "lm_head": "colwise_rep"}
    base = Base()
    base.config, base.base_model_prefix = Config(), "transformer"   # a base model: no prefix
    assert hf_plan(base) == Config.base_model_tp_plan


def test_hf_plan_leaves_out_keys_for_layers_the_config_does_not_build():
    config = moe_models.configs()["qwen3_moe"]  # every layer MoE: the plan's dense-MLP keys name nothing
    sparse = transformers.AutoModelForCausalLM.from_config(config)
    assert "model.layers.*.mlp.gate_proj" not in hf_plan(sparse)
    assert hf_plan(sparse)["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    config.num_hidden_layers, config.mlp_only_layers = 2, [0]
    assert hf_plan(transformers.AutoModelForCausalLM.from_config(config))["model.layers.*.mlp.gate_proj"] == "colwise"
    xla_tp.parallelize_xla(sparse, "hf", mesh=xla_tp.make_mesh(data=2, model=4))  # strict: no key left unused
    assert sharding(sparse.model.layers[0].self_attn.o_proj.weight) != "{replicated}"


def test_llama_under_its_own_tp_plan_matches_cpu():
    model = _llama()
    ref = copy.deepcopy(model)
    mesh = xla_tp.make_mesh(data=2, model=4)
    plan = hf_plan(model)
    layout = build_layout(model, plan, AXES, M)
    assert sorted(unplanned_parameters(model, layout)) == sorted(
        n for n, _ in model.named_parameters() if "norm" in n)
    xla_tp.parallelize_xla(model, plan, mesh=mesh)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert sharding(q) == expected_sharding(q.shape, mesh, (M, None))
    ids = torch.randint(0, 128, (4, 8))
    with torch.no_grad():
        out = model(ids.to(torch_xla.device())).logits
        torch_xla.sync()
        assert max_err(out, ref(ids).logits) < 1e-4


def test_parallelize_with_the_models_own_plan_by_name():
    model = _llama()
    mesh = xla_tp.make_mesh(data=2, model=4)
    xla_tp.parallelize_xla(model, "hf", mesh=mesh)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert sharding(q) == expected_sharding(tuple(q.shape), mesh, ("model", None))
    o = model.model.layers[0].self_attn.o_proj.weight
    assert sharding(o) == expected_sharding(tuple(o.shape), mesh, (None, "model"))
