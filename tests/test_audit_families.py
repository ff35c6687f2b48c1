"""Regression guards: the families the planners make Megatron-optimal stay optimal under "auto".

Counts, bytes and FLOPs come from the compiled program, so these are exact, not timings.
"""
import pytest
import torch_xla
import torch_xla.distributed.spmd as xs

import xla_tp
from xla_tp.zoo import registry

OPTIMAL = ["titan_llama", "llama", "qwen3", "gpt2", "torch_encoder", "torch_mha", "mlp"]


def audited(name: str):
    """Audit of ``name`` under "auto" on a 2x4 mesh, its input batch-sharded over ``data`` as a
    data loader delivers it (models that start with an embedding get that from the plan anyway)."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    model = registry.build(name)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    x = registry.example_input(name).to(torch_xla.device())
    xs.mark_sharding(x, mesh, ("data",) + (None,) * (x.dim() - 1))
    return xla_tp.audit(model, *registry.positional_args(model, x), mesh=mesh)


@pytest.mark.parametrize("name", OPTIMAL)
def test_auto_family_is_megatron_optimal(name):
    report = audited(name)
    assert report.count("all-gather") == 0 and report.count("collective-permute") == 0
    assert report.comm_ratio == pytest.approx(1.0)
    assert report.compute_balance == pytest.approx(1.0, rel=0.01)


def test_bert_replicates_only_its_small_mlm_transform():
    """BERT's communication is optimal; its MLM head transform (dense + LayerNorm, hidden x hidden)
    and embeddings' LayerNorm stay replicated: measured compute balance 1.15 on the tiny model."""
    report = audited("bert")
    assert report.count("all-gather") == 0
    assert report.comm_ratio == pytest.approx(1.0)
    assert 1.0 <= report.compute_balance < 1.2
