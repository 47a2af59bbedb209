"""Which checkpoint a resume loads, after settling what a crash or a power loss left in `run_dir/checkpoints/`.

    choice = choose_checkpoint("runs/x")                  # repairs, then the newest checkpoint that verifies
    choice = choose_checkpoint("runs/x", repair=False)    # the same choice, touching nothing (--dry-run)

What is found, and what happens to it (with `repair`; without it the choice is the same and nothing moves):

* `step_N.tmp/`: a save that did not finish: removed.
* `step_N.old/`: a re-save of step N interrupted between its two renames. When `step_N/` verifies, the
  `.old` copy is removed; when `step_N/` is missing or does not verify and the `.old` copy does, the `.old`
  copy becomes `step_N/` again.
* a newest `step_N/` that does not verify: it is renamed `step_N.corrupt/` (kept for inspection, never
  loaded or pruned) and the resume falls back to the newest checkpoint that verifies, with one log line
  naming what was skipped and why. When none verifies, nothing is moved and `ChooseError` (a ValueError)
  names each.

A checkpoint verifies when meta.json and extra.json parse and learner.pt is a complete zip archive (the format
of torch.save) whose every member matches the CRC-32 recorded for it. `torch.load` checks no checksum, so a
flipped bit would load as a wrong weight; a truncated or zero-filled file fails here instead of in the middle
of a load. The cost is one read of learner.pt at disk speed, with constant memory, once: a repairing choice
leaves `learner.pt.verified` (the file's size and modification time) beside a checkpoint it verified, and
later checks of the same unchanged file within the hour (the launcher's, rank 0's: one launch checks it up to
four times) take that stamp instead of reading an 8B model's tens of GB again; a later resume reads it anew.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
import shutil
import time
import zipfile
import zlib

from asyncrl.checkpoint.files import fsync_dir

__all__ = ["CheckpointChoice", "ChooseError", "choose_checkpoint", "checkpoint_problem"]

log = logging.getLogger(__name__)

_CHUNK = 16 * 2**20
_NAME = re.compile(r"(step_\d+)(\.old)?")


class ChooseError(ValueError):
    """The run directory holds checkpoints, but none of them verifies."""


def _archive_problem(file: pathlib.Path) -> str | None:
    """Why `file` is not a complete torch.save archive whose members match their CRC-32, or None."""
    try:
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
            if not any(m.filename.endswith("data.pkl") for m in members):
                return f"{file.name} holds no pickled state (data.pkl)"
            for member in members:
                if member.CRC == 0:  # written without checksums (torch.serialization.set_crc32_options(False))
                    continue
                with archive.open(member) as data:  # raises at the end of a member whose CRC-32 differs
                    while data.read(_CHUNK):
                        pass
    except zipfile.BadZipFile as err:
        return f"{file.name} is damaged ({err})"
    except (OSError, EOFError, zlib.error, ValueError) as err:
        return f"{file.name} does not read ({type(err).__name__}: {err})"
    return None


_STAMP_VALID_S = 3600.0


def _stamp_of(file: pathlib.Path) -> dict:
    stat = file.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _archive_problem_once(file: pathlib.Path, remember: bool) -> str | None:
    """`_archive_problem`, skipped when a stamp says this very file (size, mtime) verified before; with
    `remember`, a file that verifies is stamped."""
    stamp = file.with_name(file.name + ".verified")
    try:
        seen = json.loads(stamp.read_text())
        if seen.pop("verified_at", 0) > time.time() - _STAMP_VALID_S and seen == _stamp_of(file):
            return None
    except (OSError, ValueError, AttributeError):
        pass
    problem = _archive_problem(file)
    if problem is None and remember:
        try:
            stamp.write_text(json.dumps({**_stamp_of(file), "verified_at": time.time()}))
        except OSError:  # a read-only run dir: verified again next time
            pass
    return problem


def checkpoint_problem(path: pathlib.Path, *, remember: bool = False) -> str | None:
    """Why the checkpoint directory `path` does not verify (see the module docstring), or None. `remember`:
    stamp a learner.pt that verifies, so that the next check of the unchanged file does not read it again."""
    if not path.is_dir():
        return "it is not a directory"
    for name in ("meta.json", "extra.json"):
        if not (path / name).is_file():
            if name == "extra.json" and (path / "extra.pt").is_file():
                continue  # the older layout; load_checkpoint reads it
            return f"it holds no {name}"
        try:
            json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"its {name} does not parse ({err})"
    if not (path / "learner.pt").is_file():
        return "it holds no learner.pt"
    return _archive_problem_once(path / "learner.pt", remember)


@dataclasses.dataclass
class CheckpointChoice:
    """The checkpoint a resume loads, what was skipped on the way and what was repaired."""

    path: pathlib.Path | None
    """The checkpoint to load (without `repair`, possibly a `step_N.old` that a repair would restore); None
    when the run directory holds no checkpoint."""
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(step_N, why) of each newer checkpoint that does not verify."""
    repairs: list[str] = dataclasses.field(default_factory=list)
    """What the repair did, one phrase each."""

    @property
    def name(self) -> str | None:
        """The checkpoint's name as the run reports it (step_N, also for a `.old` copy)."""
        return None if self.path is None else self.path.name.removesuffix(".old")

    def fallback_line(self) -> str | None:
        """The one line saying why the newest checkpoint is not the one loaded (None when it is)."""
        if not self.skipped or self.path is None:
            return None
        why = "; ".join(f"{name} does not load: {reason}" for name, reason in self.skipped)
        return f"{why}; resuming from {self.name} instead"


