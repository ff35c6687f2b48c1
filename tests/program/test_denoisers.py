"""Diffusion transformers (diffusers' SD3, PixArt, Flux) by "auto" with no example input: their latents, timestep
and conditioning are made up from the config, so they are planned when parallelized, not at their first call; a
denoising call by keyword computes what the CPU model does, every device its share."""
import copy
import warnings

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.zoo import keyword_models

from ..helpers import max_err

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.complete
DEVICE = torch_xla.device()


DENOISERS = ("sd3", "pixart", "flux")


@pytest.mark.parametrize("name", DENOISERS)
def test_a_denoiser_is_planned_from_its_config_and_computes_its_function(name):
    cpu, inputs = keyword_models.build(name)
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
    assert report.compute_balance <= 1.10, report


def test_fluxs_single_stream_blocks_train_like_the_cpu_model():
    """Flux's single-stream block concatenates its attention and its MLP along their split features before
    proj_out: laid device-major, proj_out's input columns re-laid like it; one training step computes what the
    CPU model does (its state dict in the original order)."""
    cpu, inputs = keyword_models.build("flux")
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
