"""The JAX backend on real processes: ``run(n)`` starts ``n`` Pythons on 127.0.0.1 joined by
``jax.distributed.initialize`` (8 / n CPU devices each, one data=2 x model=4 mesh over all of them), each making
the same calls; ``run(1)`` is the one-process run they are compared with. Each process prints one JSON line;
``run`` returns them in process order.

What each process does: "auto" on the suite's tiny Llama; the forward on the whole batch (outputs whole, as
every process gets them), on each process's rows (``process_rows``) with ``outputs="process"``; the audit's
collectives; two AdamW steps (``train_step``); the trained weights back in the module (``to_module``).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(n: int, rank: int, port: int) -> None:
    import jax
    jax.config.update("jax_num_cpu_devices", 8 // n)
    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank, initialization_timeout=120)
    import torch
    import torch.nn.functional as F

    import xla_tp
    from xla_tp.backends.jax import AdamW

    from tests.hf_tiny import tiny_llama
    cpu = tiny_llama().eval()
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = cpu(ids, use_cache=False).logits
    jm = xla_tp.parallelize_jax(tiny_llama().eval(), "auto", mesh={"data": 2, "model": 4})
    own = xla_tp.parallelize_jax(tiny_llama().eval(), "auto", mesh={"data": 2, "model": 4}, outputs="process")
    held = jm.process_slice(8)
    mine = ids[held]
    out = {"rank": rank, "processes": jax.process_count(), "devices": len(jax.devices()),
           "local_devices": len(jax.local_devices()),
           "whole": (jm(ids).logits - want).abs().max().item(),
           "from_rows": (jm(jm.process_rows(mine)).logits - want).abs().max().item(),
           "held": [held.start, held.stop], "own_rows": list(own(own.process_rows(mine)).logits.shape),
           "own_error": (own(own.process_rows(mine)).logits - want[held]).abs().max().item()}
    report = jm.audit(ids)
    out["collectives"] = {kind: report.count(kind) for kind in ("all-reduce", "all-gather", "all-to-all")}

    def lm_loss(m, x):
        return F.cross_entropy(m(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    step = jm.train_step(lm_loss, AdamW(lr=1e-2))
    out["losses"] = [float(step(ids)) for _ in range(2)]
    module = jm.to_module()
    out["weights"] = float(sum(p.double().abs().sum() for p in module.parameters()))
    print("JSON" + json.dumps(out), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(n: int, timeout: int = 420) -> list[dict]:
    """Start ``n`` processes (see the module docstring); their JSON lines in process order."""
    port = _free_port()
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    code = "import sys; from tests.jax_processes import _worker; _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(n), str(r), str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"process exit status {p.returncode}:\n{stderr[-3000:]}"
            results.append(json.loads(next(line[4:] for line in stdout.splitlines() if line.startswith("JSON"))))
    finally:
        for p in procs:
            p.kill()
    return results
