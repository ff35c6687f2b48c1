"""The figures xla_tp prints describe the program the user's own call compiles, checked with a second instrument.

- The batch is split whatever the model's main input (token ids, pixel values), passed by keyword as Hugging Face
  users pass it or by position: compute balance read from the partitioned HLO of the user's own call
  (``tests/hlo_count``, written apart from the audit's reader) <= 1.10, and ``audit`` given the same call prints
  the same balance and communication.
- A dense decoder's forward and backward: the audit's per-device FLOPs, collectives and bytes equal that reading.
- A batch that does not divide is split as far as it does, with a warning and a note saying what it costs.
- Modules added after ``parallelize_xla`` (LoRA adapters) are named and counted in the audit's minimum.
- Generation compiles as many programs for 64 new tokens as for 16 and none on a repeat; the count it prints
  equals the programs XLA dumped (a fresh process), and the audit by keyword runs there as the README shows.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch_xla
import transformers
from torch import nn
from torch.utils._pytree import tree_leaves

import xla_tp
from xla_tp import PlanError

from xla_tp.zoo import keyword_models
from xla_tp.zoo.keyword_models import LLAMA, VISION

from ..fresh import run_fresh
from ..helpers import max_err
from ..hlo_count import collectives_of, matmul_flops

DEVICE = torch_xla.device()
VISION_LAYERS = VISION["num_hidden_layers"]


@pytest.fixture(scope="module")
def mesh():
    return xla_tp.make_mesh(data=2, model=4)


def partitioned(tensors) -> str:
    """The per-device program that computes ``tensors`` (conftest sets XLA_DUMP_POST_OPTIMIZATIONS)."""
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def on_device(inputs: dict) -> dict:
    return {k: v.to(DEVICE) for k, v in inputs.items()}


def outputs(out) -> list[torch.Tensor]:
    """Every tensor a model returned (what ``audit`` compiles: the whole call)."""
    return [t for t in tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out) if isinstance(t, torch.Tensor)]


def balance_of(text: str, cpu: nn.Module, inputs: dict, devices: int = 8) -> float:
    """Matmul FLOPs per device of ``text`` x devices / those of ``cpu``'s forward on ``inputs`` unsharded."""
    plain = copy.deepcopy(cpu).to(DEVICE)
    whole = matmul_flops(partitioned(outputs(plain(**on_device(inputs)))))
    return matmul_flops(text) * devices / whole


def assert_audit_reads_the_program(report, text: str) -> None:
    """The audit's measured figures are those of ``text``, the program of the user's call."""
    found = collectives_of(text)
    assert report.flops_per_device == matmul_flops(text)
    assert {k: (v["count"], v["bytes"]) for k, v in report.collectives.items()} == found
    assert report.comm_bytes == sum(b for _, b in found.values())


CALLS = [pytest.param(name, "keyword", id=f"{name}-keyword") for name in keyword_models.ENCODERS]
CALLS += [pytest.param(name, "position", id=f"{name}-position", marks=pytest.mark.complete) for name in keyword_models.ENCODERS]


@pytest.mark.parametrize("name,how", CALLS)
def test_the_users_call_splits_the_batch_and_the_audit_reads_its_program(name, how, mesh):
    cpu, inputs = keyword_models.build(name)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    dev = on_device(inputs)
    main = model.main_input_name
    args, kwargs = ((), dev) if how == "keyword" else ((dev[main],), {k: v for k, v in dev.items() if k != main})
    out = model(*args, **kwargs)
    text = partitioned(outputs(out))
    balance = balance_of(text, cpu, inputs)
    assert balance <= 1.10, f"{name} by {how}: every device computes {balance:.2f}x its share"
    assert "all-gather" not in collectives_of(text)
    report = xla_tp.audit(model, *args, mesh=mesh, **kwargs)
    assert report.compute_balance == pytest.approx(balance, rel=0.01)
    assert_audit_reads_the_program(report, text)
    # at the minimum; SigLIP's pooling head repeats a parameter (its probe) over the batch, which the compiler
    # then moves to the data shards once (an all-to-all of 512 bytes, 1.2% of the layers' all-reduces)
    assert report.comm_ratio == pytest.approx(1.0) if name != "siglip_vision" else report.comm_ratio < 1.02
    with torch.no_grad():
        assert max_err(out.last_hidden_state.cpu(), cpu(**inputs).last_hidden_state) < 1e-4


