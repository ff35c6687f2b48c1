"""``--print-commands``: the command each TPU VM worker of a slice runs.

A multi-host slice runs one process per worker, all with the same command; they find each other
through the TPU runtime, and only process 0 logs, draws progress and writes metrics. The same command
runs on GKE through xpk (``xpk workload create ... --num-slices N``); a multi-slice topology is one
queued resource of N nodes, reached with ``gcloud compute tpus queued-resources ssh --node=...``. Example::

    print("\\n".join(worker_commands("llama3-8b", load_topology("v5p-32"), ["steps=100"])))
    # gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=0 --command='cd ... && ...'
    # ... one line per worker (4 for v5p-32)
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Optional

from .topology import Topology


def launch_command(recipe: str, topology: Topology, overrides: list[str], workdir: str,
                   jax_join: Optional[list[str]] = None) -> str:
    """The shell command one worker runs: ``cd WORKDIR && PJRT_DEVICE=TPU xla-tp launch ...``; with
    ``jax_join`` (the worker's ``--coordinator ... --process-index i`` flags), ``xla-tp launch --backend jax``."""
    args = ["xla-tp", "launch", recipe, "--topology", topology.name, *overrides]
    if jax_join is not None:
        return f"cd {workdir} && " + " ".join(shlex.quote(a) for a in [*args, "--backend", "jax"]) + " " + " ".join(jax_join)
    return f"cd {workdir} && PJRT_DEVICE=TPU " + " ".join(shlex.quote(a) for a in args)


def worker_commands(recipe: str, topology: Topology, overrides: list[str], tpu_name: str = '"$TPU_NAME"',
                    zone: str = '"$ZONE"', workdir: str = "~/xla_tp", jax_coordinator: Optional[str] = None) -> list[str]:
    """A comment header, then one ``gcloud ... ssh --worker=i`` line per TPU VM worker. With
    ``jax_coordinator`` (worker 0's ``HOST:PORT``), the JAX backend's commands: each worker is told the
    coordinator, the process count and its own index (``jax.distributed.initialize``)."""
    ssh = f"gcloud compute tpus tpu-vm ssh {tpu_name} --zone={zone}"
    if jax_coordinator is not None:
        from .hosts import join_arguments
        head = [f"# {topology.name} ({topology.accelerator}): {topology.hosts} host(s) x {topology.chips_per_host} "
                f"chips, JAX backend: start every worker; they join worker 0 at {jax_coordinator} (its internal "
                f"address: --coordinator HOST:PORT), and only process 0 prints progress and writes metrics."]
        return head + [f"{ssh} --worker={i} --command=" + shlex.quote(launch_command(
            recipe, topology, overrides, workdir, join_arguments(jax_coordinator, topology.hosts, i)))
            for i in range(topology.hosts)]
    inner = shlex.quote(launch_command(recipe, topology, overrides, workdir))
    xpk = (f"# GKE (xpk): xpk workload create --cluster \"$CLUSTER\" --workload xla-tp-{_label(recipe)} "
           f"--tpu-type={topology.accelerator} --num-slices={topology.slices} --docker-image \"$IMAGE\" "
           f"--command={inner}")
    if topology.slices > 1:
        queued = f"gcloud compute tpus queued-resources ssh {tpu_name} --zone={zone}"
        head = [f"# {topology.name} ({topology.slices} x {topology.accelerator}): {topology.slices} slices x "
                f"{topology.hosts // topology.slices} TPU VM worker(s) x {topology.chips_per_host} chips = "
                f"{topology.chips} chips, the data axis over DCN. A multislice queued resource ({tpu_name}, "
                f"--node-count={topology.slices}): start every worker of every slice; only process 0 prints.",
                f"# All at once: {queued} --node=all --worker=all --command={inner}", xpk]
        return head + [f"{queued} --node={n} --worker=all --command={inner}" for n in range(topology.slices)]
    head = [f"# {topology.name} ({topology.accelerator}): {topology.hosts} TPU VM worker(s) x "
            f"{topology.chips_per_host} chips = {topology.chips} chips. Start every worker: they wait for each "
            f"other, and only process 0 prints progress and writes metrics.",
            f"# All at once: {ssh} --worker=all --command={inner}", xpk]
    return head + [f"{ssh} --worker={i} --command={inner}" for i in range(topology.hosts)]


def _label(recipe: str) -> str:
    """A workload name from a recipe name or path: lower-case letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", Path(recipe).stem.lower()).strip("-")[:30] or "run"
