"""Host trace overhead of xla_tp against the same sharding written by hand, on an 8-layer HF Llama (2x4).

Seven models, traced interleaved (forward + backward, process CPU time, ``TRACES`` rounds after a
warm-up, nothing executed, the order reversed every other round): no tensor parallelism; torch's
Colwise/Rowwise plan by xla_tp and by hand (one ``xs.mark_sharding`` per weight), on the Llama with 8
key/value heads and on one with 4 (grouped-query: q, k and v are not one shape, so xla_tp's column group
for them takes its Python backward); torchtitan's sequence-parallel plan by xla_tp and by hand (the same
parameter specs, plus the plan's activation layouts written as ``xs.mark_sharding`` in forward hooks). A ratio is the median over the rounds of
the two routes' ratio in that round (paired: a slow moment of the machine slows both). Example::

    ratios = trace_overhead()["ratios"]      # {"xla_tp / hand (torch plan)": 1.04, ...}
"""
from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path
from typing import Any

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import transformers
from torch.distributed.tensor.placement_types import Replicate, Shard

import xla_tp
from xla_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from .plans import hand_apply
from .timing import WARMUP, stats, trace_once

TRACES = 41
QUICK_TRACES = 9  # rounds of ``python -m bench --quick`` (a smoke run of the same measurement)
COLUMN, ROW = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")


def _module(name: str) -> str:
    return f"model.layers.*.{'self_attn' if name in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{name}"


def torch_plan() -> dict[str, Any]:
    """Colwise q/k/v/gate/up, Rowwise o/down: the plain torch plan."""
    return {**{_module(n): ColwiseParallel() for n in COLUMN}, **{_module(n): RowwiseParallel() for n in ROW}}


def sp_plan() -> dict[str, Any]:
    """torchtitan's sequence-parallel plan for an HF Llama."""
    return {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
            "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                           desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "model.layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{_module(n): ColwiseParallel() for n in COLUMN},
            **{_module(n): RowwiseParallel(output_layouts=Shard(1)) for n in ROW}}


def hand_sp(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``sp_plan`` by hand: its parameter specs by ``mark_sharding``, its activation layouts by
    ``xs.mark_sharding`` in forward hooks."""
    hand_apply(model, sp_plan(), mesh)
    seq, full, vocab = ("data", "model", None), ("data", None, None), ("data", None, "model")

    def out(spec):
        return lambda m, a, o: xs.mark_sharding(o, mesh, spec).global_tensor

    for fqn, m in model.named_modules():
        leaf = fqn.rsplit(".", 1)[-1]
        if leaf in ("embed_tokens", "input_layernorm", "post_attention_layernorm", "norm", *ROW):
            m.register_forward_hook(out(seq))
        elif leaf == "self_attn":
            m.register_forward_pre_hook(lambda m, a, k: (a, {**k, "hidden_states": xs.mark_sharding(
                k["hidden_states"], mesh, full).global_tensor}), with_kwargs=True)
        elif leaf == "mlp":
            m.register_forward_pre_hook(lambda m, a: (xs.mark_sharding(a[0], mesh, full).global_tensor,))
        elif leaf == "lm_head":
            m.register_forward_hook(out(vocab))
    return model


def _llama(kv_heads: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=kv_heads, vocab_size=256))


def trace_overhead(traces: int = TRACES) -> dict[str, Any]:
    """Trace-time stats per route (seconds) and the paired ratios (see the module), from one interleaved run."""
    mesh = xla_tp.make_mesh(data=2, model=4)
    base, grouped_query, device = _llama(), _llama(kv_heads=4), torch_xla.device()
    routes = {
        "none": lambda m: m.to(device),
        "hand (torch plan)": lambda m: hand_apply(m.to(device), torch_plan(), mesh),
        "xla_tp (torch plan)": lambda m: xla_tp.parallelize_xla(m, torch_plan(), mesh=mesh),
        "hand (torch plan, 4 kv heads)": lambda m: hand_apply(m.to(device), torch_plan(), mesh),
        "xla_tp (torch plan, 4 kv heads)": lambda m: xla_tp.parallelize_xla(m, torch_plan(), mesh=mesh),
        "hand (SP plan)": lambda m: hand_sp(m.to(device), mesh),
        "xla_tp (SP plan)": lambda m: xla_tp.parallelize_xla(m, sp_plan(), mesh=mesh),
    }
    models = {name: make(copy.deepcopy(grouped_query if "kv heads" in name else base)) for name, make in routes.items()}
    ids = torch.randint(0, 256, (8, 32)).to(device)
    xs.mark_sharding(ids, mesh, ("data", None))
    samples: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(WARMUP):
        for m in models.values():
            trace_once(m, ids, backward=True)
    for round_ in range(traces):
        for name in (list(models) if round_ % 2 else reversed(list(models))):
            samples[name].append(trace_once(models[name], ids, backward=True))

    def paired(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(samples[a], samples[b])), 3)

    ratios = {"xla_tp / hand (torch plan)": paired("xla_tp (torch plan)", "hand (torch plan)"),
              "xla_tp / hand (torch plan, 4 kv heads)": paired("xla_tp (torch plan, 4 kv heads)",
                                                               "hand (torch plan, 4 kv heads)"),
              "xla_tp / hand (SP plan)": paired("xla_tp (SP plan)", "hand (SP plan)"),
              "xla_tp (SP plan) / none": paired("xla_tp (SP plan)", "none"),
              "hand (SP plan) / none": paired("hand (SP plan)", "none")}
    return {"model": "HF Llama, 8 layers, hidden 128, batch 8 x 32, mesh 2x4, forward+backward",
            "traces": traces, "seconds": {name: stats(s) for name, s in samples.items()},
            "ratios": ratios}


def main(argv=None) -> int:
    """``python -m bench.overhead [--traces N] [--out DIR]``: ``trace_overhead`` in this (fresh) process, written
    to ``DIR/overhead.json``."""
    from . import write_result
    parser = argparse.ArgumentParser(prog="python -m bench.overhead")
    parser.add_argument("--traces", type=int, default=TRACES)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    write_result(args.out, "overhead.json", trace_overhead(args.traces))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
