"""plan_for: roles from dataflow, not names; refusals that say what was seen; explanations."""
import copy
import types

import pytest
import torch
import transformers
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate

import xla_tp
from xla_tp import PlanError
from xla_tp import compat, plan_for
from xla_tp.zoo.registry import build

from ..helpers import assert_unchanged, max_err, snapshot


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=4)


def renamed(model: nn.Module) -> nn.Module:
    """``model`` with every named submodule renamed (``q_proj`` -> ``m_q_proj_``); the forward still finds
    them through per-class properties, so only the names differ."""
    for mod in list(model.modules()):
        if not mod._modules:
            continue
        names = [n for n in mod._modules if not n.isdigit()]  # list indices stay: containers index by them
        mod._modules = type(mod._modules)((n if n.isdigit() else f"m_{n}_", m) for n, m in mod._modules.items())
        props = {n: property(lambda self, n=n: self._modules[f"m_{n}_"]) for n in names}
        mod.__class__ = types.new_class(f"Renamed{type(mod).__name__}", (type(mod),), exec_body=lambda ns, props=props: ns.update(props))
    return model


def roles(plan, model) -> list:
    by_name = {**{n: (r.kind, r.axes) for n, r in plan.roles.items()}, **{n: "replicated" for n in plan.replicated}}
    return [by_name[n] for n, _ in model.named_parameters(remove_duplicate=False)]


@pytest.mark.parametrize("name", ["llama", "gpt2", "torch_encoder"])
def test_renaming_every_submodule_gives_the_same_plan(name, mesh):
    model = build(name, kv_heads=2)
    other = renamed(copy.deepcopy(model))
    assert [n for n, _ in other.named_parameters()] != [n for n, _ in model.named_parameters()]
    assert roles(plan_for(other, mesh=mesh), other) == roles(plan_for(model, mesh=mesh), model)


def test_gqa_keeps_key_value_heads_whole_with_the_reason(mesh):
    plan = plan_for(build("qwen2", kv_heads=2), mesh=mesh)
    assert "model.layers.*.self_attn.k_proj" not in plan and "model.layers.*.self_attn.q_proj" in plan
    assert "2 heads" in plan.replicated["model.layers.0.self_attn.k_proj.weight"]


def test_packed_projections_are_found_from_their_slicing(mesh):
    gpt2 = plan_for(build("gpt2"), mesh=mesh)
    assert gpt2.packings["transformer.h.0.attn.c_attn.weight"].blocks == ((0, 64), (64, 64), (128, 64))
    assert gpt2.packings["transformer.h.0.attn.c_attn.weight"].dim == 1  # Conv1D: [in, out]
    phi3 = plan_for(build("phi3", kv_heads=4), mesh=mesh)
    assert phi3.packings["model.layers.0.self_attn.qkv_proj.weight"].blocks == ((0, 64), (64, 32), (96, 32))
    assert phi3.packings["model.layers.0.mlp.gate_up_proj.weight"].blocks == ((0, 128), (128, 128))
    neox = plan_for(build("gpt_neox"), mesh=mesh)  # per-head interleaved q/k/v: split as it is
    assert not neox.packings and "gpt_neox.layers.*.attention.query_key_value" in neox


def test_packed_relayout_happens_only_after_validation(mesh):
    model = build("gpt2")
    plan = plan_for(model, mesh=mesh)
    plan["transformer.h.*.no_such_module"] = "colwise"
    snap = snapshot(model)
    with pytest.raises(PlanError, match="no_such_module"):
        xla_tp.parallelize_xla(model, plan, mesh=mesh)
    assert_unchanged(model, snap)


