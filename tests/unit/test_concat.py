"""A concatenation along the split features (Flux's single-stream block: attention and MLP concatenated, then
one output projection) planned from its dataflow (no torch_xla): the attention and the MLP column-parallel,
the output projection row-parallel with its input columns re-laid device-major like the concatenation."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xla_tp.lowering.blocks import laid
from xla_tp.plan.packing import Packing
from xla_tp.planners import plan_for

SIZES = {"data": 2, "model": 4}


class Single(nn.Module):
    """Attention and an MLP side by side on one input; ``extra``: the input concatenated too, which no split
    computes."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.extra = extra
        self.q, self.k, self.v, self.mlp = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 64)
        self.out = nn.Linear(96 + 32 * extra, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 8, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 32)
        pieces = [attn, F.gelu(self.mlp(x))] + [x] * self.extra
        return x + self.out(torch.cat(pieces, dim=-1))


def test_a_row_reading_a_concatenation_of_split_features_is_re_laid_like_it():
    plan = plan_for(Single(), mesh=SIZES, example_inputs=(torch.randn(2, 5, 32),))
    assert {plan.roles[f"{n}.weight"].kind for n in ("q", "k", "v", "mlp")} == {"column"}
    out = plan.roles["out.weight"]
    assert out.kind == "row" and out.packing == Packing(1, ((0, 32), (32, 64)), 4)
    assert "laid device-major" in out.why and plan.concats == {(32, 64): 4}


def test_a_concatenation_with_features_no_split_computes_stays_whole():
    with pytest.warns(UserWarning, match="found nothing to split"):
        plan = plan_for(Single(extra=True), mesh=SIZES, example_inputs=(torch.randn(2, 5, 32),))
    assert not [n for n in plan.roles if n.split(".")[0] in ("q", "k", "v", "mlp", "out")]
    assert "no split block computes" in plan.replicated["mlp.weight"] and not plan.concats


def test_the_laid_concatenation_is_the_re_laid_order_of_the_plain_one():
    a, b = torch.randn(3, 8), torch.randn(3, 12)
    order = Packing(1, ((0, 8), (8, 12)), 4).order()
    assert torch.equal(laid(a, b, tp=4), torch.cat([a, b], -1)[:, order])
