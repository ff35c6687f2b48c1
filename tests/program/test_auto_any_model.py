""""auto" on models that do not fit the dense-decoder mould, each called as a new user would: no plan, no
example input. Every model is tiny (1-2 layers) with the real model's head counts and proportions; one
compiled program per model answers all its checks: no PlanError, the compiled forward's collectives, its
compute balance and parameter memory (the audit), and the values against the unsharded CPU model.

Targets (issue 18): heads the axis divides: no all-gather, at most 2 all-reduces per layer (+2 for the
embedding and the head), compute balance <= 1.10; heads it does not divide: no all-gather, balance <= 1.30,
at most 0.6 of the parameters on a device; everywhere: outputs within 1e-4 of the CPU model.
"""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.distributed.spmd as xs
import transformers
from torch import nn

import xla_tp
from xla_tp import plan_for

from ..helpers import max_err

DIVISIBLE = dict(balance=1.10, memory=0.6)
NOT_DIVISIBLE = dict(balance=1.30, memory=0.6)


class Call(nn.Module):
    """``model(main=x, **rest)`` as a one-input module (what ``audit`` takes), returning the main output."""

    def __init__(self, model: nn.Module, **rest):
        super().__init__()
        self.model, self.rest = model, rest

    def forward(self, x):
        return main_output(self.model(**{self.model.main_input_name: x, **self.rest}))


def main_output(out):
    for name in ("logits", "last_hidden_state", "loss"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0] if isinstance(out, tuple) else out


def run_auto(ref: nn.Module, x: torch.Tensor, mesh, layers: int, balance: float, memory: float, small: int = 0,
             **rest):
    """Parallelize a copy of ``ref`` with "auto" (no input given), audit its forward on ``x`` (batch split over
    data), compare with ``ref`` on the CPU; assert the targets (``small``: all-reduces of per-token values
    allowed beyond the activations'). Returns the report and the parallelized model."""
    model = copy.deepcopy(ref)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    xd = x.to(torch_xla.device())
    if "data" in mesh.axis_names and dict(zip(mesh.axis_names, mesh.mesh_shape))["data"] > 1:
        xs.mark_sharding(xd, mesh, ("data",) + (None,) * (x.dim() - 1))
    dev_rest = {k: v.to(torch_xla.device()) if isinstance(v, torch.Tensor) else v for k, v in rest.items()}
    report = xla_tp.audit(Call(model, **dev_rest), xd, mesh=mesh)
    assert report.count("all-gather") == 0, report
    assert 1 <= report.count("all-reduce") <= 2 * layers + 2 + small, report
    assert report.compute_balance <= balance, report
    assert report.param_bytes_per_device <= memory * report.param_bytes_total, report
    got = Call(model, **dev_rest)(xd)
    want = Call(ref, **rest)(x)
    assert max_err(got, want) < 1e-4
    return report, model


def ids(vocab: int = 128, shape=(4, 16)) -> torch.Tensor:
    return torch.randint(2, vocab, shape, generator=torch.Generator().manual_seed(1))


def seeded(build):
    torch.manual_seed(0)
    return build().eval()


# ---- heads the model axis does not divide (model=8: a v5e-8) ----------------------------------------------

def test_qwen2_7b_heads_split_over_a_sub_axis():
    """28 query / 4 key-value heads (Qwen2/2.5-7B) on 8 devices: attention split over groups of 4 devices
    (each holds one key-value head and its 7 query heads), the MLP and the vocabulary over all 8."""
    mesh = xla_tp.make_mesh(model=8)
    cfg = transformers.Qwen2Config(hidden_size=112, intermediate_size=592, num_hidden_layers=1, num_attention_heads=28,
                                   num_key_value_heads=4, head_dim=4, vocab_size=128, max_position_embeddings=64)
    ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    report, model = run_auto(ref, ids(), mesh, 1, **NOT_DIVISIBLE)
    assert report.count("all-reduce") == 3 and report.comm_ratio == pytest.approx(1.0), report
    plan = plan_for(ref, mesh=mesh)
    assert plan.choices[0].chosen.name == "split over 4 of 8 devices (sub-axis)" and "28 heads" in plan.choices[0].why
    assert plan.roles["model.layers.0.self_attn.k_proj.weight"].axes == ("heads@4", "embed")
    assert "split over 4 of 8 devices (sub-axis)" in plan.explain(ref, mesh)


