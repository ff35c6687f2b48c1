"""The persistent compilation cache (``xla_tp.compile_cache``): what a process writes, what the next one does with
it, the summary line against torch_xla's own counters and the files on disk; the flags; bad paths and late starts.

On the CPU backend torch_xla 2.9 writes entries but cannot load them (each lookup of one is a
``PersistentCacheDeserializeFailure`` and the program is compiled again); a TPU loads them. The assertions hold
for both: what the second process did with each entry is ``loaded + could not be loaded``. The launcher and
generate runs are in tests/user_paths/test_launch_run.py and test_generate_cli.py (the complete tier)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from xla_tp import cli
from xla_tp.compile_cache import CompileCache, cache_from_args, enable_compile_cache
from xla_tp.compiles import Compiles
from xla_tp.console import UsageError

from ..compile_counts import COUNTERS, last_counters, parse_summary
from ..fresh import run_fresh

SCRIPT = """
import torch, torch_xla
from pathlib import Path
from xla_tp.compile_cache import enable_compile_cache
from xla_tp.compiles import compile_counts
cache = enable_compile_cache(Path({path!r}))
x = torch.arange(8.0, device=torch_xla.device())
(x * 2 + 1).sum().item(), x.exp().mean().item()
print(cache.summary(compile_counts()))
"""


def _run(cache: Path) -> tuple[dict, dict]:
    out = run_fresh(SCRIPT.format(path=str(cache)) + COUNTERS)
    return parse_summary(out), last_counters(out)


@pytest.mark.complete  # two fresh processes
def test_a_second_process_looks_up_every_entry_the_first_wrote(tmp_path):
    """Two fresh processes compute the same two programs with the cache in one directory: the first writes an
    entry per program (files on disk = its "written" = torch_xla's misses); the second looks each of them up (a
    TPU loads them, the CPU cannot: loaded + could not be loaded = the files) and the line's figures are
    torch_xla's counters."""
    cache = tmp_path / "xla_cache"
    first, counters = _run(cache)
    files = sorted(p.name for p in cache.iterdir())
    assert first["path"] == str(cache)
    assert (first["programs"], first["loaded"], first["written"], first["unloadable"]) == (
        counters["CompileTime"], 0, len(files), 0)
    assert len(files) == counters["PersistentCacheMiss"] == 2

    second, counters = _run(cache)
    assert second["loaded"] + second["unloadable"] == len(files)          # every entry looked up
    assert (second["loaded"], second["unloadable"]) == (counters["PersistentCacheHit"],
                                                        counters["PersistentCacheDeserializeFailure"])
    assert second["programs"] == counters["CompileTime"] == second["unloadable"]   # loaded ones are not compiled
    assert second["written"] == second["unloadable"]                      # an entry that did not load is replaced
    assert sorted(p.name for p in cache.iterdir()) == files


def test_after_xla_ran_the_cache_warns_and_stays_off(tmp_path):
    """This process has computed (the suite's set-up): the cache cannot start; one warning, nothing created."""
    with pytest.warns(UserWarning, match=r"compile cache .* not used: XLA already ran a computation in this process.*"
                                         r"fresh process, or pass --no-compile-cache; continuing without it"):
        cache = enable_compile_cache(tmp_path / "c")
    assert cache.path is None and not (tmp_path / "c").exists()
    assert cache.summary(Compiles(5, 2.0, 0, 0, 0)) == (f"5 programs compiled (2.0 s); persistent cache off (XLA ran "
                                                        f"before it: {tmp_path / 'c'})")


def test_a_directory_that_cannot_be_written_warns_and_stays_off(monkeypatch):
    monkeypatch.setattr("xla_tp.compile_cache._xla_started", lambda: False)
    path = Path("/proc/xla_tp_cache")           # /proc takes no new directory, whoever asks
    with pytest.warns(UserWarning, match=r"compile cache /proc/xla_tp_cache not used: it cannot be written .*"
                                         r"--compile-cache DIR on a writable disk, or --no-compile-cache"):
        cache = enable_compile_cache(path)
    assert cache.path is None and "not writable" in cache.off


