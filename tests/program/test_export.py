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

from ..helpers import max_err


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