def test_gpt2_small_heads_padded_with_zero_heads_train_like_cpu():
    """GPT-2 small's 12 heads on 8 devices: 4 zero heads added to the packed c_attn (and zero inputs to
    c_proj), so each device holds 2; state_dict() keeps the original shapes and values; one training step
    matches the CPU and the zero heads stay zero."""
    mesh = xla_tp.make_mesh(model=8)
    cfg = transformers.GPT2Config(n_embd=96, n_layer=1, n_head=12, vocab_size=512, n_positions=64)
    ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    report, model = run_auto(ref, ids(512), mesh, 1, **NOT_DIVISIBLE)
    attn = model.transformer.h[0].attn
    assert tuple(attn.c_attn.weight.shape) == (96, 384) and tuple(attn.c_proj.weight.shape) == (128, 96)
    state, want = model.state_dict(), ref.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in want.items()}
    assert all(max_err(state[k], want[k]) == 0 for k in want)

    x = ids(512).to(torch_xla.device())
    for m, inp in ((model, x), (ref, ids(512))):
        F.cross_entropy(m(inp).logits.flatten(0, 1), inp.flatten()).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    torch_xla.sync()
    after = model.state_dict()
    assert all(max_err(after[k], v) < 1e-5 for k, v in ref.state_dict().items())
    laid = attn.c_attn.weight.detach().cpu().view(96, 8, 48)  # per device: q, k, v of 2 heads of 8
    assert laid[:, 6:].abs().max() == 0  # devices 6 and 7 hold the zero heads 12..15 of each block


def test_four_heads_on_eight_devices():
    """4 heads on 8 devices: attention over 4 of them (2 heads' worth of work per device, the cheapest at
    these widths), the SwiGLU MLP (4x wide) and the vocabulary over all 8."""
    mesh = xla_tp.make_mesh(model=8)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                                   vocab_size=128, max_position_embeddings=64)
    ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    run_auto(ref, ids(), mesh, 1, **NOT_DIVISIBLE)
    choice = plan_for(ref, mesh=mesh).choices[0]
    assert choice.chosen.ways == 4 and "4 heads" in choice.why


def test_strict_auto_refuses_off_the_optimum_and_leaves_the_model():
    """strict=True asks for the optimum only: the 28-head model is a PlanError naming the heads."""
    mesh = xla_tp.make_mesh(model=8)
    cfg = transformers.Qwen2Config(hidden_size=112, intermediate_size=224, num_hidden_layers=1, num_attention_heads=28,
                                   num_key_value_heads=4, head_dim=4, vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    weight = model.model.layers[0].self_attn.q_proj.weight
    with pytest.raises(xla_tp.PlanError, match="28 heads"):
        xla_tp.parallelize_xla(model, "auto", mesh=mesh, strict=True)
    assert model.model.layers[0].self_attn.q_proj.weight is weight and weight.device.type == "cpu"


# ---- heads merged with the batch, multi-query, losses (data=2 x model=4) ------------------------------------

def test_bloom_attention_with_heads_merged_into_the_batch():
    """BLOOM reshapes [B, H, S, D] to [B*H, S, D] before baddbmm (with ALiBi) and bmm: kept 4-D, split by
    heads; the packed query_key_value split as it is (per-head interleaved)."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.BloomConfig(hidden_size=64, n_layer=1, n_head=8, vocab_size=128)
    ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    report, _ = run_auto(ref, ids(), mesh, 1, **DIVISIBLE)
    assert report.count("all-reduce") == 3, report


def test_olmo2_norm_over_all_heads_keeps_q_and_k_split():
    """OLMo 2 normalises q and k over all heads at once (an RMSNorm of the whole projection): a mean over the
    split features, completed by an all-reduce of one value per token, so q_proj and k_proj stay split (the
    compute balanced) where they were computed whole; zero heads are refused there (they would enter the mean)."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.Olmo2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=128, max_position_embeddings=64)
    ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    plan = plan_for(ref, mesh=mesh)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert plan.roles[f"model.layers.0.self_attn.{name}.weight"].kind == "column", plan.explain(ref, mesh)
    model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=mesh)
    x = ids()
    report = xla_tp.audit(Call(model), x.to(torch_xla.device()), mesh=mesh)
    assert report.compute_balance <= 1.10, report
    assert max_err(Call(model)(x.to(torch_xla.device())), Call(ref)(x)) < 1e-4
    six = transformers.Olmo2Config(**{**cfg.to_dict(), "hidden_size": 48, "num_attention_heads": 6,
                                      "num_key_value_heads": 6})
    choice = plan_for(transformers.AutoModelForCausalLM.from_config(six), mesh=mesh).choices[0]
    assert any(line.startswith("zero heads: its features are reduced whole") for line in choice.invalid), choice.invalid


