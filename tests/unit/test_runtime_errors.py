"""Errors at run time as clear as at plan time: bad activation layouts, and an audit whose forward fails."""
import pytest
import torch
import torch_xla

import xla_tp
from xla_tp import ColwiseParallel, PlanError, RowwiseParallel, Shard

from ..helpers import MLP


def test_activation_layout_naming_a_missing_dim_fails_at_the_first_forward():
    mesh = xla_tp.make_mesh(model=8)
    model = xla_tp.parallelize_xla(MLP(16, 32), {"fc1": ColwiseParallel(input_layouts=Shard(5))}, mesh=mesh)
    x = torch.randn(8, 16).to(torch_xla.device())
    with pytest.raises(PlanError) as error:
        model(x)
    message = str(error.value)
    for words in ("'fc1'", "ColwiseParallel", "layout Shard(dim=5) of input 0 shards dim 5", "(8, 16)", "2 dims"):
        assert words in message, (words, message)


def test_output_layout_and_explicit_spec_of_the_wrong_rank_are_named_too():
    mesh = xla_tp.make_mesh(model=8)
    x = torch.randn(8, 16).to(torch_xla.device())
    model = xla_tp.parallelize_xla(MLP(16, 32), {"fc2": RowwiseParallel(output_layouts=Shard(-3))}, mesh=mesh)
    with pytest.raises(PlanError, match=r"'fc2'.*output 0.*\(8, 16\)"):
        model(x)
    rules = xla_tp.load_rules({"fc1": [None, None, "model"]})  # fc1's output is 2-D
    model = xla_tp.parallelize_xla(MLP(16, 32), rules, mesh=mesh)
    with pytest.raises(PlanError, match=r"'fc1'.*output 0 has 3 entries.*\(8, 32\)"):
        model(x)


def test_negative_dims_in_range_still_work():
    mesh = xla_tp.make_mesh(model=8)
    model = xla_tp.parallelize_xla(MLP(16, 32), {"fc1": ColwiseParallel(input_layouts=Shard(-2))}, mesh=mesh)
    assert model(torch.randn(8, 16).to(torch_xla.device())).shape == (8, 16)


def test_audit_surfaces_the_models_own_error():
    mesh = xla_tp.make_mesh(data=2, model=4)
    model = xla_tp.parallelize_xla(MLP(16, 32), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=mesh)
    wrong = torch.randn(8, 12).to(torch_xla.device())  # the model takes 16 features
    with pytest.raises(Exception) as direct:
        model(wrong)
    with pytest.raises(type(direct.value)) as audited:
        xla_tp.audit(model, wrong, mesh=mesh)
    assert str(audited.value) == str(direct.value)
