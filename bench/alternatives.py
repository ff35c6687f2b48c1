"""``python -m bench.alternatives``: what "auto" priced for heads the axis does not divide, and what each compiles to.

Qwen2-7B's widths (hidden 3584, 28 query and 4 key/value heads, MLP 18944, vocabulary 152064), 2 layers,
bf16, built on ``meta``, on 8 devices (model=8, a v5e-8's shape). ``plan_for`` prices every valid way to
split the attention (``xla_tp.planners.alternatives``); for each, the model is parallelized with that
alternative picked (``plan_for(pick=...)``) and its forward audited: the planner's estimate (FLOP-equivalent
cost, compute balance and bytes of the block) beside the compiled program's collectives, communication,
compute balance and parameter memory. The unsharded reference is compiled once. Writes
``bench/results/alternatives.json``. Example: ``python -m bench.alternatives --tokens 256``.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ["XLA_DUMP_POST_OPTIMIZATIONS"] = "1"  # its own process: read the partitioned HLO here
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from . import write_result  # noqa: E402

QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                vocab_size=152064, max_position_embeddings=4096)


def _model(layers: int):
    import torch
    import transformers
    config = transformers.Qwen2Config(num_hidden_layers=layers, **QWEN2_7B)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        return transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)


def alternatives(layers: int = 2, tokens: int = 256) -> dict:
    """The priced alternatives of the first block off the optimum, each with its forward audit."""
    import torch
    import torch_xla

    import xla_tp
    from xla_tp.audit.run import audit_here, unsharded_dot_flops
    from xla_tp import plan_for

    mesh = xla_tp.make_mesh(model=8)
    plan = plan_for(_model(layers), mesh=mesh)
    choice = plan.choices[0]
    rows, unsharded = [], None
    ids = torch.randint(0, QWEN2_7B["vocab_size"], (1, tokens))
    for alternative in choice.alternatives:
        start = time.perf_counter()
        model = _model(layers)
        picked = plan_for(model, mesh=mesh, pick=lambda c, n=alternative.name: next(a for a in c.alternatives
                                                                                      if a.name == n))
        xla_tp.parallelize_xla(model, picked, mesh=mesh)
        x = ids.to(torch_xla.device())
        if unsharded is None:
            unsharded = unsharded_dot_flops(model, (x,), False)
        report = audit_here(model, (x,), mesh, False, None, unsharded)
        price = alternative.price
        rows.append({"alternative": alternative.name, "chosen": alternative is choice.chosen,
                     "estimate": {"cost": round(price.cost), "block_balance": round(price.balance(8), 3),
                                  "block_bytes": round(price.comm), "block_minimum_bytes": round(price.minimum),
                                  "block_param_bytes": round(price.params)},
                     "audit": {"collectives": {k: v["count"] for k, v in report.collectives.items()},
                               "comm_ratio": _round(report.comm_ratio), "compute_balance": _round(report.compute_balance),
                               "param_fraction": round(report.param_bytes_per_device / report.param_bytes_total, 3)},
                     "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
        del model
        gc.collect()
    return {"model": f"Qwen2-7B widths, {layers} layers, bf16, on meta", "mesh": "model=8", "tokens": tokens,
            "block": choice.block, "why": choice.why, "not_valid": choice.invalid, "alternatives": rows}


def _round(v):
    return None if v is None else round(v, 3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.alternatives")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    write_result(args.out, "alternatives.json", alternatives(args.layers, args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
