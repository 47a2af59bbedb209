"""A fake Hugging Face Hub cache, laid out as `huggingface_hub` writes it (`models--ORG--NAME/refs/main` holding
a commit, `snapshots/<commit>/<files>`), for the offline tests of Hub names (`HF_HOME` pointed at it,
`HF_HUB_OFFLINE=1`)."""

from __future__ import annotations

import pathlib

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
CARD = """---
license: mit
configs:
- config_name: main
  default: true
  data_files:
  - split: train
    path: main/train-*.parquet
  - split: test
    path: main/test-*.parquet
- config_name: plain
  data_files:
  - split: train
    path: plain/train.jsonl
---
# sums
"""
SUMS = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a in range(1, 5) for b in range(1, 5)]


def snapshot(root: pathlib.Path, kind: str, repo: str, commit: str, ref: str | None = "main") -> pathlib.Path:
    """The snapshot directory of `repo` at `commit` (created), with `ref` pointing at it."""
    folder = root / "hub" / f"{kind}s--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    if ref is not None:
        (folder / "refs" / ref).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def fake_hub(root: pathlib.Path, tokenizer) -> pathlib.Path:
    """HF_HOME with: model acme/tiny (a random tiny SmolLM2-shaped model with SmolLM2's tokenizer, safetensors) at
    COMMIT_A on main and at COMMIT_B under the tag v2; acme/pickled (only pytorch_model.bin); dataset acme/sums
    (a card with configs main (default: train and test parquet) and plain (train jsonl)) and dataset
    acme/flat (no card configs: train.jsonl)."""
    from asyncrl.data.files import write_rows
    from asyncrl.policies.loading import random_model, save_pretrained
    for commit, ref, seed in ((COMMIT_A, "main", 0), (COMMIT_B, "v2", 1)):
        save_pretrained(random_model("tiny-smollm2", seed=seed), snapshot(root, "model", "acme/tiny", commit, ref),
                        tokenizer=tokenizer)
    pickled = snapshot(root, "model", "acme/pickled", COMMIT_A)
    (pickled / "config.json").write_text('{"model_type": "llama"}')
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    sums = snapshot(root, "dataset", "acme/sums", COMMIT_A)
    (sums / "README.md").write_text(CARD)
    write_rows(SUMS, sums / "main" / "train-00000-of-00001.parquet")
    write_rows(SUMS[:4], sums / "main" / "test-00000-of-00001.parquet")
    write_rows([{"prompt": r["question"], "ground_truth": r["answer"].split("#### ")[1], "data_source": "sums"}
                for r in SUMS], sums / "plain" / "train.jsonl")
    flat = snapshot(root, "dataset", "acme/flat", COMMIT_A)
    write_rows(SUMS[:5], flat / "train.jsonl")
    return root


def readme_hub(root: pathlib.Path, tokenizer, gsm8k_rows: list[dict]) -> pathlib.Path:
    """HF_HOME holding what the README's Hub commands name, offline: HuggingFaceTB/SmolLM2-135M-Instruct (random
    tiny weights, SmolLM2's tokenizer) and openai/gsm8k (its card's configs main and socratic; `gsm8k_rows` as
    every split)."""
    from asyncrl.data.files import write_rows
    from asyncrl.policies.loading import random_model, save_pretrained
    save_pretrained(random_model("tiny-smollm2"),
                    snapshot(root, "model", "HuggingFaceTB/SmolLM2-135M-Instruct", COMMIT_A), tokenizer=tokenizer)
    gsm8k = snapshot(root, "dataset", "openai/gsm8k", COMMIT_A)
    card = ["---", "configs:"]
    for config in ("main", "socratic"):
        card += [f"- config_name: {config}", "  data_files:"]
        for split in ("train", "test"):
            card += [f"  - split: {split}", f"    path: {config}/{split}-*"]
            write_rows(gsm8k_rows, gsm8k / config / f"{split}-00000-of-00001.parquet")
    (gsm8k / "README.md").write_text("\n".join(card + ["---", "# GSM8K"]) + "\n")
    return root
