"""The fit check: numbers against a hand computation, a refusal with numbers, a 70B dry run on meta."""
import subprocess
import sys
from pathlib import Path

import pytest

import xla_tp
from xla_tp import cli
from xla_tp.launch import load_recipe, load_topology
from xla_tp.launch.fit import FitSettings, estimate, human, suggest
from xla_tp.launch.model import build_model, hf_config, model_shape
from xla_tp.launch.plans import plan_input, plan_specs
from xla_tp.launch.session import estimator

from ..fresh import user_env

ROOT = Path(__file__).resolve().parents[2]

# Megatron by hand, as a rule mapping (per-dimension mesh axes): vocab-parallel embedding and head,
# column-parallel q/k/v/gate/up, row-parallel o/down; norms replicated.
RULES = {"model.embed_tokens.weight": ["model", None], "lm_head.weight": ["model", None],
         **{f"model.layers.*.self_attn.{p}_proj.weight": ["model", None] for p in "qkv"},
         "model.layers.*.self_attn.o_proj.weight": [None, "model"],
         "model.layers.*.mlp.gate_proj.weight": ["model", None], "model.layers.*.mlp.up_proj.weight": ["model", None],
         "model.layers.*.mlp.down_proj.weight": [None, "model"]}
TINY = ["model.overrides.hidden_size=64", "model.overrides.intermediate_size=128",
        "model.overrides.num_hidden_layers=2", "model.overrides.num_attention_heads=4",
        "model.overrides.num_key_value_heads=4", "batch=8", "seq_len=16"]


@pytest.fixture(scope="module")
def tiny():
    recipe = load_recipe("tiny-llama-cpu", TINY)
    recipe.plan = RULES
    config = hf_config(recipe.model, recipe.path)
    meta = build_model(config, "causal-lm", device="meta")
    return recipe, model_shape(config), meta


