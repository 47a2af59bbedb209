"""Writing a checkpoint directory so that a crash, a power loss or a full disk never leaves a half-written one
under its final name: the files go to `step_N.tmp`, are fsynced, and the directory is renamed into place (a
step saved before is replaced only once the new copy is in). The space it needs is checked before the first
byte, and a disk that fills up mid-write is named as such (`CheckpointError`), the `.tmp` removed.
"""

from __future__ import annotations

import errno
import os
import pathlib
import shutil

import torch

__all__ = ["CheckpointError", "write_checkpoint_dir", "fsync_dir", "TENSOR_FILE"]

_MARGIN_BYTES = 16 * 2**20  # zip headers, pickled structure, meta.json: a few KB; the rest is slack
_MARGIN_FRACTION = 0.02
TENSOR_FILE = "learner.pt"


class CheckpointError(OSError):
    """A checkpoint does not fit on its disk. The message names the checkpoint directory, the bytes it needs
    and the bytes free, and what to do."""


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _bytes_needed(payload: dict, texts: dict[str, str]) -> int:
    """Bytes the checkpoint takes: every storage torch.save writes, once (tied weights share one), the
    text files, and a margin for the rest."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(payload)}
    data = sum(storages.values()) + sum(len(text.encode("utf-8")) for text in texts.values())
    return data + int(data * _MARGIN_FRACTION) + _MARGIN_BYTES


def _free_bytes(path: pathlib.Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _written_bytes(directory: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _no_space(final: pathlib.Path, needed: int, free: int) -> CheckpointError:
    return CheckpointError(f"no space left on device: {final} needs ~{_size(needed)}, {_size(free)} free; "
                           "free space or point --run-dir elsewhere")


def _is_enospc(exc: BaseException) -> bool:
    """Whether an OSError with errno ENOSPC is anywhere in the chain of causes and contexts of `exc`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _free_if_disk_full(exc: BaseException, root: pathlib.Path, tmp: pathlib.Path, needed: int) -> int | None:
    """The free bytes when the failed write `exc` came from a full disk (ENOSPC in its chain, or less free
    space than the part of the checkpoint not yet written), else None."""
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not a disk problem
        return None
    try:
        free = _free_bytes(root)
        short = free < needed - _written_bytes(tmp)
    except OSError:
        free, short = 0, False
    return free if short or _is_enospc(exc) else None



def _remove_stale_tmp(root: pathlib.Path) -> None:
    """Remove the `.tmp` directories that saves which crashed mid-write left behind."""
    for stale in root.glob("step_*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | pathlib.Path) -> None:
    """Flush a directory's entries (names created, renamed or removed in it) to disk: without it, a power loss
    after a rename can leave the old name, or no name at all."""
    _fsync(pathlib.Path(directory))


def _sync(directory: pathlib.Path) -> None:
    """Flush the files of `directory` and the directory itself to disk, so a rename publishes full files."""
    for path in [*sorted(p for p in directory.iterdir() if p.is_file()), directory]:
        _fsync(path)


def _write_files(tmp: pathlib.Path, payload: dict, texts: dict[str, str]) -> None:
    created = not tmp.parent.is_dir()
    tmp.mkdir(parents=True)
    if created:  # checkpoints/ itself is a new name in the run directory
        fsync_dir(tmp.parent.parent)
    torch.save(payload, tmp / TENSOR_FILE)
    for name, text in texts.items():
        (tmp / name).write_text(text, encoding="utf-8")
    _sync(tmp)


def _publish(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename the finished `tmp` to `final` and fsync `checkpoints/`; a step saved before is replaced only
    once the new copy is in (until then it is `final`.old, which a resume restores if this is interrupted)."""
    root = final.parent
    if not final.exists():
        tmp.rename(final)
        fsync_dir(root)
        return
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        old.rename(final)
        raise
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint_dir(final: pathlib.Path, payload: dict, texts: dict[str, str]) -> None:
    """`payload` (tensors and plain data, torch.save'd as `TENSOR_FILE`) and the text files `texts` (name ->
    content) into `final`.tmp, then renamed to `final`; on any failure remove the `.tmp` and re-raise (a full
    disk as `CheckpointError`: ENOSPC in the exception chain, or too little free space left for the rest)."""
    root, tmp = final.parent, final.with_name(final.name + ".tmp")
    if root.is_dir():
        _remove_stale_tmp(root)
    needed = _bytes_needed(payload, texts)
    free = _free_bytes(root)
    if free < needed:
        raise _no_space(final, needed, free)
    try:
        _write_files(tmp, payload, texts)
        _publish(tmp, final)
    except BaseException as exc:
        free = _free_if_disk_full(exc, root, tmp, needed)
        shutil.rmtree(tmp, ignore_errors=True)
        if free is not None:
            raise _no_space(final, needed, free) from exc
        raise
