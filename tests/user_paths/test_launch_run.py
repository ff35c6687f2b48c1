"""``xla-tp launch`` as users run it: training on cpu-8, Ctrl-C, per-worker commands, process 0 only."""
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from xla_tp import cli
from xla_tp.checkpoint.store import CheckpointRoot
from xla_tp.launch import LaunchError, load_recipe, load_topology
from xla_tp.launch.checkpoints import Checkpoints
from xla_tp.launch.commands import worker_commands
from xla_tp.launch.data import IGNORE, Batches
from xla_tp.launch.progress import Reporter
from xla_tp.launch.recipe import DataSpec
from xla_tp.launch.rerun import EarlierRun, rewind_metrics
from xla_tp.launch.session import Session

from ..compile_counts import COUNTERS, last_counters, parse_summary
from ..fresh import user_env

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "xla_tp.cli", "launch"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def interrupted(args: list[str], run_dir: Path, logged: int,
                interrupt: Callable[[subprocess.Popen], None] = lambda p: p.send_signal(signal.SIGINT)
                ) -> tuple[int, str, str]:
    """``xla-tp launch *args --run-dir run_dir`` in a fresh process, sent Ctrl-C (or ``interrupt(process)``) once
    ``logged`` losses are in its metrics; (exit status, stdout, stderr)."""
    proc = subprocess.Popen([*LAUNCH, *args, "--run-dir", str(run_dir)],
                            cwd=ROOT, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 420
        while len([r for r in _records(run_dir / "metrics.jsonl") if "loss" in r]) < logged:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.5)
        interrupt(proc)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_tiny_recipe_trains_logs_jsonl_and_stops_cleanly_on_ctrl_c(tmp_path):
    """The default recipe on cpu-8: the loss falls, metrics land in JSONL, Ctrl-C ends it with status 130."""
    status, out, err = interrupted(["tiny-llama-cpu", "steps=100000", "log_interval=3",
                                    "model.overrides.num_hidden_layers=2"], tmp_path, 5)
    assert status == 130, out[-3000:] + err[-3000:]
    records = _records(tmp_path / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps[:5]] == [1, 3, 6, 9, 12]
    losses = [r["loss"] for r in steps[:5]]
    assert losses[0] > 5.0 and losses[4] < losses[0] - 1.0, losses   # ln(256) = 5.55 at the start
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in steps)   # no peak FLOP/s on CPU
    # the steps' own programs (the first step's; the second's, with the optimizer's state), not the audit's
    assert steps[0]["compiles"] == 1 and steps[1]["compiles"] == steps[4]["compiles"] == 2, steps
    assert records[-1]["event"] == "stopped" and records[-1]["step"] >= 12
    assert (tmp_path / "recipe.yaml").exists()
    assert "memory per chip (estimate)" in out and "plan summary (auto" in out
    assert "communication bytes/device" in out                          # the compiled audit ran
    assert "step      3/100000  loss" in out and "(includes compiling the step)" in out
    assert "stopped after step" in out and "Traceback" not in err


