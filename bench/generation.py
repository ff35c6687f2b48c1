"""``python -m bench.generation``: ``xla_tp.generate`` beside transformers' ``generate`` on one parallelized model.

One HF Llama (hidden 128, 4 layers, 8 heads and 8 key/value heads, vocabulary 512) under "auto" on
``data=2 x model=4``, two prompts of 16 tokens (one per data shard), greedy. For each number of new tokens: the first call's compiles
and time (cold), then the median time of ``--repeats`` warm calls per generated token, for
``xla_tp.generate`` and, on the same model in the same run, transformers' ``generate`` with its static
cache (``cache_implementation="static"``); both must give the same tokens. Two settings:

- ``eos``: the model's end-of-sequence id (LlamaConfig's 2), as a model has one: transformers then
  reads a flag on the host at every step (its stopping criteria), which runs that step's program;
- ``no eos``: none; transformers reads nothing until the end, so its whole generation is one lazy
  graph, run once (and compiled once per prompt length and number of tokens).

Then the audit of ``xla_tp.generate``'s decode step (collectives per device) and its KV cache's bytes
per device against the total. transformers compiles one to three programs per new token the first
time (its attention mask grows every step), so its cold runs cost minutes: it runs at ``--hf-new``
lengths only (default 16; ``--hf-new 16 64 256`` for all three, much longer). Writes
``bench/results/generation.json`` and prints a markdown table. Example:
``python -m bench.generation --new 16 64 256 --hf-new 16``.
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
os.environ["XLA_DUMP_POST_OPTIMIZATIONS"] = "1"  # its own process: the audit reads torch_xla's partitioned program
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=512, max_position_embeddings=512)
PROMPT = 16
SETTINGS = {"eos": 2, "no eos": None}  # LlamaConfig's end-of-sequence id, or none


def model_and_prompt():
    import torch
    import transformers

    import xla_tp
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).eval()
    model = xla_tp.parallelize_xla(model, "auto", mesh=xla_tp.make_mesh(data=2, model=4))
    return model, torch.randint(3, CONFIG["vocab_size"], (2, PROMPT))


def timed(calls: dict, repeats: int) -> dict:
    """Each call's first run (cold: compiles, seconds), then ``repeats`` warm runs of each, interleaved (the
    machine's load hits both alike): median milliseconds per new token; each ``call`` returns the sequences."""
    from xla_tp.compiles import compiled

    def once(call):
        before, start = compiled(), time.perf_counter()
        sequences = call()
        return time.perf_counter() - start, compiled() - before, sequences
    cold = {name: once(call) for name, call in calls.items()}
    warm = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            warm[name].append(once(call))
    out = {}
    for name, (seconds, compiles, sequences) in cold.items():
        new = sequences.shape[1] - PROMPT
        out[name] = {"new": new, "cold_s": seconds, "cold_compiles": compiles,
                     "warm_compiles": max(w[1] for w in warm[name]), "sequences": sequences,
                     "warm_ms_per_token": 1e3 * statistics.median(w[0] for w in warm[name]) / new}
    return out


def generations(model, prompt, n: int, eos, transformers: bool) -> dict:
    """``xla_tp.generate``'s call (and transformers' static-cache ``generate``'s) making ``n`` tokens."""
    import torch_xla

    from xla_tp.generation import run
    calls = {"xla_tp": lambda: run(model, prompt, n, eos_token_id=[] if eos is None else [eos]).sequences}
    if transformers:
        model.generation_config.eos_token_id = eos
        calls["transformers_static"] = lambda: model.generate(
            prompt.to(torch_xla.device()), max_new_tokens=n, do_sample=False, cache_implementation="static").cpu()
    return calls


def measure(new: list[int], hf_new: list[int], repeats: int) -> dict:
    import torch

    from xla_tp.generation import audit_decode, run
    model, prompt = model_and_prompt()
    rows = []
    for n in new:
        for setting, eos in SETTINGS.items():
            calls = generations(model, prompt, n, eos, n in hf_new)
            row = {"new_tokens": n, "setting": setting, **timed(calls, repeats)}
            if n in hf_new:
                ours, theirs = row["xla_tp"], row["transformers_static"]
                row.update(same_tokens=bool(torch.equal(ours["sequences"], theirs["sequences"])),
                           warm_ratio=ours["warm_ms_per_token"] / theirs["warm_ms_per_token"])
            for side in calls:
                row[side].pop("sequences")
            print(row, flush=True)
            rows.append(row)
    result = run(model, prompt, max(new), eos_token_id=[])
    report = audit_decode(model, prompt, max(new))
    return {"model": "HF Llama, hidden 128, 4 layers, 8 heads, 8 kv heads, vocab 512, fp32", "mesh": "data=2 x model=4",
            "prompt_tokens": PROMPT, "repeats": repeats, "rows": rows,
            "kv_cache": {"cache_length": result.cache_length, "bytes_per_device": result.kv_bytes_per_device,
                         "bytes": result.kv_bytes},
            "decode_step": {"collectives": report.collectives, "layers": CONFIG["num_hidden_layers"],
                            "goal": "all-reduces <= 2 per layer + 2; one all-gather: the [batch] tokens the host reads"},
            "goals": {"first_call_compiles": 6, "warm_ratio": 0.8}}


def table(result: dict) -> str:
    """The rows as a markdown table."""
    lines = ["| new tokens | eos | xla_tp first call: compiles, s | xla_tp warm ms/token | transformers first call: "
             "compiles, s | transformers warm ms/token | warm ratio | same tokens |", "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        ours, theirs = row["xla_tp"], row.get("transformers_static")
        hf = ((f"{theirs['cold_compiles']}, {theirs['cold_s']:.1f}", f"{theirs['warm_ms_per_token']:.1f}",
               f"{row['warm_ratio']:.2f}", str(row["same_tokens"])) if theirs else ("not run",) * 4)
        lines.append(f"| {row['new_tokens']} | {row['setting']} | {ours['cold_compiles']}, {ours['cold_s']:.1f} | "
                     f"{ours['warm_ms_per_token']:.1f} | " + " | ".join(hf) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generation")
    parser.add_argument("--new", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--hf-new", type=int, nargs="*", default=[16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = measure(args.new, args.hf_new, args.repeats)
    result["seconds"] = time.perf_counter() - start
    write_result(args.out, "generation.json", result)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
