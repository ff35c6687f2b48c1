"""One state per parallelized model, complete when ``parallelize_xla`` returns."""
import copy

import pytest
import torch
import torch_xla
import transformers
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import xla_tp

from ..helpers import max_err


USER_PLAN = {**{f"model.layers.*.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
             "model.layers.*.self_attn.o_proj": RowwiseParallel(),
             **{f"model.layers.*.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")},
             "model.layers.*.mlp.down_proj": RowwiseParallel(), "model.embed_tokens": RowwiseParallel()}


@pytest.mark.parametrize("plan", ["auto", "user"])
def test_the_lowering_is_found_when_the_model_is_parallelized(plan, tiny_llama):
    """Column groups and vocabulary tables come from the planner's trace ("auto") or a trace on a
    synthesised input (a user plan): nothing waits for the first forward, and ``explain`` shows them."""
    model = xla_tp.parallelize_xla(tiny_llama(), "auto" if plan == "auto" else USER_PLAN,
                                   mesh=xla_tp.make_mesh(data=2, model=4))
    state = xla_tp.state_of(model)
    assert not state.pending
    groups = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
    assert state.groups == [tuple(f"model.layers.{i}.{m}" for m in members) for i in range(2) for members in groups]
    assert state.tables == ["model.embed_tokens"]
    text = state.explain()
    assert "mesh data=2 x fsdp=1 x model=4" in text and "model.layers.0.mlp.gate_proj" in text
    assert "vocabulary tables (per-device gradients): ['model.embed_tokens']" in text


def test_a_static_cache_in_the_first_call_stays_on_the_device(tiny_llama):
    """transformers' StaticCache handed to a parallelized model's very first call (a decode loop): the call
    runs and the cache keeps its tensors on the XLA device; logits equal the CPU model's."""
    ref = tiny_llama()
    model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=xla_tp.make_mesh(model=8))
    ids = torch.randint(0, 128, (2, 6))
    device = torch_xla.device()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    out = model(ids.to(device), past_key_values=cache, cache_position=torch.arange(6, device=device), use_cache=True)
    keys = [t for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
    assert keys and all(t.device.type == "xla" for t in keys)
    assert max_err(out.logits, ref(ids).logits) < 1e-4