@pytest.mark.parametrize("name", ["xglm", "deberta"])
def test_bmm_attention_of_models_no_test_named(name):
    """XGLM (softmax on the merged [B*H, S, S]) and DeBERTa-v2 with its disentangled relative attention
    (c2p/p2c bmm against position projections, gathers, ``score += ...``): split by heads."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    if name == "xglm":
        cfg = transformers.XGLMConfig(d_model=64, num_layers=1, attention_heads=8, ffn_dim=128, vocab_size=128)
        ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    else:
        cfg = transformers.DebertaV2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                                           intermediate_size=128, vocab_size=128, relative_attention=True,
                                           pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16,
                                           max_position_embeddings=64)
        ref = seeded(lambda: transformers.AutoModel.from_config(cfg))
    # the position projections (of the 16 relative positions, not of the tokens) run whole: 64 tokens make
    # them the small part they are in a real model
    run_auto(ref, ids(shape=(2, 64)), mesh, 1, **DIVISIBLE)


def test_gpt_bigcode_multi_query_splits_q_and_copies_k_v():
    """GPT-BigCode / StarCoder: q, k and v packed with one key/value head. The query heads split, every device
    holds its own copy of the key/value block (re-laid packed weight), attention reads it in place; one
    training step matches the CPU (the copies' gradients are summed, so they stay equal)."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.GPTBigCodeConfig(n_embd=64, n_layer=1, n_head=8, vocab_size=128, n_positions=64,
                                        multi_query=True)
    ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    report, model = run_auto(ref, ids(), mesh, 1, **DIVISIBLE)
    assert tuple(model.transformer.h[0].attn.c_attn.weight.shape) == (64 + 4 * 16, 64)  # 16 q rows + k + v each
    x = ids()
    for m, inp in ((model, x.to(torch_xla.device())), (ref, x)):
        F.cross_entropy(m(inp).logits.flatten(0, 1), inp.flatten()).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    torch_xla.sync()
    after = model.state_dict()  # device 0's copies, in the original layout
    assert all(max_err(after[k], v) < 1e-5 for k, v in ref.state_dict().items())
    copies = model.transformer.h[0].attn.c_attn.weight.detach().cpu().view(4, 32, 64)[:, 16:]
    assert max_err(copies, copies[:1].expand_as(copies)) == 0  # still equal on every device


