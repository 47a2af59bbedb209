"""Models and datasets by their Hugging Face Hub names (`asyncrl.tools.hub`, `asyncrl.launch.hub_run`), offline, from a fake
Hub cache laid out as huggingface_hub writes it (tests/hub_helpers.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import tyro

from asyncrl.config import RunConfig
from asyncrl.tools.hub import HubName, dataset_name, model_name, resolve_dataset, resolve_model
from asyncrl.launch.hub_run import HUB_KEY, resolve_run_names
from asyncrl.launch.preflight import preflight
from asyncrl.config.presets import PRESETS
from tests.hub_helpers import COMMIT_A, COMMIT_B, SUMS, fake_hub
from tests.cli_forks import cli_forks
from tests.run_helpers import NO_EVAL, ROOT, train_here

GSM8K_KEYS = ["--data.prompt-key", "question", "--data.answer-key", "answer", "--data.data-source", "openai/gsm8k"]


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory, smollm2_tokenizer):
    return fake_hub(tmp_path_factory.mktemp("hf-home"), smollm2_tokenizer)


@pytest.fixture
def offline_hub(hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hub_home


def test_names_are_told_from_paths(tmp_path, monkeypatch):
    assert model_name("Qwen/Qwen3-1.7B") == HubName("Qwen/Qwen3-1.7B", None, "model")
    assert model_name("hf:Qwen/Qwen3-1.7B@v1.0") == HubName("Qwen/Qwen3-1.7B", "v1.0", "model")
    for local in ("smollm2", "random:tiny-qwen2", "/models/Qwen3", "./a/b", "~/m/x", "a/b.gguf", "a/b/c", None):
        assert model_name(local) is None, local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    assert model_name("models/qwen") is None  # a local directory of that name wins
    assert dataset_name("hf:openai/gsm8k") == HubName("openai/gsm8k", None, "dataset", split="train")
    assert dataset_name("hf:openai/gsm8k@r1:main/test") == HubName("openai/gsm8k", "r1", "dataset", "main", "test")
    assert dataset_name("data/train.parquet") is None
    with pytest.raises(ValueError, match="not a Hub dataset name; write hf:ORG/NAME"):
        dataset_name("hf:gsm8k")


def test_a_model_resolves_by_name_branch_tag_and_commit_from_the_cache(offline_hub):
    snapshots = offline_hub / "hub" / "models--acme--tiny" / "snapshots"
    for given, commit in (("acme/tiny", COMMIT_A), ("acme/tiny@main", COMMIT_A), ("acme/tiny@v2", COMMIT_B),
                          (f"acme/tiny@{COMMIT_B}", COMMIT_B)):
        resolved = resolve_model(given, "--model.path")
        assert (resolved.path, resolved.commit) == (str(snapshots / commit), commit), given
    pinned = resolve_model("acme/tiny", "--model.path", commit=COMMIT_B)  # a resume's pin wins over main
    assert pinned.commit == COMMIT_B and pinned.record()["revision"] == "main"


@pytest.mark.parametrize("given, flag, expected", [
    ("acme/nothing", "--model.path", "--model.path acme/nothing: not in the Hugging Face cache ({cache}), and "
     "HF_HUB_OFFLINE=1 forbids downloading it; run once with network access (unset HF_HUB_OFFLINE), or give a "
     "local path"),
    ("acme/tiny@v9", "--model.tokenizer", "--model.tokenizer acme/tiny@v9: not in the Hugging Face cache ({cache}) "
     "at revision 'v9', and HF_HUB_OFFLINE=1 forbids downloading it"),
    ("acme/pickled", "--model.path", "--model.path acme/pickled: no *.safetensors weights (it holds "
     "pytorch_model.bin: pickled weights, which asyncrl never loads); pick a revision or a repository with "
     "safetensors weights"),
])
def test_a_model_that_does_not_resolve_gets_one_message_naming_the_flag(offline_hub, given, flag, expected):
    with pytest.raises(ValueError) as err:
        resolve_model(given, flag)
    assert str(err.value).startswith(expected.format(cache=offline_hub / "hub")), str(err.value)


def test_a_dataset_split_resolves_through_its_card_or_its_file_names(offline_hub):
    base = offline_hub / "hub" / "datasets--acme--sums" / "snapshots" / COMMIT_A
    assert resolve_dataset("hf:acme/sums", "--data.path").path == str(base / "main" / "train-00000-of-00001.parquet")
    assert resolve_dataset("hf:acme/sums:test", "--data.path").path == str(base / "main" / "test-00000-of-00001.parquet")
    assert resolve_dataset("hf:acme/sums:plain/train", "--data.path").path == str(base / "plain" / "train.jsonl")
    flat = resolve_dataset("hf:acme/flat", "--eval.data")
    assert flat.path.endswith("train.jsonl") and flat.commit == COMMIT_A
    for given, expected in (
            ("hf:acme/sums:validation", "--data.path hf:acme/sums:validation: config 'main' of acme/sums has no split "
                                        "'validation'; its splits: train, test"),
            ("hf:acme/sums:socratic/train", "--data.path hf:acme/sums:socratic/train: acme/sums has no config "
                                            "'socratic'; its configs: main, plain"),
            ("hf:acme/flat:test", "--data.path hf:acme/flat:test: no file of split 'test' in acme/flat"),
            ("hf:acme/none", "--data.path hf:acme/none: not in the Hugging Face cache")):
        with pytest.raises(ValueError) as err:
            resolve_dataset(given, "--data.path")
        assert str(err.value).startswith(expected), str(err.value)


def _config(*args: str) -> RunConfig:
    return tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1], args=["--wandb", "off", *NO_EVAL, *args])


def test_the_checks_before_launch_resolve_names_and_name_the_flag_of_what_is_wrong(offline_hub, tmp_path):
    run = ["--run-dir", str(tmp_path / "run")]
    report = preflight(_config("--model.path", "acme/tiny", "--data.path", "hf:acme/sums:main/train", *GSM8K_KEYS,
                               *run))
    assert report.ok, report.problems
    assert report.config.model.path.endswith(f"snapshots/{COMMIT_A}") and report.config.data.path.endswith(".parquet")
    assert f"model.path: acme/tiny resolved to commit {COMMIT_A[:12]} of acme/tiny" in "\n".join(report.facts)
    assert any(f.startswith("data: ") and "16 rows, 16 kept" in f for f in report.facts), report.facts
    [prompt] = report.spec.source_factory.file_prompts()[:1]
    assert prompt.data_source == "openai/gsm8k" and prompt.ground_truth.endswith("#### 2")
    # the raw split without the field mapping: one message, naming the flags that map the fields
    [problem] = preflight(_config("--model.path", "acme/tiny", "--data.path", "hf:acme/sums", *run)).problems
    assert problem.startswith("--data.path hf:acme/sums: ") and "missing field 'prompt'" in problem
    assert "--data.prompt-key" in problem and "the row's fields: question, answer" in problem
    [problem] = preflight(_config("--model.path", "acme/pickled", *run)).problems
    assert problem.startswith("--model.path acme/pickled: no *.safetensors weights")
    [problem] = preflight(_config("--model.path", "acme/tiny", "--data.path", "hf:acme/sums", "--data.prompt-key",
                                  "query", *run)).problems
    assert "missing field 'query' (--data.prompt-key); the row's fields: question, answer" in problem


def test_a_resume_resolves_a_name_to_the_commit_its_run_recorded(offline_hub, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {HUB_KEY: {"model.path": {"name": "acme/tiny", "commit": COMMIT_B}}}
    (run_dir / "config.json").write_text(json.dumps(record))
    cfg = _config("--model.path", "acme/tiny", "--run-dir", str(run_dir))
    assert resolve_run_names(cfg)[1]["model.path"].commit == COMMIT_A  # a new run: the branch's head
    resumed, named = resolve_run_names(dataclasses.replace(cfg, resume=True))
    assert named["model.path"].commit == COMMIT_B and resumed.model.path.endswith(COMMIT_B)
    other, named = resolve_run_names(dataclasses.replace(cfg, resume=True, model=dataclasses.replace(
        cfg.model, path="acme/tiny@v2")))  # another name than the recorded one: no pin
    assert named["model.path"].name.revision == "v2"


@pytest.mark.slow
def test_a_run_trains_from_a_named_model_and_dataset_and_records_the_commits(offline_hub, tmp_path, capsys):
    """`asyncrl train` with a Hub model and a Hub dataset, offline (in this process, the local launcher): the run
    trains from the snapshot, config.json holds the names and their commits, and a resume passes the checks."""
    run_dir = tmp_path / "run"
    common = ["cpu-demo", "--model.path", "acme/tiny", "--data.path", "hf:acme/sums", *GSM8K_KEYS, "--wandb", "off",
              *NO_EVAL, "--rollout.max-new-tokens", "4", "--run-dir", str(run_dir)]
    train_here(*common, "--async-training.total-versions", "2", "--checkpoint-every", "2")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 2 and summary["dead_agents"] == []
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["path"] == "acme/tiny" and config["data"]["path"] == "hf:acme/sums"
    assert config[HUB_KEY]["model.path"]["commit"] == COMMIT_A
    assert config[HUB_KEY]["data.path"]["path"].endswith("train-00000-of-00001.parquet")
    capsys.readouterr()
    train_here(*common, "--resume", "--async-training.total-versions", "3", "--dry-run")
    dry = capsys.readouterr().out
    assert "resume: from" in dry and f"acme/tiny resolved to commit {COMMIT_A[:12]}" in dry
    with pytest.raises(SystemExit) as missing:  # the command prints the message alone, no traceback
        train_here(common[0], "--model.path", "acme/tiny@nope", "--run-dir", str(tmp_path / "x"))
    assert isinstance(missing.value.code, str)
    assert "--model.path acme/tiny@nope: not in the Hugging Face cache" in missing.value.code
    assert not (tmp_path / "x").exists()  # refused before anything started


@pytest.mark.e2e
def test_the_gsm8k_converter_and_the_data_commands_read_a_hub_split(hub_home, tmp_path):
    env = {"HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    converted, inspected, out = cli_forks([
        ["data", "convert-gsm8k", "--src", "hf:acme/sums:test", "--out", str(tmp_path / "t.jsonl")],
        ["data", "inspect", "hf:acme/sums:plain/train", "--model", "acme/tiny"],
        ["eval", "--model", "acme/tiny@v2", "--data.path", "hf:acme/sums:plain/train", "--data.data-source",
         "arithmetic", "--num-prompts", "2", "--n", "1", "--temperature", "0", "--max-new-tokens", "2"]],
        cwd=ROOT, env=env)
    assert converted.returncode == 0, converted.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["reward_model"]["ground_truth"] for r in rows] == [s["answer"].split("#### ")[1] for s in SUMS[:4]]
    assert inspected.returncode == 0 and "16 rows" in inspected.stdout, inspected.stderr
    assert "data sources: sums (16)" in inspected.stdout
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["prompts"] == 2
