"""Hugging Face export of parallelized models: ``export_hf`` and ``save_pretrained`` load back
through ``from_pretrained`` to the same logits (GPT-2 "auto" re-lays its packed c_attn), and
``load_checkpoint`` reads the same files into a model built on ``meta``."""
import json
import os

import pytest
import torch
import torch_xla

import xla_tp
from xla_tp.lowering.packed import packing_of
from xla_tp.zoo.registry import build, example_input, run

from .helpers import max_err


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_export_and_save_pretrained_round_trip(name, tmp_path):
    torch.manual_seed(0)
    model = build(name)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(fsdp=2, model=4))
    if name == "gpt2":
        assert packing_of(model.transformer.h[0].attn.c_attn.weight) is not None  # re-laid head-aligned
    x = example_input(name)
    logits = run(model, x.to(torch_xla.device())).cpu()
    files = xla_tp.export_hf(model, str(tmp_path / "export"))
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    assert json.load(open(tmp_path / "export" / "config.json"))["model_type"] == name
    model.save_pretrained(str(tmp_path / "hf"))
    for out in ("export", "hf"):
        loaded = type(model).from_pretrained(str(tmp_path / out))
        assert max_err(run(loaded, x), logits) < 1e-5, out
    with torch.device("meta"):
        lazy = build(name)
    xla_tp.parallelize_xla(lazy, "auto", mesh=xla_tp.make_mesh(model=8))
    assert xla_tp.load_checkpoint(str(tmp_path / "export"), lazy) is None
    assert max_err(run(lazy, x.to(torch_xla.device())), logits) < 1e-5


def test_export_cuts_shards_with_an_index(tmp_path):
    torch.manual_seed(0)
    model = build("llama")
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(model=8))
    files = xla_tp.export_hf(model, str(tmp_path), max_shard_bytes=64 * 1024)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(files) > 3 and set(index["weight_map"]) == set(model.state_dict())
    loaded = type(model).from_pretrained(str(tmp_path))
    x = example_input("llama")
    assert max_err(run(loaded, x), run(model, x.to(torch_xla.device()))) < 1e-5


README_CHILD = r"""
import sys, torch, xla_tp
from xla_tp.zoo.registry import build, example_input, run

torch.manual_seed(0)
model = build("llama")
model = xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(fsdp=2, model=4))
opt = torch.optim.AdamW(model.parameters())
run(model, example_input("llama").to("xla")).float().pow(2).mean().backward()
opt.step()
xla_tp.save_checkpoint(sys.argv[1] + "/ckpt", model, opt, step=100, keep=3)
handle = xla_tp.save_checkpoint(sys.argv[1] + "/ckpt", model, opt, step=200, async_save=True)
print("async", handle.result())
step = xla_tp.load_checkpoint(sys.argv[1] + "/ckpt", model, opt)
print("loaded", step)
print("exported", xla_tp.export_hf(model, sys.argv[1] + "/out"))
"""


def test_readme_training_at_scale_in_a_fresh_process(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: os.environ[k] for k in ("PATH", "HOME", "PJRT_DEVICE", "CPU_NUM_DEVICES") if k in os.environ}
    out = subprocess.run([sys.executable, "-c", README_CHILD, str(tmp_path)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"async {tmp_path}/ckpt/step_00000200" in out.stdout and "loaded 200" in out.stdout
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000100", "step_00000200"]
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "config.json").exists()
