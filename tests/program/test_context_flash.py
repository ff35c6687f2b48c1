"""Flash attention per context block (``xla_tp.lowering.context_flash``): JAX's Pallas splash kernel on each
device's query block against the keys and values gathered over the context axis. Here (CPU) the kernel runs in
Pallas' interpreter (``use_flash_attention(True, interpret=True)``), through the same ``call_jax``, ``shard_map``
and mask tables split over the context axis as on a TPU; the compiled TPU kernel is checked only on a TPU."""
import copy
import re

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.runtime as xr
import torch.nn.functional as F

import xla_tp
from xla_tp.auditing.capture import capture_partitioned_hlo
from xla_tp.lowering import attention, context_flash

from ..hf_tiny import tiny_llama
from ..hlo_count import collectives_of
from .test_context import _gathered

TPU = xr.device_type() == "TPU"


class Attention(torch.nn.Module):
    """SDPA on projected heads (grouped keys and values when ``kv_heads < heads``)."""

    def __init__(self, d: int = 64, heads: int = 4, kv_heads: int = 4, causal: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads, causal
        self.wq, self.wo = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)
        self.wk, self.wv = (torch.nn.Linear(d, d // heads * kv_heads, bias=False) for _ in range(2))

    def forward(self, x):
        b, n, d = x.shape
        q = self.wq(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (w(x).view(b, n, self.kv_heads, -1).transpose(1, 2) for w in (self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.kv_heads < self.heads)
        return self.wo(out.transpose(1, 2).reshape(b, n, d))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The ``Blocks`` of each call that took the kernel route; the route on (interpreted) for the test."""
    calls, run = [], context_flash.attention

    def recorded(query, key, value, blocks):
        calls.append(blocks)
        return run(query, key, value, blocks)

    monkeypatch.setattr(context_flash, "attention", recorded)
    attention.use_flash_attention(True, interpret=not TPU)
    yield calls
    attention.use_flash_attention(False)


def _run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict, str]:
    """Output, input and weight gradients, and the partitioned HLO of ``model`` on ``x`` in a context_parallel
    block over context=4 x model=2 (heads over model), for the output gradient ``x.flip(-1)``."""
    world = xla_tp.init_device_mesh("xla", (4, 2), mesh_dim_names=("cp", "tp"))
    xla_tp.parallelize_module(model, world["tp"], {"wq": xla_tp.ColwiseParallel(), "wk": xla_tp.ColwiseParallel(),
                                                   "wv": xla_tp.ColwiseParallel(), "wo": xla_tp.RowwiseParallel()})
    xd = x.to(torch_xla.device()).requires_grad_()
    with xla_tp.context_parallel(world["cp"], buffers=[xd], buffer_seq_dims=[1]):
        out = model(xd)
        hlo = capture_partitioned_hlo([out])
        (out * x.flip(-1).to(xd.device)).sum().backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()} | {"x": xd.grad.cpu()}
    return out.cpu(), grads, hlo


def _assert_matches_cpu(ref, x, out, grads):
    """``out`` and ``grads`` (``_run``'s) equal the CPU module's output and gradients on ``x`` (1e-4)."""
    xc = x.clone().requires_grad_()
    want = ref(xc)
    (want * x.flip(-1)).sum().backward()
    assert (out - want).abs().max() < 1e-4
    assert max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()) < 1e-4
    assert (grads["x"] - xc.grad).abs().max() < 1e-4


@pytest.mark.parametrize("kv_heads,causal", [(2, True), *(pytest.param(*c, marks=pytest.mark.complete)
                                                          for c in ((4, True), (1, True), (4, False)))])
def test_splash_per_context_block_equals_cpu_sdpa_forward_and_backward(kernel_calls, kv_heads, causal):
    torch.manual_seed(0)
    ref = Attention(kv_heads=kv_heads, causal=causal)
    model = copy.deepcopy(ref).to(torch_xla.device())
    x = torch.randn(2, 512, 64)
    out, grads, hlo = _run(model, x)
    (blocks,) = kernel_calls  # the kernel route, once
    assert (blocks.seq, blocks.heads, blocks.block_q, blocks.block_kv) == ("context", "model", 128, 512)
    # grouped keys and values stay grouped where their heads divide the model axis, else they are repeated
    assert blocks.kv_heads == ("model" if kv_heads % 2 == 0 else None)
    _assert_matches_cpu(ref, x, out, grads)
    # the queries stay split: what crosses devices is the keys and values, gathered over the context axis (one
    # key/value head's projection split over the model axis is gathered first, as on the einsum route)
    kv = kv_heads // 2 if kv_heads % 2 == 0 else kv_heads  # per device (in the compiler's order of dimensions)
    want = [(2, kv, 512, 16)] * 2 + ([(2, 128, 1, 16)] * 2 if kv_heads == 1 else [])
    assert sorted(tuple(sorted(s)) for s in _gathered(hlo)) == sorted(tuple(sorted(s)) for s in want)
    assert set(collectives_of(hlo)) == {"all-gather", "all-reduce"}


@pytest.mark.complete  # 45 s
def test_llama_with_the_kernel_per_context_block_equals_the_cpu_model(kernel_calls):
    seq = 512
    ref = tiny_llama(0, max_position_embeddings=seq, num_attention_heads=4, num_key_value_heads=2)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (2, seq))
    dev = torch_xla.device()
    loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
    loss.backward()
    assert len(kernel_calls) == ref.config.num_hidden_layers
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-4
    grads = dict(ref.named_parameters())
    assert max((p.grad.cpu() - grads[n].grad).abs().max().item() for n, p in model.named_parameters()) < 1e-4


def test_the_kernel_route_moves_the_audits_minimum_forward_and_backward(kernel_calls):
    """Keys and values gathered over the context axis, their gradients reduce-scattered back (inside the
    kernel's own shard_map), nothing else (the einsum route's backward all-reduces them: 1.19 here)."""
    model = tiny_llama(0, max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (2, 512)).to(torch_xla.device())
    for report in (xla_tp.audit(model, input_ids=ids), xla_tp.audit(model, input_ids=ids, backward=True)):
        assert {k: v["count"] for k, v in report.collectives.items()} == \
            {k: v["count"] for k, v in report.expected.items()}
        assert report.collectives["all-gather"]["axes"] == ["context"]
        assert report.comm_ratio == pytest.approx(1.0)
    assert report.collectives["reduce-scatter"]["axes"] == ["context"]
    assert kernel_calls


@pytest.mark.parametrize("case", ["mask", "dropout", "ragged", "compiling", "no kernel here"])
def test_calls_the_kernel_cannot_take_keep_the_einsum_route(case, monkeypatch):
    world = xla_tp.init_device_mesh("xla", (4, 2), mesh_dim_names=("cp", "tp"))
    s = 384 if case == "ragged" else 512  # 96 queries per device: not a multiple of the kernel's 128 lanes
    dev = torch_xla.device()
    q, k = torch.randn(2, 4, s, 16).to(dev), torch.randn(2, 4, s, 16).to(dev)
    mask = torch.ones(s, s, dtype=torch.bool).tril().to(dev) if case == "mask" else None
    with xla_tp.context_parallel(world["cp"], buffers=[q], buffer_seq_dims=[2]):
        with monkeypatch.context() as patch:
            if case == "compiling":  # what dynamo's trace reports
                patch.setattr(torch.compiler, "is_compiling", lambda: True)
            blocks = context_flash.plan(q, k, mask, 0.1 if case == "dropout" else 0.0, True, 0.25,
                                        interpret=case != "no kernel here")
        assert (blocks is None) == (case != "no kernel here" or not TPU)
        assert (context_flash.plan(q, k, None, 0.0, True, 0.25, interpret=True) is None) == (case == "ragged")
    assert context_flash.plan(q, k, None, 0.0, True, 0.25, interpret=True) is None  # no context split outside


def test_a_split_the_kernel_cannot_take_never_reaches_torch_xla_flash(monkeypatch):
    """One key/value head broadcast to the queries' (torch's SDPA takes it, no enable_gqa) under a context split,
    flash on, on a TPU (as reported): torch_xla's flash_attention, whose one partition spec would gather the
    split queries back, is not called; the einsum route computes it."""
    import torch_xla.experimental.custom_kernel as kernels
    world = xla_tp.init_device_mesh("xla", (4, 2), mesh_dim_names=("cp", "tp"))
    dev = torch_xla.device()
    q, k, v = torch.randn(2, 4, 512, 16), torch.randn(2, 1, 512, 16), torch.randn(2, 1, 512, 16)
    called = []
    monkeypatch.setattr(xr, "device_type", lambda: "TPU")
    monkeypatch.setattr(kernels, "flash_attention", lambda **kwargs: called.append(kwargs))
    attention.use_flash_attention(True)
    try:
        qd = q.to(dev)
        with xla_tp.context_parallel(world["cp"], buffers=[qd], buffer_seq_dims=[2]):
            out = attention.sdpa(qd, k.to(dev), v.to(dev), is_causal=True)
    finally:
        attention.use_flash_attention(False)
    assert not called
    assert (out.cpu() - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() < 1e-5


def _needed_blocks(positions: np.ndarray, block_q: int, block_kv: int) -> int:
    """(query block, key block) pairs a causal mask leaves something to compute in, for queries at ``positions``
    (in the order a device holds them) against keys ``0..``: a key block counts when it starts at or before the
    block's last query position."""
    return sum(int(rows.max()) // block_kv + 1 for rows in positions.reshape(-1, block_q))


@pytest.mark.parametrize("mirrored", [True, False])
def test_mirrored_chunks_give_every_device_as_many_causal_blocks(mirrored):
    """The kernel's own tables (forward and backward), split over context=4, against an independent count of
    the blocks each device's query positions need: mirrored chunks (device c: chunks c and 7 - c of 8) even,
    contiguous blocks 1 : 2.6 : 4.2 : 5.8."""
    length, shards, block = 8192, 4, 512
    blocks = context_flash.Blocks(axes=(("context", shards), ("model", 2)), batch=None, heads="model",
                                  kv_heads="model", seq="context", causal=True, scale=1.0, block_q=block,
                                  block_kv=block, interpret=True, mirrored=mirrored)
    kernel, _, _ = context_flash._kernel(blocks, 4, length)
    chunks = np.arange(length).reshape(2 * shards, -1)
    positions = [np.r_[chunks[c], chunks[2 * shards - 1 - c]] if mirrored else np.r_[chunks[2 * c], chunks[2 * c + 1]]
                 for c in range(shards)]
    needed = [_needed_blocks(p, block, block) for p in positions]
    assert needed == ([34] * 4 if mirrored else [10, 26, 42, 58])  # of 16 * 17 / 2 = 136
    assert (np.asarray(kernel.fwd_mask_info.q_sequence).reshape(shards, -1) == np.stack(positions)).all()
    for tables in (kernel.fwd_mask_info, kernel.dkv_mask_info):
        per_device = np.asarray(tables.block_mask).reshape(2, shards, -1, length // block)  # head shards first
        assert [int((per_device[:, c] != 0).sum()) for c in range(shards)] == [2 * n for n in needed]


@pytest.mark.parametrize("shards", [2, 3, 4, 5, 8])
def test_the_exchange_routes_put_every_chunk_where_the_mirrored_order_wants_it(shards):
    """``_mirror``'s two permutes, simulated on chunk numbers: device d sends its chunk 2d along the even route and
    2d + 1 along the odd one; each device keeps them in the order of its parity; the result is chunks c and
    2C - 1 - c on device c, and the routes back restore 2d, 2d + 1."""
    even, odd = context_flash._routes(shards)
    for route in (even, odd):
        assert sorted(a for a, _ in route) == sorted(b for _, b in route) == list(range(shards))
    got_even, got_odd = dict((b, 2 * a) for a, b in even), dict((b, 2 * a + 1) for a, b in odd)
    held = [(got_even[c], got_odd[c]) if c % 2 == 0 else (got_odd[c], got_even[c]) for c in range(shards)]
    assert held == [(c, 2 * shards - 1 - c) for c in range(shards)]
    back_even = {a: held[b][0 if b % 2 == 0 else 1] for a, b in even}
    back_odd = {a: held[b][1 if b % 2 == 0 else 0] for a, b in odd}
    assert [(back_even[d], back_odd[d]) for d in range(shards)] == [(2 * d, 2 * d + 1) for d in range(shards)]
    assert context_flash.mirrored_order(2 * shards, shards).tolist() == [c for pair in held for c in pair]


@pytest.mark.parametrize("case", ["balanced", "off", "not causal", "chunks under 128"])
def test_the_kernel_takes_mirrored_chunks_where_they_apply(case):
    world = xla_tp.init_device_mesh("xla", (4, 2), mesh_dim_names=("cp", "tp"))
    s = 512 if case == "chunks under 128" else 1024  # 8 chunks of 64 tokens: under the kernel's lane width
    q = torch.randn(2, 4, s, 16).to(torch_xla.device())
    with xla_tp.context_parallel(world["cp"], buffers=[q], buffer_seq_dims=[2]):
        blocks = context_flash.plan(q, q, None, 0.0, case != "not causal", 0.25, interpret=True,
                                    balance=case != "off")
    assert blocks.mirrored == (case == "balanced")
    assert blocks.block_q == (128 if case in ("balanced", "chunks under 128") else 256)


def _permuted(hlo: str) -> list[tuple[int, ...]]:
    """The result shape of each collective-permute."""
    return [tuple(int(d) for d in m.split(",") if d)
            for m in re.findall(r"= [a-z0-9]+\[([\d,]*)\]\S* collective-permute\(", hlo)]


@pytest.mark.complete  # 45 s each
@pytest.mark.parametrize("kv_heads", [2])  # the exchange moves queries only: the contiguous tests cover 4 and 1
def test_mirrored_chunks_equal_cpu_sdpa_forward_and_backward(kernel_calls, kv_heads):
    torch.manual_seed(0)
    ref = Attention(kv_heads=kv_heads)
    model = copy.deepcopy(ref).to(torch_xla.device())
    x = torch.randn(2, 1024, 64)
    out, grads, hlo = _run(model, x)
    assert [(b.mirrored, b.block_q) for b in kernel_calls] == [(True, 128)]
    _assert_matches_cpu(ref, x, out, grads)
    # the forward adds four collective-permutes of a half query block per device (two chunks in, two out)
    assert sorted(tuple(sorted(s)) for s in _permuted(hlo)) == [(2, 2, 16, 128)] * 4
    assert set(collectives_of(hlo)) == {"all-gather", "all-reduce", "collective-permute"}


@pytest.mark.complete  # 150 s (the kernel interpreted at 1,024 tokens)
def test_llama_on_mirrored_chunks_equals_the_cpu_model_and_adds_only_collective_permutes(kernel_calls):
    seq, dev = 1024, torch_xla.device()
    ref = tiny_llama(0, max_position_embeddings=seq, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=1)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (2, seq))
    loss = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
    loss.backward()
    assert [b.mirrored for b in kernel_calls] == [True] * ref.config.num_hidden_layers
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-4
    grads = dict(ref.named_parameters())
    assert max((p.grad.cpu() - grads[n].grad).abs().max().item() for n, p in model.named_parameters()) < 1e-4
    # against the same program on contiguous blocks: the same collectives, plus per layer four
    # collective-permutes forward and four more backward (the queries' are shared with the forward)
    found = {}
    for balance in (True, False):
        attention.use_flash_attention(True, interpret=not TPU, balance=balance)
        found[balance] = [{k: (v["count"], v["bytes"]) for k, v in xla_tp.audit(
            model, input_ids=ids.to(dev), backward=backward).collectives.items()} for backward in (False, True)]
    layers = ref.config.num_hidden_layers
    for per_layer, balanced, contiguous in zip((4, 8), found[True], found[False]):
        assert balanced.pop("collective-permute")[0] == per_layer * layers
        assert balanced == contiguous


@pytest.fixture
def highest_precision():
    """float32 matmuls at full precision for the test (a TPU's default rounds their inputs to bfloat16)."""
    import torch_xla.backends
    before = torch_xla.backends.get_mat_mul_precision()
    torch_xla.backends.set_mat_mul_precision("highest")
    yield
    torch_xla.backends.set_mat_mul_precision(before)


@pytest.mark.skipif(not TPU or xr.global_runtime_device_count() != 8,
                    reason="the compiled Pallas splash kernel runs on a TPU only, here on 8 of its devices (else its "
                           "interpreter runs: test_splash_per_context_block_equals_cpu_sdpa_forward_and_backward)")
def test_compiled_kernel_on_tpu_equals_cpu_sdpa(kernel_calls, highest_precision):
    torch.manual_seed(0)
    ref = Attention(d=512, heads=4, kv_heads=2)  # head dim 128, the kernel's lane width
    model = copy.deepcopy(ref).to(torch_xla.device())
    x = torch.randn(2, 2048, 512)
    out, grads, _ = _run(model, x)
    assert [(b.interpret, b.mirrored) for b in kernel_calls] == [(False, True)]  # the causal load balance
    xc = x.clone().requires_grad_()
    want = ref(xc)
    (want * x.flip(-1)).sum().backward()
    assert (out - want).abs().max() < 1e-4
    assert (grads["x"] - xc.grad).abs().max() < 1e-4
