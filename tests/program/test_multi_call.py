"""A model parallelized in several calls (torch's idiom) is one layout: union, order, re-calls, audit."""
import pytest
import torch
import torch_xla

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel
from xla_tp.auditing.run import audit
from xla_tp import layout_of

from ..helpers import MLP, expected_sharding, sharding
from ..titan import report_dict, settled, titan


@pytest.mark.parametrize("order", ["root_first", "blocks_first"])
def test_several_calls_audit_like_one_call_with_the_merged_plan(order, titan_single_call):
    layout, shardings, report = titan_single_call
    model, mesh = titan(order)
    merged = layout_of(model)
    assert merged.params == layout.params
    assert {k: (m.inputs, m.outputs, m.params) for k, m in merged.modules.items()} == \
        {k: (m.inputs, m.outputs, m.params) for k, m in layout.modules.items()}
    assert {n: sharding(p) for n, p in model.named_parameters()} == shardings
    values = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    got = report_dict(model, mesh)
    assert got == report
    assert abs(got["compute_balance"] - 1.0) < 0.01
    # the audit left every annotation, value and gradient as it found them
    assert {n: settled(p) for n, p in model.named_parameters()} == shardings
    assert all(torch.equal(p.detach().cpu(), values[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_audit_adds_no_annotation_to_replicated_parameters_or_inputs():
    mesh = xla_tp.make_mesh(data=2, model=4)
    model = xla_tp.parallelize_xla(MLP(16, 32), {"fc1": ColwiseParallel()}, mesh=mesh)
    x = torch.randn(8, 16).to(torch_xla.device())
    before = [sharding(t) for t in (*model.parameters(), x)]
    assert before[2:] == ["", "", ""]  # fc2 and the input carry no annotation
    audit(model, x, mesh=mesh, backward=True)
    assert [settled(t) for t in (*model.parameters(), x)] == before


def test_root_after_blocks_keeps_the_blocks_shardings():
    mesh = xla_tp.make_mesh(model=8)
    model = torch.nn.Sequential(MLP(16, 32), MLP(16, 32))
    xla_tp.parallelize_module(model[0], mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    xla_tp.parallelize_module(model, mesh, {"1.fc1": ColwiseParallel()})
    assert sharding(model[0].fc1.weight) == expected_sharding((32, 16), mesh, ("model", None))
    assert sharding(model[1].fc1.weight) == expected_sharding((32, 16), mesh, ("model", None))
    assert sorted(layout_of(model).params) == ["0.fc1.bias", "0.fc1.weight", "0.fc2.bias", "0.fc2.weight",
                                               "1.fc1.bias", "1.fc1.weight"]


def test_a_later_call_wins_and_a_re_call_drops_only_its_own_earlier_work():
    mesh = xla_tp.make_mesh(model=8)
    model = torch.nn.Sequential(MLP(16, 32), MLP(16, 32))
    xla_tp.parallelize_module(model, mesh, {"0.fc1": ColwiseParallel(), "1.fc1": ColwiseParallel()})
    xla_tp.parallelize_module(model[1], mesh, {"fc1": RowwiseParallel()})   # later call on a child wins
    assert layout_of(model).params["1.fc1.weight"] == (None, "model")
    assert len(model[1].fc1._forward_pre_hooks) == 1  # the child's hooks replaced the root's there
    xla_tp.parallelize_module(model, mesh, {"0.fc2": RowwiseParallel()})     # re-call on the root
    assert "devices" not in sharding(model[0].fc1.weight)                    # the root's own earlier work
    assert not model[0].fc1._forward_pre_hooks
    assert sharding(model[1].fc1.weight) == expected_sharding((32, 16), mesh, (None, "model"))  # the child's
    assert set(layout_of(model).params) == {"0.fc2.weight", "0.fc2.bias", "1.fc1.weight", "1.fc1.bias"}


def test_calls_on_different_tensor_parallel_axes_cannot_be_merged():
    mesh = xla_tp.make_mesh(data=2, model=4)
    model = torch.nn.Sequential(MLP(16, 32), MLP(16, 32))
    xla_tp.parallelize_xla(model[0], {"fc1": ColwiseParallel()}, mesh=mesh)
    xla_tp.parallelize_xla(model[1], {"fc1": ColwiseParallel()}, mesh=mesh, tp_axis="data")
    with pytest.raises(xla_tp.PlanError, match="different axes"):
        layout_of(model)
