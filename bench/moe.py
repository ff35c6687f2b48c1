"""``python -m bench.moe``: mixture-of-experts layers at real widths, each layout against HF's plan by hand.

Two models built on ``meta`` in bf16 on 8 CPU devices (a data=2 x model=4 mesh, or expert=2 x model=4),
one process each:

- ``mixtral-8x7b``: one Mixtral-8x7B layer (hidden 4096, 8 experts of 14336, top-2, 32 heads, 8 KV heads);
- ``deepseek-v3``: a dense layer, then one DeepSeek-V3 MoE layer (hidden 7168, MLA, experts of 2048,
  top-8, a shared expert) with 32 routed experts instead of 256 and a 32000-token vocabulary (the real
  ones do not fit this machine's 24 GB; every width is DeepSeek-V3's).

Routes: ``auto`` ("auto": expert-tensor-parallel, the experts split on their features, gate/up re-laid),
``expert-parallel`` (the auto plan with whole experts split over the model axis), ``expert-axis`` ("auto" on expert=2 x model=4: the experts
split over the expert axis, their token slots moved there and back by all-to-all, each expert's features
split over the model axis), and ``hf-by-hand`` (the model's own ``tp_plan`` applied with
one ``xs.mark_sharding`` per weight, experts computed by transformers' ``batched_mm``, the one of its
implementations XLA runs). Each row is the forward audit of a batch of 4 x 128 tokens at capacity
factor 1.25: collectives, comm ratio (against the plan's own minimum), compute balance (against the
model's active-expert FLOPs) and parameter bytes per device.

Then ``costs``: what one MoE layer of each model at its real widths (DeepSeek-V3 with its 256 experts)
computes and holds per device for 4,096 tokens per data shard on ``data=2 x model=4``, by route: capacity
1.25 in slots (what it drops), dropless in slots (a slot per token for every expert), and dropless grouped
(sorted by expert, TPU's grouped-matmul kernel: the row tiles it runs for the group sizes), expert-parallel
and expert-tensor-parallel. The routing is a skewed one (router logits plus a per-expert bias), the same
for every route; FLOPs are the expert matmuls' per device, forward, over the routed ones split evenly
(1.00 = no expert row computed that the router did not ask for); bytes are the layer's rows (bf16) a
device holds. Nothing is compiled for these: the kernel runs on TPU only, and the counts follow from the
group sizes (``lowering.ragged.tile_flops``); the slots rows are what ``experts.run`` allocates, whose
compiled FLOPs the suite checks. Writes ``bench/results/moe.json``.
Example: ``python -m bench.moe`` (about 8 minutes here; the DeepSeek-V3 children peak near 20 GB of host
memory), ``--model mixtral-8x7b``. On a loaded machine a child can die in XLA's CPU collectives (a
device thread 10 s late to an all-reduce: "Termination timeout"); its row says so, and a rerun measures it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from . import write_result

MODELS = {
    "mixtral-8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                           num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                                           vocab_size=32000, num_hidden_layers=1)),
    "deepseek-v3": ("DeepseekV3Config", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                             n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1,
                                             n_group=8, topk_group=4, first_k_dense_replace=1, num_hidden_layers=2,
                                             num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                                             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128, vocab_size=32000)),
}
ROUTES = ("auto", "expert-parallel", "expert-axis", "hf-by-hand")
# one MoE layer at its real widths: hidden, an expert's intermediate size, experts, top-k
COST_MODELS = {"mixtral-8x7b": (4096, 14336, 8, 2), "deepseek-v3": (7168, 2048, 256, 8)}
COST_TOKENS, COST_TP = 4096, 4  # tokens per data shard, the model axis
MESHES = {"expert-axis": {"expert": 2, "model": 4}}  # the others: data=2 x model=4
TOKENS = (4, 128)


def _model(name: str):
    import torch
    import transformers
    cls, fields = MODELS[name]
    config = getattr(transformers, cls)(**fields)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def run_one(name: str, route: str) -> dict:
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs

    import xla_tp
    from bench.plans import plan_layout
    from xla_tp.planners.experts import LAYOUTS
    sizes = MESHES.get(route, {"data": 2, "model": 4})
    mesh = xla_tp.make_mesh(**sizes)
    model = _model(name)
    if route == "hf-by-hand":
        model.set_experts_implementation("batched_mm")
        model = model.to_empty(device=torch_xla.device())
        for pname, spec in plan_layout(model, xla_tp.hf_plan(model), mesh).params.items():
            xs.mark_sharding(model.get_parameter(pname), mesh, spec)
        layout = plan_layout(model, xla_tp.hf_plan(model), mesh)
    else:
        plan = xla_tp.plan_for(model, mesh=sizes, experts=route if route in LAYOUTS else None)
        xla_tp.parallelize_xla(model, plan, mesh=mesh)
        xla_tp.set_moe_options(model, capacity_factor=1.25)  # the rows compare layouts at one capacity
        layout = None
    ids = torch.randint(0, 1000, TOKENS).to(torch_xla.device())
    report = xla_tp.audit(model, ids, mesh=mesh, plan_layout=layout)
    layouts = sorted({r["layout"] + (f" x {r['expert_axis']} axis" if r["expert_axis"] else "")
                      for r in xla_tp.moe_report(model).values()}) if route != "hf-by-hand" else []
    return {"model": name, "route": route, "mesh": " x ".join(f"{a}={n}" for a, n in sizes.items()), "layouts": layouts,
            "collectives": {k: v["count"] for k, v in report.collectives.items()},
            "comm_bytes": report.comm_bytes, "comm_ratio": round(report.comm_ratio, 3) if report.comm_ratio else None,
            "compute_balance": round(report.compute_balance, 3),
            "param_bytes_per_device": report.param_bytes_per_device, "param_bytes_total": report.param_bytes_total}


def skewed_routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> list[int]:
    """Rows per expert of a router whose experts are not equally liked (logits plus a per-expert bias)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) + 0.5 * torch.randn(experts, generator=g)
    ids = logits.topk(top_k, dim=-1).indices.flatten()
    return torch.bincount(ids, minlength=experts).tolist()


