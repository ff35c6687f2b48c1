"""State-space mixers planned from their dataflow (no torch_xla): Mamba2's in_proj packed and split by heads,
B/C copied when one group cannot split, the depthwise convolution and the per-head parameters split with the
features they meet, out_proj row-parallel."""
import torch
import transformers

from xla_tp.planners import plan_for
from xla_tp.dataflow.partners import partners
from xla_tp.dataflow.shapes import Features
from xla_tp.dataflow.trace import trace

from .test_planner import renamed

SIZES = {"data": 2, "model": 4}


def mamba2(groups: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        hidden_size=64, num_hidden_layers=2, vocab_size=128, num_heads=8, head_dim=16, expand=2, n_groups=groups,
        state_size=16, chunk_size=16))


def test_mamba2s_mixer_splits_by_heads_with_one_group_copied():
    plan = plan_for(mamba2(1), mesh=SIZES)
    mixer = "backbone.layers.0.mixer"
    in_proj = plan.roles[f"{mixer}.in_proj.weight"]
    assert in_proj.kind == "column" and in_proj.packing.blocks == ((0, 128), (128, 128), (256, 16), (272, 16),
                                                                  (288, 8))
    assert in_proj.packing.whole == {2, 3}  # B and C: one group, copied to every device
    assert plan.roles[f"{mixer}.out_proj.weight"].kind == "row"
    conv = plan.roles[f"{mixer}.conv1d.weight"]
    assert conv.axes[0] is not None and conv.packing.blocks == ((0, 128), (128, 16), (144, 16))
    assert conv.packing.whole == {1, 2}
    for name in ("A_log", "D", "dt_bias", "norm.weight", "conv1d.bias"):
        role = plan.roles[f"{mixer}.{name}"]
        assert role.kind == "column" and role.axes[0] is not None
    assert not [n for n in plan.replicated if ".mixer." in n]
    assert "copied to every device" in in_proj.why and "one small all-reduce" in in_proj.why


def test_the_mixer_is_found_by_its_dataflow_not_its_names():
    model, twin = mamba2(1), renamed(mamba2(1))
    plan, other = plan_for(model, mesh=SIZES), plan_for(twin, mesh=SIZES)

    def laid(p, m):
        return [(p.roles[n].kind, p.roles[n].axes, p.roles[n].packing) if n in p.roles else "replicated"
                for n, _ in m.named_parameters()]

    assert laid(plan, model) == laid(other, twin)


def test_groups_the_axis_divides_split_with_the_heads():
    plan = plan_for(mamba2(4), mesh=SIZES)
    in_proj = plan.roles["backbone.layers.0.mixer.in_proj.weight"]
    assert in_proj.packing.whole == frozenset() and in_proj.packing.tp == 4
    conv = plan.roles["backbone.layers.0.mixer.conv1d.weight"]
    assert conv.packing.blocks == ((0, 128), (128, 64), (192, 64)) and not conv.packing.whole


def test_a_parameter_that_mixes_features_is_no_partner():
    """Only a parameter with one entry per split feature pairs with them: a matrix applied element-wise
    across another dim, or a scale over a dim that is not the split one, does not."""
    class Scales(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.per_feature = torch.nn.Parameter(torch.ones(8))
            self.per_position = torch.nn.Parameter(torch.ones(5, 1))
            self.grid = torch.nn.Parameter(torch.ones(5, 8))

        def forward(self, x):
            return x * self.per_feature.exp() * self.per_position * self.grid

    graph = trace(Scales(), (torch.zeros(2, 5, 8),))
    found = [p.name for n in graph.nodes if n.op == "mul" for pos, v in enumerate(n.tensors) if v.dynamic
             for p, _ in partners(n, pos, Features.whole(2, 8))]
    assert found == ["per_feature"]


def qwen3_next() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        head_dim=8, vocab_size=128, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"]))


def test_qwen3_nexts_gated_delta_net_splits_by_key_head_group():
    """Its projections' outputs are grouped by key head already: split as they are, q, k, v concatenated for
    the convolution laid device-major (the kernel re-laid like them), the per-head parameters split."""
    plan = plan_for(qwen3_next(), mesh=SIZES)
    mixer = "model.layers.0.linear_attn"
    for name in ("in_proj_qkvz", "in_proj_ba"):
        role = plan.roles[f"{mixer}.{name}.weight"]
        assert role.kind == "column" and role.packing is None and role.axes[0] is not None
    assert plan.roles[f"{mixer}.out_proj.weight"].kind == "row"
    conv = plan.roles[f"{mixer}.conv1d.weight"]
    assert conv.axes[0] is not None and conv.packing.blocks == ((0, 32), (32, 32), (64, 64)) and conv.packing.tp == 4
    assert plan.tagged_concats == {(32, 32, 64)} and plan.concats == {(32, 32, 64): 4}
    for name in ("A_log", "dt_bias"):
        assert plan.roles[f"{mixer}.{name}"].kind == "column"
    assert [n for n in plan.replicated if ".linear_attn." in n] == [f"{mixer}.norm.weight"]  # per head dim


def test_groups_the_axis_does_not_divide_copied_to_the_devices_reading_them():
    """2 groups on 4 devices: the heads split 4 ways, each group of B and C copied to the 2 devices whose heads
    read it (the convolution's kernel entries too), the gated norm's 2 groups split over 2 devices each."""
    plan = plan_for(mamba2(2), mesh=SIZES)
    mixer = "backbone.layers.0.mixer"
    in_proj = plan.roles[f"{mixer}.in_proj.weight"]
    assert in_proj.axes[0] == "heads" and in_proj.packing.whole == {2, 3} and in_proj.packing.groups == (1, 1, 2, 2, 1)
    assert in_proj.packing.laid_size == 128 + 128 + 2 * 4 * 16 + 8  # B and C: 16 rows (a group) per device
    conv = plan.roles[f"{mixer}.conv1d.weight"]
    assert conv.packing.whole == {1, 2} and conv.packing.groups == (1, 2, 2)
    assert not plan.choices and "each group copied to the devices whose heads read it" in in_proj.why
    assert "as 2 groups, which 4 devices do not divide: each group split over 2 devices" in in_proj.why
