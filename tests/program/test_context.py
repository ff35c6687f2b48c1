"""Context parallelism: a ``context`` mesh axis splits the sequence for the whole model; attention gathers
keys and values over it. Checked in the compiled program (per-device score blocks, what is gathered), by the
audit against its own minimum, and against the CPU model's numbers."""
import copy
import re

import pytest
import torch
import torch_xla
import torch.nn.functional as F
import transformers

import xla_tp
from xla_tp.auditing.capture import capture_partitioned_hlo

from ..hf_tiny import tiny_llama
from ..fresh import run_fresh
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
    assert "context parallelism: the sequence split 4 ways" in xla_tp.state_of(model).explain()


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


def _bytes(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_planners_block_prices_count_what_the_audits_minimum_counts():
    """``plan_for(...).explain()`` on context=4 x model=2 prints per block the bytes each device moves for the
    traced input: Megatron's all-reduce of its tokens and the keys and values gathered over the context axis;
    those and their total are the audit's minimum for the same input (which adds the embedding's all-reduce)."""
    model = tiny_llama(0, max_position_embeddings=512, **HEADS)
    ids = torch.randint(0, 128, (2, 512))
    mesh = xla_tp.make_mesh(context=4, model=2)
    plan = xla_tp.plan_for(model, mesh=mesh, example_inputs=(ids,))
    text = plan.explain(model)
    layers = model.config.num_hidden_layers
    blocks = [tuple(map(_bytes, m)) for m in re.findall(rf"\(x{layers}\): ([\d,]+) \+ ([\d,]+) = ([\d,]+)", text)]
    total = _bytes(re.search(r"blocks total: ([\d,]+) bytes/device", text)[1])
    xla_tp.parallelize_xla(model, plan, mesh=mesh)
    report = xla_tp.audit(model, input_ids=ids.to(torch_xla.device()))
    embedding = ids.numel() // 4 * model.config.hidden_size * 4  # each device's tokens' embeddings, float32
    assert len(blocks) == 2 and all(megatron + gathers == moved for megatron, gathers, moved in blocks)
    assert sum(gathers for _, gathers, _ in blocks) * layers == report.expected["all-gather"]["bytes"] > 0
    assert sum(megatron for megatron, _, _ in blocks) * layers + embedding == report.expected["all-reduce"]["bytes"]
    assert total == sum(moved for *_, moved in blocks) * layers == report.comm_minimum_bytes - embedding


@pytest.mark.parametrize("family", ["Qwen2", "Gemma2"])
def test_a_padding_mask_by_keyword_costs_no_all_to_all(family):
    """An attention mask (a left-padded row) and transformers' KV cache: the key/value gathers are the only
    collectives of the sequence, and the audit's minimum counts them. Qwen2 takes the SDPA route (grouped
    keys and values reach xla_tp's attention unrepeated); Gemma 2 its eager attention (split at the
    attention function's entry, before repeat_kv). Either way repeat_kv's reshape on a split sequence cost
    4 all-to-alls per layer."""
    cfg = getattr(transformers, f"{family}Config")(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   vocab_size=128, max_position_embeddings=256, head_dim=16, **HEADS)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (2, 256))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    dev = torch_xla.device()
    out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
    hlo = capture_partitioned_hlo([out])
    assert (out.cpu() - ref(input_ids=ids, attention_mask=mask).logits).abs().max() < 1e-4
    assert "all-to-all" not in collectives_of(hlo) and len(_gathered(hlo)) == 4
    report = xla_tp.audit(model, input_ids=ids.to(dev), attention_mask=mask.to(dev))
    assert report.comm_ratio == pytest.approx(1.0) and report.compute_balance == pytest.approx(1.0)


@pytest.mark.parametrize("seq,batch,layers", [
    pytest.param(512, 2, 1, marks=pytest.mark.complete), pytest.param(4096, 1, 1, marks=pytest.mark.complete),
    (512, 1, 1)])  # one row: labels left replicated were miscompiled (batch.LIKE_MAIN)
