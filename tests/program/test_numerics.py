"""Forward, backward and optimizer steps of parallelized models match the unsharded CPU model."""
import pytest
import torch
import torch.nn.functional as F
import torch_xla

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel
from xla_tp.zoo.llama import Llama, LlamaArgs, megatron_tp_plan, torchtitan_tp_plan

from ..helpers import MLP, grads, max_err, sharding, twin

MESHES = [{"model": 8}, {"data": 2, "model": 4}, {"fsdp": 2, "model": 4}]
MLP_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


@pytest.mark.parametrize("axes", MESHES)
def test_mlp_training_steps_match_cpu(axes):
    ref, model = twin(MLP, 16, 64)
    xla_tp.parallelize_xla(model, MLP_PLAN, mesh=xla_tp.make_mesh(**axes))
    before = {n: sharding(p) for n, p in model.named_parameters()}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dev = model.fc1.weight.device
    torch.manual_seed(1)
    for step in range(3):
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        losses = []
        for m, o, xx, yy in ((ref, opt_ref, x, y), (model, opt, x.to(dev), y.to(dev))):
            o.zero_grad()
            losses.append(F.mse_loss(m(xx), yy))
            losses[-1].backward()
            o.step()
        torch_xla.sync()
        assert max_err(*losses) < 1e-5, f"step {step}"
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert max_err(p, q) < 1e-5, n
        assert sharding(p) == before[n], f"{n} lost its sharding over AdamW steps"


@pytest.mark.parametrize("axes", [{"model": 8}, {"data": 2, "model": 4}])
@pytest.mark.parametrize("plan_name", ["torchtitan", "torchtitan_no_sp", "megatron"])
def test_llama_forward_backward_match_cpu(axes, plan_name):
    args = LlamaArgs(dim=64, n_layers=2, n_heads=8, vocab_size=128)
    ref, model = twin(Llama, args)
    plan = {"torchtitan": lambda: torchtitan_tp_plan(model),
            "torchtitan_no_sp": lambda: torchtitan_tp_plan(model, sequence_parallel=False, loss_parallel=False),
            "megatron": megatron_tp_plan}[plan_name]()
    xla_tp.parallelize_xla(model, plan, mesh=xla_tp.make_mesh(**axes))
    tokens = torch.randint(0, 128, (4, 16))
    out_ref, out = ref(tokens), model(tokens.to(model.output.weight.device))
    assert max_err(out, out_ref) < 1e-5
    loss_ref = F.cross_entropy(out_ref.flatten(0, 1), tokens.flatten())
    with xla_tp.loss_parallel():
        loss = F.cross_entropy(out.flatten(0, 1), tokens.to(out.device).flatten())
        loss.backward()
    loss_ref.backward()
    assert max_err(loss, loss_ref) < 1e-5
    g_ref, g = grads(ref), grads(model)
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        assert max_err(g[n], g_ref[n]) < 1e-5, n


def test_llama_grouped_query_attention_matches_cpu():
    args = LlamaArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=4, vocab_size=128)
    ref, model = twin(Llama, args)
    xla_tp.parallelize_xla(model, torchtitan_tp_plan(model), mesh=xla_tp.make_mesh(data=2, model=4))
    tokens = torch.randint(0, 128, (2, 8))
    assert max_err(model(tokens.to(model.output.weight.device)), ref(tokens)) < 1e-5
