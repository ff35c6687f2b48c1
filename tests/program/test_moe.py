"""Mixture-of-experts models under "auto" on a data=2 x model=4 mesh: routed experts in static slots.

Each family (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss, tiny configs, no example input) is compiled once
for a training step with default options (dropless: the model's own results) and once for a forward at
capacity factor 1.25, a user's choice (the audit); every test reads those.
"""
import copy
from collections import OrderedDict

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.auditing.params import local_numel, sharding_string
from xla_tp.launch.check import parallelizer
from xla_tp.launch.progress import format_metrics
from xla_tp.launch.train import causal_or_masked_loss
from xla_tp.plan.hf import hf_plan

from ..helpers import max_err
from ..moe_models import build, original_grads, trained

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "nemotron_h")
TP = 4


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=TP)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, mesh):
    cpu, ref, model, out = trained(request.param, mesh)
    aux = None if ref.aux_loss is None else (out.aux_loss.item(), ref.aux_loss.item())  # DeepSeek-V3 has none
    result = {"name": request.param, "model": model, "cpu": cpu, "logits": max_err(out.logits, ref.logits),
              "loss": (out.loss.item(), ref.loss.item()), "aux": aux, "grads": original_grads(model),
              "report": xla_tp.moe_report(model)}
    xla_tp.set_moe_options(model, capacity_factor=1.25)  # token dropping, as a training recipe chooses it
    result["audit"] = xla_tp.audit(model, torch.randint(0, 128, (4, 32)).to(torch_xla.device()), mesh=mesh)
    return result


def test_logits_loss_and_gradients_equal_the_cpu_model(family):
    assert family["logits"] < 1e-4
    assert family["loss"][0] == pytest.approx(family["loss"][1], abs=1e-5)
    if family["aux"] is not None:  # the router's load-balancing loss, in the training loss
        assert family["aux"][0] == pytest.approx(family["aux"][1], abs=1e-5) and family["aux"][1] > 0
    cpu = {n: p.grad for n, p in family["cpu"].named_parameters() if p.grad is not None}
    assert set(family["grads"]) == set(cpu)
    worst = max(max_err(family["grads"][n], g) for n, g in cpu.items())
    assert worst < 1e-4


def test_expert_weights_and_their_gradients_stay_split(family):
    model = family["model"]
    experts = {n: p for n, p in model.named_parameters() if p.dim() == 3}
    assert experts
    for name, p in experts.items():
        assert local_numel(tuple(p.shape), sharding_string(p)) * TP == p.numel(), name
        assert sharding_string(p.grad) == sharding_string(p), name
    report = family["audit"]
    assert report.param_bytes_per_device <= 0.6 * report.param_bytes_total


def test_one_reduction_per_layer_and_balance_at_capacity_factor_1_25(family):
    report, layers = family["audit"], family["model"].config.num_hidden_layers
    assert report.count("all-gather") == 0 and report.count("all-to-all") == 0
    assert report.count("collective-permute") == 0
    # OLMoE's q/k norms run over all heads: two more small reductions ([batch, seq]) per layer
    extra = 2 * layers if family["name"] == "olmoe" else 0
    assert report.count("all-reduce") <= 2 * layers + 2 + extra
    assert report.compute_balance <= 1.30
    assert report.comm_ratio <= 1.05


def test_every_moe_layer_is_reported_expert_tensor_parallel_and_dropless(family):
    report, model = family["report"], family["model"]
    moe = [fqn for fqn, m in model.named_modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]
    assert sorted(report) == sorted(moe)
    for layer in report.values():  # default options: dropless; off TPU in slots, a slot per token per expert
        assert layer == {"layout": "expert-tensor-parallel", "expert_axis": None, "capacity_factor": 1.25,
                         "dropless": True, "route": "slots", "cost": 8 / 2, "routed": 4 * 16 * 2, "dropped": 0}