class NormedQKV(nn.Module):
    """Attention whose packed q/k/v are normalised over all their features first: no split keeps them."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        qkv = nn.functional.layer_norm(self.qkv(x), (3 * d,))
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        return self.o(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


def test_attention_nothing_splits_is_computed_whole_and_strict_refuses_it(mesh):
    """Never a refusal by default: the attention runs whole (said in the plan); strict=True asks for the
    optimum and gets a PlanError naming what it saw, with the model untouched."""
    model = NormedQKV()
    plan = plan_for(model, mesh=mesh)
    assert "scaled_dot_product_attention" in plan.whole_attention[0] and "layer_norm" in plan.whole_attention[0]
    assert "layer_norm" in plan.replicated["qkv.weight"]
    snap = snapshot(model)
    with pytest.raises(PlanError) as info:
        xla_tp.parallelize_xla(model, "auto", mesh=mesh, strict=True)
    assert "strict=True" in str(info.value) and "attention computed whole" in str(info.value)
    assert_unchanged(model, snap)


def test_heads_the_axis_does_not_divide_take_the_cheapest_alternative(mesh):
    """6 heads on 4 devices: 2 zero heads added (a device holds 2 of 8 heads, against 3 of 6 for a split over 2
    devices), priced against the other valid splits; strict=True (only the optimum) refuses, naming the heads."""
    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=6,
                                   vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    plan = plan_for(model, mesh=mesh)
    choice = plan.choices[0]
    names = [a.name for a in choice.alternatives]
    assert choice.chosen.name == "split over 4 devices, 6 heads padded to 8 with zero heads" and "6 heads" in choice.why
    assert "split over 2 of 4 devices (sub-axis)" in names and "computed whole on every device" in names
    assert any(n.startswith("uneven split over 4") for n in names)
    assert [a.price.cost for a in choice.alternatives] == sorted(a.price.cost for a in choice.alternatives)
    assert plan.packings["model.layers.0.self_attn.q_proj.weight"].padded == (64,)  # 8 heads of 8
    assert plan.packings["model.layers.0.self_attn.o_proj.weight"].dim == 1  # its inputs, zero columns
    with pytest.raises(PlanError, match="6 heads.*strict=True|strict=True.*6 heads"):
        plan_for(model, mesh=mesh, strict=True)


def test_a_context_axis_prices_the_key_value_gathers_alike_for_every_alternative():
    """3 heads on 2 devices (off the optimum): on context=4 x model=2 each alternative moves the same key/value
    gathers on top of each device's quarter of the tokens' traffic, and the same one wins."""
    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=3,
                                   vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (1, 16))
    first = plan_for(model, mesh={"model": 2}, example_inputs=(ids,))
    plain, split = first.choices[0], plan_for(model, mesh={"context": 4, "model": 2}, example_inputs=(ids,),
                                                   graph=first.graph).choices[0]
    assert [a.name for a in split.alternatives] == [a.name for a in plain.alternatives]
    gathers = 2 * ids.numel() * cfg.hidden_size * 4  # the keys and values whole (3 heads: not split), float32
    for a, b in zip(plain.alternatives, split.alternatives):
        assert (a.price.gathers, b.price.gathers) == (0, gathers)
        assert b.price.comm == a.price.comm / 4 + gathers and b.price.minimum == a.price.minimum / 4 + gathers
        assert b.price.flops == a.price.flops / 4
    assert "key/value gathers over the context axis" in split.chosen.price.text(2)


ADDMM, LINEAR = torch.addmm, torch.nn.functional.linear


def test_plans_do_not_change_while_another_model_is_parallelized(mesh):
    """A parallelized model holds its lease on the compat effects and its lowering hooks; planning another model
    meanwhile sees torch's own functions: GPT-2's packed ``c_attn`` (``addmm``) still gets its zero heads (6 heads
    on 4 devices), the same plan as with no parallelized model alive."""
    cfg = transformers.GPT2Config(n_embd=48, n_layer=1, n_head=6, vocab_size=128, n_positions=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    alone = plan_for(model, mesh=mesh)
    other = xla_tp.parallelize_xla(build("mlp"), "auto", mesh=mesh)
    assert "histc" in compat.installed() and torch.addmm is ADDMM and torch.nn.functional.linear is LINEAR
    meanwhile = plan_for(model, mesh=mesh)
    assert meanwhile.choices[0].chosen.name == alone.choices[0].chosen.name, meanwhile.choices[0].invalid
    assert "zero heads" in meanwhile.choices[0].chosen.name
    xla_tp.unparallelize(other)


def test_a_trace_serves_the_plans_of_other_meshes():
    """The trace does not depend on the mesh: a plan made from another mesh's ``plan.graph`` (what the
    launcher's fit search does for each mesh it tries) is the plan made by tracing again."""
    model = build("llama", kv_heads=2)
    first = plan_for(model, mesh={"model": 4})
    for sizes in ({"model": 8}, {"data": 4, "model": 2}):
        again, reused = plan_for(model, mesh=sizes), plan_for(model, mesh=sizes, graph=first.graph)
        assert reused.graph is first.graph and roles(reused, model) == roles(again, model)
        assert [c.chosen.name for c in reused.choices] == [c.chosen.name for c in again.choices]


def test_linear_stacks_pair_along_their_dataflow_and_pad_uneven_widths(mesh):
    stack = build("mlp")
    plan = plan_for(stack, mesh=mesh)
    assert [plan[k].role for k in sorted(plan)] == ["column-parallel", "row-parallel"] * 2
    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
    ref = copy.deepcopy(odd)
    with pytest.warns(UserWarning, match=r"0.weight dim 0 \(30 -> 32 over 4\)"):
        xla_tp.parallelize_xla(odd, "auto", mesh=mesh)
    x = torch.randn(4, 8)
    assert max_err(odd(x.to(odd[0].weight.device)), ref(x)) < 1e-5


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x, gate):
        return self.down(torch.relu(self.up(x)) * gate)