def test_check_against_the_cpu_model_on_four_devices(tmp_path):
    """--check: one step of the sharded model against the unsharded CPU model (4 devices: own process)."""
    run = subprocess.run([*LAUNCH, "tiny-llama-cpu", "--topology", "cpu-4", "--check", "--no-audit", "--run-dir",
                          str(tmp_path), "mesh={data: 2, model: 2}", "steps=0", "check_tolerance=1e-5"],
                         cwd=ROOT, env=user_env(4), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "cpu-4 (4 chips, 1 host(s)), mesh data=2,model=2" in run.stdout
    assert "check: OK" in run.stdout and "max |grads - CPU|" in run.stdout
    assert _records(tmp_path / "metrics.jsonl") == [{"event": "done", "step": 0}]


def test_print_commands_for_a_four_host_slice(capsys):
    status = cli.main(["launch", "llama3-8b", "--topology", "v5p-32", "--print-commands", "--tpu-name", "my-tpu",
                       "--zone", "us-east5-a", "checkpoint.interval=0", "optimizer.lr=1e-4"])
    assert status == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("# v5p-32 (v5p-32): 4 TPU VM worker(s) x 4 chips = 16 chips")
    workers = [line for line in lines if not line.startswith("#")]
    inner = ("'cd ~/xla_tp && PJRT_DEVICE=TPU xla-tp launch llama3-8b --topology v5p-32 checkpoint.interval=0 "
             "optimizer.lr=1e-4'")
    assert workers == [f"gcloud compute tpus tpu-vm ssh my-tpu --zone=us-east5-a --worker={i} --command={inner}"
                       for i in range(4)]
    assert f"--worker=all --command={inner}" in lines[1]


def test_bad_launch_input_is_one_line_and_status_2(capsys):
    assert cli.main(["launch", "tiny-llama-cpu", "--topology", "v5p-65"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xla-tp launch: unknown topology 'v5p-65'") and err.count("\n") == 1
    assert cli.main(["launch", "tiny-llama-cpu", "--nope"]) == 2
    assert "unrecognised argument(s) --nope" in capsys.readouterr().err


def test_print_commands_quotes_what_the_shell_would_split():
    lines = worker_commands("r.yaml", load_topology("v6e-16"), ["plan=my plan.yaml"])
    assert lines[-1].endswith("""--command='cd ~/xla_tp && PJRT_DEVICE=TPU xla-tp launch r.yaml --topology v6e-16 '"'"'plan=my plan.yaml'"'"''""")
    assert len([line for line in lines if "--worker=" in line and "all" not in line]) == 4


def test_only_process_zero_speaks(tmp_path, capsys):
    """On a multi-host slice every worker runs the launcher: the others print and write nothing."""
    recipe = load_recipe("tiny-llama-cpu")
    for index, run_dir in ((1, tmp_path / "p1"), (0, tmp_path / "p0")):
        session = Session(recipe, load_topology("cpu-8"), {"data": 2, "model": 4}, process_index=index)
        assert session.plan_and_fit()          # a dry run's steps
        reporter = Reporter(run_dir, process_index=index, stream=sys.stdout)
        reporter.start(10)
        reporter.step(1, {"step": 1, "steps": 10, "loss": 5.5, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None,
                          "compiles": 3})
        reporter.close()
        out = capsys.readouterr().out
        if index:
            assert out == "" and not run_dir.exists()
        else:
            assert "memory per chip" in out and "step  1/10  loss 5.5000" in out
            assert _records(run_dir / "metrics.jsonl")[0]["loss"] == 5.5


def test_reporter_draws_a_bar_only_on_a_terminal(tmp_path):
    stream = io.StringIO()
    reporter = Reporter(tmp_path, stream=stream, tty=True)
    reporter.start(4)
    for step in (1, 2):
        reporter.step(step, {"step": step, "steps": 4, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 1e3,
                             "mfu": 0.41, "compiles": 4} if step == 2 else None)
    reporter.close()
    assert "2/4" in stream.getvalue() and "MFU 41.0%" in stream.getvalue()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


SMALL = ["model.overrides.num_hidden_layers=1", "seq_len=32"]  # runs about checkpoints: the smallest model will do


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *args], cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=600)


def test_kill_9_rerun_refused_resume_past_a_damaged_checkpoint_then_overwrite(tmp_path, capsys):
    """A run checkpointing every 3 steps is killed with SIGKILL part-way. Launched again without a flag: refused
    in one line, every file as it was (run in this process: the refusal comes before the XLA runtime starts).
    The newest checkpoint truncated: --resume says it skipped it and why, and continues from the one before
    with the same batches, optimizer state and learning rate (the repeated steps have the first run's
    losses); metrics.jsonl holds each step once, the later ones after one resume record. --overwrite then
    starts over (in this process too), the earlier checkpoints and metrics moved aside intact."""
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    common = ["tiny-llama-cpu", "--no-audit", "log_interval=1", f"checkpoint.dir={ckpt}", "checkpoint.interval=3",
              *SMALL, "--run-dir", str(run_dir)]
    proc = subprocess.Popen([*LAUNCH, *common, "steps=100000"], cwd=ROOT, env=user_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 420
        while max([r["step"] for r in _records(metrics) if "loss" in r], default=0) < 8:
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
    finally:
        proc.kill()                                # SIGKILL: no handler runs
        proc.wait()
    saved = CheckpointRoot(str(ckpt)).steps()
    newest, previous = saved[-1], saved[-2]
    assert saved[:2] == [3, 6] and newest - previous == 3, saved
    first = {r["step"]: r["loss"] for r in _records(metrics) if "loss" in r}

    before = _files(tmp_path)
    capsys.readouterr()
    assert cli.main(["launch", *common, f"steps={newest + 3}"]) == 2
    again = capsys.readouterr().err
    assert again.count("\n") == 1, again[-3000:]
    assert f"already holds the checkpoints of an earlier run (steps {', '.join(map(str, saved))})" in again
    assert "pass --resume" in again and "--overwrite" in again
    assert _files(tmp_path) == before

    shard = ckpt / f"step_{newest:08d}" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    resumed = _launch(*common, f"steps={newest + 3}", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"--resume: skipped {ckpt / f'step_{newest:08d}'}" in resumed.stdout and "truncated" in resumed.stdout
    assert f"resumed from step {previous}" in resumed.stdout and "Traceback" not in resumed.stderr
    records = _records(metrics)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, newest + 4))
    marks = [r for r in records if r.get("event") == "resume"]
    assert len(marks) == 1 and marks[0]["step"] == previous and marks[0]["from"].endswith(f"step_{previous:08d}")
    at = records.index(marks[0])
    assert all(r["step"] <= previous for r in records[:at]) and all(r["step"] > previous for r in records[at + 1:])
    assert records[-1] == {"event": "done", "step": newest + 3}
    again = {r["step"]: r["loss"] for r in records[at + 1:] if "loss" in r and r["step"] in first}
    assert sorted(again) == [s for s in sorted(first) if s > previous] and len(again) >= 2, (again, first)
    assert all(abs(again[s] - first[s]) < 1e-5 for s in again), (again, first)

    before, kept = _files(ckpt), CheckpointRoot(str(ckpt)).steps()
    assert kept[-2:] == [newest, newest + 3]                     # the damaged step was written again
    capsys.readouterr()
    assert cli.main(["launch", *common, "steps=0", "--overwrite"]) == 0
    third = capsys.readouterr().out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.replaced-")]
    assert len(aside) == 1 and _files(aside[0]) == before and not ckpt.exists()
    assert f"moved the earlier run's checkpoints (steps {', '.join(map(str, kept))}) to {str(aside[0])!r}" in third
    assert len([p for p in run_dir.iterdir() if p.name.startswith("metrics.jsonl.replaced-")]) == 1
    assert _records(metrics) == [{"event": "done", "step": 0}]


def test_rewinding_metrics_drops_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)] + [json.dumps({"event": "checkpoint", "step": 3})]
    path.write_text("\n".join(lines) + '\n{"step": 5, "lo')          # the last line cut by a kill
    assert rewind_metrics(path, 3, "ckpt/step_00000003") == 2
    assert _records(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}, {"step": 3, "loss": 1.0},
                              {"event": "checkpoint", "step": 3},
                              {"event": "resume", "step": 3, "from": "ckpt/step_00000003", "dropped": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert rewind_metrics(tmp_path / "new" / "metrics.jsonl", 6, "ckpt/step_00000006") == 0  # resumed into a new --run-dir
    assert _records(tmp_path / "new" / "metrics.jsonl") == [{"event": "resume", "step": 6, "from": "ckpt/step_00000006",
                                                             "dropped": 0}]


def test_an_earlier_runs_metrics_alone_also_need_a_flag(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    earlier = EarlierRun(None, tmp_path)
    with pytest.raises(LaunchError, match="already holds the metrics.jsonl of an earlier run: pass --resume"):
        earlier.check(resume=False, overwrite=False)
    with pytest.raises(LaunchError, match="pass one of them"):
        earlier.check(resume=True, overwrite=True)
    earlier.check(resume=True, overwrite=False)
    moved = earlier.move_aside()
    assert len(moved) == 1 and not (tmp_path / "metrics.jsonl").exists()
    assert [p.name.startswith("metrics.jsonl.replaced-") for p in tmp_path.iterdir()] == [True]
    EarlierRun(None, tmp_path).check(resume=False, overwrite=False)


def test_resume_needs_a_checkpoint_directory_that_holds_one(tmp_path):
    with pytest.raises(LaunchError, match="--resume needs checkpoint.dir"):
        Checkpoints(load_recipe("tiny-llama-cpu"), resume=True)
    recipe = load_recipe("tiny-llama-cpu")
    recipe.checkpoint.dir = str(tmp_path / "none")
    with pytest.raises(LaunchError, match="holds no checkpoint"):
        Checkpoints(recipe, resume=True).resume(None, None, None)


def test_byte_batches_are_shifted_and_deterministic():
    batches = Batches(DataSpec("text", "data/tiny_corpus.txt"), vocab=256, batch=4, seq_len=32, seed=0,
                      task="causal-lm")
    x, y = batches.get(5)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])                 # targets are the next bytes
    assert torch.equal(batches.get(5)[0], x) and not torch.equal(batches.get(6)[0], x)
    text = (ROOT / "data" / "tiny_corpus.txt").read_bytes()
    assert bytes(x[0].tolist()) in text


