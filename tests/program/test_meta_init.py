"""Sharded initialisation: an HF model built on ``meta`` initialises with its own ``_init_weights``
straight into its sharded layout (element-wise inits replayed per device block), and loads a
safetensors checkpoint in place with host memory near one tensor (peak RSS measured in fresh
processes by ``bench.meta_init``)."""
import math
import re

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import transformers

import xla_tp
from xla_tp import layout_of
from xla_tp.zoo.registry import build, example_input, run

from ..helpers import expected_sharding, sharding



def test_meta_hf_llama_initialises_with_its_own_init_weights():
    reference = build("llama")
    with torch.device("meta"):
        model = build("llama")
    mesh = xla_tp.make_mesh(fsdp=2, model=4)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)  # LlamaRMSNorm has no reset_parameters
    for name, p in model.named_parameters():
        assert p.device.type == "xla" and sharding(p) == expected_sharding(
            tuple(p.shape), mesh, layout_of(model).params[name]), name
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight.cpu(), torch.ones(64))
    std = layer.mlp.up_proj.weight.cpu().std().item()
    assert abs(std - model.config.initializer_range) < 0.002, std  # HF's normal(0, 0.02), not kaiming
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq.cpu(), reference.model.rotary_emb.inv_freq)
    assert torch.isfinite(run(model, example_input("llama").to(torch_xla.device())).cpu()).all()


class _Mixed(torch.nn.Module):
    """Inits of every kind: element-wise (Linear's kaiming bound from its whole fan-in), a padding
    row zeroed (Embedding), a table computed and assigned (``reset_parameters`` below)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32, padding_idx=3)
        self.proj = torch.nn.Linear(32, 48)
        self.register_buffer("table", torch.empty(8, 4))

    def reset_parameters(self):
        self.table = torch.arange(32.0, device=self.table.device).view(8, 4)

    def forward(self, ids):
        return self.proj(self.emb(ids)) + self.table.sum()


def test_meta_init_replays_elementwise_inits_per_block_and_runs_others_whole():
    from xla_tp.backends import init
    from xla_tp import ColwiseParallel, RowwiseParallel
    with torch.device("meta"):
        model = _Mixed()
    slots = lambda mod, *names: [(mod._parameters, n, getattr(mod, n)) for n in names]
    recipes = init._record(model, "proj", slots(model.proj, "weight", "bias"))
    assert [[str(step[0]) for _, step in r] for r in recipes] == [["aten.uniform_.default"]] * 2
    (emb,) = init._record(model, "emb", slots(model.emb, "weight"))  # normal_, then the padding row zeroed
    assert [([str(v[0]) for v in path], str(step[0])) for path, step in emb] == [
        ([], "aten.normal_.default"), (["aten.select.int"], "aten.fill_.Scalar")]
    assert init._record(model, "", [(model._buffers, "table", model.table)]) == [None]  # assigned
    mesh = xla_tp.make_mesh(model=8)
    xla_tp.parallelize_xla(model, {"proj": RowwiseParallel(), "emb": ColwiseParallel()}, mesh=mesh)
    assert sharding(model.proj.weight) == expected_sharding((48, 32), mesh, (None, "model"))
    weight, bound = model.proj.weight.cpu(), 1 / 32 ** 0.5  # fan-in 32, not a block's 4
    assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
    assert weight.std() > 0.5 * bound / 3 ** 0.5  # each block drawn, none left zero
    assert all(weight[:, i:i + 4].abs().sum() > 0 for i in range(0, 32, 4))
    emb = model.emb.weight.cpu()
    assert torch.equal(emb[3], torch.zeros(32)) and 0.8 < emb.std() < 1.2
    assert torch.equal(model.table.cpu(), torch.arange(32.0).view(8, 4))


def _sharded_empty(shape, mesh, spec):
    t = torch.empty(shape, device=torch_xla.device())
    xs.mark_sharding(t, mesh, spec)
    return t


def test_device_init_program_computes_each_devices_shard_only():
    """The replayed init (normal_, then a padding row zeroed) compiles to per-device shapes only: no
    collective, no buffer of the whole tensor (torch_xla's own normal_ draws the whole tensor's bits
    on every device)."""
    from xla_tp.auditing.capture import capture_partitioned_hlo
    from xla_tp.backends import init
    with torch.device("meta"):
        emb = torch.nn.Embedding(512, 96, padding_idx=5)
    (recipe,) = init._record(emb, "", [(emb._parameters, "weight", emb.weight)])
    weight = _sharded_empty((512, 96), xla_tp.make_mesh(fsdp=2, model=4), ("model", "fsdp"))
    with torch.no_grad():
        init._replay(recipe, weight)
    hlo = capture_partitioned_hlo([weight])
    shapes = {tuple(int(n) for n in dims.split(",")) for dims in re.findall(r"\w+\[(\d+(?:,\d+)*)\]", hlo)}
    assert (128, 48) in shapes, sorted(shapes)  # the device's block of [512, 96]
    assert all(math.prod(s) <= 128 * 48 * 2 for s in shapes), sorted(shapes)  # 2: a block's two draws at most
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter", hlo)


def test_device_init_draws_the_right_distribution_on_every_shard():
    """normal_(0, 0.02) on the device: mean and std right over the whole tensor and on each shard,
    the padding row zero, the shards different from each other; the same seed gives the same values
    on another mesh (each element's value depends on its index, not on the device holding it)."""
    def build(mesh):
        torch.manual_seed(7)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                hidden_size=128, intermediate_size=256, num_attention_heads=8, num_hidden_layers=1,
                vocab_size=1024, pad_token_id=2))
        xla_tp.parallelize_xla(model, "auto", mesh=mesh)
        return model

    model = build(xla_tp.make_mesh(model=8))
    weight = model.model.embed_tokens.weight
    assert sharding(weight) != "{replicated}"
    values = weight.cpu()
    assert torch.equal(values[2], torch.zeros(128))  # the padding row
    assert abs(values.mean().item()) < 1e-3 and abs(values.std().item() - 0.02) < 5e-4
    shards = [data for data, _ in torch_xla._XLAC._get_local_shards([weight])[0]]
    assert len(shards) == 8 and all(abs(s.float().std().item() - 0.02) < 2e-3 for s in shards)
    assert len({tuple(s.flatten()[:16].tolist()) for s in shards}) == 8  # every shard its own draw
    up = model.model.layers[0].mlp.up_proj.weight.cpu()
    assert abs(up.std().item() - 0.02) < 1e-3 and not torch.equal(up[:128], values[:256, :128].T)
    again = build(xla_tp.make_mesh(fsdp=2, model=4))
    assert torch.equal(again.model.embed_tokens.weight.cpu(), values)
    assert torch.equal(again.model.layers[0].mlp.up_proj.weight.cpu(), up)