def test_models_whose_input_cannot_be_guessed_take_example_inputs(mesh):
    with pytest.raises(PlanError, match="example_inputs"):
        plan_for(TwoInputs(), mesh=mesh)
    plan = plan_for(TwoInputs(), mesh=mesh, example_inputs=(torch.zeros(2, 8, 16), torch.ones(2, 8, 64)))
    assert set(plan) == {"up", "down"}


def test_explain_shows_roles_and_reasons(mesh):
    model = build("llama", kv_heads=2)
    text = plan_for(model, mesh=mesh).explain(model, mesh)
    assert "model.layers.*.self_attn.q_proj" in text and "column-parallel" in text and "row-parallel" in text
    assert "model.layers.*.self_attn.k_proj.weight" in text and "2 heads" in text
    assert "vocab-parallel" in text and "per device" in text


def test_a_forward_that_casts_a_submodule_to_its_own_dtype_is_planned(mesh):
    """SwitchTransformers' and NLLB-MoE's routers run ``self.classifier = self.classifier.to(self.dtype)`` in their
    forward: on the trace's fake parameters torch would swap them (and fail); a cast that changes nothing is
    skipped while tracing, and the modules are left as they were."""
    class Casting(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            self.up = self.up.to(torch.float32)
            return self.down(torch.relu(self.up(x)))

    model = Casting()
    plan = plan_for(model, mesh=mesh)
    assert (plan.roles["up.weight"].kind.value, plan.roles["down.weight"].kind.value) == ("column", "row"), plan.roles
    assert not any("_apply" in vars(m) for m in model.modules())


class TwoUses(nn.Module):
    """A router read twice (Gemma 3n's AltUp): once before a projection that contracts its features, once
    whole (a softmax over them)."""

    def __init__(self):
        super().__init__()
        self.router, self.coefs = nn.Linear(16, 8, bias=False), nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.coefs(torch.tanh(self.router(x))) + self.router(x * 2).softmax(-1).sum(-1, keepdim=True)


def test_a_block_whose_weight_is_replicated_by_disagreeing_uses_is_computed_whole():
    with pytest.warns(UserWarning, match="found nothing to split"):
        plan = plan_for(TwoUses(), mesh={"model": 4}, example_inputs=(torch.randn(2, 16),))
    assert "uses disagree" in plan.replicated["router.weight"]
    assert "in one block with router.weight" in plan.replicated["coefs.weight"]  # not row-parallel over a whole input


class MaskedIds(nn.Module):
    """Gemma 3n's per-layer table: looked up with the token ids masked to its rows (``where(ids < n, ids, 0)``);
    a position table beside it, looked up with indices computed from the ids' shape."""

    def __init__(self):
        super().__init__()
        self.table, self.positions, self.out = nn.Embedding(32, 16), nn.Embedding(16, 16), nn.Linear(16, 8)

    def forward(self, input_ids):
        kept = torch.where(input_ids < self.table.num_embeddings, input_ids, 0)
        where = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return self.out(self.table(kept) + self.positions(where))


def test_a_table_looked_up_with_masked_token_ids_is_vocab_parallel():
    plan = plan_for(MaskedIds(), mesh={"model": 4}, example_inputs=(torch.randint(0, 48, (2, 16)),))
    assert plan.roles["table.weight"].kind == "vocab" and plan.roles["table.weight"].axes == ("vocab", "embed")
    assert plan.replicated["positions.weight"].startswith("position/type embedding")


class SideStream(nn.Module):
    """Gemma 3n's shapes: a square projection normalised with the stream it joins (a stop for a column split), a
    gate multiplied (``torch.multiply``) by a whole per-token input before the projection back, a small router."""

    def __init__(self):
        super().__init__()
        self.side, self.router = nn.Linear(16, 16, bias=False), nn.Linear(16, 4, bias=False)
        self.gate, self.back, self.norm = nn.Linear(16, 8, bias=False), nn.Linear(8, 16, bias=False), nn.LayerNorm(16)

    def forward(self, x, extra):
        h = self.norm(x + self.side(x))
        return self.back(torch.multiply(torch.tanh(self.gate(h)), extra)) + h * self.router(h).softmax(-1)[..., :1]


def test_a_square_projection_left_whole_splits_over_its_inputs_and_torch_multiply_is_followed():
    plan = plan_for(SideStream(), mesh={"model": 4}, example_inputs=(torch.randn(2, 5, 16), torch.randn(2, 5, 8)))
    side = plan.roles["side.weight"]
    assert (side.kind, side.axes) == ("row", ("embed", "mlp")) and "all-gather of its input's gradient" in side.why
    assert "layer_norm" in side.why  # why not column-parallel
    assert plan.roles["gate.weight"].kind == "column" and plan.roles["back.weight"].kind == "row"
    assert "router.weight" in plan.replicated  # not square: a row split would all-reduce more than it saves
    layout = plan["side"].lower("side", SideStream().side, "side", "model")
    assert layout.natural_output == Partial() and layout.inputs == ((Replicate(), Replicate()),)