def test_masked_batches_hide_and_score_only_masked_tokens():
    batches = Batches(DataSpec("synthetic"), vocab=1000, batch=8, seq_len=64, seed=0, task="masked-lm")
    x, y = batches.get(0)
    scored = y != IGNORE
    assert scored.any(dim=1).all() and bool((x[scored] == 999).all()) and not (x[~scored] == 999).any()
    assert 0.05 < scored.float().mean().item() < 0.3


def test_byte_text_needs_a_byte_vocabulary():
    with pytest.raises(LaunchError, match=r"vocab_size >= 256"):
        Batches(DataSpec("text", "data/tiny_corpus.txt"), vocab=128, batch=2, seq_len=8, seed=0, task="causal-lm")


def _launch_counted(*args: str) -> tuple[str, dict, dict]:
    """``xla-tp launch`` in a fresh process, then torch_xla's own counters printed by that process: (stdout, the
    summary line parsed, the counters)."""
    script = "import sys\nfrom xla_tp import cli\nstatus = cli.main(sys.argv[1:])\n" + COUNTERS + "\nsys.exit(status)"
    run = subprocess.run([sys.executable, "-c", script, "launch", *args], cwd=ROOT, env=user_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout, parse_summary(run.stdout), last_counters(run.stdout)


def test_a_repeated_run_looks_up_the_programs_the_first_compiled(tmp_path):
    """The same run twice into one --run-dir: the first writes one entry per program it compiled into
    RUN_DIR/xla_cache (files = "written" = torch_xla's misses); the second looks every entry up (a TPU loads
    them; the CPU backend cannot, and says so) with the line's figures equal to torch_xla's counters. With
    --no-compile-cache a third compiles and writes nothing to it."""
    run_dir = tmp_path / "run"
    cache = run_dir / "xla_cache"
    common = ["tiny-llama-cpu", "--no-audit", "--run-dir", str(run_dir), "steps=1", *SMALL]
    _, first, counters = _launch_counted(*common)
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert first["path"] == str(cache) and first["programs"] == counters["CompileTime"]
    assert (first["loaded"], first["written"], first["unloadable"]) == (0, len(files), 0)
    assert len(files) == counters["PersistentCacheMiss"] > 0

    _, second, counters = _launch_counted(*common, "--overwrite")
    assert second["loaded"] + second["unloadable"] == len(files)           # every entry looked up
    assert (second["loaded"], second["unloadable"], second["programs"]) == (
        counters["PersistentCacheHit"], counters["PersistentCacheDeserializeFailure"], counters["CompileTime"])
    assert sorted(p.name for p in cache.iterdir()) == sorted(files)
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}

    _, third, counters = _launch_counted(*common, "--overwrite", "--no-compile-cache", "steps=0")   # no step: faster
    assert third["off"] == "--no-compile-cache" and third["programs"] == counters["CompileTime"] > 0
    assert counters["PersistentCacheMiss"] == counters["PersistentCacheDeserializeFailure"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files