def _candidates(root: pathlib.Path) -> dict[str, list[pathlib.Path]]:
    """step_N -> its directories to try in order: step_N/, then step_N.old/ (newest step first)."""
    found: dict[str, list[pathlib.Path]] = {}
    for path in root.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.setdefault(match.group(1), []).append(path)
    return {name: sorted(found[name], key=lambda p: p.name.endswith(".old"))
            for name in sorted(found, key=lambda n: int(n.removeprefix("step_")), reverse=True)}


def _settle_old(root: pathlib.Path, name: str, dirs: list[pathlib.Path], chosen: pathlib.Path | None,
                repairs: list[str]) -> pathlib.Path | None:
    """Repair step N: the `.old` copy removed, or restored in place of a missing or damaged `step_N/`.
    Returns where the chosen copy now is."""
    final, old = root / name, root / f"{name}.old"
    if old not in dirs:
        return chosen
    if chosen == old:
        if final.exists():
            shutil.rmtree(final)
        old.rename(final)
        repairs.append(f"restored {name} from {old.name} (its re-save was interrupted)")
        return final
    shutil.rmtree(old)
    repairs.append(f"removed {old.name} ({'a finished re-save left it' if chosen == final else 'damaged too'})")
    return chosen


def _set_aside(root: pathlib.Path, name: str, repairs: list[str]) -> None:
    final, aside = root / name, root / f"{name}.corrupt"
    if final.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
        repairs.append(f"moved {name} aside to {aside.name}")


def _verify_step(root: pathlib.Path, name: str, dirs: list[pathlib.Path], repair: bool,
                 repairs: list[str]) -> tuple[pathlib.Path | None, str | None]:
    """(the copy of step N that verifies, settled on disk with `repair`; None and why when none does)."""
    reasons = {}
    for path in dirs:
        reasons[path] = checkpoint_problem(path, remember=repair)
        if reasons[path] is None:
            break
    chosen = next((path for path, reason in reasons.items() if reason is None), None)
    if repair:
        chosen = _settle_old(root, name, dirs, chosen, repairs)
    return chosen, None if chosen is not None else reasons[dirs[0]]


def choose_checkpoint(run_dir: str | pathlib.Path, *, repair: bool = True) -> CheckpointChoice:
    """The newest checkpoint of `run_dir` that verifies (see the module docstring); older ones are not read.
    With `repair`, leftovers are settled on disk (and `checkpoints/` fsynced), a skipped newer checkpoint is
    moved aside, and a fallback is logged in one line. Raises `ChooseError` when checkpoints exist and none
    verifies."""
    root = pathlib.Path(run_dir) / "checkpoints"
    choice = CheckpointChoice(None)
    if not root.is_dir():
        return choice
    if repair:
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
            choice.repairs.append(f"removed {stale.name} (a save that did not finish)")
    for name, dirs in _candidates(root).items():
        if choice.path is None:
            choice.path, why = _verify_step(root, name, dirs, repair, choice.repairs)
            if why is not None:
                choice.skipped.append((name, why))
        elif repair and len(dirs) > 1:  # an older step's interrupted re-save: settled too
            _verify_step(root, name, dirs, repair, choice.repairs)
    if repair and choice.path is not None:
        for name, _ in choice.skipped:  # moved aside only when there is one to fall back to
            _set_aside(root, name, choice.repairs)
    if repair and choice.repairs:
        fsync_dir(root)
        log.info("checkpoints: %s", "; ".join(choice.repairs))
    if choice.path is None and choice.skipped:
        raise ChooseError(f"no checkpoint in {root} loads: "
                          + "; ".join(f"{name}: {reason}" for name, reason in choice.skipped))
    if repair and (line := choice.fallback_line()) is not None:
        log.warning("%s", line)
    return choice
