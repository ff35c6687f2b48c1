"""Llama 4's stacked experts under "auto" on a data=2 x model=4 mesh: every expert computed for every token.

``Llama4TextExperts`` runs all its experts densely (``bmm`` over ``[E, tokens, hidden]``, summed over ``E``):
"auto" finds them by dataflow (``dataflow.stacked``) and splits them by experts; the tokens repeated once per
expert stay split over the batch (``lowering.entry``'s ``repeat``). The user's calls, by keyword, no example
input; compiled several times: the complete tier.
"""
import copy

import pytest
import torch
import torch_xla
import transformers
from torch.distributed.tensor.placement_types import Partial

import xla_tp

from ..helpers import grads, max_err

pytestmark = pytest.mark.complete
LAYERS = 2


def llama4(experts: int = 4):
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, vocab_size=128, num_local_experts=experts,
        num_experts_per_tok=1, interleave_moe_layer_step=1))


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=4)


@pytest.fixture(scope="module")
def trained(mesh):
    cpu = llama4()
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    ids = torch.randint(0, 128, (4, 16))
    ref = cpu(input_ids=ids, labels=ids)
    ref.loss.backward()
    out = model(input_ids=ids.to(torch_xla.device()), labels=ids.to(torch_xla.device()))
    out.loss.backward()
    audits = {bwd: xla_tp.audit(model, input_ids=ids.to(torch_xla.device()), backward=bwd) for bwd in (False, True)}
    return {"cpu": cpu, "model": model, "ref": ref, "out": out, "audits": audits}


def test_logits_and_gradients_equal_the_cpu_model(trained):
    assert max_err(trained["out"].logits, trained["ref"].logits) < 1e-4
    cpu = {n: p.grad for n, p in trained["cpu"].named_parameters() if p.grad is not None}
    got = grads(trained["model"])
    assert set(got) == set(cpu)
    assert max(max_err(got[n], g) for n, g in cpu.items()) < 1e-4


@pytest.mark.parametrize("backward", [False, True])
def test_experts_split_without_gathers_or_all_to_alls(trained, backward):
    report = trained["audits"][backward]
    for kind in ("all-gather", "all-to-all", "collective-permute"):
        assert report.count(kind) == 0, (kind, report.collectives)
    assert report.compute_balance <= 1.30 and report.param_memory_ratio <= 1.15
    assert report.comm_ratio <= 1.10
    if not backward:  # the embedding, then per layer attention's, the shared expert's and the experts' sum
        assert report.count("all-reduce") <= 1 + 3 * LAYERS


def test_plan_says_what_happened_to_the_experts(mesh):
    plan = xla_tp.plan_for(llama4(), mesh=mesh)
    for name in ("gate_up_proj", "down_proj"):
        role = plan.roles[f"model.layers.0.feed_forward.experts.{name}"]
        assert role.axes == ("experts", None, None)
        assert role.why.startswith("expert-parallel: 4 stacked experts, every one computed for every token, "
                                   "split 4 ways")
    assert plan.roles["model.layers.0.feed_forward.shared_expert.down_proj.weight"].kind == "row"
    assert plan["model.layers.*.feed_forward"].natural_output == Partial()  # it sums the experts: a partial sum
    text = plan.explain(llama4())
    assert "expert-parallel: 4 stacked experts" in text
    odd = xla_tp.plan_for(llama4(experts=6), mesh=mesh)  # 6 experts on 4 devices: whole, and said why
    assert odd.replicated["model.layers.0.feed_forward.experts.down_proj"].startswith(
        "stacked experts computed for every token: their 6 experts do not split 4 ways")
