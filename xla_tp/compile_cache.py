"""torch_xla's persistent compilation cache for ``xla-tp launch`` and ``xla-tp generate``: compiled programs kept
on disk, so a resumed or repeated run loads them instead of compiling them again.

The cache is on by default (the launcher: ``<run dir>/xla_cache``; generate: ``~/.cache/xla_tp/xla_cache``);
``--compile-cache DIR`` gives a directory the hosts share (process 0 writes it, the others only read), and
``--no-compile-cache`` turns it off. It must start before the process's first XLA computation: a process
that has already computed (or a directory that cannot be written) gets a one-line warning naming the
directory and the fix, and runs without it; a path that is a file is bad input (``UsageError``). The
summary line says how many programs came from the cache. On the CPU backend torch_xla 2.9 writes entries
but cannot load them: each later lookup counts as "could not be loaded" and the program is compiled again
(docs/launcher.md). Example::

    cache = enable_compile_cache(Path("runs/a/xla_cache"))    # before any XLA computation
    ...                                                       # build, shard, train
    print(cache.summary(compile_counts()))
    # 3 programs compiled (12.4 s); persistent cache runs/a/xla_cache: 0 loaded, 3 written
"""
from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch_xla
import torch_xla.runtime as xr

from .compiles import Compiles
from .console import UsageError

ENV_PATH = "XLA_PERSISTENT_CACHE_PATH"     # torch_xla's own variable (what ``initialize_cache`` sets)


@dataclass(frozen=True)
class CompileCache:
    """The persistent cache this process uses: its directory (``None``: off, ``off`` says why), whether this
    process writes it (``False``: a shared cache another process writes) and its entries when it started."""

    path: Optional[Path]
    writes: bool = True
    off: str = ""
    found: dict[str, int] = field(default_factory=dict, compare=False, repr=False)   # entry -> mtime (ns)

    def changes(self) -> tuple[int, int]:
        """(entries new since the cache started, entries there then and written again), read from the directory.
        torch_xla writes an entry only when it has none, and replaces one only when the backend could not
        load it; it writes the programs ``torch.compile`` captures (generation's decode step) without counting
        their lookups (``Compiles``), so the directory is the fuller record of both."""
        now = _entries(self.path) if self.path is not None else {}
        new = sum(name not in self.found for name in now)
        return new, sum(name in self.found and self.found[name] != mtime for name, mtime in now.items())

    def summary(self, counts: Compiles) -> str:
        """One line: programs compiled and their time, then what the cache did."""
        head = f"{counts.programs} programs compiled ({counts.seconds:.1f} s)"
        if self.path is None:
            return f"{head}; persistent cache off ({self.off})"
        new, replaced = self.changes() if self.writes else (0, 0)     # a reader sees the writer's changes
        unloadable = max(counts.unloadable, replaced)    # each a lower bound: uncounted lookups, a read-only process
        done = [f"{counts.loaded} loaded",
                f"{new + replaced} written" if self.writes else "none written (process 0 writes this cache)"]
        if unloadable:
            done.append(f"{unloadable} could not be loaded by this backend")
        return f"{head}; persistent cache {self.path}: {', '.join(done)}"


def enable_compile_cache(path: Path, shared: bool = False, process_index: int = 0) -> CompileCache:
    """Turn torch_xla's persistent cache on at ``path`` (created if missing). ``shared``: a directory every
    host sees, written by process 0 only. ``UsageError`` when ``path`` is a file; a warning and an off cache
    when XLA has already computed in this process or ``path`` cannot be written."""
    path = Path(path).expanduser()
    check_path(path)
    if _xla_started():
        return _without(path, "XLA already ran a computation in this process and the cache must start before the "
                              "first one; run the command in a fresh process, or pass --no-compile-cache",
                        "XLA ran before it")
    writes = not shared or process_index == 0
    try:
        if writes:  # a unique probe: hosts sharing the directory may run with the same process id
            path.mkdir(parents=True, exist_ok=True)
            descriptor, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
            os.close(descriptor)
            os.unlink(probe)
        elif not path.is_dir():  # a reader may start before the writer made it
            path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return _without(path, f"it cannot be {'written' if writes else 'read'} ({error.strerror or error}); pass "
                              f"--compile-cache DIR on a {'writable' if writes else 'shared'} disk, or "
                              f"--no-compile-cache", "not writable" if writes else "not readable")
    xr.initialize_cache(str(path), readonly=not writes)
    return CompileCache(path, writes, found=_entries(path))


