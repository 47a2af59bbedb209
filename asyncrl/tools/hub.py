"""Models and datasets by their Hugging Face Hub names, resolved to files in the local Hub cache.

    resolve_model("Qwen/Qwen3-1.7B@main", "--model.path")       # Resolved(path=<snapshot dir>, commit=<sha>)
    resolve_dataset("hf:openai/gsm8k:main/train", "--data.path")  # Resolved(path=<the split's .parquet file>)

Names:
* a model: `ORG/NAME[@REVISION]` (or with an `hf:` prefix) that is not a path on this machine (a local
  directory of that name wins);
* a dataset: `hf:ORG/NAME[@REVISION][:[CONFIG/]SPLIT]` (split `train` unless given). The split's files come
  from the dataset card's `configs:` (its `data_files`; the `default: true` config, or the only one, unless
  CONFIG is given), or, for a repo without them, from the file names (`train.jsonl`, `data/train-*.parquet`).
  One `.parquet` or `.jsonl` file per split (the row formats of `--data.path`).

Everything goes through `huggingface_hub`: the cache under `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, tokens
from `HF_TOKEN` or `hf auth login`. Only what is loaded is fetched: a model's config, tokenizer files and
`*.safetensors` (pickled `.bin` weights are never loaded, and no repository code is run); a dataset's card and
the split's file. Every failure is one `ValueError` naming the flag and the fix.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import pathlib
import re
from typing import Literal

__all__ = ["HubName", "Resolved", "model_name", "dataset_name", "resolve_model", "resolve_dataset", "offline",
           "local_model_path", "MODEL_FILES"]

MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
"""What a model resolution fetches: the config, the safetensors weights and the tokenizer."""

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_MODEL = re.compile(rf"(?:hf:)?(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^:@\s]+))?")
_DATASET = re.compile(rf"hf:(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^:@\s]+))?(?::(?:(?P<config>{_PART})/)?"
                      rf"(?P<split>{_PART}))?")
_FILE_SUFFIXES = (".gguf", ".jsonl", ".parquet", ".json", ".safetensors", ".bin", ".py")


@dataclasses.dataclass(frozen=True)
class HubName:
    """A parsed Hub name."""

    repo_id: str
    revision: str | None
    """As given (a branch, tag or commit); None: the default branch."""
    kind: Literal["model", "dataset"]
    config: str | None = None
    split: str = "train"


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A Hub name and the local files it resolved to."""

    given: str
    name: HubName
    path: str
    """The model's snapshot directory, or the dataset split's file."""
    commit: str
    """The commit the snapshot holds: what a resume pins."""

    def record(self) -> dict:
        return {"name": self.given, "repo": self.name.repo_id, "revision": self.name.revision or "main",
                "commit": self.commit, "path": self.path}


def model_name(text: str | None) -> HubName | None:
    """The Hub name in a model path, or None for anything else (an existing path, a file, `smollm2`,
    `random:...`)."""
    if not text or text.startswith(("random:", "/", ".", "~")) or text.endswith(_FILE_SUFFIXES):
        return None
    if not text.startswith("hf:") and pathlib.Path(text).exists():
        return None
    m = _MODEL.fullmatch(text)
    return HubName(m["repo"], m["rev"], "model") if m else None


def dataset_name(text: str | None) -> HubName | None:
    """The Hub name in a data path (`hf:` prefix), or None for a local file."""
    if not text or not text.startswith("hf:"):
        return None
    m = _DATASET.fullmatch(text)
    if m is None:
        raise ValueError(f"{text}: not a Hub dataset name; write hf:ORG/NAME[@REVISION][:[CONFIG/]SPLIT], e.g. "
                         "hf:openai/gsm8k:main/train")
    return HubName(m["repo"], m["rev"], "dataset", config=m["config"], split=m["split"] or "train")


def offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants
    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def _cache_dir() -> str:
    """The Hub cache, read now: HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    from huggingface_hub import constants
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def _snapshot(name: HubName, flag: str, given: str, patterns: list[str], commit: str | None) -> pathlib.Path:
    """snapshot_download of `patterns` at the pinned commit (else the given revision), with its errors turned
    into one message each."""
    from huggingface_hub import errors, snapshot_download
    revision = commit or name.revision
    where = f"{flag} {given}" + (f" (pinned to commit {commit[:12]} by the run's config.json)" if commit else "")
    local = "" if given.startswith("hf:") else f" ({given} is no local path either)"
    try:
        return pathlib.Path(snapshot_download(name.repo_id, repo_type=name.kind, revision=revision,
                                              allow_patterns=patterns, cache_dir=_cache_dir(),
                                              local_files_only=offline()))
    except errors.RevisionNotFoundError:
        raise ValueError(f"{where}: {name.repo_id} has no revision {revision!r}; give an existing branch, tag or "
                         "commit after '@', or none for the default branch") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError):
        raise ValueError(f"{where}: no {name.kind} repository {name.repo_id} on the Hugging Face Hub that this "
                         "machine may read; check the name, or log in (`hf auth login` or HF_TOKEN) for a private or "
                         "gated one") from None
    except errors.LocalEntryNotFoundError:
        revision_text = f" at revision {revision!r}" if revision else ""
        if offline():
            raise ValueError(f"{where}: not in the Hugging Face cache ({_cache_dir()}){revision_text}, and "
                             "HF_HUB_OFFLINE=1 forbids downloading it; run once with network access (unset "
                             f"HF_HUB_OFFLINE), or give a local path{local}") from None
        raise ValueError(f"{where}: the Hugging Face Hub could not be reached and {name.repo_id}{revision_text} "
                         f"is not in the cache ({_cache_dir()}); check the network, or give a local "
                         f"path{local}") from None
    except errors.IncompleteSnapshotError as err:
        raise ValueError(f"{where}: the cached snapshot is incomplete ({err}); run once with network access") from None
    except errors.HFValidationError as err:
        raise ValueError(f"{where}: not a valid Hub name ({err})") from None


def resolve_model(given: str, flag: str, *, commit: str | None = None) -> Resolved:
    """The local snapshot of a Hub model (`model_name(given)` must not be None): its config, safetensors
    weights and tokenizer files, fetched when missing."""
    name = model_name(given)
    if name is None:
        raise ValueError(f"{flag} {given}: not a Hub model name (ORG/NAME[@REVISION])")
    folder = _snapshot(name, flag, given, list(MODEL_FILES), commit)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} {given}: the repository has no config.json; asyncrl loads Hugging Face model "
                         "repositories (config.json and *.safetensors)")
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        held = f" (it holds {', '.join(pickled)}: pickled weights, which asyncrl never loads)" if pickled else ""
        raise ValueError(f"{flag} {given}: no *.safetensors weights{held}; pick a revision or a repository with "
                         "safetensors weights, or convert them yourself into a local directory")
    return Resolved(given, name, str(folder), folder.name)


def local_model_path(value: str, flag: str, commit: str | None = None) -> str:
    """A model path as the loaders read it: a Hub name resolved to its snapshot (at `commit` when given, e.g.
    the one a run recorded), anything else as it is."""
    return resolve_model(value, flag, commit=commit).path if model_name(value) is not None else value


def _card_configs(card: pathlib.Path) -> list[dict]:
    """The `configs:` list of a dataset card's YAML header ([] without one)."""
    import yaml
    if not card.is_file():
        return []
    text = card.read_text(encoding="utf-8", errors="replace")
    m = re.match(r"---\s*\n(.*?)\n---\s*\n", text, flags=re.S)
    if m is None:
        return []
    try:
        header = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        return []
    configs = header.get("configs") if isinstance(header, dict) else None
    return [c for c in configs if isinstance(c, dict) and "config_name" in c] if isinstance(configs, list) else []


