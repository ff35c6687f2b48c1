"""plan_for / parallelize_xla(model, "auto") on every family: numerics, compiled collectives, memory.

Each tiny model (2 layers, 8 heads, built from a config) runs on a 2x4 (data x model) mesh and is
compared with its unsharded CPU twin; the compiled forward is read before any ``.cpu()``.
"""
import copy

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.planners import plan_for
from xla_tp.report import sharding_rows
from xla_tp.zoo.registry import LAYERS, build, example_input, run

from .helpers import collective_counts, max_err

DECODERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite", "cohere", "titan_llama"]
IDEAL = {"all-reduce": 2 * LAYERS + 2}  # 2 per layer, plus at most 2 for embedding and head


def _pair(name: str, **kw):
    torch.manual_seed(0)
    ref = build(name, **kw)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("name", [*DECODERS, "gpt2", "bert", "roberta", "torch_encoder", "torch_mha", "mlp"])
def test_family_forward_collectives_memory(name):
    ref, model = _pair(name)
    mesh = xla_tp.make_mesh(data=2, model=4)
    plan = plan_for(model, mesh=mesh)
    xla_tp.parallelize_xla(model, plan, mesh=mesh)
    x = example_input(name)
    out = run(model, x.to(torch_xla.device()))
    counts = collective_counts([out])
    assert set(counts) <= {"all-reduce"}, counts
    assert counts.get("all-reduce", 0) <= IDEAL["all-reduce"], counts
    assert max_err(out, run(ref, x)) < 1e-4
    _check_memory(model, plan, mesh)


def _check_memory(model, plan, mesh) -> None:
    rows = sharding_rows(model, mesh)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    replicated = sum(r.local_bytes for r in rows if all(a is None for a in r.spec))
    per_device = sum(r.local_bytes for r in rows)
    assert per_device <= (total - replicated) / 4 + replicated + 1
    assert set(plan.replicated) <= {r.name for r in rows if all(a is None for a in r.spec)}
