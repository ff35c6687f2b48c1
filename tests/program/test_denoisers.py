"""Diffusion transformers (diffusers' SD3, PixArt, Flux) by "auto" with no example input: their latents, timestep
and conditioning are made up from the config, so they are planned when parallelized, not at their first call; a
denoising call by keyword computes what the CPU model does, every device its share."""
import copy
import warnings

import pytest
import torch
import torch_xla

import xla_tp

from ..helpers import max_err

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.complete
DEVICE = torch_xla.device()


def _sd3():
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=8,
        joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16), {"pooled_projections": torch.randn(4, 16)}


def _pixart():
    return diffusers.PixArtTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=8,
        cross_attention_dim=64, caption_channels=32, out_channels=8, norm_type="ada_norm_single",
        use_additional_conditions=False), {}


def _flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=8,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)), {
        "hidden_states": torch.randn(4, 16, 16), "pooled_projections": torch.randn(4, 16),
        "img_ids": torch.randn(16, 3), "txt_ids": torch.randn(6, 3)}


# name -> (builder, balance the plan reaches today)
DENOISERS = {"sd3": (_sd3, 1.10), "pixart": (_pixart, 1.10), "flux": (_flux, 1.10)}


def _inputs(extra: dict) -> dict:
    base = {"hidden_states": torch.randn(4, 4, 8, 8), "encoder_hidden_states": torch.randn(4, 6, 32),
            "timestep": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    return {**base, **extra}


@pytest.mark.parametrize("name", list(DENOISERS))
def test_a_denoiser_is_planned_from_its_config_and_computes_its_function(name):
    build, balance = DENOISERS[name]
    torch.manual_seed(0)
    cpu, extra = build()
    cpu.eval()
    inputs = _inputs(extra)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*planned and parallelized at its first call")
        model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    assert any("model" in spec for spec in xla_tp.layout_of(model).params.values())
    dev = {k: v.to(DEVICE) for k, v in inputs.items()}
    with torch.no_grad():
        err = (model(**dev).sample.cpu() - cpu(**inputs).sample).abs().max().item()
    assert err < 1e-4, err
    report = xla_tp.audit(model, **dev)
    assert report.count("all-gather") == 0 and report.comm_ratio == pytest.approx(1.0, abs=0.01), report
    assert report.compute_balance <= balance, report


def test_fluxs_single_stream_blocks_train_like_the_cpu_model():
    """Flux's single-stream block concatenates its attention and its MLP along their split features before
    proj_out: laid device-major, proj_out's input columns re-laid like it; one training step computes what the
    CPU model does (its state dict in the original order)."""
    torch.manual_seed(0)
    cpu, extra = _flux()
    inputs = _inputs(extra)
    model = xla_tp.parallelize_xla(copy.deepcopy(cpu), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    assert xla_tp.layout_of(model).params["single_transformer_blocks.0.proj_out.weight"][1] is not None
    dev = {k: v.to(DEVICE) for k, v in inputs.items()}
    for m, inp in ((model, dev), (cpu, inputs)):
        m(**inp).sample.square().mean().backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    torch_xla.sync()
    after = model.state_dict()
    assert all(max_err(after[k], v) < 1e-5 for k, v in cpu.state_dict().items())
    with torch.no_grad():
        assert max_err(model(**dev).sample, cpu(**inputs).sample) < 1e-4