@pytest.mark.complete
def test_falcon_multi_query_reads_its_heads_view_in_place_and_copies_k_v():
    """Falcon (``multi_query``): ``x @ w.T`` packs q with one key/value head, then ``view(b, s, heads + 2, d)``
    and ``[..., :-2, :]``, ``[..., [-2], :]``, ``[..., [-1], :]``. The query heads split 4 ways, every device
    copies the key/value heads (no sub-axis, no all-to-all), rotary embeddings keep the copies; the layer
    norm's output feeds q/k/v and the MLP with one input gradient (a column group of ``x @ w.T``). Forward:
    the plan's all-reduces only; forward+backward: those and, per layer, the sums of the key and the value
    copies' weight gradients. Logits and one training step match the CPU model."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, vocab_size=128)
    assert cfg.multi_query and not cfg.new_decoder_architecture
    ref = seeded(lambda: transformers.AutoModelForCausalLM.from_config(cfg))
    model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=mesh)
    x = ids()
    xd = x.to(torch_xla.device())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing put back in the original order
        fwd = xla_tp.audit(model, input_ids=xd)
        bwd = xla_tp.audit(model, input_ids=xd, backward=True)
    for report in (fwd, bwd):
        assert set(report.collectives) == {"all-reduce"}, report
        assert report.compute_balance <= 1.10 and report.param_memory_ratio <= 1.05, report
    assert fwd.count("all-reduce") == fwd.expected["all-reduce"]["count"] and fwd.comm_ratio == 1.0, fwd
    assert bwd.count("all-reduce") == bwd.expected["all-reduce"]["count"] + 2 * 2 and bwd.comm_ratio <= 1.10, bwd
    assert max_err(model(input_ids=xd).logits, ref(input_ids=x).logits) < 1e-4
    for m, inp in ((model, xd), (ref, x)):
        F.cross_entropy(m(input_ids=inp).logits.flatten(0, 1), inp.flatten()).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    torch_xla.sync()
    after = model.state_dict()
    assert all(max_err(after[k], v) < 1e-5 for k, v in ref.state_dict().items())
    copies = model.transformer.h[0].self_attention.query_key_value.weight.detach().cpu().view(4, 32, 64)[:, 16:]
    assert max_err(copies, copies[:1].expand_as(copies)) == 0  # still equal on every device


@pytest.mark.complete
def test_transformer_encoder_self_attention_has_one_input_gradient_per_projection():
    """torch's ``nn.TransformerEncoder`` called as users do (``src=``): its self-attention projects q, k and v
    from one input in one contraction of the re-laid ``in_proj_weight``, so the backward reduces that input's
    gradient once (not once per q, k, v) and each weight's gradient once over the data axis: the plan's
    all-reduces exactly (the minimum counts the attention input's gradient, a partial sum of the column-split
    ``in_proj_weight``). Outputs and gradients match the CPU model."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    layer = nn.TransformerEncoderLayer(64, 8, 128, batch_first=True, dropout=0.0)
    ref = seeded(lambda: nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=mesh)
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    xd = x.to(torch_xla.device())
    fwd, bwd = xla_tp.audit(model, src=xd), xla_tp.audit(model, src=xd, backward=True)
    for report in (fwd, bwd):
        assert set(report.collectives) == {"all-reduce"} and report.compute_balance <= 1.05, report
    assert fwd.count("all-reduce") == fwd.expected["all-reduce"]["count"] and fwd.comm_ratio == 1.0, fwd
    assert bwd.count("all-reduce") == bwd.expected["all-reduce"]["count"] and bwd.comm_ratio == pytest.approx(1.0), bwd
    got, want = model(src=xd), ref(src=x)
    assert max_err(got, want) < 1e-4
    for m, out in ((model, got), (ref, want)):
        out.pow(2).mean().backward()
        torch.optim.SGD(m.parameters(), lr=1.0).step()
    torch_xla.sync()
    after = model.state_dict()  # in the original layout
    assert all(max_err(after[k], v) < 1e-5 for k, v in ref.state_dict().items())