def route_costs(name: str) -> list[dict]:
    """Per-device expert FLOPs and rows' bytes of one MoE layer of ``name`` by route (see the module docstring)."""
    import math

    from xla_tp.lowering.ragged import tile_flops, tile_rows
    from xla_tp.lowering.slots import capacity
    hidden, inter, experts, k = COST_MODELS[name]
    tokens, tp = COST_TOKENS, COST_TP
    sizes = skewed_routing(tokens, experts, k)
    local = experts // tp
    per_row = 6 * hidden * inter  # gate and up ([H] -> [2I]), then down ([I] -> [H])
    routed = tokens * k * per_row / tp

    def row(route: str, layout: str, flops: float, rows: int, width_share: int, dropped: int = 0) -> dict:
        """A route's figures; each row holds the dispatched token and output, and gate, up and the activation
        (``1 / width_share`` of them: expert-tensor-parallel splits the features), in bf16."""
        return {"model": name, "route": route, "layout": layout, "tokens_per_shard": tokens,
                "expert_gflops_per_device": round(flops / 1e9, 2), "over_routed": round(flops / routed, 3),
                "rows_per_device": rows, "row_bytes_per_device": rows * (2 * hidden + 3 * inter // width_share) * 2,
                "dropped": dropped}

    slots = capacity(tokens, k, experts, 1.25)
    rows = [row("capacity 1.25 (slots)", "expert-parallel", local * slots * per_row, local * slots, 1,
                sum(max(0, s - slots) for s in sizes)),
            row("dropless (slots)", "expert-parallel", local * tokens * per_row, local * tokens, 1)]
    tm = tile_rows(tokens * k, local)
    padded = math.ceil(tokens * k / tm) * tm
    busiest = max(tile_flops(sizes, tm, 1, 1, groups=range(t * local, (t + 1) * local)) for t in range(tp)) // 2
    rows.append(row("dropless (grouped)", "expert-parallel", busiest * per_row, padded, 1))
    tm = tile_rows(tokens * k, experts)
    every = tile_flops(sizes, tm, 1, 1) // 2
    rows.append(row("dropless (grouped)", "expert-tensor-parallel", every * per_row / tp,
                    math.ceil(tokens * k / tm) * tm, tp))
    return rows


def _error(stderr: str) -> str:
    """The child's exception line (XLA's own log lines left out), or its last line."""
    lines = [line for line in stderr.strip().splitlines() if line and not line[:4].isdigit()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
    return (errors or lines or ["no output"])[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.moe")
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(run_one(*args.child)), flush=True)
        return 0
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "XLA_DUMP_POST_OPTIMIZATIONS": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    rows = []
    for name in args.model or list(MODELS):
        for route in ROUTES:
            done = subprocess.run([sys.executable, "-m", "bench.moe", "--child", name, route], env=env,
                                  capture_output=True, text=True, cwd=Path(__file__).parent.parent)
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            rows.append(json.loads(found[0]) if found else
                        {"model": name, "route": route, "status": f"fails ({done.returncode}): {_error(done.stderr)}"})
            print(json.dumps(rows[-1]), flush=True)
    costs = [c for name in args.model or list(MODELS) for c in route_costs(name)]
    for c in costs:
        print(json.dumps(c), flush=True)
    write_result(args.out, "moe.json", {"tokens": list(TOKENS), "rows": rows, "costs": costs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
