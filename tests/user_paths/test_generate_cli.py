"""``xla-tp generate``: a recipe's model with weights from an HF directory (run as a user runs it, in a fresh
process) or from a checkpoint the launcher's ``save_checkpoint`` wrote, the tokens streamed as the CPU model
generates them, the speed and compiles at the end; bad input is one line with exit status 2."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import xla_tp
from xla_tp import cli
from xla_tp.launch.data import ByteTokenizer
from xla_tp.launch.model import build_model, hf_config
from xla_tp.launch.recipe import load_recipe

from ..compile_counts import parse_summary
from ..fresh import ROOT, user_env

SMALL = ["model.overrides.num_hidden_layers=2", "model.overrides.hidden_size=64", "model.overrides.intermediate_size=128"]
PROMPT = "The tiny corpus"


def recipe_model(seed: int) -> torch.nn.Module:
    """The default recipe's model, made small by ``SMALL``, on the CPU."""
    recipe = load_recipe("tiny-llama-cpu", SMALL)
    return build_model(hf_config(recipe.model, recipe.path), "causal-lm", seed=seed).eval()


def continuation(model: torch.nn.Module, new: int) -> str:
    """What the CPU model generates after ``PROMPT`` (greedy), prompt included, as text."""
    ids = torch.tensor([ByteTokenizer().encode(PROMPT)])
    return ByteTokenizer().decode(model.generate(ids, max_new_tokens=new, do_sample=False)[0])


def test_generate_streams_what_the_cpu_model_generates_from_an_hf_directory(tmp_path):
    """... and keeps the programs it compiled in the user's cache directory (``$XDG_CACHE_HOME/xla_tp/xla_cache``):
    one entry per program; run again, every entry is looked up (the CPU backend cannot load one: each is
    compiled again and replaced), the captured decode step's too, which torch_xla's counters leave out."""
    model = recipe_model(seed=1)
    model.save_pretrained(tmp_path / "hf")
    cache = tmp_path / "cache" / "xla_tp" / "xla_cache"
    lines = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-m", "xla_tp.cli", "generate", "--checkpoint", str(tmp_path / "hf"),
                                 "--prompt", PROMPT, "--max-new-tokens", "12", *SMALL], cwd=ROOT,
                                env={**user_env(), "XDG_CACHE_HOME": str(tmp_path / "cache")},
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout == continuation(model, 12) + "\n"
        said = result.stderr.strip().splitlines()
        assert said[0].startswith("xla-tp generate tiny-llama-cpu: LlamaForCausalLM on mesh data=2,model=4, weights from")
        assert said[-2].startswith("12 tokens in ") and " tokens/s; 3 programs compiled (prompt bucket 16, cache 28 tokens" in said[-2]
        lines.append(parse_summary(said[-1]))
        if not lines[1:]:
            files = sorted(p.name for p in cache.iterdir())
    first, second = lines
    assert first["path"] == str(cache) and first["written"] == first["programs"] == len(files) >= 3, first
    assert second["loaded"] + second["unloadable"] == len(files) == second["written"], second
    assert sorted(p.name for p in cache.iterdir()) == files


def test_generate_from_a_checkpoint_the_launcher_saved(tmp_path, capsys):
    model = recipe_model(seed=2)
    sharded = xla_tp.parallelize_xla(copy.deepcopy(model), "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    xla_tp.save_checkpoint(str(tmp_path / "ckpt"), sharded, step=5)
    status = cli.main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", PROMPT,
                       "--max-new-tokens", "6", *SMALL])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert out.out == continuation(model, 6) + "\n"


@pytest.mark.parametrize("args, words", [
    (["nope", "--prompt", "x"], "xla-tp generate: unknown recipe 'nope'"),
    (["--prompt", ""], "xla-tp generate: --prompt is empty"),
    (["--prompt", "x", "--checkpoint", "/nonexistent"], "xla-tp generate: --checkpoint /nonexistent: no such file"),
    (["bert", "--prompt", "x"], "generate needs a causal-lm recipe"),
    (["--prompt", "x" * 120, "--max-new-tokens", "16", *SMALL], "longer than the model's 128 positions"),
])
def test_bad_input_is_one_line_and_status_2(args, words, capsys):
    status = cli.main(["generate", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and words in lines[-1], lines
    assert len([line for line in lines if line.startswith("xla-tp generate:")]) == 1