def _card_patterns(configs: list[dict], name: HubName, where: str) -> list[str]:
    """The split's data_files patterns from the card's configs."""
    names = [c["config_name"] for c in configs]
    if name.config is not None:
        chosen = [c for c in configs if c["config_name"] == name.config]
        if not chosen:
            raise ValueError(f"{where}: {name.repo_id} has no config {name.config!r}; its configs: {', '.join(names)}")
    else:
        chosen = [c for c in configs if c.get("default")] or (configs if len(configs) == 1 else [])
        if not chosen:
            raise ValueError(f"{where}: {name.repo_id} has several configs ({', '.join(names)}) and none is the "
                             f"default; name one: hf:{name.repo_id}:{names[0]}/{name.split}")
    files = chosen[0].get("data_files")
    entries = files if isinstance(files, list) else [{"split": "train", "path": files}]
    splits = {}
    for entry in entries:
        if isinstance(entry, dict) and "split" in entry:
            paths = entry.get("path")
            splits[entry["split"]] = paths if isinstance(paths, list) else [paths]
        elif isinstance(entry, str):
            splits.setdefault("train", []).append(entry)
    if name.split not in splits:
        raise ValueError(f"{where}: config {chosen[0]['config_name']!r} of {name.repo_id} has no split "
                         f"{name.split!r}; its splits: {', '.join(splits) or 'none'}")
    return [str(p) for p in splits[name.split]]


def _split_file(name: HubName, files: list[str], where: str) -> str:
    """The one .parquet/.jsonl file of the split among `files` (repo-relative paths)."""
    data = [f for f in files if f.endswith((".parquet", ".jsonl"))]
    if not data:
        raise ValueError(f"{where}: no .parquet or .jsonl file for split {name.split!r} in {name.repo_id} (found: "
                         f"{', '.join(files[:5]) or 'nothing'}); asyncrl reads those two formats")
    if len(data) > 1:
        raise ValueError(f"{where}: split {name.split!r} of {name.repo_id} is {len(data)} files ({', '.join(data[:3])}"
                         f"{', ...' if len(data) > 3 else ''}); asyncrl reads one file per split: download them "
                         "(`hf download --repo-type dataset`) and pass one, or join them into one file")
    return data[0]


def _named_split(name: HubName, files: list[str]) -> list[str]:
    """Files named after the split, for a repo without card configs: split.jsonl, data/split-00000-of-1.parquet."""
    pattern = re.compile(rf"(^|/){re.escape(name.split)}([-_.][^/]*)?\.(parquet|jsonl)$")
    by_dir = [f for f in files if pattern.search(f) and (name.config is None or f.startswith(name.config + "/"))]
    return by_dir


def _repo_files(name: HubName, folder: pathlib.Path) -> list[str]:
    """Every file of the repo at the snapshot's commit: listed by the Hub, or (offline) what the cache holds."""
    if not offline():
        from huggingface_hub import HfApi
        try:
            return HfApi().list_repo_files(name.repo_id, repo_type="dataset", revision=folder.name)
        except Exception:  # noqa: BLE001 - unreachable: fall back to the cache below
            pass
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def resolve_dataset(given: str, flag: str, *, commit: str | None = None) -> Resolved:
    """The local file of a Hub dataset split (`dataset_name(given)` must not be None), fetched when missing."""
    name = dataset_name(given)
    if name is None:
        raise ValueError(f"{flag} {given}: not a Hub dataset name (hf:ORG/NAME[@REVISION][:[CONFIG/]SPLIT])")
    where = f"{flag} {given}"
    folder = _snapshot(name, flag, given, ["README.md"], commit)
    configs = _card_configs(folder / "README.md")
    if configs:
        patterns = _card_patterns(configs, name, where)
    else:
        patterns = _named_split(name, _repo_files(name, folder))
        if not patterns:
            raise ValueError(f"{where}: no file of split {name.split!r} in {name.repo_id} (no configs in its card, "
                             f"and no file named {name.split}.jsonl or {name.split}-*.parquet)")
    folder = _snapshot(name, flag, given, patterns, folder.name)
    present = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    matched = [f for f in present if any(fnmatch.fnmatch(f, p) for p in patterns)]
    return Resolved(given, name, str(folder / _split_file(name, matched, where)), folder.name)