@pytest.mark.complete
def test_gemma3n_altup_stacks_its_innovation_without_moving_the_batch():
    """Gemma 3n's AltUp stacks a batch-split activation in a new leading dim (``innovation.repeat(2, 1, 1, 1)``),
    which torch_xla lowers to an op GSPMD reshards with all-to-alls over the data axis (4 on 2 layers); lowered
    as the broadcast it is, the forward has all-reduces only, and neither pass moves the batch. Compute and
    parameters split within 15% of 1/4 each (the per-layer table vocab-parallel, the per-layer gate and projection
    a column -> row pair, the AltUp projections row-parallel alone).
    ``altup.prediction_coefs`` contracts the router's features, which the router's other use keeps whole: it
    is computed whole too (no padding of its 2 inputs to 4, no all-reduce). Logits match the CPU model."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.Gemma3nTextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        head_dim=8, vocab_size=128, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, laurel_rank=8,
        altup_num_inputs=2, num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0, 0.0])
    torch.manual_seed(0)
    ref = transformers.Gemma3nForCausalLM(cfg)  # in training mode, as built: AltUp clamps its correction coefficients
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing padded
        model = xla_tp.parallelize_xla(copy.deepcopy(ref), "auto", mesh=mesh)
    x = ids()
    xd = x.to(torch_xla.device())
    fwd, bwd = xla_tp.audit(model, input_ids=xd), xla_tp.audit(model, input_ids=xd, backward=True)
    assert set(fwd.collectives) == {"all-reduce"} and fwd.comm_ratio <= 1.01, fwd
    # the AltUp projections split over their input features (row-parallel alone) and the per-layer gate multiplied
    # by the whole per-layer input gather the gradients of those whole inputs in the backward (which the minimum
    # does not count: 8% of it here); nothing else gathers, and the all-reduces stay at the minimum
    tokens = x.numel() // 2  # per device: the batch split over the data axis
    gathers = 2 * tokens * cfg.hidden_size * 4 + 2 * tokens * cfg.num_hidden_layers * cfg.hidden_size_per_layer_input * 4
    assert set(bwd.collectives) == {"all-reduce", "all-gather"}, bwd
    assert bwd.collectives["all-gather"]["bytes"] == gathers, bwd
    assert bwd.collectives["all-reduce"]["bytes"] <= 1.02 * bwd.comm_minimum_bytes, bwd
    for report in (fwd, bwd):  # the per-layer table, gate and projection, the AltUp projections split too
        assert report.compute_balance <= 1.15 and report.param_memory_ratio <= 1.15, report
    assert max_err(model(input_ids=xd).logits, ref(input_ids=x).logits) < 1e-4


class TrainingLoss(nn.Module):
    """A training wrapper: the loss is computed inside the forward that "auto" traces."""

    main_input_name = "input_ids"

    def __init__(self, lm: nn.Module, labels: bool):
        super().__init__()
        self.lm, self.labels = lm, labels

    def forward(self, input_ids):
        if self.labels:  # Hugging Face's own loss
            return self.lm(input_ids, labels=input_ids, use_cache=False).loss
        logits = self.lm(input_ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


@pytest.mark.parametrize("labels", [False, True])
def test_a_loss_inside_the_forward_keeps_the_head_vocab_parallel(labels):
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                                   vocab_size=512, max_position_embeddings=64)
    ref = seeded(lambda: TrainingLoss(transformers.AutoModelForCausalLM.from_config(cfg), labels))
    plan = plan_for(ref, mesh=mesh)
    assert "cross_entropy over the split classes" in plan.roles["lm.lm_head.weight"].why
    report, _ = run_auto(ref, ids(512), mesh, 1, **DIVISIBLE, small=6)
    assert report.comm_ratio < 1.02, report  # per-token max and sum (and the mean) only: the logits stay split


# ---- no example input: vision towers and encoder-decoders ---------------------------------------------------

def _vision(name: str) -> nn.Module:
    kw = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=8, intermediate_size=128, image_size=32,
              patch_size=8)
    cls, config = {"vit": (transformers.ViTModel, transformers.ViTConfig),
                   "clip": (transformers.CLIPVisionModel, transformers.CLIPVisionConfig),
                   "siglip": (transformers.SiglipVisionModel, transformers.SiglipVisionConfig)}[name]
    return cls(config(**kw))


@pytest.mark.parametrize("name", ["vit", "clip", "siglip"])
def test_vision_towers_from_their_config(name):
    """Images made up from the config (image size, channels); the patch embedding split over its kernel rows
    (one all-reduce), the encoder layers at Megatron's minimum."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    ref = seeded(lambda: _vision(name))
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    report, _ = run_auto(ref, images, mesh, 1, **DIVISIBLE)
    assert report.comm_ratio == pytest.approx(1.0, abs=0.05), report