def test_a_router_of_two_top_1_choices_is_found_and_split_like_top_2(mesh):
    """PhiMoE's sparsemixer picks an expert with ``max``, masks it, picks another and concatenates the two:
    the same experts layer as a top-2, planned like one, with the CPU model's logits (eval: it samples while
    training)."""
    torch.manual_seed(0)
    cpu = build("phimoe").eval()
    plan = xla_tp.plan_for(cpu, mesh=mesh)
    assert plan.roles["model.layers.0.mlp.experts.gate_up_proj"].why.startswith(
        "expert-tensor-parallel: each expert's 32 intermediate features split 4 ways")
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), plan, mesh=mesh)
    ids = torch.randint(0, 128, (4, 16))
    with torch.no_grad():
        assert max_err(model(ids.to(torch_xla.device())).logits, cpu(ids).logits) < 1e-4
        report = xla_tp.audit(model, ids.to(torch_xla.device()), mesh=mesh)
    assert report.count("all-gather") == 0 and report.count("all-reduce") <= 2 * 1 + 2
    assert report.param_bytes_per_device <= 0.6 * report.param_bytes_total


def test_router_replicated_and_explained(mesh):
    with pytest.raises(xla_tp.PlanError, match="is not an experts layout"):
        xla_tp.plan_for(build("mixtral"), mesh=mesh, experts="expert_parallel")
    plan = xla_tp.plan_for(build("mixtral"), mesh=mesh)
    assert plan.replicated["model.layers.0.mlp.gate.weight"].startswith("router of model.layers.0.mlp.experts")
    assert plan.roles["model.layers.0.mlp.experts.down_proj"].why.startswith(
        "expert-tensor-parallel: each expert's 32 intermediate features split 4 ways")
    asked = xla_tp.plan_for(build("mixtral"), mesh=mesh, experts="expert-parallel")
    assert asked.roles["model.layers.0.mlp.experts.down_proj"].why.startswith(
        "expert-parallel, as asked (experts=...): 8 experts split 4 ways")


def test_expert_tensor_parallel_when_the_axis_does_not_divide_the_experts(mesh):
    torch.manual_seed(0)
    cpu = build("mixtral", experts=6)
    model = copy.deepcopy(cpu)
    plan = xla_tp.plan_for(model, mesh=mesh)
    assert plan.roles["model.layers.0.mlp.experts.gate_up_proj"].axes == (None, "mlp", None)
    assert "model.layers.0.mlp.experts.gate_up_proj" in plan.packings  # gate and up re-laid device-major
    xla_tp.parallelize_xla(model, plan, mesh=mesh)
    ids = torch.randint(0, 128, (4, 16))
    assert max_err(model(ids.to(torch_xla.device())).logits, cpu(ids).logits) < 1e-4
    assert {r["layout"] for r in xla_tp.moe_report(model).values()} == {"expert-tensor-parallel"}
    xla_tp.set_moe_options(model, capacity_factor=0.5)  # half the slots: some dropped, counted
    model(ids.to(torch_xla.device()))
    (layer,) = xla_tp.moe_report(model).values()
    assert layer["routed"] == 4 * 16 * 2 and 0 < layer["dropped"] < layer["routed"]
    report = xla_tp.audit(model, ids.to(torch_xla.device()), mesh=mesh)
    assert report.count("all-gather") == 0 and report.count("all-to-all") == 0
    assert report.count("all-reduce") <= 2 * 1 + 2 and report.count("collective-permute") == 0
    assert model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].cpu().equal(
        cpu.state_dict()["model.layers.0.mlp.experts.gate_up_proj"])  # saved in the original order


def test_fsdp_tp_ep_mesh_trains_like_cpu():
    cpu, ref, model, out = trained("mixtral", xla_tp.make_mesh(fsdp=2, model=TP))
    assert max_err(out.logits, ref.logits) < 1e-4
    got = original_grads(model)
    assert max(max_err(got[n], p.grad) for n, p in cpu.named_parameters()) < 1e-4
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert local_numel(tuple(w.shape), sharding_string(w)) * 2 * TP == w.numel()  # experts x fsdp shards


