"""``python -m bench.optimizers``: torchao's bf16 stochastic-rounding AdamW vs ``torch.optim.AdamW``.

Same bf16 tiny Llama under "auto" on an fsdp=2 x model=4 mesh, same batch, both measured in one run:
the host time of ``optimizer.step()`` (tracing: what XLA re-does every step) and of the whole step
(forward, backward, step, ``torch_xla.sync``), medians over steps after warm-up, and the number of
programs compiled per step once warm (1 is one program per step). Goal: SR AdamW / AdamW <= 1.10.
Writes ``bench/results/optimizers.json``. Example: ``python -m bench.optimizers --steps 10``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from . import write_result

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def measure(make_optimizer, steps: int, warmup: int = 3) -> dict:
    import torch
    import torch.nn.functional as F
    import torch_xla

    import xla_tp
    from xla_tp.compiles import compiled
    from xla_tp.zoo.registry import VOCAB, build, run

    torch.manual_seed(0)
    model = build("llama", width="small").train().to(torch.bfloat16)
    xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(fsdp=2, model=4))
    opt = make_optimizer(model.parameters())
    tokens = torch.randint(0, VOCAB, (8, 32), device=torch_xla.device())
    step_host, whole, compiles = [], [], []
    for i in range(warmup + steps):
        before_compiles, start = compiled(), time.perf_counter()
        logits = run(model, tokens)
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        before = time.perf_counter()
        opt.step()
        after = time.perf_counter()
        opt.zero_grad()
        torch_xla.sync(wait=True)
        if i >= warmup:
            step_host.append(after - before)
            whole.append(time.perf_counter() - start)
            compiles.append(compiled() - before_compiles)
    return {"optimizer_step_host_s": statistics.median(step_host), "whole_step_s": statistics.median(whole),
            "compiles_per_step_warm": max(compiles)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.optimizers")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    import torch
    import torchao.optim

    rows = {"torch.optim.AdamW": measure(lambda p: torch.optim.AdamW(p, lr=1e-3), args.steps),
            "torchao _AdamW(bf16_stochastic_round=True)": measure(
                lambda p: torchao.optim._AdamW(p, lr=1e-3, bf16_stochastic_round=True), args.steps)}
    base, sr = rows.values()
    result = {"mesh": "fsdp=2 x model=4", "model": "llama small, bf16", "rows": rows,
              "ratio_optimizer_step_host": sr["optimizer_step_host_s"] / base["optimizer_step_host_s"],
              "ratio_whole_step": sr["whole_step_s"] / base["whole_step_s"], "goal": 1.10}
    write_result(args.out, "optimizers.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
