"""Context parallelism: a ``context`` mesh axis splits the sequence for the whole model; attention gathers
keys and values over it. Checked in the compiled program (per-device score blocks, what is gathered), by the
audit against its own minimum, and against the CPU model's numbers."""
import copy
import re

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.auditing.capture import capture_partitioned_hlo

from ..hf_tiny import tiny_llama
from ..hlo_count import collectives_of

HEADS = dict(num_attention_heads=4, num_key_value_heads=2)


def _arrays(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"(?:f32|bf16|pred)\[([\d,]*)\]", hlo)]


def _gathered(hlo: str) -> list[tuple[int, ...]]:
    """The result shape of each all-gather."""
    return [tuple(int(d) for d in m.split(",") if d)
            for m in re.findall(r"= [a-z0-9]+\[([\d,]*)\]\S* all-gather\(", hlo)]


@pytest.mark.parametrize("batch", [1, 2])
def test_auto_on_context_4_x_model_2_splits_the_score_block_and_gathers_only_keys_and_values(batch):
    seq = 2048
    ref = tiny_llama(0, max_position_embeddings=seq, **HEADS)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (batch, seq))
    out = model(input_ids=ids.to(torch_xla.device())).logits
    hlo = capture_partitioned_hlo([out])
    # each device: its 2 of 4 heads, a quarter of the queries against every key: a quarter of each [S, S] block
    assert max(map(lambda s: torch.Size(s).numel(), _arrays(hlo))) <= batch * 2 * (seq // 4) * seq
    assert not [s for s in _arrays(hlo) if s.count(seq) >= 2]
    # all-gathers: keys and values only ([batch, one kv head per device, S, head dim]), two per layer; no weight
    assert _gathered(hlo) == [(batch, 1, seq, 16)] * 4
    assert set(collectives_of(hlo)) == {"all-gather", "all-reduce"}
    assert (out.cpu() - ref(input_ids=ids).logits).abs().max() < 1e-4


def test_the_audit_counts_the_context_gathers_and_the_sequence_split():
    model = tiny_llama(0, max_position_embeddings=512, **HEADS)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (2, 512)).to(torch_xla.device())
    fwd = xla_tp.audit(model, input_ids=ids)
    assert fwd.count("all-gather") == fwd.expected["all-gather"]["count"] == 4
    assert fwd.collectives["all-gather"]["axes"] == ["context"]
    assert fwd.comm_ratio == pytest.approx(1.0) and fwd.compute_balance == pytest.approx(1.0)
    bwd = xla_tp.audit(model, input_ids=ids, backward=True)
    assert {k: v["count"] for k, v in bwd.collectives.items()} == {k: v["count"] for k, v in bwd.expected.items()}
    assert bwd.compute_balance == pytest.approx(1.0)


def test_forward_and_backward_on_context_4_x_model_2_equal_the_cpu_model():
    seq = 512
    ref = tiny_llama(0, max_position_embeddings=seq, **HEADS)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (2, seq))
    dev = torch_xla.device()
    loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
    loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-4
    grads = dict(ref.named_parameters())
    assert max((p.grad.cpu() - grads[n].grad).abs().max().item() for n, p in model.named_parameters()) < 1e-4


def test_context_axis_by_name_alias_and_device_mesh():
    mesh = xla_tp.make_mesh(cp=4, tp=2)
    assert tuple(mesh.axis_names) == ("data", "fsdp", "context", "model") and tuple(mesh.mesh_shape) == (1, 1, 4, 2)
    assert tuple(xla_tp.make_mesh(model=8).axis_names) == ("data", "fsdp", "model")  # only when asked for
    world = xla_tp.init_device_mesh("xla", (1, 4, 2), mesh_dim_names=("dp", "cp", "tp"))
    model = tiny_llama(0, max_position_embeddings=256, **HEADS)
    xla_tp.parallelize_xla(model, "auto", mesh=world)
    out = model(input_ids=torch.randint(0, 128, (1, 256)).to(torch_xla.device())).logits
    assert _gathered(capture_partitioned_hlo([out])) == [(1, 1, 256, 16)] * 4
