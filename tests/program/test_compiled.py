"""What the compiled (post-partition) program communicates: deterministic, so asserted exactly."""
import pytest
import torch
import torch.nn.functional as F

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel
from xla_tp.auditing.capture import capture_partitioned_hlo
from xla_tp.auditing.hlo import parse_collectives
from xla_tp.zoo.llama import Llama, LlamaArgs, megatron_tp_plan, torchtitan_tp_plan

from ..helpers import MLP, collective_counts, expected_sharding, sharding


@pytest.mark.parametrize("axes", [{"model": 8}, {"data": 2, "model": 4}])
def test_colwise_rowwise_mlp_is_one_all_reduce(axes):
    model = xla_tp.parallelize_xla(MLP(16, 64), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
                                   mesh=xla_tp.make_mesh(**axes))
    out = model(torch.randn(8, 16, device=model.fc1.weight.device))
    colls = parse_collectives(capture_partitioned_hlo([out]))
    assert [c.kind for c in colls] == ["all-reduce"]
    batch_shards = axes.get("data", 1)
    assert colls[0].bytes == 8 // batch_shards * 16 * 4  # the output, once


def block_model(n_layers: int = 1) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaArgs(dim=64, n_layers=n_layers, n_heads=8, vocab_size=128))


@pytest.mark.parametrize("n_layers", [1, 2])
def test_transformer_block_is_two_all_reduces_per_layer(n_layers):
    """q/k/v/o + gate/up/down under the Megatron plan: the Megatron minimum, nothing else."""
    model = xla_tp.parallelize_xla(block_model(n_layers), megatron_tp_plan(), mesh=xla_tp.make_mesh(data=2, model=4))
    out = model(torch.randint(0, 128, (4, 16), device=model.output.weight.device))
    assert collective_counts([out]) == {"all-reduce": 2 * n_layers}


def test_sequence_parallel_norms_run_sequence_sharded():
    """torchtitan's SP plan: all-gather into attention/FFN, reduce-scatter (CPU: all-reduce +
    dynamic-slice) out of them; the norms see sequence-sharded activations."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    model = block_model(1)
    xla_tp.parallelize_xla(model, torchtitan_tp_plan(model, loss_parallel=False), mesh=mesh)
    seen = {}
    for name in ("attention_norm", "ffn_norm"):
        mod = model.layers["0"].get_submodule(name)
        mod.register_forward_hook(lambda m, a, o, name=name: seen.update({name: (sharding(a[0]), sharding(o))}))
    out = model(torch.randint(0, 128, (4, 16), device=model.output.weight.device))
    seq_sharded = expected_sharding((4, 16, 64), mesh, ("data", "model", None))
    assert seen == {n: (seq_sharded, seq_sharded) for n in ("attention_norm", "ffn_norm")}
    counts = collective_counts([out])
    assert counts.get("all-gather", 0) >= 2  # into attention and FFN (and the output projection)
    # out of attention and FFN: a reduce-scatter on TPU; GSPMD on CPU emits all-reduce + dynamic-slice
    assert counts.get("reduce-scatter", 0) + counts.get("all-reduce", 0) >= 2
    text = capture_partitioned_hlo([out])
    if counts.get("reduce-scatter", 0) == 0:
        assert "dynamic-slice" in text


def test_loss_parallel_does_not_gather_logits():
    """Vocab-sharded logits feed cross-entropy: only small all-reduces of B*S values."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    model = block_model(1)
    xla_tp.parallelize_xla(model, torchtitan_tp_plan(model, loss_parallel=True), mesh=mesh)
    tokens = torch.randint(0, 128, (4, 16), device=model.output.weight.device)
    logits = model(tokens)
    assert sharding(logits) == expected_sharding((4, 16, 128), mesh, ("data", None, "model"))
    before = {(c.kind, c.shape) for c in parse_collectives(capture_partitioned_hlo([logits]))}
    with xla_tp.loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    tokens_per_device = 4 * 16 // 2
    added = [c for c in parse_collectives(capture_partitioned_hlo([loss])) if (c.kind, c.shape) not in before]
    assert added, "the loss reduces across the vocabulary shards"
    for c in added:
        assert c.kind == "all-reduce" and c.bytes <= tokens_per_device * 4, f"more than per-token values: {c}"
    grad_colls = parse_collectives(capture_partitioned_hlo([model.output.weight.grad]))
    assert not [c for c in grad_colls if c.kind == "all-gather" and 128 in c.shape], "logits gathered in backward"
