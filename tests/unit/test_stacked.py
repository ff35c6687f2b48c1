"""Stacked experts found by dataflow (``dataflow.stacked``), whatever the modules are called, and planned."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Partial

from xla_tp.dataflow.stacked import find_stacked
from xla_tp.dataflow.trace import trace
from xla_tp.planners import plan_for

pytestmark = pytest.mark.core


class Stacked(nn.Module):
    """Every expert on every token, written without transformers: einsum, no module of its own."""

    def __init__(self, experts: int = 4, summed: bool = True):
        super().__init__()
        self.a = nn.Parameter(torch.randn(experts, 8, 32))
        self.b = nn.Parameter(torch.randn(experts, 16, 8))
        self.summed = summed

    def forward(self, x):
        e = self.a.shape[0]
        xs = x.repeat(e, 1).view(e, -1, x.shape[-1])
        g, u = torch.einsum("eth,ehf->etf", xs, self.a).chunk(2, -1)
        y = torch.bmm(F.silu(g) * u, self.b)
        return y.sum(0) if self.summed else y.mean(1)


def test_found_by_what_its_tensors_do():
    (layer,) = find_stacked(trace(Stacked(), (torch.randn(6, 8),)))
    assert (layer.module, layer.repeats, layer.sums, layer.experts) == ("", "", "", 4)
    assert [(w.param.name, w.contracted, w.kept) for w in layer.weights] == [("a", 1, 2), ("b", 1, 2)]


def test_not_stacked_experts_without_the_sum_over_them():
    assert find_stacked(trace(Stacked(summed=False), (torch.randn(6, 8),))) == []


def test_split_by_experts_where_the_model_axis_divides_them():
    plan = plan_for(Stacked(), {"model": 4}, example_inputs=(torch.randn(6, 8),))
    assert plan.roles["a"].axes == plan.roles["b"].axes == ("experts", None, None)
    assert plan[""].natural_output == Partial()  # its own forward sums the experts: a partial sum, one all-reduce
    with pytest.warns(UserWarning, match="found nothing to split"):
        odd = plan_for(Stacked(experts=6), {"model": 4}, example_inputs=(torch.randn(6, 8),))
        asked = plan_for(Stacked(), {"model": 4}, example_inputs=(torch.randn(6, 8),), experts="replicated")
    assert "their 6 experts do not split 4 ways" in odd.replicated["b"]
    assert asked.replicated["a"].startswith("replicated, as asked")
