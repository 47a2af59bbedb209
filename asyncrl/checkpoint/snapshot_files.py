"""Restore points that outlive their process: a packed shard snapshot (`ShardSnapshot.packed()`) in a file of host
shared memory (tmpfs, /dev/shm), so that a trainer rank that exits on a fault (on gloo, the only way to free a
survivor blocked in a collective) restarts and restores the step boundary it had reached.

    path = write_packed(directory, rank=1, step=7, packed=snapshot.packed())   # atomic: a complete file or none
    held = held_snapshots(directory)            # [(rank, step, path)], what a restart can restore from
    snapshot.load_packed(*read_packed(path))    # then snapshot.restore(state)

A file is `ASRLSNAP` + the JSON's byte length (8 bytes, little endian) + the JSON + the tensor bytes; nothing in it is
unpickled or evaluated, and a truncated or foreign file is refused with its path. A rank keeps its newest two
steps (`keep`), so a death while writing step S leaves S − 1 whole.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import tempfile

import torch
from torch import Tensor

__all__ = ["ROOT_ENV", "snapshot_directory", "write_packed", "read_packed", "held_snapshots"]

_MAGIC = b"ASRLSNAP"
_NAME = re.compile(r"rank(\d+)-s(\d+)\.snap")
CHUNK_BYTES = 256 << 20
"""The tensor bytes one thread writes or reads at a time: a shard of several GB moves on up to `_threads()` threads
(each call releases the GIL), since one thread copies only a few GB/s into or out of shared memory."""


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _chunks(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of `chunk_bytes` covering [0, total)."""
    return [(a, min(a + chunk_bytes, total)) for a in range(0, total, chunk_bytes)]


def _in_threads(jobs: list, run) -> None:
    """`run(job)` for every job, on threads when there is more than one."""
    if len(jobs) <= 1:
        for job in jobs:
            run(job)
        return
    with concurrent.futures.ThreadPoolExecutor(min(_threads(), len(jobs))) as pool:
        for done in pool.map(run, jobs):
            del done


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pread_all(fd: int, view: memoryview, offset: int, path: pathlib.Path) -> None:
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise ValueError(f"{path}: truncated while it was read")
        view, offset = view[got:], offset + got


ROOT_ENV = "ASYNCRL_RESTORE_POINTS_DIR"


def snapshot_directory(run_id: str) -> pathlib.Path:
    """Where this run's restore points live on this host: under $ASYNCRL_RESTORE_POINTS_DIR when set (a container's
    /dev/shm is often 64 MB), else /dev/shm (memory) where it exists, else the temp dir."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id):
        raise ValueError(f"snapshot_directory: run id {run_id!r} must be letters, digits, '_', '.' or '-'")
    if os.environ.get(ROOT_ENV):
        root = pathlib.Path(os.environ[ROOT_ENV])
    else:
        root = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else pathlib.Path(tempfile.gettempdir())
    return root / f"asyncrl-{run_id}"


def write_packed(directory: str | os.PathLike, *, rank: int, step: int, packed: tuple[str, Tensor | list[Tensor]],
                 keep: int = 2, pinned: int | None = None, chunk_bytes: int = CHUNK_BYTES) -> pathlib.Path:
    """Write rank `rank`'s packed snapshot at learner step `step` (renamed into place once complete), then delete
    its files older than its newest `keep` steps, except the file of step `pinned` (None: none). `packed`: (text,
    flat) or (text, parts), the flat bytes as the parts that concatenate to them (`ShardSnapshot.packed_parts`,
    written without a copy, in chunks of `chunk_bytes` on threads of their own). Returns the file."""
    if keep < 1:
        raise ValueError(f"write_packed: keep {keep} must be >= 1")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    text, parts = packed
    raw = text.encode()
    final = directory / f"rank{rank}-s{step}.snap"
    tmp = final.with_suffix(".tmp")
    head = _MAGIC + len(raw).to_bytes(8, "little") + raw
    jobs, offset = [], len(head)
    for part in [parts] if isinstance(parts, Tensor) else parts:
        view = memoryview(part.contiguous().numpy()).cast("B")
        jobs += [(view[a:b], offset + a) for a, b in _chunks(len(view), chunk_bytes)]
        offset += len(view)
    with open(tmp, "wb") as f:
        f.write(head)
        f.flush()
        _in_threads(jobs, lambda job: _pwrite_all(f.fileno(), *job))
    os.replace(tmp, final)
    mine = sorted((v, p) for r, v, p in held_snapshots(directory) if r == rank)
    for held, old in mine[:-keep]:
        if held != pinned:
            old.unlink(missing_ok=True)
    return final


def read_packed(path: str | os.PathLike, *, chunk_bytes: int = CHUNK_BYTES) -> tuple[str, Tensor]:
    """A packed snapshot back from `write_packed`'s file, its tensor bytes read in chunks of `chunk_bytes` on threads
    of their own (ValueError naming the file when it is not one)."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != _MAGIC:
            raise ValueError(f"{path}: not an asyncrl snapshot file")
        length = int.from_bytes(head[8:16], "little")
        if 16 + length > size:
            raise ValueError(f"{path}: truncated ({size} bytes, its header says at least {16 + length})")
        text = f.read(length).decode()
        try:
            expected = sum(json.loads(text)["lengths"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: its header is not a packed snapshot's ({err})") from None
        if size - 16 - length != expected:
            raise ValueError(f"{path}: truncated ({size - 16 - length} tensor bytes of {expected})")
        flat = torch.empty(expected, dtype=torch.uint8)
        view, start = memoryview(flat.numpy()), 16 + length  # once, into the tensor
        _in_threads(_chunks(expected, chunk_bytes),
                    lambda span: _pread_all(f.fileno(), view[span[0]:span[1]], start + span[0], path))
    return text, flat


def held_snapshots(directory: str | os.PathLike) -> list[tuple[int, int, pathlib.Path]]:
    """(rank, step, file) of every complete snapshot file in `directory`."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        m = _NAME.fullmatch(p.name)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(out)
