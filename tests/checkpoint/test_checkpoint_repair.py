"""Checkpoints that survive a crash or a power loss (`asyncrl.checkpoint.repair`, `asyncrl.checkpoint`): the
`checkpoints/` directory is fsynced after the rename; an interrupted re-save's `step_N.old` is restored or
removed at the next resume; a newest checkpoint that does not load (a flipped bit, a truncated file, a missing
file) is moved aside and the resume falls back to the one before, saying why in one line; pruning never
deletes the checkpoint just written; without `repair` the same choice is made and nothing on disk changes."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import struct
import types
import zipfile

import pytest

from asyncrl.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from asyncrl.checkpoint.repair import ChooseError, checkpoint_problem, choose_checkpoint
from asyncrl.rpc.assembly import resume_checkpoint
from tests.dist_helpers import build


def _resume(run_dir: pathlib.Path):
    """What `--resume` (RunSpec.resume) loads: resume_checkpoint reads only these fields of the spec."""
    return resume_checkpoint(types.SimpleNamespace(run_dir=str(run_dir), resume=True, resume_or_start=False))


def _saved(run_dir: pathlib.Path, *steps: int, keep_last: int = 3) -> list[pathlib.Path]:
    state = build("grpo")
    paths = []
    for step in steps:
        state.step = step
        paths.append(save_checkpoint(run_dir, state, keep_last=keep_last))
    return paths


def _tree(run_dir: pathlib.Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _data_offset(file: pathlib.Path) -> int:
    """Where the bytes of the archive's largest member (a tensor's storage) start in `file`."""
    with zipfile.ZipFile(file) as archive:
        member = max(archive.infolist(), key=lambda m: m.file_size)
    with open(file, "rb") as raw:
        raw.seek(member.header_offset)
        header = raw.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return member.header_offset + 30 + name_len + extra_len + member.file_size // 2


def _flip_a_bit(path: pathlib.Path) -> None:
    file = path / "learner.pt"
    offset = _data_offset(file)
    with open(file, "r+b") as raw:
        raw.seek(offset)
        byte = raw.read(1)
        raw.seek(offset)
        raw.write(bytes([byte[0] ^ 0x10]))


def _truncate(path: pathlib.Path) -> None:
    file = path / "learner.pt"
    os.truncate(file, file.stat().st_size // 2)


DAMAGE = {
    "a flipped bit in a weight": (_flip_a_bit, "learner.pt is damaged (Bad CRC-32"),
    "a truncated learner.pt": (_truncate, "learner.pt is damaged"),
    "a zero-filled learner.pt": (lambda p: (p / "learner.pt").write_bytes(bytes((p / "learner.pt").stat().st_size)),
                                 "learner.pt is damaged"),
    "no learner.pt": (lambda p: (p / "learner.pt").unlink(), "it holds no learner.pt"),
    "no extra.json": (lambda p: (p / "extra.json").unlink(), "it holds no extra.json"),
    "a meta.json cut short": (lambda p: (p / "meta.json").write_text('{"step": 3'), "its meta.json does not parse"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_newest_checkpoint_that_does_not_load_is_moved_aside_and_the_previous_one_is_resumed(tmp_path, damage,
                                                                                              caplog):
    older, newest = _saved(tmp_path, 2, 3)
    spoil, reason = DAMAGE[damage]
    spoil(newest)
    assert checkpoint_problem(older) is None and reason in checkpoint_problem(newest)

    before = _tree(tmp_path)
    dry = choose_checkpoint(tmp_path, repair=False)  # --dry-run / preflight: the same choice, nothing moves
    assert dry.path == older and _tree(tmp_path) == before

    with caplog.at_level(logging.INFO, logger="asyncrl.checkpoint.repair"):
        path = _resume(tmp_path)
    assert path == older
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"step_00000003 does not load: {reason}")
    assert lines[0].endswith("; resuming from step_00000002 instead")
    # moved aside, kept for inspection; no longer a checkpoint (never loaded, never pruned)
    assert (tmp_path / "checkpoints" / "step_00000003.corrupt").is_dir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    state = build("grpo", seed=1)
    load_checkpoint(path, state)
    assert state.step == 2


def test_when_no_checkpoint_loads_the_resume_is_refused_naming_each(tmp_path):
    first, second = _saved(tmp_path, 1, 2)
    _truncate(first)
    (second / "learner.pt").unlink()
    with pytest.raises(ValueError) as err:
        _resume(tmp_path)
    message = str(err.value)
    assert message.startswith(f"--resume: no checkpoint in {tmp_path / 'checkpoints'} loads: ")
    assert "step_00000002: it holds no learner.pt; step_00000001: learner.pt is damaged" in message
    assert message.endswith("start a new run with --overwrite or another --run-dir")
    with pytest.raises(ChooseError):  # --resume-or-start does not start afresh over damaged checkpoints either
        choose_checkpoint(tmp_path)


def _interrupted_resave(path: pathlib.Path, *, finished_rename: bool) -> pathlib.Path:
    """What `_publish` leaves when re-saving step N is cut off: the old copy renamed `step_N.old`, the new one
    still `step_N.tmp` (or, after the second rename, already `step_N`)."""
    old = path.with_name(path.name + ".old")
    shutil.copytree(path, old)
    if not finished_rename:
        path.rename(path.with_name(path.name + ".tmp"))
    return old


def test_an_interrupted_resave_is_restored_from_step_old_when_the_new_copy_is_not_in(tmp_path, caplog):
    [path] = _saved(tmp_path, 4)
    old = _interrupted_resave(path, finished_rename=False)
    assert not path.exists() and list_checkpoints(tmp_path) == []  # before: nothing to resume from

    assert choose_checkpoint(tmp_path, repair=False).path == old  # a dry choice names the copy, moves nothing
    assert old.is_dir() and not path.exists()

    with caplog.at_level(logging.INFO, logger="asyncrl.checkpoint.repair"):
        choice = choose_checkpoint(tmp_path)
    assert choice.path == path and checkpoint_problem(path) is None
    assert _tree(tmp_path) == ["step_00000004", *(f"step_00000004/{n}" for n in (
        "extra.json", "learner.pt", "learner.pt.verified", "meta.json"))]
    assert "restored step_00000004 from step_00000004.old (its re-save was interrupted)" in caplog.text
    assert "removed step_00000004.tmp" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing was lost: no fallback line


def test_a_damaged_step_is_replaced_by_its_old_copy(tmp_path):
    [path] = _saved(tmp_path, 4)
    old = _interrupted_resave(path, finished_rename=True)
    _truncate(path)
    choice = choose_checkpoint(tmp_path)
    assert choice.path == path and not old.exists() and checkpoint_problem(path) is None


def test_a_finished_resave_leaves_a_step_old_that_is_removed(tmp_path):
    _saved(tmp_path, 1)
    [path] = _saved(tmp_path, 5)
    old = _interrupted_resave(path, finished_rename=True)
    # an older step's leftover is settled too, although the newest checkpoint is the one chosen
    older_old = _interrupted_resave(tmp_path / "checkpoints" / "step_00000001", finished_rename=True)
    choice = choose_checkpoint(tmp_path)
    assert choice.path == path and not old.exists() and not older_old.exists()
    assert "removed step_00000005.old (a finished re-save left it)" in choice.repairs
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000005"]


def _fsynced(monkeypatch) -> list[tuple[str, bool]]:
    """Record each fsync as (path, whether a checkpoint named step_* was published at that moment)."""
    calls = []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        published = [p.name for p in pathlib.Path(path).glob("step_0*") if not p.name.endswith(".tmp")] \
            if pathlib.Path(path).is_dir() else []
        calls.append((path, bool(published)))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_the_checkpoints_directory_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    calls = _fsynced(monkeypatch)
    path = _saved(tmp_path, 7)[0]
    root = str(tmp_path / "checkpoints")
    paths = [p for p, _ in calls]
    # the files and the .tmp directory first, then checkpoints/ once step_00000007 is its entry
    assert str(path.with_name(path.name + ".tmp") / "learner.pt") in paths
    assert (root, True) in calls
    assert paths.index(root) > paths.index(str(path.with_name(path.name + ".tmp")))
    assert str(tmp_path) in paths  # checkpoints/ was new: the run directory's entry is flushed too

    calls.clear()  # a re-save of the same step: checkpoints/ is flushed after the rename that replaces it
    _saved(tmp_path, 7)
    assert (root, True) in calls

    calls.clear()  # a repair that renames flushes checkpoints/ too
    _interrupted_resave(path, finished_rename=False)
    choose_checkpoint(tmp_path)
    assert calls[-1] == (root, True)


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    # an older run's higher steps must not make keep-last-N delete the step written now
    _saved(tmp_path, 8, 9)
    [path] = _saved(tmp_path, 2, keep_last=1)
    assert list_checkpoints(tmp_path) == [path]
    _saved(tmp_path, 8, 9)
    [path] = _saved(tmp_path, 3, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000009"]


def test_a_verified_checkpoint_is_read_once_per_launch_and_a_changed_or_old_stamp_reads_it_again(tmp_path,
                                                                                                monkeypatch):
    import json
    import time

    from asyncrl.checkpoint import repair as checkpoint_repair
    (newest,) = _saved(tmp_path, 4)
    stamp = newest / "learner.pt.verified"
    choose_checkpoint(tmp_path, repair=False)
    assert not stamp.exists()  # a check that repairs nothing writes nothing
    assert choose_checkpoint(tmp_path).path == newest and stamp.is_file()
    reads = []
    monkeypatch.setattr(checkpoint_repair, "_archive_problem", lambda file: reads.append(file))
    assert choose_checkpoint(tmp_path).path == newest and reads == []  # the launcher's and rank 0's checks
    os.utime(newest / "learner.pt", ns=(1, 1))  # the file changed since
    choose_checkpoint(tmp_path, repair=False)
    assert reads == [newest / "learner.pt"]
    choose_checkpoint(tmp_path)  # stamped anew
    record = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**record, "verified_at": time.time() - 2 * 3600}))  # a resume hours later
    choose_checkpoint(tmp_path)
    assert len(reads) == 3