def check_path(path: Path) -> None:
    """``UsageError`` when ``path``, or the nearest of its parents that exists, is not a directory."""
    found = next((p for p in (path, *path.parents) if os.path.exists(p)), None)   # False, not an error, when unreadable
    if found is not None and not os.path.isdir(found):
        where = "" if found == path else f" ({found} is a file)"
        raise UsageError(f"compile cache {path}: a file, not a directory{where}; pass --compile-cache DIR (a "
                         f"directory, created if missing) or --no-compile-cache")


def add_cache_flags(parser: argparse.ArgumentParser, default: str) -> None:
    """``--compile-cache DIR`` and ``--no-compile-cache`` on a command's parser (``default``: for the help)."""
    parser.add_argument("--compile-cache", type=Path, metavar="DIR",
                        help=f"persistent compilation cache, e.g. a directory every host shares (default {default})")
    parser.add_argument("--no-compile-cache", action="store_true", help="compile everything, keep nothing on disk")


def check_cache_flags(args: argparse.Namespace) -> None:
    """``UsageError`` for flags that cannot work (both given, a file as the directory): called before the
    runtime starts and on dry runs, so bad input stops the command before anything runs."""
    if args.compile_cache is not None and args.no_compile_cache:
        raise UsageError("--compile-cache and --no-compile-cache: pass one of them")
    if args.compile_cache is not None:
        check_path(Path(args.compile_cache).expanduser())


def cache_from_args(args: argparse.Namespace, default: Path, process_index: int = 0) -> CompileCache:
    """The cache the flags ask for: ``--compile-cache DIR`` (shared), else torch_xla's own
    ``XLA_PERSISTENT_CACHE_PATH`` when set (shared), else ``default`` (this host's)."""
    check_cache_flags(args)
    given, off = args.compile_cache, args.no_compile_cache
    if off:
        os.environ.pop(ENV_PATH, None)
        return CompileCache(None, off="--no-compile-cache")
    if given is None and os.environ.get(ENV_PATH):
        given = Path(os.environ[ENV_PATH])
    return enable_compile_cache(default if given is None else given, shared=given is not None,
                                process_index=process_index)


def cache_flags(args: argparse.Namespace) -> list[str]:
    """The flags again, for the command another host runs (``--print-commands``)."""
    return ((["--compile-cache", str(args.compile_cache)] if args.compile_cache is not None else [])
            + (["--no-compile-cache"] if args.no_compile_cache else []))


def _xla_started() -> bool:
    """Whether this process has started torch_xla's computation cache (it does at the first computation)."""
    return torch_xla._XLAC._xla_computation_cache_is_initialized()


def _entries(path: Path) -> dict[str, int]:
    """The cache's entries (torch_xla names each by its program's hash) and their modification times; none
    when the directory is gone (deleted during the run: the summary must not fail the run)."""
    try:
        with os.scandir(path) as found:
            return {e.name: e.stat().st_mtime_ns for e in found if e.is_file() and not e.name.startswith(".")}
    except OSError:
        return {}


def _without(path: Path, why: str, short: str) -> CompileCache:
    warnings.warn(f"xla_tp: compile cache {path} not used: {why}; continuing without it", stacklevel=3)
    return CompileCache(None, off=f"{short}: {path}")
