"""The lowering mode: attention written by users (SDPA, 4-D matmuls, torch's MHA) compiles with its
heads split, with the numerics of the original ops; the flash-attention call it would make on TPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla
from torch import nn

import xla_tp
from xla_tp import ColwiseParallel, RowwiseParallel
from xla_tp.lowering import attention, chunks, rejoin
from xla_tp.lowering.entry import clamp_slices, placed, placed_in_groups, row_groups

from ..helpers import collective_counts, max_err

E, H, B, S = 64, 8, 4, 12


class Attn(nn.Module):
    """q/k/v/o projections around one attention call written the CUDA way."""

    def __init__(self, kv_heads: int = H, matmul: bool = False, **sdpa_kwargs):
        super().__init__()
        self.kv, self.matmul, self.kwargs = kv_heads, matmul, sdpa_kwargs
        self.q, self.o = nn.Linear(E, E), nn.Linear(E, E)
        self.k, self.v = nn.Linear(E, kv_heads * E // H), nn.Linear(E, kv_heads * E // H)

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, E // H).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.matmul:
            probs = torch.softmax(q @ k.transpose(-1, -2) / (E // H) ** 0.5, dim=-1)
            out = probs @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kwargs)
        return self.o(out.transpose(1, 2).reshape(b, s, E))


PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
MASKS = {"none": None, "bool": torch.rand(S, S) > 0.3, "additive": torch.randn(B, 1, S, S)}


@pytest.mark.parametrize("variant", [
    dict(), dict(is_causal=True), dict(scale=0.3), dict(mask="bool"), dict(mask="additive"),
    dict(kv_heads=4, enable_gqa=True, is_causal=True), dict(matmul=True)])
def test_user_attention_compiles_with_heads_split_and_same_values(variant):
    variant = dict(variant)
    mask = MASKS[variant.pop("mask", "none")]
    torch.manual_seed(0)
    ref = Attn(**variant)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, PLAN, mesh=xla_tp.make_mesh(data=2, model=4))
    x = torch.randn(B, S, E)
    dev = torch_xla.device()
    out = model(x.to(dev), None if mask is None else mask.to(dev))
    assert collective_counts([out]) == {"all-reduce": 1}  # the row-parallel o; attention stays split
    assert max_err(out, ref(x, mask)) < 1e-5


def test_a_query_with_no_key_to_attend_gets_zeros_as_in_torch():
    """A left-padded position masks every key: torch's SDPA gives it zeros, and so does the lowering (not NaN,
    which the next layer would spread through the padding's keys and values into every token)."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[:2] = False
    for attn_mask in (mask, torch.zeros(5, 5).masked_fill(~mask, float("-inf"))):
        got = attention.sdpa(q, k, v, attn_mask=attn_mask)
        assert torch.equal(got[..., :2, :], torch.zeros(2, 4, 2, 8))
        assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask), atol=1e-6)


