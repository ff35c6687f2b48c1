"""``python -m bench.moe``: mixture-of-experts layers at real widths, each layout against HF's plan by hand.

Two models built on ``meta`` in bf16 on 8 CPU devices (a data=2 x model=4 mesh, or expert=2 x model=4),
one process each:

- ``mixtral-8x7b``: one Mixtral-8x7B layer (hidden 4096, 8 experts of 14336, top-2, 32 heads, 8 KV heads);
- ``deepseek-v3``: a dense layer, then one DeepSeek-V3 MoE layer (hidden 7168, MLA, experts of 2048,
  top-8, a shared expert) with 32 routed experts instead of 256 and a 32000-token vocabulary (the real
  ones do not fit this machine's 24 GB; every width is DeepSeek-V3's).

Routes: ``auto`` ("auto": expert-parallel), ``expert-tensor-parallel`` (the auto plan with the experts
split on their features, gate/up re-laid), ``expert-axis`` ("auto" on expert=2 x model=4: the experts
split over the expert axis, their token slots moved there and back by all-to-all, each expert's features
split over the model axis), and ``hf-by-hand`` (the model's own ``tp_plan`` applied with
one ``xs.mark_sharding`` per weight, experts computed by transformers' ``batched_mm``, the one of its
implementations XLA runs). Each row is the forward audit of a batch of 4 x 128 tokens at capacity
factor 1.25: collectives, comm ratio (against the plan's own minimum), compute balance (against the
model's active-expert FLOPs) and parameter bytes per device. Writes ``bench/results/moe.json``.
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
ROUTES = ("auto", "expert-tensor-parallel", "expert-axis", "hf-by-hand")
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
    write_result(args.out, "moe.json", {"tokens": list(TOKENS), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
