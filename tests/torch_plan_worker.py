"""``xla_tp.torch_plan`` under torch's own ``parallelize_module``: 4 gloo processes on 127.0.0.1, CPU DTensors.

``main()`` spawns them; each builds the same tiny models (a dense Llama, a grouped-query Qwen3 whose key/value heads
4 devices do not divide, BERT, Mixtral), parallelizes a copy with ``parallelize_module(model, mesh, torch_plan(model,
mesh))`` (BERT: ``xla_tp.parallelize_dtensor(model, "auto")``, which does that on its own mesh) and compares its
output with the unsharded model's. Prints one JSON line (rank 0's), per model: the largest
difference, the modules torch's styles split, those whose parameters became DTensors, and those left whole.
"""
from __future__ import annotations

import copy
import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def models() -> dict:
    import transformers as T
    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**small, num_attention_heads=8, num_key_value_heads=4)),
        "qwen3_gqa": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**small, num_attention_heads=8, num_key_value_heads=2,
                                                             head_dim=16)),
        "bert": lambda: T.BertModel(T.BertConfig(**{**small, "vocab_size": 64}, num_attention_heads=8),
                                    add_pooling_layer=False),
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**{**small, "intermediate_size": 32},
                                                                num_attention_heads=4, num_key_value_heads=4,
                                                                num_local_experts=8, num_experts_per_tok=2)),
    }


def _worker(rank: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import xla_tp
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for name, make in models().items():
        torch.manual_seed(0)
        reference = make().eval()
        model = copy.deepcopy(reference)
        ids = torch.randint(4, 60, (2, 16), generator=torch.Generator().manual_seed(1))
        plan = xla_tp.torch_plan(model, mesh)
        if name == "bert":  # xla_tp's own entry point: the mesh of every process, "auto" in torch's styles
            xla_tp.parallelize_dtensor(model, "auto")
        else:
            parallelize_module(model, mesh, dict(plan))
        with torch.no_grad():
            got, want = model(input_ids=ids), reference(input_ids=ids)
        key = "logits" if getattr(want, "logits", None) is not None else "last_hidden_state"
        got = getattr(got, key)
        got = got.full_tensor() if isinstance(got, DTensor) else got
        split = sorted(fqn for fqn, m in model.named_modules()
                       if any(isinstance(p, DTensor) for p in m.parameters(recurse=False)))
        out[name] = {"error": (got - getattr(want, key)).abs().max().item(), "styled": sorted(plan),
                     "split": split, "whole": sorted(plan.whole)}
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(port, queue), nprocs=WORLD, start_method="spawn")
    print("JSON" + json.dumps(queue.get(timeout=60)))


if __name__ == "__main__":
    main()