def test_forward_and_backward_on_context_4_x_model_2_equal_the_cpu_model(seq, batch, layers):
    ref = tiny_llama(0, max_position_embeddings=seq, num_hidden_layers=layers, **HEADS)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (batch, seq))
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
    assert "context: the sequence split 4 ways" in xla_tp.plan_for(model, mesh=mesh).explain(model)
    xla_tp.parallelize_xla(model, "auto", mesh=world)
    out = model(input_ids=torch.randint(0, 128, (1, 256)).to(torch_xla.device())).logits
    assert _gathered(capture_partitioned_hlo([out])) == [(1, 1, 256, 16)] * 4


class Block(torch.nn.Module):
    """A torchtitan-style block: SDPA called directly, or a custom attention op (``torch.library``)."""

    def __init__(self, custom: bool = False, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.custom = heads, custom
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w2 = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (w(x).view(b, n, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = causal_attention(q, k, v) if self.custom else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, n, d))
        return x + self.w2(F.silu(self.w1(x)))


def _titan_plan() -> dict:
    plan = {f"{i}.{n}": xla_tp.ColwiseParallel() for i in range(2) for n in ("wq", "wk", "wv", "w1")}
    return plan | {f"{i}.{n}": xla_tp.RowwiseParallel() for i in range(2) for n in ("wo", "w2")}


@pytest.mark.parametrize("parallelized", [True, False])
def test_torch_context_parallel_signature_splits_the_buffers_and_gathers_keys_and_values(parallelized):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(Block(), Block())
    model = copy.deepcopy(ref).to(torch_xla.device())
    world = xla_tp.init_device_mesh("xla", (4, 2), mesh_dim_names=("cp", "tp"))
    if parallelized:  # torchtitan's order: the TP plan on world["tp"], then the CP block
        xla_tp.parallelize_module(model, world["tp"], _titan_plan())
    x = torch.randn(2, 256, 64)
    xd = x.to(torch_xla.device())
    with xla_tp.context_parallel(world["cp"], buffers=[xd], buffer_seq_dims=[1]):
        assert "devices=[1,4,1,2]" in torch_xla._XLAC._get_xla_sharding_spec(xd)  # sequence over cp, whole on tp
        out = model(xd)
        hlo = capture_partitioned_hlo([out])
    assert torch_xla._XLAC._get_xla_sharding_spec(xd) == "" and torch.equal(xd.cpu(), x)  # as before the block
    # keys and values of the two blocks, whole sequence, heads split over tp, gathered over cp (in the compiler's
    # order); an unplanned model's attention output is gathered over tp for its whole wo (2 x [2, 256 / 4, 64])
    gathered = [tuple(sorted(s)) for s in _gathered(hlo)]
    want = [tuple(sorted((2, 2, 256, 16)))] * 4 + ([] if parallelized else [tuple(sorted((2, 64, 64)))] * 2)
    assert sorted(gathered) == sorted(want)
    assert set(collectives_of(hlo)) == ({"all-gather", "all-reduce"} if parallelized else {"all-gather"})
    assert (out.cpu() - ref(x)).abs().max() < 1e-4


def test_context_parallel_refuses_bad_buffers_before_changing_any():
    world = xla_tp.init_device_mesh("xla", (4, 2), mesh_dim_names=("cp", "tp"))
    good, odd = (torch.zeros(2, n).to(torch_xla.device()) for n in (256, 6))
    cases = {"buffer_seq_dims": dict(buffers=[good], buffer_seq_dims=[1, 0]),
             "does not divide": dict(buffers=[good, odd], buffer_seq_dims=[1, 1]),
             "XLA tensors": dict(buffers=[good, torch.zeros(2, 8)], buffer_seq_dims=[1, 1])}
    for words, kwargs in cases.items():
        with pytest.raises(xla_tp.PlanError, match=words):
            with xla_tp.context_parallel(world["cp"], **kwargs):
                pass
        assert torch_xla._XLAC._get_xla_sharding_spec(good) == ""
    with pytest.raises(xla_tp.PlanError, match="no context axis"):
        with xla_tp.context_parallel(xla_tp.init_device_mesh("xla", (8,), mesh_dim_names=("tp",))):
            pass


@torch.library.custom_op("xla_tp_test::causal_attention", mutates_args=())
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError  # replaced below: a reference written with torch ops, no sharding rule anywhere


@torch.library.register_kernel("xla_tp_test::causal_attention", ["cpu", "xla"])
def _causal_attention_reference(q, k, v):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return torch.einsum("bhqk,bhkd->bhqd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(_causal_attention_reference(q, k, v), (q, k, v), grad)


causal_attention.register_autograd(_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def test_a_custom_attention_op_on_sequence_split_activations_needs_no_sharding_rule():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(Block(custom=True), Block(custom=True))
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, _titan_plan(), mesh=xla_tp.make_mesh(context=4, model=2))
    x = torch.randn(2, 256, 64, requires_grad=True)
    xd = x.detach().to(torch_xla.device()).requires_grad_()
    out = model(xd)
    out.square().mean().backward()
    ref(x).square().mean().backward()
    assert (out.cpu() - ref(x)).abs().max() < 1e-4
    assert (xd.grad.cpu() - x.grad).abs().max() < 1e-4
    grads = dict(ref.named_parameters())
    assert max((p.grad.cpu() - grads[n].grad).abs().max().item() for n, p in model.named_parameters()) < 1e-4


@pytest.mark.complete  # two compiles in a fresh process
def test_peak_temporary_memory_per_device_falls_with_the_context_axis():
    """Read from XLA's buffer assignment of the compiled program (jaxlib's route, as the bench reads it)."""
    out = run_fresh("import bench.long_context as b; print([b.row(1024, c)['temp_mib'] for c in (1, 4)])")
    whole, split = eval(out.strip().splitlines()[-1])
    assert 0 < split <= 0.35 * whole  # the score blocks dominate: a quarter each


def test_the_jax_backend_splits_the_sequence_and_its_audit_counts_the_gathers():
    """The same plan on JAX (Shardy lays the program out): logits of the CPU model, and the audit's minimum
    counts the key/value gathers (recorded from the torch module's SDPA calls on the mesh's context axis)."""
    ref = tiny_llama(0, max_position_embeddings=256, **HEADS)
    jm = xla_tp.parallelize_jax(copy.deepcopy(ref), "auto", mesh={"context": 4, "model": 2})
    ids = torch.randint(0, 128, (2, 256))
    assert (torch.as_tensor(jm(input_ids=ids).logits) - ref(input_ids=ids).logits).abs().max() < 1e-4
    report = jm.audit(input_ids=ids)
    assert report.count("all-gather") == report.expected["all-gather"]["count"] == 4
    assert report.comm_ratio == pytest.approx(1.0) and report.compute_balance == pytest.approx(1.0)


@pytest.mark.complete
def test_generation_on_a_context_mesh_equals_cpu_generate_without_a_program_per_token():
    """The prompt's prefill splits over the context axis (a length it divides), each decoded token is whole."""
    from xla_tp.compiles import compiled
    ref = tiny_llama(0, max_position_embeddings=512, **HEADS)
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(context=4, model=2))
    ids = torch.randint(0, 128, (2, 256))
    dev = torch_xla.device()
    before = compiled()
    got = xla_tp.generate(model, ids.to(dev), max_new_tokens=8)
    first = compiled() - before
    assert torch.equal(got.cpu(), ref.generate(ids, max_new_tokens=8, do_sample=False))
    assert first < 8                                   # fewer programs than tokens
    before = compiled()
    assert torch.equal(xla_tp.generate(model, ids.to(dev), max_new_tokens=16).cpu(),
                       ref.generate(ids, max_new_tokens=16, do_sample=False))
    assert compiled() == before                       # a longer generation reuses the same programs
