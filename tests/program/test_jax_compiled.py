"""What the JAX-compiled program communicates (forward): deterministic, so asserted exactly."""
import pytest
import torch

import xla_tp
from xla_tp import ColwiseParallel, Replicate, RowwiseParallel
from xla_tp.auditing.hlo import parse_collectives
from xla_tp.zoo import registry
from xla_tp.zoo.llama import Llama, LlamaArgs, megatron_tp_plan

from ..helpers import MLP


@pytest.mark.parametrize("axes", [{"model": 8}, {"data": 2, "model": 4}])
def test_colwise_rowwise_mlp_is_one_all_reduce(axes):
    jm = xla_tp.parallelize_jax(MLP(16, 64), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, mesh=axes)
    colls = parse_collectives(jm.hlo(torch.randn(8, 16)))
    assert [c.kind for c in colls] == ["all-reduce"]
    assert colls[0].bytes == 8 // axes.get("data", 1) * 16 * 4  # the output, once


def test_activation_layouts_become_sharding_constraints():
    """``output_layouts=Replicate()`` gathers fc1's output (left alone, the compiler would rather
    all-reduce fc2's partial sums: 4x fewer bytes)."""
    jm = xla_tp.parallelize_jax(MLP(16, 64), {"fc1": ColwiseParallel(output_layouts=Replicate())}, mesh={"model": 8})
    colls = parse_collectives(jm.hlo(torch.randn(8, 16)))
    assert [(c.kind, c.shape) for c in colls] == [("all-gather", (8, 64))]


@pytest.mark.parametrize("n_layers", [1, 2])
def test_llama_block_is_two_all_reduces_per_layer(n_layers):
    """q/k/v/o + gate/up/down under the Megatron plan: the Megatron minimum, no all-gather."""
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=64, n_layers=n_layers, n_heads=8, vocab_size=128))
    jm = xla_tp.parallelize_jax(model, megatron_tp_plan(), mesh={"data": 2, "model": 4})
    report = jm.audit(torch.randint(0, 128, (4, 16)))
    assert {k: v["count"] for k, v in report.collectives.items()} == {"all-reduce": 2 * n_layers}
    assert report.collectives["all-reduce"]["axes"] == ["model"]
    assert report.comm_ratio == 1.0  # (the Megatron plan leaves the output head replicated)


def test_hf_llama_auto_attention_stays_sharded():
    """HF Llama under "auto": its own SDPA is lowered to einsums, so heads stay split on JAX too."""
    model = registry.build("llama")
    jm = xla_tp.parallelize_jax(model, "auto", mesh={"data": 2, "model": 4})
    report = jm.audit(registry.example_input("llama"))
    layers = model.config.num_hidden_layers
    assert {k: v["count"] for k, v in report.collectives.items()} == {"all-reduce": 1 + 2 * layers}  # + embedding
    assert report.comm_ratio == 1.0 and report.compute_balance == 1.0
    assert report.param_memory_ratio < 1.02


def test_without_the_lowering_torchax_gathers_the_heads():
    """The same plan with the lowering mode taken off: HF's SDPA through torchax all-gathers q, k and v
    and runs attention replicated, as on torch_xla. Why every parallelized forward runs under it."""
    model = registry.build("llama")
    plan = dict(xla_tp.plan_for(model, mesh={"data": 2, "model": 4}))
    jm = xla_tp.parallelize_jax(model, plan, mesh={"data": 2, "model": 4})
    assert jm.audit(registry.example_input("llama")).count("all-gather") == 0
    xla_tp.unparallelize(model)
    report = jm.audit(registry.example_input("llama"))
    assert report.count("all-gather") == 3 * model.config.num_hidden_layers  # q, k and v of every layer
    assert report.compute_balance > 1.05
