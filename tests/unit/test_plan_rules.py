"""Rule lists: torchprime-style YAML (parameters and module outputs) and ordered regex lists (EasyDeL)."""
import copy

import pytest
import torch
import torch_xla
from torch import nn

import xla_tp
from xla_tp import PlanError
from xla_tp.plan.normalize import build_layout
from xla_tp.plan.rules import AxisRule, load_rules, regex_plan

from ..helpers import MLP, expected_sharding, max_err, sharding
from .test_errors import assert_unchanged, snapshot

AXES = {"data": 2, "fsdp": 1, "model": 4}


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLP(16, 32) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Pair(nn.Module):
    """Returns a tuple, like HF decoder layers of older eras."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x), x


YAML = """
layers.*.fc1.weight: [tp, null]
layers.*.fc1.bias: [tensor]
layers.*.fc2.weight: [null, model]
layers.*: [dp, null]
"": [data, null]
"""


def test_load_rules_groups_parameters_and_outputs():
    plan = load_rules(YAML)
    assert plan["layers.*.fc1.weight"] == AxisRule((("model", None),))
    assert plan["layers.*"] == AxisRule((("data", None),))
    layout = build_layout(Stack(), plan, AXES, "model")
    assert layout.params["layers.1.fc1.weight"] == ("model", None)
    assert layout.params["layers.0.fc1.bias"] == ("model",)
    assert layout.modules["layers.0"].outputs == ((("data", None),),)
    assert layout.modules[""].outputs == ((("data", None),),)


def test_yaml_rules_place_parameters_and_keep_numerics():
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    mesh = xla_tp.make_mesh(data=2, model=4)
    xla_tp.parallelize_xla(model, load_rules(YAML), mesh=mesh)
    w1, w2 = model.layers[0].fc1.weight, model.layers[1].fc2.weight
    assert sharding(w1) == expected_sharding(w1.shape, mesh, ("model", None))
    assert sharding(w2) == expected_sharding(w2.shape, mesh, (None, "model"))
    x = torch.randn(4, 16)
    assert max_err(model(x.to(torch_xla.device())), ref(x)) < 1e-5


def test_tuple_output_index_and_sources(tmp_path):
    rules = {"sharding": {"pair[1]": ["data", None], "pair.fc.weight": [["data", "model"], None]}}
    path = tmp_path / "rules.yaml"
    path.write_text("pair[1]: [data, null]\npair.fc.weight: [[data, model], null]\n")
    for source in (rules, path, str(path)):
        plan = load_rules(source)
        layout = build_layout(nn.ModuleDict({"pair": Pair()}), plan, AXES, "model")
        assert layout.modules["pair"].outputs == ((), (("data", None),))
        assert layout.params["pair.fc.weight"] == (("data", "model"), None)


def test_tuple_output_forward():
    torch.manual_seed(0)
    model = nn.ModuleDict({"pair": Pair()})
    ref = copy.deepcopy(model)
    xla_tp.parallelize_xla(model, load_rules("pair[0]: [data, model]\npair[1]: [data, null]"),
                           mesh=xla_tp.make_mesh(data=2, model=4))
    x = torch.randn(4, 16)
    out, ref_out = model["pair"](x.to(torch_xla.device())), ref["pair"](x)
    assert max_err(out[0], ref_out[0]) < 1e-5 and max_err(out[1], ref_out[1]) == 0


@pytest.mark.parametrize("rules, words", [
    ("layers.*.fc1.wieght: [model, null]", ["'layers.*.fc1.wieght'", "layers.*.fc1.weight", "match no"]),
    ("layers.*.fc1.weight[0]: [model, null]", ["'layers.*.fc1.weight'", "[i]"]),
    ("layers.*.fc1.weight: model", ["'layers.*.fc1.weight'", "list of mesh axes"]),
    ("layers.*.fc1.weight: [3, null]", ["3", "mesh axis"]),
    ("- a\n- b", ["mapping"]),
])
def test_yaml_rule_errors_leave_model_unchanged(rules, words):
    model = Stack()
    snap = snapshot(model)
    with pytest.raises(PlanError) as info:
        xla_tp.parallelize_xla(model, load_rules(rules), mesh=xla_tp.make_mesh(data=2, model=4))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_unchanged(model, snap)


def test_regex_first_match_wins_with_search_semantics():
    rules = [(r"fc1\.weight", ("tp", None)), (r"layers\.1\.", ()), (r"fc2\.weight$", (None, "model")),
             (r".*", ())]
    plan = regex_plan(Stack(), rules)
    layout = build_layout(Stack(), plan, AXES, "model")
    assert layout.params["layers.0.fc1.weight"] == ("model", None)
    assert layout.params["layers.1.fc1.weight"] == ("model", None)      # rule 0 came first
    assert layout.params["layers.1.fc2.weight"] == (None, None)         # rule 1 shadows rule 2 here
    assert layout.params["layers.0.fc2.weight"] == (None, "model")
    assert layout.params["layers.0.fc1.bias"] == (None,)                # catch-all: replicated


def test_regex_rules_place_parameters():
    model = Stack()
    mesh = xla_tp.make_mesh(data=2, model=4)
    xla_tp.parallelize_xla(model, regex_plan(model, [(r"fc1\.bias", ("model",)),
                                                     (r"fc1\.weight", ("model", None)), (r"fc2\.weight", (None, "tp")),
                                                     (r".", ())]), mesh=mesh)
    w = model.layers[1].fc2.weight
    assert sharding(w) == expected_sharding(w.shape, mesh, (None, "model"))


@pytest.mark.parametrize("rules, words", [
    ([(r"fc3\.weight", ("model", None))], ["'fc3\\\\.weight' matches no parameter", "fc"]),
    ([(r"weight", ()), (r"fc1\.weight", ("model", None))], ["earlier rules already took"]),
    ([(r"fc1[", ())], ["invalid regular expression"]),
])
def test_regex_strict_errors(rules, words):
    with pytest.raises(PlanError) as info:
        regex_plan(Stack(), rules)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_regex_spec_of_wrong_rank_fails_before_touching_the_model():
    model = Stack()
    snap = snapshot(model)
    with pytest.raises(PlanError, match=r"'layers.0.fc1.weight' has 2 dims"):
        xla_tp.parallelize_xla(model, regex_plan(model, [(r"fc1\.weight", ("model",))], strict=False),
                               mesh=xla_tp.make_mesh(data=2, model=4))
    assert_unchanged(model, snap)
