"""Hosts of a pod stood in for by local processes: ``start(n, task, *args)`` runs ``n`` Pythons on 127.0.0.1
(``PJRT_DEVICE=CPU``, ``8 // n`` devices each, or ``devices``), joined by ``xla_tp.processes.init_group`` into
one gloo group (``tcp://127.0.0.1:PORT``, a free port); ``finish`` waits for them (bounded) and returns each one's JSON line.
torch_xla's CPU client cannot span processes, so each process is its own XLA world holding every shard; what
is tested is what the processes agree on: one shared directory, one commit, each row read once.

Tasks (``python -m tests.pod_processes TASK RANK WORLD PORT ARGS...``):
- ``save ROOT STEPS [DIE_STEP DIE_RANK]``: two Linears, column- then row-parallel on fsdp x model=2, one AdamW
  step, then ``save_checkpoint`` at steps 1..STEPS (the last one ``async_save=True``, a forward run meanwhile);
  at ``DIE_STEP`` process ``DIE_RANK`` kills itself (SIGKILL) while writing its files; when all saves succeed,
  every process loads the newest into a model built with another seed. Process 0 also writes the weights to
  ``ROOT/../expected.pt``.
- ``load ROOT``: loads the newest checkpoint into a model built with another seed on ``model=8``.
- ``rows``: the rows of batch 3 (8 rows, data=4 x model=2) this process reads (``host_rows`` of its
  ``local_devices``), and whether what it read equals those rows of the whole batch; then a loop of 6 steps
  where only the last process is asked to stop (its ``StopFlag`` set at step 3): the step each one stops after.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from xla_tp.launch.hosts import free_port

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240


def start(n: int, task: str, *args: str, devices: int = 0) -> list[subprocess.Popen]:
    port = str(free_port())
    env = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices or 8 // n), XLA_FLAGS="--xla_backend_optimization_level=0")
    return [subprocess.Popen([sys.executable, "-m", "tests.pod_processes", task, str(rank), str(n), port, *args],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(n)]


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, dict]]:
    """``(exit status, JSON line or {})`` per process, in rank order; all killed after ``TIMEOUT`` seconds."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            lines = [line[4:] for line in stdout.splitlines() if line.startswith("JSON")]
            out.append((p.returncode, json.loads(lines[-1]) if lines else {"stderr": stderr[-3000:]}))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _model(seed: int):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"0": ColwiseParallel(), "1": RowwiseParallel()}


def _save(root: str, steps: int, die: int, die_rank: int) -> dict:
    import torch

    import xla_tp
    from xla_tp import processes
    from xla_tp.checkpoint import save
    import torch_xla.runtime as xr
    mesh = xla_tp.make_mesh(fsdp=xr.global_runtime_device_count() // 2, model=2)
    model = xla_tp.parallelize_xla(_model(0), _plan(), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(4, 16, device=next(model.parameters()).device)).sum().backward()
    opt.step()
    if processes.is_reporter():
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, os.path.join(root, "..", "expected.pt"))
    out: dict = {"saved": [], "error": None}
    for step in range(1, steps + 1):
        if step == die and processes.index() == die_rank:
            save.RecordingWriter.write_data = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        try:
            if step < steps:
                out["saved"].append(xla_tp.save_checkpoint(root, model, opt, step=step, keep=5))
            else:                                  # the last one in the background, as a loop would
                handle = xla_tp.save_checkpoint(root, model, opt, step=step, keep=5, async_save=True)
                model(torch.ones(4, 16, device=next(model.parameters()).device)).sum().item()
                out["saved"].append(handle.result(timeout=200))
        except xla_tp.CheckpointError as error:
            out["error"] = str(error)
            return out
    fresh = xla_tp.parallelize_xla(_model(1), _plan(), mesh=mesh)
    out["loaded"] = xla_tp.load_checkpoint(root, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    expected = torch.load(os.path.join(root, "..", "expected.pt"))
    out["load_error"] = max((v.cpu() - expected[k]).abs().max().item() for k, v in fresh.state_dict().items())
    return out


def _load(root: str) -> dict:
    import torch

    import xla_tp
    model = xla_tp.parallelize_xla(_model(1), _plan(), mesh=xla_tp.make_mesh(model=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = xla_tp.load_checkpoint(root, model, opt)
    expected = torch.load(os.path.join(root, "..", "expected.pt"))
    return {"step": step, "error": max((v.cpu() - expected[k]).abs().max().item()
                                       for k, v in model.state_dict().items()),
            "optimizer_steps": sorted({int(s["step"]) for s in opt.state_dict()["state"].values()})}


def _rows() -> dict:
    import torch

    from xla_tp import processes
    from xla_tp.launch.data import Batches, host_rows
    from xla_tp.launch.recipe import DataSpec
    from xla_tp.launch.train import StopFlag
    mine = host_rows(8, {"data": 4, "model": 2}, processes.local_devices(8))
    batches = Batches(DataSpec("text", "data/tiny_corpus.txt"), vocab=257, batch=8, seq_len=16, seed=0,
                      task="masked-lm")
    read, whole = batches.get(3, mine.rows), batches.get(3)
    flag, stopped = StopFlag(), None
    for step in range(1, 7):
        flag.stop = flag.stop or (step == 3 and processes.index() == processes.count() - 1)
        if flag.agreed():
            stopped = step
            break
    return {"index": processes.index(), "count": processes.count(), "rows": mine.rows, "stopped": stopped,
            "equal": all(torch.equal(r, w[mine.rows]) for r, w in zip(read, whole))}


def main(task: str, rank: int, world: int, port: int, *args: str) -> None:
    from xla_tp import processes
    if world > 1:
        assert processes.init_group(f"tcp://127.0.0.1:{port}?rank={rank}&world_size={world}")
    if task == "save":
        out = _save(args[0], int(args[1]), *(map(int, args[2:4]) if len(args) > 2 else (0, 0)))
    elif task == "load":
        out = _load(args[0])
    else:
        out = _rows()
    print("JSON" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
