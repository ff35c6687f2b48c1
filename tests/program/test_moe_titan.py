"""torchtitan 0.2.0's DeepSeek-V3 parallelized by its own ``apply_non_moe_tp`` and ``apply_moe_ep_tp``, with
only ``parallelize_module`` swapped for xla_tp's (the model, the plan dicts and torchtitan's style classes
reproduced in ``titan_moe``): it trains like the CPU model, its grouped experts in static slots."""
import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import xla_tp
from xla_tp.auditing.params import local_numel, sharding_string

from ..helpers import grads, max_err
from ..titan_moe import DeepSeekV3Model, ExpertTensorParallel, apply_moe_ep_tp, apply_non_moe_tp, int_histc


def _loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    cpu = DeepSeekV3Model()
    ids = torch.randint(0, 128, (4, 16))
    with mock.patch("torch.histc", int_histc(torch.histc)):
        _loss(cpu, ids).backward()
        logits = cpu(ids).detach()
    return cpu, ids, logits


# experts style -> (mesh names, layout, the expert axis, ways w1 is split)
CASES = {"TensorParallel": (("dp", "tp"), "expert-tensor-parallel", None, 4),
         "ExpertParallel": (("dp", "tp"), "expert-parallel", None, 4),                # borrowing the TP ranks
         "ExpertTensorParallel": (("ep", "tp"), "expert-tensor-parallel", "expert", 8)}  # on world["ep", "tp"]


@pytest.mark.parametrize("experts", sorted(CASES))
def test_torchtitan_deepseek_v3_with_its_own_plans_trains_like_cpu(reference, experts):
    cpu, ids, logits = reference
    names, layout, expert_axis, ways = CASES[experts]
    model = copy.deepcopy(cpu)
    model.zero_grad(set_to_none=True)
    world = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=names)
    apply_non_moe_tp(model, world["tp"], loss_parallel=True)
    if experts == "ExpertTensorParallel":
        apply_moe_ep_tp(model, world["tp"], world["ep"], world["ep", "tp"], etp_enabled=True)
    else:
        apply_moe_ep_tp(model, world["tp"], world["tp"] if experts == "ExpertParallel" else None, None,
                        etp_enabled=False)
    xids = ids.to(torch_xla.device())
    assert max_err(model(xids), logits) < 1e-4
    assert xla_tp.moe_report(model)["layers.1.moe.experts"] == {
        "layout": layout, "expert_axis": expert_axis, "capacity_factor": 1.25, "dropless": True, "route": "slots",
        "cost": 8.0, "routed": 4 * 16 * 2, "dropped": 0}
    w1 = model.layers["1"].moe.experts.w1
    assert local_numel(tuple(w1.shape), sharding_string(w1)) * ways == w1.numel()
    _loss(model, xids).backward()
    got = grads(model)
    assert max(max_err(got[n], p.grad) for n, p in cpu.named_parameters()) < 1e-4
    assert sharding_string(w1.grad) == sharding_string(w1)


def test_experts_on_the_expert_slice_are_refused_with_the_slice_that_works(reference):
    """torchtitan's usual EP mesh (``world["ep"]``) is xla_tp's expert axis, which carries the batch: one line
    naming the slice that works, and the experts left as they were."""
    cpu, _, _ = reference
    model = copy.deepcopy(cpu)
    world = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("ep", "tp"))
    apply_non_moe_tp(model, world["tp"], loss_parallel=True)
    experts = model.layers["1"].moe.experts
    with pytest.raises(xla_tp.PlanError, match=r"axis 'expert' \(ep\) carries the batch.*world\['tp'\].*world\['ep', 'tp'\]"):
        apply_moe_ep_tp(model, world["tp"], world["ep"], None, etp_enabled=False)
    assert "forward" not in experts.__dict__ and sharding_string(experts.w1) == ""
    # ExpertTensorParallel on a mesh without an expert axis: the axis it needs, named
    tp_only = xla_tp.init_device_mesh("xla", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(xla_tp.PlanError, match=r"'w1' \(8, 32, 64\): spec \('expert', 'model', None\) uses axis "
                                               r"'expert', which the mesh lacks"):
        xla_tp.parallelize_module(experts, tp_only["tp"], ExpertTensorParallel())
    assert "forward" not in experts.__dict__ and sharding_string(experts.w1) == ""