def test_a_tower_the_made_up_images_do_not_run_is_left_whole_with_a_warning_that_says_so():
    """SmolVLM takes ``[batch, images, 3, H, W]`` where the images made up are ``[batch, 3, H, W]``: planned from a
    text call, the tower whole, and a warning naming the model, the error and what to pass."""
    cfg = transformers.SmolVLMConfig(image_token_id=127, scale_factor=2, vision_config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8, image_size=32, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=4, pad_token_id=0))
    ref = seeded(lambda: transformers.SmolVLMForConditionalGeneration(cfg))
    with pytest.warns(UserWarning, match=r"SmolVLMForConditionalGeneration takes images, but its vision tower did not "
                                         r"run on the images xla_tp made up \(ValueError: .*\).*example_kwargs"):
        plan = plan_for(ref, mesh=xla_tp.make_mesh(data=2, model=4))
    assert "model.vision_model.encoder.layers.0.mlp.fc1.weight" in plan.replicated


def test_t5_for_conditional_generation_gets_decoder_inputs():
    """Encoder and decoder stacks, self- and cross-attention (k/v from the encoder), the tied head."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.T5Config(d_model=64, d_kv=8, d_ff=128, num_layers=1, num_heads=8, vocab_size=128,
                                decoder_start_token_id=0)
    ref = seeded(lambda: transformers.T5ForConditionalGeneration(cfg))
    report, _ = run_auto(ref, ids(), mesh, 3, **DIVISIBLE, decoder_input_ids=ids(shape=(4, 8)))
    assert report.count("all-reduce") == 7, report  # encoder 2, decoder 3 (cross-attention), embedding, head


def test_whisper_gets_mel_frames_of_its_source_length():
    """Mel frames as many as the encoder's strided convolutions bring to max_source_positions; conv1 -> GELU
    -> conv2 split as a column/row pair; decoder inputs from the decoder start token."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    cfg = transformers.WhisperConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=8,
                                     decoder_attention_heads=8, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                     num_mel_bins=16, max_source_positions=8, max_target_positions=16,
                                     vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1)
    ref = seeded(lambda: transformers.WhisperForConditionalGeneration(cfg))
    frames = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(1))
    run_auto(ref, frames, mesh, 3, **DIVISIBLE, decoder_input_ids=ids(shape=(4, 8)))
    roles = plan_for(ref, mesh=mesh).roles
    assert roles["model.encoder.conv1.weight"].kind == "column" and roles["model.encoder.conv2.weight"].kind == "row"


# ---- a model that declares nothing: planned at its first call ------------------------------------------------

class Gated(nn.Module):
    """Two inputs and an options object: nothing to make an input from."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x, gate, options):
        options.calls += 1
        return self.down(torch.relu(self.up(x)) * gate) * options.scale


def test_a_model_that_declares_nothing_is_planned_at_its_first_call():
    mesh = xla_tp.make_mesh(data=2, model=4)
    ref = seeded(Gated)
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="planned and parallelized at its first call"):
        xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    assert model.up.weight.device.type == "cpu"  # untouched until then
    options = type("Options", (), {"calls": 0, "scale": 2.0})()
    x, gate = torch.randn(4, 8, 16), torch.randn(4, 8, 64)
    xd, gd = x.to(torch_xla.device()), gate.to(torch_xla.device())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # planning the call warns about nothing
        out = model(xd, gd, options)
    assert options.calls == 1  # the planning trace did not run the forward on the caller's objects
    assert max_err(xd, x) == 0 and max_err(gd, gate) == 0
    ref_options = type("Options", (), {"calls": 0, "scale": 2.0})()
    assert max_err(out, ref(x, gate, ref_options)) < 1e-5
    assert torch_xla._XLAC._get_xla_sharding_spec(model.up.weight).startswith("{devices=[4,1,2]")  # rows over 4