def test_fit_numbers_match_a_hand_computation(tiny):
    recipe, shape, meta = tiny
    mesh = xla_tp.make_mesh(data=2, model=4)
    planned = plan_specs(meta, plan_input(recipe), mesh)
    assert all(p.device.type == "meta" for p in meta.parameters())
    report = estimate(meta, planned.specs, mesh, shape, FitSettings("fp32", "adamw", 0.0, 8, 16, False),
                      load_topology("v5e-8"))
    # Parameters: embedding and head 256x64 each; per layer q,k,v,o 64x64 and gate,up,down 64x128
    # (4*4096 + 3*8192 = 40960), two norms of 64; a final norm of 64.
    sharded = 2 * 256 * 64 + 2 * 40960                 # 114,688 elements, split 4 ways
    replicated = 2 * 2 * 64 + 64                       # 320 elements, whole on every chip
    params = (sharded // 4 + replicated) * 4           # fp32
    assert report.params == params == 115_968
    assert report.grads == params and report.optimizer == 2 * params   # AdamW: exp_avg, exp_avg_sq
    # Activations per token (a=4 bytes, tp=4): per layer norms 2*64*(8+4) = 1536, attention
    # 4*(4*16)*4/4 = 256, scores 4*16*(4+4)/4 = 128, MLP 4*128*4/4 = 512 -> 2432; two layers 4864;
    # once: embedding output 64*4 = 256, logits 256/4*(4+8) = 768. Tokens per chip: 8*16/2 = 64.
    assert report.tokens_per_chip == 64
    assert report.activations == 64 * (2 * 2432 + 256 + 768) == 376_832
    assert report.gathered == 0                        # no fsdp axis
    assert report.total == 4 * params + 376_832
    assert report.usable == int(16 * 2**30 * 0.9) and report.fits
    # Activation checkpointing: each layer keeps its input (64*4), one layer is live again.
    remat = estimate(meta, planned.specs, mesh, shape, FitSettings("fp32", "adamw", 0.0, 8, 16, True),
                     load_topology("v5e-8"))
    assert remat.activations == 64 * (2 * 64 * 4 + 2432 + 256 + 768)
    # bf16 halves parameters, gradients, optimizer state and activation bytes per element.
    bf16 = estimate(meta, planned.specs, mesh, shape, FitSettings("bf16", "sgd", 0.9, 8, 16, False),
                    load_topology("v5e-8"))
    assert bf16.params == params // 2 and bf16.optimizer == params // 2   # SGD momentum: one state
    table = report.table()
    for row in ("parameters", "gradients", "optimizer state", "activations", "total", "usable HBM", "fits"):
        assert row in table


def _fp32(tiny, mesh, seq_len: int = 16):
    """The tiny recipe's fit report on ``mesh``: fp32, AdamW, batch 8, no checkpointing, a v5e-8."""
    recipe, shape, meta = tiny
    specs = plan_specs(meta, plan_input(recipe), mesh).specs
    return estimate(meta, specs, mesh, shape, FitSettings("fp32", "adamw", 0.0, 8, seq_len, False),
                    load_topology("v5e-8"))


def test_fsdp_adds_the_largest_gathered_block(tiny):
    report = _fp32(tiny, xla_tp.make_mesh(fsdp=2, model=4))
    # Largest block gathered over fsdp, still split over model: a decoder layer, 40960/4 + 128 elements,
    # beats the embedding (256*64/4 = 4096).
    assert report.gathered == (40960 // 4 + 128) * 4


def test_suggestions_name_overrides_that_fit(tiny):
    recipe, shape, meta = tiny
    mesh = xla_tp.make_mesh(data=2, model=4)
    planned = plan_specs(meta, plan_input(recipe), mesh)
    big = FitSettings("fp32", "adamw", 0.0, 1024, 16, False)   # 8192 tokens per chip
    topo = load_topology("v5e-8")
    report = estimate(meta, planned.specs, mesh, shape, big, topo)
    tiny_hbm = type(topo)(**{**vars(topo), "hbm_gib_per_chip": report.total * 0.7 / 2**30 / 0.9})
    report = estimate(meta, planned.specs, mesh, shape, big, tiny_hbm)
    assert not report.fits
    tips = suggest(report, shape, 8, estimator(meta, plan_input(recipe), shape, big, tiny_hbm))
    assert tips[0].startswith("precision=bf16") and tips[1].startswith("activation_checkpointing=true")
    assert tips[2].startswith("mesh={fsdp: 8}")        # 8-way batch split beats data=2 x model=4 here
    assert tips[3].startswith("batch=") and tips[3].endswith("(fits)")
    assert all(" per chip" in t for t in tips)


def test_a_context_axis_splits_the_tokens_and_gathers_keys_and_values(tiny):
    mesh = xla_tp.make_mesh(context=2, model=4)
    report = _fp32(tiny, mesh)
    # As the hand computation above, the tokens split over context instead of data (8*16/2 = 64 per chip);
    # keys and values are the whole sequence's on every chip: attention 2*(4*16)*4/4 + 2*2*(4*16)*4/4 = 384.
    assert report.tokens_per_chip == 64
    assert report.activations == 64 * (2 * (1536 + 384 + 128 + 512) + 256 + 768)
    assert _fp32(tiny, mesh, seq_len=15).tokens_per_chip == 8 * 15   # a length the axis does not divide stays whole


def test_long_sequences_are_suggested_a_context_axis(tiny):
    """One sequence of 8k tokens on 8 chips, a model of 4 heads: past model=4 neither the batch nor the heads
    split further, the sequence does. The search covers every fsdp x context x model mesh."""
    recipe, shape, meta = tiny
    mesh = xla_tp.make_mesh(model=8)
    planned = plan_specs(meta, plan_input(recipe), mesh)
    long = FitSettings("bf16", "adamw", 0.0, 1, 8192, True)
    topo = load_topology("v5e-8")
    report = estimate(meta, planned.specs, mesh, shape, long, topo)
    each = estimator(meta, plan_input(recipe), shape, long, topo)
    totals = {str(m): each(m).total for m in ({"context": 8}, {"context": 4, "model": 2}, {"context": 2, "model": 4})}
    best = min(totals, key=totals.get)
    assert best == "{'context': 8}" and totals[best] < report.total
    small = type(topo)(**{**vars(topo), "hbm_gib_per_chip": (totals[best] + report.total) / 2 / 2**30 / 0.9})
    report = estimate(meta, planned.specs, mesh, shape, long, small)
    tips = suggest(report, shape, 8, estimator(meta, plan_input(recipe), shape, long, small))
    assert tips == [f"mesh={{context: 8}}: {human(totals[best])} per chip (fits)"]
    tiny_hbm = type(topo)(**{**vars(topo), "hbm_gib_per_chip": totals[best] / 4 / 2**30 / 0.9})
    report = estimate(meta, planned.specs, mesh, shape, long, tiny_hbm)
    tips = suggest(report, shape, 8, estimator(meta, plan_input(recipe), shape, long, tiny_hbm))
    assert "nothing fits 8 chips: at seq_len=8192 the activations alone are" in tips[-1]   # not the weights
    assert tips[-1].endswith("use a shorter seq_len, or a larger slice for a larger context axis")


def test_70b_on_v5e_8_is_refused_with_numbers(capsys):
    """In this process: the refusal comes before anything is allocated (the dry run below is a fresh process)."""
    assert cli.main(["launch", "llama3-70b", "--topology", "v5e-8"]) == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "usable HBM       16 GiB less 10% reserve" in out
    assert "parameters       bf16, mesh model=8 (8 chips)" in out and "16.4 GiB" in out   # 141 GB / 8
    assert "refused: llama3-70b needs about" in out and "use a larger slice" in out
    assert "training" not in out


# A child's ru_maxrss starts from its parent's peak (vfork + exec keeps the parent's high-water mark), and a
# pytest worker may have peaked at gigabytes: a small intermediate process starts the command and reports it.
_PEAK = """import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=sys.stdout, stderr=subprocess.STDOUT)
_, status, usage = os.wait4(proc.pid, 0)
print(f"child exit {os.waitstatus_to_exitcode(status)} peak KiB {usage.ru_maxrss}")
"""


@pytest.mark.complete
def test_70b_dry_run_on_v5p_64_stays_on_meta(tmp_path):
    """Planned, fitted and audited on meta: nothing of the 131 GiB is allocated (the child's own peak memory)."""
    command = [sys.executable, "-m", "xla_tp.cli", "launch", "llama3-70b", "--dry-run"]
    out = subprocess.run([sys.executable, "-c", _PEAK, *command], cwd=ROOT, env=user_env(), capture_output=True,
                         text=True, timeout=600).stdout
    assert "child exit 0 peak KiB" in out, out
    assert "v5p-64 (32 chips, 8 host(s)), mesh fsdp=8,model=4" in out
    assert "70,553.7 M parameters on meta" in out and "=> fits" in out
    assert "ratio 1.000" in out                       # every parameter split over all 32 chips
    assert "only process 0 logs" in out and "nothing was allocated or compiled" in out
    peak_gib = int(out.rsplit("peak KiB ", 1)[1]) / 2**20
    assert peak_gib < 3, f"dry run peaked at {peak_gib:.1f} GiB"   # the model in bf16 would be 131 GiB


def test_an_moe_model_stores_every_expert_and_computes_with_its_top_k():
    from xla_tp.launch.fit import activation_bytes
    from xla_tp.launch.model import active_parameters
    from xla_tp.launch.train import flops_per_token
    from ..moe_models import configs
    config = configs()["mixtral"]
    shape = model_shape(config)
    assert (shape.experts, shape.top_k, shape.expert_intermediate) == (8, 2, 32)
    meta = build_model(config, "causal-lm", device="meta")
    total = sum(p.numel() for p in meta.parameters())
    experts = 8 * (2 * 32 * 64 + 64 * 32)  # gate_up [8, 64, 64] and down [8, 64, 32], one layer
    assert active_parameters(meta, shape) == total - experts + experts // 4
    embedding = meta.model.embed_tokens.weight.numel()  # a lookup, not a matmul (untied)
    assert flops_per_token(meta, shape, 16) == 6 * (active_parameters(meta, shape) - embedding) + 12 * 1 * 4 * 16 * 16
    dense = model_shape(hf_config(load_recipe("tiny-llama-cpu", TINY).model, "tiny"))
    attention_and_norms, once = 2 * 64 * 12 + 4 * 64 * 4 / 4 + 4 * 16 * 8 / 4, 64 * 4 + 128 / 4 * 12
    row = (64 + 4 * 32) * 4 / 4  # a dispatched token and its expert's gate, up, activation and product
    per_token = {route: activation_bytes(shape, FitSettings("fp32", "adamw", 0.0, 8, 16, False, route),
                                         {"model": 4})[0] / (8 * 16) for route in ("grouped", "slots")}
    # TPU: top-2 rows (and the kernel's tile padding), recomputed in the backward, so only the choices are kept
    assert per_token["grouped"] == pytest.approx(attention_and_norms + 2 * 12 + once + 2 * 1.15 * row, rel=1e-4)
    # elsewhere, dropless in slots: a row for every expert, all kept
    assert per_token["slots"] == pytest.approx(attention_and_norms + 8 * row + once, rel=1e-4)
    assert dense.experts == 0