def _checked_call(model: nn.Module, cpu: nn.Module, call: dict, mesh) -> tuple[str, xla_tp.AuditReport]:
    """The program of ``call`` on ``model`` and its audit, checked: the CPU model's logits, balance <= 1.10, the
    audit reads that program, parameters per device <= 1.15 of the ideal."""
    out = model(**on_device(call))
    text = partitioned(outputs(out))
    with torch.no_grad():
        assert max_err(out.logits.cpu(), cpu(**call).logits) < 1e-4, list(call)
    assert balance_of(text, cpu, call) <= 1.10, list(call)
    report = xla_tp.audit(model, mesh=mesh, **on_device(call))
    assert_audit_reads_the_program(report, text)
    assert report.param_memory_ratio <= 1.15, list(call)
    return text, report


@pytest.mark.complete
def test_a_vision_language_models_text_and_image_calls(mesh):
    """Llava by "auto" with no example input: its trace is made with images, so the vision tower and projector
    are split too; an image call by keyword computes what the CPU model does, every device its share (read from
    the program); the image features, cut per image and concatenated again by the model, are put in place by the
    placeholder mask within each row (one image per row): nothing moves over data, the layers' all-reduces only.
    The tower's hidden states (transformers captures them with hooks, which the trace keeps) are still returned."""
    cpu, inputs = keyword_models.build("llava")
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    specs = xla_tp.layout_of(model).params
    assert "model" in specs["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"], specs
    assert "model" in specs["model.multi_modal_projector.linear_1.weight"], specs
    for call in ({"input_ids": inputs["input_ids"][:, 18:]}, inputs):  # text, then images
        text, report = _checked_call(model, cpu, call, mesh)  # the language model's key/value heads split too
        assert set(collectives_of(text)) == {"all-reduce"}, list(call)
        # not below the minimum: the tower's last layer, which the model does not read (vision_feature_layer=-2),
        # is not in the program and the minimum does not count it
        assert 0.99 <= report.comm_ratio <= 1.10, (list(call), report.comm_ratio)
    tower = model.model.vision_tower(pixel_values=inputs["pixel_values"].to(DEVICE), output_hidden_states=True)
    assert len(tower.hidden_states) == 1 + VISION_LAYERS


@pytest.mark.complete
@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen_vl_a_vision_tower_of_flattened_patches_planned_and_its_text_and_image_calls(version, mesh):
    """Qwen2-VL and Qwen2.5-VL by "auto" with no example input: its tower takes flattened patches and a grid whose values it
    reads on the host (``.tolist()``), which the trace keeps real, so the tower's attention, MLPs and merger are
    split. A text call and an image call by keyword (as its processor makes it: ``mm_token_type_ids``) compute what
    the CPU model does, every device its share (the patches split over data with the batch). The text call has
    the layers' all-reduces only. The tower's attention loops over the images (``cu_seqlens`` chunks of the
    patches), which run as one batch of images, so no chunk moves; its features, which the model splits per image
    and concatenates again, are put in place within each row (one image per row): what moves over data is the
    tower's rotary positions, which the model builds image by image and concatenates (a few integers:
    all-to-all), within 1.10 of the minimum and no all-gather. Qwen2.5-VL's tower reorders its patches into
    windows by an index the host holds, within each image: within each data shard (no all-reduce over data)."""
    cpu, inputs = keyword_models.build("qwen2_vl" if version == "2" else "qwen2_5_vl")
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    specs = xla_tp.layout_of(model).params
    mlp = ("fc1", "fc2") if version == "2" else ("up_proj", "down_proj")
    for name in ("blocks.0.attn.qkv", "blocks.0.attn.proj", f"blocks.1.mlp.{mlp[0]}", f"blocks.1.mlp.{mlp[1]}",
                 "merger.mlp.0", "merger.mlp.2"):
        assert "model" in specs[f"model.visual.{name}.weight"], (name, specs)
    for call in ({"input_ids": inputs["input_ids"]}, inputs):  # text, then images
        text, report = _checked_call(model, cpu, call, mesh)
        found = collectives_of(text)
        kinds = {"all-reduce"} if len(call) == 1 else {"all-reduce", "all-to-all"}
        assert set(found) <= kinds and "all-reduce" in found, (list(call), found)
        assert report.comm_ratio <= 1.10, (list(call), report.comm_ratio)