def test_bench_meta_init_and_lazy_load_need_little_host_memory():
    """The meta-init peak-RSS test: a model of a few hundred MB, built on meta, parallelized, then
    loaded lazily from safetensors, each in a fresh process (``bench.meta_init``)."""
    from bench.meta_init import measure
    result = measure("test", layers=8, routes=("meta", "load"), audit=False)
    meta, load = result["rows"]["meta"], result["rows"]["load"]
    assert meta["model_bytes"] > 200e6 and meta["device_bytes"] >= meta["model_bytes"], meta
    assert load["checksum"] == meta["checksum"]  # what the meta route initialised and exported was loaded
    for row in (meta, load):
        print(f"{row['route']}: {row['model_bytes'] / 1e6:.0f} MB in {row['seconds']:.1f} s, host peak "
              f"{row['host_peak'] / 1e6:.0f} MB (model {row['host_peak_over_model']:.2f}, device share "
              f"{row['host_peak_over_device_share']:.2f}, largest tensor {row['host_peak_over_largest_tensor']:.2f})")
        # below half the model, as the issue asks; near one device's share (measured 1.1 meta, 1.5 load here,
        # a fixed ~20 MB of runtime caches included); a whole-model staging would be 1.0 of the model.
        assert row["host_peak"] < 0.5 * row["model_bytes"], row
        assert row["host_peak"] < 2.5 * row["device_share_bytes"], row