def test_unparallelize_takes_the_lowering_off(mesh):
    from xla_tp.lowering.routed import expert_set
    model = xla_tp.parallelize_xla(build("olmoe"), "auto", mesh=mesh)
    experts = model.model.layers[0].mlp.experts
    assert expert_set(experts) is not None
    xla_tp.unparallelize(model)
    assert expert_set(experts) is None
    with pytest.raises(xla_tp.PlanError, match="is not parallelized"):
        xla_tp.set_moe_options(model, dropless=True)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        xla_tp.set_moe_options(xla_tp.parallelize_xla(model, "auto", mesh=mesh), capacity_factor=0)


def _ep_plan(model) -> dict:
    """The model's HF tensor-parallel plan with its expert-parallel one (``grouped_gemm``) on the experts."""
    ep = {"model." + k: v for k, v in model.config.base_model_ep_plan.items()}
    tp = {k: v for k, v in hf_plan(model).items() if ".experts" not in k}
    return {**tp, **ep}


@pytest.mark.parametrize("plan,layout", [("hf", "expert-tensor-parallel"), (_ep_plan, "expert-parallel")],
                         ids=["tp_plan", "ep_plan"])
def test_hf_moe_strings_lower_to_the_experts_layouts(mesh, plan, layout):
    torch.manual_seed(0)
    cpu = build("mixtral")
    plan = plan if isinstance(plan, str) else plan(cpu)  # packed_colwise, rowwise, moe_tp_experts | grouped_gemm
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), plan, mesh=mesh)
    ids = torch.randint(0, 128, (4, 16))
    assert max_err(model(ids.to(torch_xla.device())).logits, cpu(ids).logits) < 1e-4
    assert {r["layout"] for r in xla_tp.moe_report(model).values()} == {layout}
    report = xla_tp.audit(model, ids.to(torch_xla.device()), mesh=mesh)
    assert report.count("collective-permute") == 0 and report.count("all-to-all") == 0  # gate/up re-laid as HF's


class _CountedExperts(torch.nn.Module):
    """The grouped form: rows sorted by expert, split by counts read on the host (``.tolist()``)."""

    def __init__(self, hidden: int = 16, experts: int = 4):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(experts))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        order = ids.flatten().argsort()
        counts = torch.nn.functional.one_hot(ids.flatten(), len(self.experts)).sum(0).tolist()
        rows = x.repeat_interleave(2, 0)[order].split(counts)
        routed = torch.cat([expert(r) for expert, r in zip(self.experts, rows)]) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add(0, order // 2, routed)


def test_experts_counted_on_the_host_are_refused_with_what_to_do(mesh):
    """(Experts picking their tokens with torch.where are planned: tests/program/test_moe_looped.py.)"""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    _CountedExperts()(x)  # runs on the CPU
    model = torch.nn.Sequential(OrderedDict(moe=_CountedExperts()))
    op = "_local_scalar_dense"
    with pytest.raises(xla_tp.PlanError, match=rf"{op}.* in moe.* needs the tensors. values.*"
                                                r"pass a plan instead of 'auto'"):
        xla_tp.plan_for(model, mesh=mesh, example_inputs=(x,))
    with pytest.warns(UserWarning, match="first call"):  # its made-up input may be what the trace stops at
        xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    with pytest.raises(xla_tp.PlanError, match=rf"{op}.* in moe.* needs the tensors. values"):
        model(x.to(torch_xla.device()))


def test_launcher_adds_the_router_loss_checks_dropless_and_logs_drops(mesh):
    torch.manual_seed(0)
    cpu = build("mixtral")
    ids = torch.randint(0, 128, (2, 8))
    _, loss = causal_or_masked_loss("causal-lm")(cpu, ids, ids)
    out = cpu(ids, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())
    assert out.aux_loss > 0 and loss.item() == pytest.approx((ce + 0.01 * out.aux_loss).item(), abs=1e-6)
    model = parallelizer("auto", mesh)(copy.deepcopy(cpu))  # --check: the CPU model's own results
    assert [layer["dropless"] for layer in xla_tp.moe_report(model).values()] == [True]
    line = format_metrics({"step": 1, "steps": 2, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "mfu": None,
                           "compiles": 1, "moe_dropped": 0.125})
    assert "MoE dropped 12.5%" in line
