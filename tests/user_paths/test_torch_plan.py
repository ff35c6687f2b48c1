"""``xla_tp.torch_plan``: the plan "auto" writes, run by torch's own ``parallelize_module`` on 4 gloo processes
(127.0.0.1, CPU DTensors), equal to the unsharded model; what torch's styles cannot express stays whole, said.

The same file runs in the torch_xla-free environment of ``bash scripts/dev.sh complete`` (torch 2.11).
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import xla_tp

from ..fresh import run_fresh

pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def on_four_processes() -> dict:
    out = run_fresh("from tests.torch_plan_worker import main; main()", timeout=900)
    return json.loads(next(line[4:] for line in out.splitlines() if line.startswith("JSON")))


@pytest.mark.complete
@pytest.mark.parametrize("name", ["llama", "qwen3_gqa", "bert", "mixtral"])
def test_torch_runs_the_plan_and_computes_the_models_function(on_four_processes, name):
    got = on_four_processes[name]
    assert got["error"] < 1e-5, got
    assert got["split"] == got["styled"]  # every module the plan styles holds DTensor parameters, no other


@pytest.mark.complete
def test_what_torch_styles_cannot_say_stays_whole_with_its_block(on_four_processes):
    llama, gqa, mixtral = (on_four_processes[n] for n in ("llama", "qwen3_gqa", "mixtral"))
    assert llama["whole"] == [] and len(llama["styled"]) == 2 * 7 + 2
    # 2 key/value heads on 4 devices: "auto" keeps k and v whole; torch's local heads would not match q's, so
    # the attention's block stays whole, q and o too
    assert gqa["whole"] == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("o_proj", "q_proj")]
    assert "model.layers.0.mlp.down_proj" in gqa["styled"]
    assert mixtral["whole"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_the_plan_says_each_style_and_why_the_rest_stays_whole():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=8, vocab_size=128))
    plan = xla_tp.torch_plan(model, mesh={"model": 4}, loss_parallel=True)
    text = plan.explain()
    assert text.startswith("torch plan over a model axis of 4")
    # GPT-2's Conv1D projections: "auto" splits them (c_attn re-laid), torch's styles shard Linear and Embedding only
    assert plan.whole["transformer.h.0.attn.c_attn"].startswith("its weight is re-laid device-major")
    assert "nn.Linear and nn.Embedding only" in plan.whole["transformer.h.0.mlp.c_fc"]
    assert plan.plan["transformer.h.*.mlp.c_fc"].role == "column-parallel"  # what "auto" does on XLA
    assert "transformer.wte: its weight is lm_head's too" not in text  # the tied head: the embedding keeps its style
    assert "lm_head" in plan.whole and "tied" in plan.whole["lm_head"]
    assert "transformer.wte: RowwiseParallel(input_layouts=Replicate())" in text


def test_parallelize_dtensor_takes_torch_tpu_where_it_is_and_needs_a_process_group(monkeypatch):
    """The TorchTPU route, dry: with ``torch_tpu`` importable its mesh is a "tpu" DeviceMesh (built by torch, which
    needs a TPU: recorded here instead); without a process group it says what to call first."""
    import importlib.util

    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    from xla_tp.backends import dtensor
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(xla_tp.PlanError, match="no process group; call torch.distributed.init_process_group first"):
        xla_tp.parallelize_dtensor(model, "auto")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch_tpu" else found(name, *a))
    assert dtensor.device_type() == "tpu"
    asked = []

    def init_device_mesh(kind, shape, **kwargs):
        asked.append((kind, shape))
        raise RuntimeError("stop: a TPU mesh needs TPUs")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(device_mesh, "init_device_mesh", init_device_mesh)
    with pytest.raises(RuntimeError, match="stop"):
        xla_tp.parallelize_dtensor(model, "auto")
    assert asked == [("tpu", (8,))]
    assert isinstance(model[0].weight, torch.nn.Parameter) and type(model[0].weight) is torch.nn.Parameter  # untouched
