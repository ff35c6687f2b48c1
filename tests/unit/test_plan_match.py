"""Key matching precedence (exact > wildcard > regex; modules before parameters), strict-mode errors with
suggestions, and the report of parameters left replicated."""
import pytest
from torch import nn

import xla_tp
from xla_tp import ColwiseParallel, PlanError, RowwiseParallel, SequenceParallel
from xla_tp.plan.match import match_keys, suggest
from xla_tp.plan.normalize import build_layout
from xla_tp.plan.unplanned import unplanned_parameters

from ..helpers import MLP
from .test_errors import assert_unchanged, snapshot

AXES = {"data": 2, "fsdp": 1, "model": 4}


def _model():
    return nn.ModuleDict({"layers": nn.ModuleList([MLP(16, 32) for _ in range(2)]), "norm": nn.LayerNorm(16)})


def test_exact_beats_wildcard_beats_regex():
    fqns = ["fc1", "fc2", "fc3"]
    best, unused = match_keys(["re:fc.", "fc*", "fc1"], fqns)
    assert best == {"fc1": "fc1", "fc2": "fc*", "fc3": "fc*"} and unused == []
    best, _ = match_keys(["re:fc[12]", "fc1"], fqns)
    assert best == {"fc1": "fc1", "fc2": "re:fc[12]"}


def test_precedence_in_a_layout():
    plan = {"layers.0.fc1": RowwiseParallel(), "layers.*.fc1": ColwiseParallel(), "re:layers\\.\\d\\.fc2": RowwiseParallel()}
    layout = build_layout(_model(), plan, AXES, "model")
    assert layout.params["layers.0.fc1.weight"] == (None, "model")   # exact
    assert layout.params["layers.1.fc1.weight"] == ("model", None)   # wildcard
    assert layout.modules["layers.1.fc2"].source == "re:layers\\.\\d\\.fc2"


def test_keys_match_modules_before_parameters():
    plan = {"layers.*.fc1": "colwise", "layers.*.fc1.bias": "replicate", "layers.0.fc1.weight": "rowwise"}
    layout = build_layout(_model(), plan, AXES, "model")
    assert layout.params["layers.0.fc1.weight"] == (None, "model")   # exact parameter key wins
    assert layout.params["layers.1.fc1.weight"] == ("model", None)   # module key
    assert layout.params["layers.1.fc1.bias"] == (None,)             # wildcard parameter key


def test_same_kind_keys_on_one_parameter_are_ambiguous():
    with pytest.raises(PlanError, match=r"'layers\.\*\.fc1\.bias' and 'layers\.\*\.fc1\.bia\?' both match"):
        build_layout(_model(), {"layers.*.fc1.bias": "replicate", "layers.*.fc1.bia?": "colwise"}, AXES, "model")


def test_suggestions_cover_modules_parameters_and_wildcards():
    names = ["layers.0.fc1", "layers.0.fc1.weight", "layers.1.fc1"]
    assert suggest("layers.*.fc_1", names)[0] == "layers.*.fc1"
    assert "layers.0.fc1.weight" in suggest("layers.0.fc1.wieght", names)


@pytest.mark.parametrize("plan, words", [
    ({"layers.*.fc1.wieght": "colwise"}, ["'layers.*.fc1.wieght'", "did you mean", "'layers.*.fc1.weight'"]),
    ({"layers.*.fc1": "colwise", "nrom": SequenceParallel()}, ["'nrom'", "'norm'", "strict=False"]),
])
def test_strict_mode_fails_on_unused_keys_with_suggestions(plan, words):
    model = _model()
    snap = snapshot(model)
    with pytest.raises(PlanError) as info:
        xla_tp.parallelize_xla(model, plan, mesh=xla_tp.make_mesh(data=2, model=4))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_unchanged(model, snap)


def test_non_strict_warns_and_applies_the_rest():
    with pytest.warns(UserWarning, match="'nrom'"):
        layout = build_layout(_model(), {"layers.*.fc1": "colwise", "nrom": "replicate"}, AXES, "model", strict=False)
    assert layout.params["layers.0.fc1.weight"] == ("model", None)


def test_unplanned_parameters_says_why():
    plan = {"layers.*.fc1": "colwise", "layers.0.fc2": "gather", "norm": SequenceParallel()}
    model = _model()
    report = unplanned_parameters(model, build_layout(model, plan, AXES, "model"))
    assert "layers.0.fc1.weight" not in report and "layers.1.fc1.bias" not in report
    assert report["layers.1.fc2.weight"] == "no plan key matches module 'layers.1.fc2' or parameter 'layers.1.fc2.weight'"
    assert "style 'gather' (key 'layers.0.fc2') on module 'layers.0.fc2' does not shard it" == report["layers.0.fc2.bias"]
    assert report["norm.weight"].startswith("style SequenceParallel(") and report["norm.weight"].endswith("replicates it")


def test_unplanned_parameters_notes_fsdp_only():
    model = _model()
    layout = build_layout(model, {"layers.*.fc1": "colwise"}, {"fsdp": 2, "model": 4}, "model")
    assert unplanned_parameters(model, layout)["layers.0.fc2.weight"].endswith("(sharded over ('fsdp', None) only)")


def test_ambiguity_does_not_depend_on_key_order():
    from xla_tp.plan.match import match_keys
    for keys in (["l*", "l?", "l1"], ["l1", "l*", "l?"]):
        best, _ = match_keys(keys, ["l1"])
        assert best == {"l1": "l1"}  # the exact key wins over both wildcards, in either order
    for keys in (["l*", "l?"], ["l?", "l*"]):
        with pytest.raises(xla_tp.PlanError, match="both match 'l2'"):
            match_keys(keys, ["l2"])