def test_a_file_is_bad_input_for_launch_and_generate_before_anything_runs(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for path in (afile, afile / "below"):
        for command in (["launch", "--run-dir", str(tmp_path / "run")], ["launch", "--dry-run"],
                        ["generate", "--prompt", "x"]):
            assert cli.main([*command, "--compile-cache", str(path), "steps=1"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"compile cache {path}: a file, not a directory" in err, err
            assert "--no-compile-cache" in err
    assert not (tmp_path / "run").exists()
    assert cli.main(["launch", "--compile-cache", str(tmp_path), "--no-compile-cache"]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_flags_choose_the_directory_and_who_writes_it(tmp_path, monkeypatch):
    monkeypatch.setattr("xla_tp.compile_cache.xr.initialize_cache", lambda path, readonly: calls.append((path, readonly)))
    monkeypatch.setattr("xla_tp.compile_cache._xla_started", lambda: False)
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH", raising=False)
    calls: list = []

    def flags(given=None, off=False):
        return argparse.Namespace(compile_cache=given, no_compile_cache=off)
    default = tmp_path / "run" / "xla_cache"
    assert cache_from_args(flags(), default, process_index=3) == CompileCache(default, writes=True)   # this host's
    assert cache_from_args(flags(tmp_path / "shared"), default, process_index=1) == CompileCache(tmp_path / "shared",
                                                                                                  writes=False)
    assert cache_from_args(flags(tmp_path / "shared"), default, process_index=0).writes
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path / "env"))
    assert cache_from_args(flags(), default).path == tmp_path / "env"      # torch_xla's own variable is respected
    assert cache_from_args(flags(off=True), default) == CompileCache(None, off="--no-compile-cache")
    assert "XLA_PERSISTENT_CACHE_PATH" not in os.environ    # off means off for torch_xla too
    assert calls == [(str(default), False), (str(tmp_path / "shared"), True), (str(tmp_path / "shared"), False),
                     (str(tmp_path / "env"), False)]
    with pytest.raises(UsageError, match="pass one of them"):
        cache_from_args(flags(tmp_path, off=True), default)


def test_the_summary_reads_entries_written_and_replaced_from_the_directory(tmp_path):
    """"written" and "could not be loaded" are read from the directory too (new entries; entries replaced, which
    torch_xla does only after failing to load one): torch_xla counts no lookup for the programs torch.compile
    captures, but writes and replaces them."""
    (tmp_path / "kept").write_bytes(b"1")
    (tmp_path / "replaced").write_bytes(b"2")
    cache = CompileCache(tmp_path, found={"kept": (tmp_path / "kept").stat().st_mtime_ns, "replaced": 0})
    (tmp_path / "new").write_bytes(b"3")
    (tmp_path / ".write-test-1").write_bytes(b"")
    assert cache.changes() == (1, 1)
    assert cache.summary(Compiles(programs=7, seconds=22.94, loaded=2, missed=3, unloadable=0)) == (
        f"7 programs compiled (22.9 s); persistent cache {tmp_path}: 2 loaded, 2 written, 1 could not be loaded by "
        f"this backend")
    read_only = CompileCache(tmp_path, writes=False, found=cache.found)
    assert read_only.summary(Compiles(7, 22.94, 2, 0, 3)).endswith("2 loaded, none written (process 0 writes this "
                                                                   "cache), 3 could not be loaded by this backend")


def test_print_commands_pass_the_shared_cache_to_every_worker(capsys):
    assert cli.main(["launch", "llama3-8b", "--topology", "v5p-32", "--print-commands", "--compile-cache",
                     "/mnt/shared/xla_cache"]) == 0
    workers = [line for line in capsys.readouterr().out.splitlines() if "--worker=" in line]
    assert len(workers) == 5 and all("launch llama3-8b --topology v5p-32 --compile-cache /mnt/shared/xla_cache"
                                     in line for line in workers)
