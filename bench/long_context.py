"""``python -m bench.long_context``: context parallelism at 2k-32k tokens, compiled, not run.

A tiny Llama (2 layers, hidden 64, 8 heads of 8, vocab 128) parallelized with "auto" on
``data=8/c x context=c`` for c in 1, 2, 4, 8, at each sequence length, with a batch of 8/c sequences:
each data replica holds one sequence, split c ways (context=1 is plain data parallelism; the model axis
is left out so that only the context axis changes what a device holds). Each row is the forward's audit:
collectives (the keys and values gathered over the context axis), compute balance, and the peak temporary
memory per device from XLA's buffer assignment of the compiled program. Nothing executes (a 32k-token
score block per head is 4 GiB), so the audit takes jaxlib's route (``XLA_DUMP_POST_OPTIMIZATIONS=0`` for
this process: jaxlib's compiler hands out its memory statistics, torch_xla's does not). ``memory_ratio``:
the row's peak temporary memory over the same length's at context=1. Writes
``bench/results/long_context.json``. Example: ``python -m bench.long_context --tokens 2048 8192``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ["XLA_DUMP_POST_OPTIMIZATIONS"] = "0"  # jaxlib's route: the compiled program's memory statistics
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from . import write_result  # noqa: E402

TOKENS = (2048, 4096, 8192, 16384, 32768)
CONTEXTS = (1, 2, 4, 8)


def row(tokens: int, context: int) -> dict:
    """The forward's audit at ``tokens`` on ``data=8/context x context=context``, batch 8/context."""
    import torch
    import torch_xla
    import transformers

    import xla_tp
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=128, max_position_embeddings=tokens))
    mesh = xla_tp.make_mesh(data=8 // context, context=context, model=1)
    xla_tp.parallelize_xla(model, "auto", mesh=mesh)
    ids = torch.randint(0, 128, (8 // context, tokens)).to(torch_xla.device())
    report = xla_tp.audit(model, input_ids=ids)
    xla_tp.unparallelize(model)
    return {"tokens": tokens, "context": context, "data": 8 // context,
            "collectives": {k: v["count"] for k, v in report.collectives.items()},
            "comm_ratio": report.comm_ratio, "compute_balance": report.compute_balance,
            "temp_mib": round(report.temp_bytes_per_device / 2**20, 2),
            "score_mib_per_device": round(8 * tokens * tokens // context * 4 / 2**20, 1)}  # 8 heads, f32


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_context")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    rows = []
    for tokens in args.tokens:
        base = None
        for context in args.contexts:
            r = row(tokens, context)
            base = r["temp_mib"] if context == 1 else base
            r["memory_ratio"] = round(r["temp_mib"] / base, 3) if base else None
            print(r, flush=True)
            rows.append(r)
    write_result(args.out, "long_context.json", {
        "model": "Llama, 2 layers, hidden 64, 8 heads, forward, 'auto' on data=8/c x context=c, batch 8/c",
        "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
