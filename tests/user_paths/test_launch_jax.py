"""``xla-tp launch --backend jax [--hosts N]`` as users run it: the tiny recipe on JAX in one process and in two
joined local processes (the same losses), a failing process failing the launch, Ctrl-C, the pod's commands, and
the flags the JAX path refuses."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xla_tp import cli
from xla_tp.launch.hosts import free_port, run_local_hosts

from ..fresh import user_env
from .test_launch_run import _records, interrupted

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "xla_tp.cli", "launch"]
TINY = ["tiny-llama-cpu", "--backend", "jax", "--no-audit", "steps=3", "log_interval=1"]


def _launch(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *args], cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.complete
def test_two_joined_processes_train_as_one(tmp_path):
    """--hosts 2: two processes of 4 CPU devices joined into one data=2 x model=4 mesh give the one-process
    losses, and so do the pod commands' flags run by hand, and the torch_xla launcher; only process 0 prints and
    writes metrics."""
    one = _launch([*TINY, "--run-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two = _launch([*TINY, "--hosts", "2", "--run-dir", str(tmp_path / "two")])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "8 cpu devices, 1 process(es)" in one.stdout and "8 cpu devices, 2 process(es)" in two.stdout
    assert "starting 2 processes x 4 CPU devices" in two.stdout and "memory per chip (estimate)" in two.stdout
    runs = [[r for r in _records(tmp_path / name / "metrics.jsonl") if "loss" in r] for name in ("one", "two")]
    assert [r["step"] for r in runs[1]] == [1, 2, 3]
    assert [r["loss"] for r in runs[1]] == pytest.approx([r["loss"] for r in runs[0]], abs=1e-4)
    # what --print-commands gives a pod's hosts, run by hand as two local processes (each does the checks)
    port = free_port()
    hosts = [subprocess.Popen([*LAUNCH, *TINY, "--run-dir", str(tmp_path / "pod"), "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", "2", "--process-index", str(i)], cwd=ROOT,
                              env={**user_env(), "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        ran = [p.communicate(timeout=600) for p in hosts]
    finally:
        for p in hosts:
            p.kill()
    assert [p.returncode for p in hosts] == [0, 0], ran[0][1][-2000:] + ran[1][1][-2000:]
    assert "8 cpu devices, 2 process(es)" in ran[0][0] and ran[1][0] == ""
    pod = [r["loss"] for r in _records(tmp_path / "pod" / "metrics.jsonl") if "loss" in r]
    assert pod == pytest.approx([r["loss"] for r in runs[0]], abs=1e-4)
    # the torch_xla launcher: the same model, batches and optimizer arithmetic (measured: within 1e-6)
    xla = _launch(["tiny-llama-cpu", "--no-audit", "--no-compile-cache", "steps=3", "log_interval=1", "--run-dir",
                   str(tmp_path / "xla")])
    assert xla.returncode == 0, xla.stdout[-3000:] + xla.stderr[-3000:]
    xla_losses = [r["loss"] for r in _records(tmp_path / "xla" / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in runs[0]] == pytest.approx(xla_losses, abs=1e-4)
    assert runs[0][0]["loss"] > 5.0 and runs[0][2]["loss"] < runs[0][0]["loss"] - 0.2   # ln(256) = 5.55 at first
    assert runs[1][2]["compiles"] == runs[1][1]["compiles"], "the step recompiled"
    assert _records(tmp_path / "two" / "metrics.jsonl")[-1] == {"event": "done", "step": 3}
    assert two.stdout.count("step 2/3  loss") == 1 and "Traceback" not in two.stderr   # process 0 only
    assert "backend: jax" in (tmp_path / "two" / "recipe.yaml").read_text()


@pytest.mark.complete
def test_ctrl_c_stops_every_process_after_the_same_step(tmp_path):
    status, out, err = interrupted([*TINY, "--hosts", "2", "steps=100000"], tmp_path, 2)
    assert status == 130, out[-3000:] + err[-3000:]
    assert _records(tmp_path / "metrics.jsonl")[-1]["event"] == "stopped"
    assert "stopped after step" in out and "exited with status" not in err


def _kill_process_one(launcher: subprocess.Popen) -> None:
    """SIGKILL the launcher's child started with ``--process-index 1``."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[argv.index(b"--process-index") + 1] == b"1":
            os.kill(int(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no process 1 among {children}")


@pytest.mark.complete
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the child through /proc (Linux)")
def test_a_process_killed_mid_run_fails_the_launch(tmp_path):
    """Process 1 killed during training: process 0 (waiting in the next step's collectives) is stopped, the
    launch exits with status 1 and says which process failed."""
    start = time.time()
    status, out, err = interrupted([*TINY, "--hosts", "2", "steps=100000"], tmp_path, 2, _kill_process_one)
    assert status == 1, out[-3000:] + err[-3000:]
    assert "xla-tp launch: process 1 of 2 exited with status -9; the other processes were stopped" in err
    assert time.time() - start < 400


def test_a_failing_process_fails_the_launch_and_stops_the_others(capsys):
    """Process 1 fails at once; process 0 (which would wait ten minutes) is stopped; status 1, and which failed."""
    start = time.time()
    wait_or_fail = ("import sys, time; index = int(sys.argv[sys.argv.index('--process-index') + 1]); "
                    "time.sleep(600) if index == 0 else sys.exit(3)")
    status = run_local_hosts([], hosts=2, chips=8, launcher=[sys.executable, "-c", wait_or_fail])
    assert status == 1 and time.time() - start < 60
    assert ("xla-tp launch: process 1 of 2 exited with status 3; the other processes were stopped"
            in capsys.readouterr().err)


@pytest.mark.parametrize("args, message", [
    (["--hosts", "2"], "--hosts needs --backend jax"),
    (["--backend", "jax", "--check"], "--check is not supported with --backend jax yet"),
    (["--backend", "jax", "--resume"], "--resume is not supported with --backend jax yet"),
    (["--backend", "jax", "--compile-cache", "/tmp/c"], "--compile-cache is not supported with --backend jax"),
    (["--backend", "jax", "--hosts", "3"], "--hosts 3: the 8 devices of cpu-8 must divide"),
    (["--backend", "jax", "--hosts", "2", "--topology", "v5e-8", "--print-commands"], "--hosts emulates hosts"),
    (["--backend", "jax", "--coordinator", "10.0.0.2:8476"], "--coordinator needs --num-processes"),
    (["--backend", "jax", "checkpoint.dir=ck", "checkpoint.interval=5"], "checkpoint.interval: --backend jax"),
    (["--backend", "jax", "optimizer.name=sgd"], "optimizer.name=sgd: --backend jax trains with adamw or adam"),
])
def test_what_the_jax_path_refuses_is_one_line_and_status_2(capsys, args, message):
    assert cli.main(["launch", "tiny-llama-cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xla-tp launch: ") and message in err and err.count("\n") == 1, err


def test_the_fit_check_of_a_local_pod_names_its_processes(capsys):
    """``--hosts 2 --dry-run``: the header counts the processes the run would start, not torch_xla's one."""
    assert cli.main(["launch", "tiny-llama-cpu", "--backend", "jax", "--hosts", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "process 0 of 2" in out.splitlines()[0] and "dry run: the model stayed on meta" in out


def test_print_commands_for_a_jax_pod(capsys):
    """Each host is told the coordinator, the process count and its own index."""
    assert cli.main(["launch", "tiny-llama-cpu", "--topology", "v5e-16", "--backend", "jax", "--print-commands",
                     "--coordinator", "10.0.0.2:8476", "--tpu-name", "pod", "--zone", "z", "steps=5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("# v5e-16 (") and "JAX backend" in lines[0] and "10.0.0.2:8476" in lines[0]
    hosts = [line for line in lines if not line.startswith("#")]
    assert hosts == [f"gcloud compute tpus tpu-vm ssh pod --zone=z --worker={i} --command='cd ~/xla_tp && xla-tp "
                     f"launch tiny-llama-cpu --topology v5e-16 steps=5 --backend jax --coordinator 10.0.0.2:8476 "
                     f"--num-processes 4 --process-index {i}'" for i in range(4)]


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_processes_end_when_the_launcher_is_killed(tmp_path):
    """SIGKILL of the parent (no chance to stop them): its processes end too, not left training."""
    sleeper = "import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close(); time.sleep(600)"
    code = ("import sys; from xla_tp.launch.hosts import free_port, run_local_hosts; "
            f"run_local_hosts([{str(tmp_path)!r}], 2, 8, launcher=[sys.executable, '-c', {sleeper!r}])")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=user_env())
    try:
        deadline = time.time() + 60
        while len(list(tmp_path.iterdir())) < 2:
            assert time.time() < deadline and parent.poll() is None
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()
    pids = [int(p.name) for p in tmp_path.iterdir()]
    deadline = time.time() + 20
    while any(_running(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _running(pid)]
