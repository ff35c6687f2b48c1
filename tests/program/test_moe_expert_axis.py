"""Mixture-of-experts layers on a mesh with an expert axis (``make_mesh(expert=2, model=4)``), "auto", no
example input: the experts split over the expert axis, each batch shard's token slots moved to them by an
all-to-all and back by another; the model axis splits each expert's features. Mixtral (gate and up packed,
re-laid) and gpt-oss (interleaved, with biases), one training step each (dropless) and one audit of a
training step at the default capacity factor."""
import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.auditing.params import local_numel, sharding_string
from xla_tp.launch.check import compare_one_step, parallelizer
from xla_tp.launch.train import causal_or_masked_loss

from ..helpers import max_err
from ..moe_models import build, original_grads, trained

MESH = {"expert": 2, "model": 4}


@pytest.fixture(scope="module", params=("mixtral", "gpt_oss"))
def family(request):
    mesh = xla_tp.make_mesh(**MESH)
    cpu, ref, model, out = trained(request.param, mesh)
    result = {"model": model, "cpu": cpu, "logits": max_err(out.logits, ref.logits), "grads": original_grads(model),
              "report": xla_tp.moe_report(model)}
    xla_tp.set_moe_options(model, capacity_factor=1.25, dropless=False)
    result["audit"] = xla_tp.audit(model, torch.randint(0, 128, (4, 32)).to(torch_xla.device()), mesh=mesh,
                                   backward=True)
    return result


def test_logits_and_gradients_equal_the_cpu_model(family):
    assert family["logits"] < 1e-4
    cpu = {n: p.grad for n, p in family["cpu"].named_parameters() if p.grad is not None}
    assert set(family["grads"]) == set(cpu)
    assert max(max_err(family["grads"][n], g) for n, g in cpu.items()) < 1e-4


def test_expert_weights_split_over_both_axes_and_reported(family):
    model = family["model"]
    experts = {n: p for n, p in model.named_parameters() if p.dim() == 3}
    for name, p in experts.items():  # experts over the expert axis, their features over the model axis
        assert local_numel(tuple(p.shape), sharding_string(p)) * MESH["expert"] * MESH["model"] == p.numel(), name
        assert sharding_string(p.grad) == sharding_string(p), name
    for layer in family["report"].values():
        assert (layer["layout"], layer["expert_axis"], layer["dropped"]) == ("expert-tensor-parallel", "expert", 0)


def test_two_all_to_alls_each_way_at_the_minimum(family):
    """Forward and backward: the dispatch and the combine (4 all-to-alls over the expert axis), the
    dense all-reduces over the model axis; nothing gathered, nothing permuted, the audit's minimum."""
    report = family["audit"]
    assert report.count("all-to-all") == 4 and report.collectives["all-to-all"]["axes"] == ["expert"]
    assert report.count("all-gather") == 0 and report.count("collective-permute") == 0
    assert report.comm_ratio <= 1.02 and report.compute_balance <= 1.30


def test_experts_the_expert_axis_does_not_divide_split_over_the_model_axis_with_why():
    plan = xla_tp.plan_for(build("mixtral", experts=6), mesh={"expert": 4, "model": 2})
    role = plan.roles["model.layers.0.mlp.experts.gate_up_proj"]
    assert role.axes == (None, "mlp", None)  # split over the model axis instead, as without an expert axis
    assert role.why.startswith("the 6 experts do not split over the expert axis's 4 devices")
    assert "expert-tensor-parallel: each expert's 32 intermediate features split 2 ways" in role.why
    plan = xla_tp.plan_for(build("mixtral"), mesh={"expert": 2, "model": 4})
    role = plan.roles["model.layers.0.mlp.experts.down_proj"]
    assert role.axes == ("dispatched_experts", None, "mlp")
    assert role.why.startswith("8 experts split 2 ways over the expert axis (4 per device)")
    assert "the model axis splits each expert's 32 intermediate features 4 ways" in role.why


def test_the_launchers_check_compares_re_laid_experts_in_the_order_written():
    """``xla-tp launch --check`` on this mesh: gate and up re-laid device-major are put back before the
    gradients and the updated weights are compared with the CPU model's."""
    torch.manual_seed(0)
    cpu = build("mixtral")
    ids = torch.randint(0, 128, (4, 16))
    mesh = xla_tp.make_mesh(**MESH)
    errors = compare_one_step(cpu, parallelizer("auto", mesh), ids, ids, lambda t: t.to(torch_xla.device()),
                              causal_or_masked_loss("causal-lm"))
    assert max(errors.values()) < 1e-4, errors


def test_fsdp_expert_and_model_axes_train_like_cpu():
    """fsdp=2 x expert=2 x model=2: the batch over fsdp and expert, the experts over expert, their features
    over model, every weight also sharded over fsdp; a training step equals the CPU model's."""
    cpu, ref, model, out = trained("mixtral", xla_tp.make_mesh(fsdp=2, expert=2, model=2))
    assert max_err(out.logits, ref.logits) < 1e-4
    got = original_grads(model)
    assert max(max_err(got[n], p.grad) for n, p in cpu.named_parameters()) < 1e-4
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert local_numel(tuple(w.shape), sharding_string(w)) * 8 == w.numel()  # experts x features x fsdp shards
