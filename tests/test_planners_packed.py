"""Packed q/k/v re-laid head-aligned: nn.MultiheadAttention, torch Transformer layers, GPT-2.

Numerics (forward and backward) against the unsharded CPU model, the compiled collectives on a
2x4 (data x model) mesh, and checkpoints in the original shapes.
"""
import copy

import pytest
import torch
from torch import nn

import xla_tp
from xla_tp.planners import plan_for
from xla_tp.planners.mha import pack_mha
from xla_tp.planners.packed import PackedStyle
from xla_tp.zoo.registry import build

from .helpers import collective_counts, grads, max_err, sharding, twin

E, H, B, L, S = 64, 8, 4, 6, 10


def _qkv(batch_first: bool = True, batched: bool = True):
    g = torch.Generator().manual_seed(3)
    shape = lambda n: ((B, n, E) if batch_first else (n, B, E)) if batched else (n, E)  # noqa: E731
    return torch.randn(shape(L), generator=g), torch.randn(shape(S), generator=g), torch.randn(shape(S), generator=g)


def _masks(kind: str, batched: bool = True) -> dict:
    causal = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    pad = torch.zeros((B, S) if batched else (S,), dtype=torch.bool)
    pad[..., -3:] = True
    per_head = torch.randn(B * H if batched else H, L, S)
    return {"none": {}, "bool": {"attn_mask": causal}, "float": {"attn_mask": per_head},
            "causal": {"attn_mask": causal, "is_causal": True}, "pad": {"key_padding_mask": pad},
            "pad_float": {"key_padding_mask": pad.float() * -1e4, "attn_mask": causal.float() * -1e9}}[kind]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal", "pad", "pad_float"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_packed_mha_matches_torch_on_cpu(batch_first, batched, kind, need_weights):
    ref, mha = twin(nn.MultiheadAttention, E, H, dropout=0.1, batch_first=batch_first)
    ref.eval(), mha.eval()
    assert pack_mha(mha) and not pack_mha(mha)
    assert mha.in_proj_weight.shape == (3, E, E) and isinstance(mha, nn.MultiheadAttention)
    q, k, v = _qkv(batch_first, batched)
    kw = dict(_masks(kind, batched), need_weights=need_weights)
    for average in (True, False):
        want, got = ref(q, k, v, average_attn_weights=average, **kw), mha(q, k, v, average_attn_weights=average, **kw)
        assert max_err(got[0], want[0]) < 1e-5
        assert (got[1] is None) == (want[1] is None) and (got[1] is None or max_err(got[1], want[1]) < 1e-5)


def test_packed_mha_needs_mask_for_is_causal_and_skips_extras():
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    pack_mha(mha)
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        mha(q, k, v, is_causal=True)
    assert not pack_mha(nn.MultiheadAttention(E, H, add_bias_kv=True))


def _parallel(model: nn.Module) -> nn.Module:
    mesh = xla_tp.make_mesh(data=2, model=4)
    return xla_tp.parallelize_xla(model, plan_for(model, mesh=mesh), mesh=mesh)


def _check(ref: nn.Module, model: nn.Module, run, n_all_reduce: int) -> None:
    """At most ``n_all_reduce`` and no other collective in the forward; values and gradients as on the CPU."""
    dev = next(model.parameters()).device
    out = run(model, dev)
    counts = collective_counts([out])
    assert set(counts) == {"all-reduce"} and counts["all-reduce"] <= n_all_reduce, counts
    want = run(ref, torch.device("cpu"))
    assert max_err(out, want) < 1e-4
    out.square().mean().backward()
    want.square().mean().backward()
    got = {n: t.reshape(ref.get_parameter(n).shape) for n, t in grads(model).items()}
    assert set(got) == {n for n, _ in ref.named_parameters()}
    assert max(max_err(got[n], p.grad) for n, p in ref.named_parameters()) < 1e-4


@pytest.mark.parametrize("batch_first,kind", [(True, "pad"), (False, "causal"), (True, "float")])
def test_mha_parallel_one_all_reduce_forward_backward(batch_first, kind):
    ref, model = twin(nn.MultiheadAttention, E, H, dropout=0.1, batch_first=batch_first)
    ref.eval(), model.eval()
    _parallel(model)
    assert model.in_proj_weight.shape == (3, E, E)
    kw = _masks(kind)

    def run(m, dev):
        q, k, v = (t.to(dev) for t in _qkv(batch_first))
        return m(q, k, v, need_weights=False, **{n: t.to(dev) if torch.is_tensor(t) else t for n, t in kw.items()})[0]
    _check(ref, model, run, 1)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_self_and_cross_attention(norm_first):
    ref, model = twin(nn.TransformerDecoderLayer, E, H, dim_feedforward=2 * E, dropout=0.0,
                      batch_first=True, norm_first=norm_first)
    plan = plan_for(model, mesh=xla_tp.make_mesh(data=2, model=4))
    assert isinstance(plan["self_attn"], PackedStyle) and isinstance(plan["multihead_attn"], PackedStyle)
    _parallel(model)
    causal = nn.Transformer.generate_square_subsequent_mask(L)

    def run(m, dev):
        tgt, mem, _ = (t.to(dev) for t in _qkv())
        return m(tgt, mem, tgt_mask=causal.to(dev), tgt_is_causal=True)
    _check(ref, model, run, 3)  # self attention, cross attention, feed-forward: one each


def test_encoder_training_step_matches():
    ref = build("torch_encoder").train()
    model = copy.deepcopy(ref)
    _parallel(model)

    def run(m, dev):
        return m(_qkv()[0].to(dev))
    _check(ref, model, run, 4)


def test_gpt2_forward_backward_and_state_dict():
    torch.manual_seed(0)
    ref = build("gpt2")
    model = copy.deepcopy(ref)
    _parallel(model)
    assert model.transformer.h[0].attn.c_attn.weight.shape == (E, 3, E)
    ids = torch.randint(2, 128, (4, 16), generator=torch.Generator().manual_seed(1))

    def run(m, dev):
        return m(ids.to(dev), use_cache=False).logits
    _check(ref, model, run, 2 * 2 + 1)  # 2 per layer + vocab-parallel embedding
    _check_state_dict(ref, model, lambda m: run(m, next(m.parameters()).device))


def test_mha_state_dict_round_trip():
    ref, model = twin(nn.TransformerEncoderLayer, E, H, dim_feedforward=2 * E, dropout=0.0, batch_first=True)
    ref.eval(), model.eval()
    _parallel(model)
    _check_state_dict(ref, model, lambda m: m(_qkv()[0].to(next(m.parameters()).device)))


def _check_state_dict(ref: nn.Module, model: nn.Module, run) -> None:
    """Original shapes and values out; an original-shape checkpoint loads in, keeping the sharding."""
    saved, original = model.state_dict(), {n: t.clone() for n, t in ref.state_dict().items()}
    assert {n: t.shape for n, t in saved.items()} == {n: t.shape for n, t in original.items()}
    assert max(max_err(saved[n], original[n]) for n in original) == 0
    fresh = copy.deepcopy(ref)
    fresh.load_state_dict({n: t.cpu() for n, t in saved.items()})
    packed = {n: sharding(p) for n, p in model.named_parameters() if p.shape != ref.get_parameter(n).shape}
    assert packed and all("devices=" in s for s in packed.values())
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
        model.load_state_dict(ref.state_dict())
        assert max_err(run(model), run(ref)) < 1e-4
    assert {n: sharding(model.get_parameter(n)) for n in packed} == packed
    assert max(max_err(fresh.state_dict()[n], t) for n, t in original.items()) == 0
