"""``--hosts N`` with ``--backend jax``: the run as N local processes joined into one JAX mesh (a pod, emulated
on one machine's CPU), and what each host of a real pod runs.

``run_local_hosts`` starts N copies of the launcher (``xla-tp launch ... --coordinator 127.0.0.1:PORT
--num-processes N --process-index i``), each with ``chips / N`` CPU devices (``JAX_PLATFORMS=cpu``,
``--xla_force_host_platform_device_count``); they join through ``jax.distributed.initialize`` and train as one
mesh, and only process 0 prints and writes metrics. The parent waits for them, forwards Ctrl-C/SIGTERM (they
stop after the same step, status 130), and when one fails stops the others and says which failed (status 1).
``join`` is what each of those processes (or each host of a pod) does first. Example::

    status = run_local_hosts(["tiny-llama-cpu", "steps=5", "--backend", "jax"], hosts=2, chips=8)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

JOIN_TIMEOUT = 120      # seconds for every process to reach the coordinator
FAILED = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_arguments(coordinator: str, processes: int, index: int) -> list[str]:
    """The launcher flags that make a process ``index`` of ``processes`` joined at ``coordinator``."""
    return ["--coordinator", coordinator, "--num-processes", str(processes), "--process-index", str(index)]


def join(coordinator: str, processes: int, index: int) -> None:
    """``jax.distributed.initialize`` for process ``index`` of ``processes`` (before anything uses jax)."""
    import jax
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=index,
                               initialization_timeout=JOIN_TIMEOUT)


def child_env(devices: int) -> dict[str, str]:
    """This process's environment for a CPU process of ``devices`` JAX devices."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])}


def _end_with_parent() -> None:
    """In a child, before it runs: on Linux, SIGTERM when the parent ends, even killed (``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


LAUNCHER = [sys.executable, "-m", "xla_tp.cli", "launch"]


def run_local_hosts(argv: list[str], hosts: int, chips: int, poll: float = 0.2,
                    launcher: Optional[list[str]] = None) -> int:
    """Run ``xla-tp launch *argv`` (``launcher``: another command, for tests) as ``hosts`` joined local
    processes; the exit status (0, 130, or 1 with a line on stderr when a process failed)."""
    port = free_port()
    env = child_env(chips // hosts)
    procs = [subprocess.Popen([*(launcher or LAUNCHER), *argv, *join_arguments(f"127.0.0.1:{port}", hosts, i)],
                              env=env, start_new_session=True,     # Ctrl-C reaches them through the parent only
                              preexec_fn=_end_with_parent)
             for i in range(hosts)]
    forwarded: dict[int, object] = {}

    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    for sig in (signal.SIGINT, signal.SIGTERM):
        forwarded[sig] = signal.signal(sig, forward)
    failed: Optional[tuple[int, int]] = None
    try:
        while failed is None and None in [p.poll() for p in procs]:      # every process polled each time
            failed = next(((i, p.returncode) for i, p in enumerate(procs)
                           if p.returncode not in (None, 0, 130)), None)
            time.sleep(poll)
        failed = failed or next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (0, 130)), None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, old in forwarded.items():
            signal.signal(sig, old)
    if failed is not None:
        print(f"xla-tp launch: process {failed[0]} of {hosts} exited with status {failed[1]}; the other "
              f"processes were stopped", file=sys.stderr, flush=True)
        return FAILED
    return 130 if any(p.returncode == 130 for p in procs) else 0