def test_sdpa_dropout_applies_only_when_asked():
    q = k = v = torch.randn(2, 4, 6, 8)
    assert torch.equal(attention.sdpa(q, k, v, dropout_p=0.0), attention.sdpa(q, k, v))
    torch.manual_seed(0)
    dropped = attention.sdpa(q, k, v, dropout_p=0.5)
    assert not torch.allclose(dropped, attention.sdpa(q, k, v))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["none", "bool", "float", "pad", "pad_float"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("self_attention", [False, True])
def test_mha_lowering_matches_torch(batch_first, kind, need_weights, self_attention):
    """``attention.mha`` is ``F.multi_head_attention_forward`` (sequence-first) for every mask kind, with
    other keys and values or the query itself (self-attention: one projection)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H).eval()
    L, Sk = 5, 5 if self_attention else 7
    q, k, v = torch.randn(L, B, E), torch.randn(Sk, B, E), torch.randn(Sk, B, E)
    k = v = q if self_attention else k
    causal = torch.triu(torch.ones(L, Sk, dtype=torch.bool), 1)
    pad = torch.zeros(B, Sk, dtype=torch.bool)
    pad[:, -2:] = True
    masks = {"none": {}, "bool": {"attn_mask": causal}, "float": {"attn_mask": torch.randn(B * H, L, Sk)},
             "pad": {"key_padding_mask": pad}, "pad_float": {"key_padding_mask": pad.float() * -1e4,
                                                             "attn_mask": causal.float() * -1e9}}[kind]
    args = dict(query=q, key=k, value=v, embed_dim_to_check=E, num_heads=H, in_proj_weight=mha.in_proj_weight,
                in_proj_bias=mha.in_proj_bias, bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
                out_proj_weight=mha.out_proj.weight, out_proj_bias=mha.out_proj.bias, training=False,
                need_weights=need_weights, **masks)
    want, got = F.multi_head_attention_forward(**args), attention.mha(**args)
    assert max_err(got[0], want[0]) < 1e-5
    assert (got[1] is None) == (want[1] is None) and (got[1] is None or max_err(got[1], want[1]) < 1e-5)


def test_flash_attention_call_on_tpu(monkeypatch):
    """What xla_tp passes to torch_xla's Pallas kernel on a TPU (not runnable here: the call is recorded)."""
    import torch_xla.experimental.custom_kernel as kernels
    import torch_xla.runtime as xr
    calls = []

    def fake_flash(**kw):
        calls.append(kw)
        return attention.einsum_sdpa(kw["q"], kw["k"], kw["v"], kw["ab"], 0.0, kw["causal"], kw["sm_scale"])

    monkeypatch.setattr(kernels, "flash_attention", fake_flash)
    monkeypatch.setattr(xr, "device_type", lambda: "TPU")
    mesh = xla_tp.make_mesh(data=2, model=4)
    torch.manual_seed(0)
    ref = Attn(kv_heads=4, enable_gqa=True, is_causal=True)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, PLAN, mesh=mesh)
    attention.use_flash_attention(True)
    try:
        out = model(torch.randn(B, S, E).to(torch_xla.device()))
    finally:
        attention.use_flash_attention(False)
    (call,) = calls
    assert call["partition_spec"] == ("data", "model", None, None) and call["mesh"] is mesh
    assert call["causal"] is True and call["sm_scale"] == pytest.approx((E // H) ** -0.5)
    assert call["k"].shape == call["q"].shape == (B, H, S, E // H)  # key/value heads repeated for the kernel
    assert out.shape == (B, S, E)
    assert not attention.flash_eligible(call["q"], call["k"], torch.ones(S, S, dtype=torch.bool), 0.0)


def test_out_of_range_slices_are_clamped_like_on_cpu():
    assert clamp_slices((Ellipsis, slice(-4095, None), slice(None)), (2, 16, 8)) == \
        (Ellipsis, slice(-16, None), slice(None))
    assert clamp_slices((slice(0, 4),), (8,)) is None


@pytest.mark.parametrize("shape,mask_shape", [((4, 24, 16), (4, 24, 1)), ((4, 24, 16), (4, 24, 16)), ((3, 5), (3, 5)),
                                              ((7,), (7,))])
def test_placed_features_equal_masked_scatter_values_and_gradients(shape, mask_shape):
    """The static-shape ``masked_scatter`` (image features put in place) on CPU tensors: values and both gradients,
    with a mask broadcast over the features (as transformers passes it) or one per element, and a spare source."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(mask_shape, generator=g) > 0.4
    count = int(mask.expand(shape).sum())
    for spare in (0, 5):
        x, src = torch.randn(shape, generator=g), torch.randn(count + spare, generator=g)
        got, want = [(x.clone().requires_grad_(), src.clone().requires_grad_()) for _ in range(2)]
        out_got, out_want = placed(got[0], mask, got[1]), want[0].masked_scatter(mask, want[1])
        assert torch.equal(out_got, out_want)
        weights = torch.randn(shape, generator=g)
        (out_got * weights).sum().backward()
        (out_want * weights).sum().backward()
        assert torch.equal(got[0].grad, want[0].grad) and torch.equal(got[1].grad, want[1].grad)


def test_placed_features_of_one_image_per_row_are_read_within_the_row():
    """Every row holding the same number of placeholders (an image per row): each row reads its own block of the
    features (``row_groups``), the values and both gradients ``masked_scatter``'s; one row more or less, not."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 24, 1, dtype=torch.bool)
    for row, start in enumerate((2, 0, 7, 18)):
        mask[row, start:start + 5] = True
    x, src = torch.randn(4, 24, 16, generator=g), torch.randn(4 * 5 * 16, generator=g)
    assert row_groups(mask.expand_as(x).reshape(4, -1), src) == 4
    got, want = [(x.clone().requires_grad_(), src.clone().requires_grad_()) for _ in range(2)]
    out_got, out_want = placed(got[0], mask, got[1]), want[0].masked_scatter(mask, want[1])
    assert torch.equal(out_got, out_want)
    weights = torch.randn(out_got.shape, generator=g)
    (out_got * weights).sum().backward()
    (out_want * weights).sum().backward()
    assert torch.equal(got[0].grad, want[0].grad) and torch.equal(got[1].grad, want[1].grad)
    mask[0, 10], mask[1, 0] = True, False  # the same total, not per row
    assert not row_groups(mask.expand_as(x).reshape(4, -1), src)


def test_placed_features_of_images_of_different_sizes_are_read_within_each_block_of_rows():
    """Rows holding 5, 3, 4 and 4 placeholders (images of different sizes): no row's share is equal, but each block
    of two rows of a batch split in two holds half the features (``row_groups``), which it reads as its own block:
    the values and both gradients ``masked_scatter``'s. Blocks of 7 and 9 placeholders, or no split: not."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 24, 1, dtype=torch.bool)
    for row, (start, n) in enumerate(((2, 5), (0, 3), (7, 4), (18, 4))):
        mask[row, start:start + n] = True
    x, src = torch.randn(4, 24, 16, generator=g), torch.randn(16 * 16, generator=g)
    rows = mask.expand_as(x).reshape(4, -1)
    assert row_groups(rows, src, ways=2) == 2 and not row_groups(rows, src, ways=1)
    got, want = [(x.clone().requires_grad_(), src.clone().requires_grad_()) for _ in range(2)]
    out_got, out_want = placed_in_groups(got[0], mask, got[1], 2), want[0].masked_scatter(mask, want[1])
    assert torch.equal(out_got, out_want)
    weights = torch.randn(out_got.shape, generator=g)
    (out_got * weights).sum().backward()
    (out_want * weights).sum().backward()
    assert torch.equal(got[0].grad, want[0].grad) and torch.equal(got[1].grad, want[1].grad)
    mask[1, 3], mask[2, 7] = True, False  # 9 and 7 per block
    assert not row_groups(mask.expand_as(x).reshape(4, -1), src, ways=2)


def test_unequal_chunks_whole_in_each_block_attend_as_blocks_with_a_block_diagonal_mask():
    """Chunks of 3, 5, 6 and 2 rows split in two blocks of 8: attention over each block with the mask
    ``block_diagonal`` gives, is attention per chunk, concatenated; a chunk across the blocks' edge, or chunks all
    equal (``batched``), or no split, give no mask."""
    sizes = [3, 5, 6, 2]
    q, k, v = (torch.randn(1, 2, 16, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    want = torch.cat([F.scaled_dot_product_attention(*c) for c in zip(*(t.split(sizes, 2) for t in (q, k, v)))], 2)
    mask = chunks.block_diagonal(sizes, 2)
    blocks = [chunks.batched(t, [8, 8], 2)[0] for t in (q, k, v)]
    got = F.scaled_dot_product_attention(*blocks, attn_mask=mask)
    assert torch.allclose(got.movedim(0, 1).reshape(want.shape), want, atol=1e-6)
    assert all(chunks.block_diagonal(s, w) is None for s, w in (([3, 6, 5, 2], 2), ([4, 4, 4, 4], 2), (sizes, 1)))


def test_pieces_joined_back_in_order_are_their_tensor():
    """``torch.cat`` of all the pieces ``unbind`` or ``split`` cut along dimension 0, in order, is their tensor
    (reshaped for ``unbind``); pieces out of order, some of them, or of two tensors are concatenated."""
    x, y = torch.randn(4, 3, 2), torch.randn(4, 3, 2)
    rows, halves = rejoin.cut(torch.Tensor.unbind)(x), rejoin.cut(torch.Tensor.split)(x, [1, 3])
    assert not any(p in rejoin._pieces for p in (*rows, *halves))  # outside a parallelized model: not remembered
    rejoin._pieces.update({p: (x, i, 4) for i, p in enumerate(rows)})
    rejoin._pieces.update({p: (x, i, 2) for i, p in enumerate(halves)})
    assert torch.equal(rejoin.whole(rows, 0), torch.cat(rows, 0)) and torch.equal(rejoin.whole(halves, -3), x)
    others = list(y)
    rejoin._pieces.update({p: (y, i, 4) for i, p in enumerate(others)})
    for wrong in (rows[::-1], rows[:3], [*rows[:2], *others[2:]]):
        assert rejoin.whole(wrong, 0) is None
    assert rejoin.whole(rows, 1) is None


WINDOWED = {  # transformers' cache keeps a window of their keys: its update slices from -window + 1 on a short sequence
    "mistral_sliding_window": lambda T: T.MistralForCausalLM(T.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=128)),
    "llama4_attention_chunks": lambda T: T.Llama4ForCausalLM(T.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, vocab_size=128, num_local_experts=4, num_experts_per_tok=1)),
}


@pytest.mark.parametrize("name", list(WINDOWED))
def test_a_windowed_cache_on_a_sequence_shorter_than_its_window(name):
    """torch_xla refuses the cache's slice past a 16-token sequence's start (plain torch_xla fails on these
    models); the attention module runs in the lowering mode, whose ``x[i]`` clamps it as the CPU does."""
    import transformers as T
    torch.manual_seed(0)
    ref = WINDOWED[name](T)
    config = ref.config
    assert max(getattr(config, a, None) or 0 for a in ("sliding_window", "attention_chunk_size")) > 16
    model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    ids = torch.randint(0, 128, (4, 16))
    got = model(input_ids=ids.to(torch_xla.device())).logits
    assert max_err(got, ref(input_ids=ids).logits) < 1e-4
