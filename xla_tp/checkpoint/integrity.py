"""Whole checkpoints: each file's size and SHA-256 recorded as it is written, all checked before a load.

A save hashes every file as its bytes go out (``RecordingWriter``: no second read; SHA-256 runs at
about 1.4 GB/s on one core with the CPU's SHA instructions, so a 10 GB shard costs about 7 s more)
and records ``{"size", "sha256"}`` per file in the ``xla_tp.json`` marker. ``verify`` reads the
whole checkpoint once before anything is loaded (files hashed in parallel): the marker, every
recorded file present with its size and hash, and ``.metadata`` readable with every byte range it
points to inside its file. A checkpoint saved before sizes and hashes were recorded (no ``files``
in its marker) gets the last two checks only. Example::

    dcp.save(state, storage_writer=RecordingWriter(tmp))
    files = writer.records()                # {"__0_0.distcp": {"size": ..., "sha256": ...}, ".metadata": ...}
    metadata = verify("ckpt/step_00000010")  # or CheckpointError naming the file and what is wrong
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointError
from .store import MARKER, read_marker

METADATA = ".metadata"
UNCHANGED = "nothing was loaded: the model and optimizer are unchanged"
_CHUNK = 16 << 20


def open_for_write(path: Union[str, os.PathLike]) -> io.BufferedWriter:
    """The file a save writes to (a test swaps it for one that runs out of space)."""
    return open(path, "wb")


class _HashingStream(io.RawIOBase):
    """A write-only stream that hashes and counts what it passes on to ``raw``."""

    def __init__(self, raw: io.BufferedWriter, on_error):
        self.raw, self.sha, self.size, self._on_error = raw, hashlib.sha256(), 0, on_error

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        with self._reporting():
            self.raw.write(view)
        self.sha.update(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        """The file's descriptor, its buffer flushed first (an ``fsync`` on it then sees every byte)."""
        self.flush()
        return self.raw.fileno()

    def flush(self) -> None:
        with self._reporting():
            self.raw.flush()

    @contextlib.contextmanager
    def _reporting(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            self._on_error(error)
            raise


class RecordingFileSystem(FileSystem):
    """DCP's file system, recording the size and SHA-256 of each file it writes, and the first
    ``OSError`` a write hit (torch.save reports a failed write only as ``unexpected pos``)."""

    def __init__(self):
        self.files: dict[str, dict[str, Any]] = {}
        self.write_error: Optional[tuple[str, OSError]] = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: Union[str, os.PathLike], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name
        raw = open_for_write(path)
        stream = _HashingStream(raw, lambda error: self._failed(name, error))
        try:
            yield stream
            stream.flush()
        finally:
            try:
                raw.close()
            except OSError as error:
                self._failed(name, error)
                raise
        with self._lock:
            self.files[name] = {"size": stream.size, "sha256": stream.sha.hexdigest()}

    def rename(self, path: Union[str, os.PathLike], new_path: Union[str, os.PathLike]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.files:
                self.files[Path(new_path).name] = self.files.pop(Path(path).name)

    def _failed(self, name: str, error: OSError) -> None:
        with self._lock:
            if self.write_error is None:
                self.write_error = (name, error)


class RecordingWriter(dcp.FileSystemWriter):
    """``dcp.FileSystemWriter`` that records each file's size and SHA-256 as it writes it.

    ``per_thread_copy_ahead=0``: the overlapping loader is for CUDA streams, and it breaks when
    another backend owns PrivateUse1 (torchax does, and ``xs.mark_sharding`` imports it when installed).
    """

    def __init__(self, path: str):
        super().__init__(path, per_thread_copy_ahead=0)
        self.fs = RecordingFileSystem()

    def records(self) -> dict[str, dict[str, Any]]:
        return dict(self.fs.files)


def disk_full(error: BaseException, writer: Optional[RecordingWriter] = None) -> Optional[str]:
    """The file a save was writing when the disk filled up, if ``error`` (or what caused it) is ENOSPC."""
    if writer is not None and writer.fs.write_error and writer.fs.write_error[1].errno == errno.ENOSPC:
        return writer.fs.write_error[0]
    for cause in causes(error):
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return os.path.basename(cause.filename) if cause.filename else "a file"
    return None


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, what it was raised from, and the per-rank failures a DCP ``CheckpointException`` carries."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [failure for failure, _ in e.failures.values()]


def reason(error: BaseException) -> str:
    """One line for what went wrong: the innermost failure DCP wrapped, else ``error`` itself."""
    inner = [e for e in causes(error) if not isinstance(e, CheckpointException)] or [error]
    return f"{type(inner[0]).__name__}: {str(inner[0]).strip().splitlines()[-1] if str(inner[0]).strip() else ''}"


def verify(directory: str) -> Metadata:
    """Check the checkpoint in ``directory`` completely, reading nothing into any model; return its
    DCP metadata. ``CheckpointError`` names the first damaged file and what is wrong with it."""
    marker = os.path.join(directory, MARKER)
    try:
        recorded = read_marker(directory).get("files")
    except FileNotFoundError:
        raise _damaged(directory, f"{marker} is missing (a save that did not finish, or a copy that lost it)") from None
    except (OSError, ValueError) as error:
        raise _damaged(directory, f"{marker} cannot be read ({error})") from error
    if recorded is not None:
        _check_recorded(directory, recorded)
    metadata = _read_metadata(directory)
    _check_ranges(directory, metadata)
    return metadata


def _check_recorded(directory: str, recorded: dict[str, dict[str, Any]]) -> None:
    for name, want in sorted(recorded.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise _damaged(directory, f"{path} is missing")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise _damaged(directory, f"{path} is {size:,} bytes, {want['size']:,} when saved "
                                      f"({'truncated' if size < want['size'] else 'grown'})")
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = dict(zip(sorted(recorded), pool.map(_sha256, (os.path.join(directory, n) for n in sorted(recorded)))))
    for name, digest in digests.items():
        if digest != recorded[name]["sha256"]:
            raise _damaged(directory, f"{os.path.join(directory, name)} does not match the SHA-256 recorded when it "
                                      f"was saved (its bytes changed)")


def _read_metadata(directory: str) -> Metadata:
    path = os.path.join(directory, METADATA)
    if not os.path.isfile(path):
        raise _damaged(directory, f"{path} is missing")
    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except Exception as error:
        raise _damaged(directory, f"{path} cannot be read ({type(error).__name__}: {error})") from error


def _check_ranges(directory: str, metadata: Metadata) -> None:
    """Every byte range ``.metadata`` points to lies inside an existing file."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise _damaged(directory, f"{path} is missing")
        if os.path.getsize(path) < end:
            raise _damaged(directory, f"{path} is {os.path.getsize(path):,} bytes but its tensors reach byte "
                                      f"{end:,} (truncated)")


def _sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def _damaged(directory: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {directory!r} is damaged: {what}; {UNCHANGED}")