@pytest.mark.complete
def test_qwen2_vl_images_of_different_sizes_in_one_batch(mesh):
    """Qwen2-VL's image call with images of two sizes (16 and 32 patches, 4 and 8 placeholders per row), each data
    shard's rows holding the same number of patches: the tower's attention of unequal chunks runs as the shards'
    blocks of patches, a block-diagonal mask keeping each image to itself, and the features are put in place
    within each shard's rows, so nothing but the tower's rotary positions moves over data: no all-gather and no
    collective-permute (both moved chunks and features between shards before), within 1.10 of the minimum."""
    cpu, _ = keyword_models.build("qwen2_vl")
    image = keyword_models.IMAGE_TOKEN
    grids = torch.tensor([[1, 4, 4], [1, 4, 8], [1, 4, 4], [1, 8, 4]])
    ids = torch.randint(4, image - 3, (4, 16), generator=torch.Generator().manual_seed(0))
    for row, grid in enumerate(grids):
        n = int(grid.prod()) // 4  # the merger joins 2 x 2 patches into a placeholder's features
        ids[row, 1], ids[row, 2:2 + n], ids[row, 2 + n] = image - 2, image, image - 3
    pixels = torch.randn(int(grids.prod(1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    call = {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grids, "mm_token_type_ids": (ids == image).int()}
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    text, report = _checked_call(model, cpu, call, mesh)
    found = collectives_of(text)
    assert set(found) <= {"all-reduce", "all-to-all"}, found
    assert report.comm_ratio <= 1.10 and report.compute_balance <= 1.15, (report.comm_ratio, report.compute_balance)


@pytest.mark.complete
def test_gemma3_vision_language_models_image_call(mesh):
    """Gemma 3 by "auto" with no example input: its language model attends with grouped key/value heads inside SDPA
    (``enable_gqa``, no ``repeat_kv``), which repeats each key/value head over its query heads, so its k/v
    projections split with them (parameters per device within 1.15 of the ideal); the image call computes what
    the CPU model does, at the communication minimum, no all-gather."""
    cpu, inputs = keyword_models.build("gemma3_vl")
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    specs = xla_tp.layout_of(model).params
    assert "model" in specs["model.language_model.layers.0.self_attn.k_proj.weight"], specs
    out = model(**on_device(inputs))  # (its unsharded copy on XLA would fail: the windowed cache's slice)
    text = partitioned(outputs(out))
    with torch.no_grad():
        assert max_err(out.logits.cpu(), cpu(**inputs).logits) < 1e-4
    report = xla_tp.audit(model, mesh=mesh, **on_device(inputs))
    assert_audit_reads_the_program(report, text)
    assert report.param_memory_ratio <= 1.15 and report.compute_balance <= 1.10, report
    # SigLIP's pooling head, which Gemma 3 does not read, is not in the program and the minimum does not count it
    assert "all-gather" not in collectives_of(text) and 0.99 <= report.comm_ratio <= 1.10, report.collectives


def test_an_input_sharded_by_the_user_keeps_its_split(mesh):
    """``mark_sharding`` (or ``MpDeviceLoader``'s ``input_sharding``) on the input before a keyword call."""
    import torch_xla.distributed.spmd as xs
    cpu, inputs = keyword_models.build("vit")
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    pixels = inputs["pixel_values"].to(DEVICE)
    xs.mark_sharding(pixels, mesh, ("data", None, None, None))
    text = partitioned(outputs(model(pixel_values=pixels)))
    assert balance_of(text, cpu, inputs) <= 1.10 and set(collectives_of(text)) == {"all-reduce"}


TINY_LLAMA = LLAMA


def test_a_decoders_forward_and_backward_audit_equals_a_second_reading(mesh):
    torch.manual_seed(0)
    cpu = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    ids = torch.randint(0, 128, (4, 16)).to(DEVICE)
    logits = model(input_ids=ids).logits
    params = [p for p in model.parameters() if p.requires_grad]
    text = partitioned([logits, *torch.autograd.grad(logits.float().sum(), params)])
    report = xla_tp.audit(model, mesh=mesh, backward=True, input_ids=ids)
    assert_audit_reads_the_program(report, text)
    assert report.comm_ratio == pytest.approx(1.0) and report.compute_balance == pytest.approx(1.0, abs=0.01)


def test_a_batch_that_does_not_divide_is_split_as_far_as_it_does_and_says_so():
    mesh = xla_tp.make_mesh(data=2, fsdp=2, model=2)
    cpu, inputs = keyword_models.build("esm")
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=mesh)
    six = {k: v.repeat(2, 1)[:6] for k, v in inputs.items()}  # 6 rows: data=2 divides them, data x fsdp does not
    with pytest.warns(UserWarning, match=r"batch 6 does not divide over data=2 x fsdp=2 .* split over data only"):
        text = partitioned(outputs(model(**on_device(six))))
    balance = balance_of(text, cpu, six)
    assert balance < 1.5  # the compiler splits the 3 rows of each data shard's over fsdp's devices
    with pytest.warns(UserWarning, match="batch 6 does not divide"):
        report = xla_tp.audit(model, mesh=mesh, **on_device(six))
    assert any("its inputs are split over data only (2 ways)" in note for note in report.notes)
    assert report.compute_balance == pytest.approx(balance, rel=0.01)
    three = {k: v[:3] for k, v in inputs.items()}  # nothing divides 3: whole on every device, as measured
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    with pytest.warns(UserWarning, match="batch 3 does not divide over data=2 .* its inputs are whole on every device"):
        text = partitioned(outputs(model(**on_device(three))))
    assert balance_of(text, cpu, three) == pytest.approx(2.0, rel=0.01)


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, backward=None):
        return self.fc(x)


def test_an_input_named_like_the_audits_own_keywords_is_refused(mesh):
    model = xla_tp.parallelize_xla(Named(), {}, mesh=mesh)
    with pytest.raises(PlanError, match=r"takes an input named 'backward'.* audit's own keywords"):
        xla_tp.audit(model, torch.ones(4, 8, device=DEVICE), mesh=mesh)


class Lora(nn.Module):
    """peft's LoRA layer as ``get_peft_model`` puts it in place of a Linear: the base layer and rank-r adapters."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)}).to(DEVICE)
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)}).to(DEVICE)
        nn.init.normal_(self.lora_B["default"].weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * 2.0


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_adapters_added_after_parallelizing_are_named_and_counted(mesh, backward):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    model.requires_grad_(False)
    for layer in model.model.layers:  # peft's all-linear targets: column- and row-parallel layers alike
        for owner, name in ((layer.self_attn, "q_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "up_proj"),
                            (layer.mlp, "down_proj")):
            setattr(owner, name, Lora(getattr(owner, name)))
    ids = torch.randint(0, 128, (4, 16)).to(DEVICE)
    report = xla_tp.audit(model, mesh=mesh, backward=backward, input_ids=ids)
    logits = model(input_ids=ids).logits
    adapters = [p for p in model.parameters() if p.requires_grad]
    text = partitioned([logits, *(torch.autograd.grad(logits.float().sum(), adapters) if backward else ())])
    assert_audit_reads_the_program(report, text)
    assert report.comm_ratio == pytest.approx(1.0)  # the minimum counts each adapter's rank-sized reduction
    assert any(note.startswith("16 modules added after parallelize_xla (Linear; e.g. model.layers.0.")
               for note in report.notes), report.notes


GENERATE = '''
import json, os, torch, torch_xla, transformers, xla_tp
from xla_tp.generation import run
dump = os.environ["DUMP"]
def dumped():
    return sum(name.endswith("before_optimizations.txt") for name in os.listdir(dump))
torch.manual_seed(0)
config = transformers.LlamaConfig(**CONFIG)
model = xla_tp.parallelize_xla(transformers.LlamaForCausalLM(config).eval(), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
out = {"calls": []}
for new in (16, 64, 64):
    before = dumped()
    result = run(model, torch.randint(3, 128, (2, 12)), new, eos_token_id=None)
    out["calls"].append([new, result.compiles, dumped() - before])
ids = torch.randint(3, 128, (4, 16)).to(torch_xla.device())
report = xla_tp.audit(model, mesh=xla_tp.make_mesh(data=2, model=4), input_ids=ids, attention_mask=torch.ones_like(ids))
out["audit"] = [report.comm_ratio, report.compute_balance, report.count("all-gather")]
print("JSON" + json.dumps(out))
'''


@pytest.mark.complete  # 33 s: kept out of the quick tier (its margin under 8 minutes on CI)
def test_generation_compiles_per_bucket_not_per_token_counted_as_xla_dumps_them(tmp_path):
    out = run_fresh(f"import os\nos.environ['DUMP'] = {str(tmp_path)!r}\nos.environ['XLA_FLAGS'] = "
                    f"'--xla_dump_to={tmp_path}'\nCONFIG = {TINY_LLAMA!r}\n" + GENERATE)
    got = json.loads(next(line[4:] for line in out.splitlines() if line.startswith("JSON")))
    (_, short, short_dumped), (_, long, long_dumped), (_, again, again_dumped) = got["calls"]
    assert (short, long, again) == (short_dumped, long_dumped, again_dumped)  # the printed count is XLA's
    assert long <= 3 and long <= short and again == 0  # 64 tokens: no program per token
    assert got["audit"] == [pytest.approx(1.0), pytest.approx(1.0, abs=0.01), 0]
