"""The `asyncrl …` commands of README.md and of the pages in docs/, in the order a reader meets them (README.md,
then each page in the order of the README's table of pages), in a fresh directory, and what docs/development.md
says of them (`command_kinds`; the page states each count, and a test holds it to them):

- run for real: five `asyncrl train` commands with a tiny model and budget appended at the end (after
  `algorithm:NAME` too, where flags may follow it) — the plain `asyncrl train cpu-demo` (its final checkpoint
  is what the commands page's `asyncrl eval` reads), the worked examples of a task and an environment of your
  own, DAPO, and `cpu-demo-lora` (whose checkpoint `export` and the LoRA `eval` read) — and every command of
  RUN_FOR_REAL (`eval` with a smaller budget appended). `eval` and `export` name a run directory (its newest
  checkpoint), so every training runs 2 versions;
- dry-run: the other `asyncrl train` commands, with `--dry-run` (every up-front check: config, devices, model,
  rewards, data; nothing starts);
- refused: commands naming a model you download (`/models/…`) run until they are refused up front, naming
  that path alone;
- not run: NOT_RUN, with the reason (GPUs, minutes, a second running job, a synopsis).

A command that fits none of these (a new subcommand, say) fails `test_every_command_has_a_kind`: put it in one.
Every command runs, in order, in a fork of one process that imported the library once (tests/cli_forks.py): a
process of its own, as `asyncrl ARGS` would be, without the seconds of imports a fresh interpreter pays; a real
training's launcher starts its role processes as it always does.
The benchmark reports (docs/benchmarks/) are not read: their commands need GPUs or hours.

The same pages' links are checked here too: every relative link and image in README.md, BENCHMARKS.md and docs/
names a file or folder that exists, and an `#anchor` a heading of the page it points to; BENCHMARKS.md indexes
every dated report, and docs/benchmarks/archive/README.md every superseded one.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil

import pytest

from tests.cli_forks import cli_forks
from tests.timing import limit

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_TRAIN = ["--model.path", "random:tiny-smollm2", "--model.tokenizer", "smollm2", "--wandb", "off",
              "--rollout.max-new-tokens", "2"]
TINY_TOY = ["--model.path", "random:tiny-qwen2", "--data.task", "toy"]
TRAINED_FOR_REAL = {
    "asyncrl train cpu-demo": TINY_TRAIN + ["--async-training.total-versions", "2"],
    "asyncrl train cpu-demo --data.path examples/word_length/data.jsonl --reward.fn examples/word_length/reward.py:score"
    " --run-dir runs/word_length": TINY_TRAIN + ["--async-training.total-versions", "2"],
    "asyncrl train cpu-retry --data.path examples/guess_number/data.jsonl --env.fn examples/guess_number/env.py:Guess"
    " --run-dir runs/guess_number": TINY_TRAIN[:-2] + ["--async-training.total-versions", "2", "--rollout.n", "2",
                                                      "--trainer.mini-batch-size", "2"],  # a 4x smaller step
    # once passed --dry-run and then failed in its first train step (DAPO's buffer exceeded the token budget);
    # on the toy task, since a random model scores 0 on every sum and DAPO's dynamic sampling would drop every group
    # flags on both sides of algorithm:dapo, the run's included (`--wandb off`), as a user appends them
    "asyncrl train cpu-demo --run-dir runs/dapo algorithm:dapo --algorithm.kl-loss-coef 0.001 --wandb off":
        TINY_TOY + ["--async-training.total-versions", "2"],
    # its final checkpoint is what the LoRA page's `asyncrl export` and `eval` read (given the run directory)
    "asyncrl train cpu-demo-lora --run-dir runs/cpu-demo-lora": TINY_TRAIN + ["--async-training.total-versions", "2"],
}
RUN_FOR_REAL = ("eval", "export", "data", "report", "plan")  # the subcommands that run for real, whatever their flags
SMALLER = {"eval": ["--num-prompts", "4", "--max-new-tokens", "4"]}
NOT_RUN = {
    "asyncrl train PRESET [--field value ...]": "a synopsis",
    "asyncrl bench engine [--batch-sizes 64 256]": "a GPU benchmark (tests/bench/test_bench.py runs it small on CPU)",
    "asyncrl bench learner": "a benchmark of minutes (tests/bench/test_bench.py runs it small)",
    "asyncrl bench async --devices cuda:0 cuda:1": "needs two GPUs (tests/bench/test_bench_async.py runs it on CPU)",
    "asyncrl bench launch --repeats 3": "a benchmark of minutes, 8 training jobs (tests/bench/test_bench_launch.py "
                                        "runs it small)",
    "asyncrl agent --join 127.0.0.1:29511 --device cpu": "joins a running job (tests/rpc/test_supervision.py "
                                                         "runs the pair)",
}
NEEDS_DOWNLOAD = "/models/"  # commands naming a model you download: refused up front naming that path alone
DEVELOPMENT = ROOT / "docs" / "development.md"  # the page that states the counts


def doc_pages() -> list[pathlib.Path]:
    """README.md, then the pages of docs/ in the order the README's table of pages (its "Documentation"
    section) links them."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Documentation\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert section, "README.md has no '## Documentation' section with the table of pages"
    pages = []
    for target in re.findall(r"\]\((docs/[\w-]+\.md)\)", section.group(1)):
        if ROOT / target not in pages:
            pages.append(ROOT / target)
    return [ROOT / "README.md", *pages]


def commands_of(path: pathlib.Path) -> list[str]:
    """The `asyncrl …` lines of a page's bash blocks, without trailing comments."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.splitlines():
            if line.startswith("asyncrl "):
                commands.append(re.sub(r"\s+#.*$", "", line).strip())
    return commands


def doc_commands() -> list[str]:
    """Every page's commands, in the order a reader meets them."""
    return [command for page in doc_pages() for command in commands_of(page)]


def kind_of(command: str) -> str | None:
    """What test_every_doc_command_runs does with a command: "real", "dry", "refused", "not", or None."""
    args = shlex.split(command)[1:]
    if command in NOT_RUN:
        return "not"
    if NEEDS_DOWNLOAD in command:
        return "refused"
    if command in TRAINED_FOR_REAL or args[0] in RUN_FOR_REAL:
        return "real"
    if args[0] == "train":
        return "dry"
    return None


def command_kinds() -> dict[str, list[str]]:
    """The docs' commands by kind."""
    kinds = {"real": [], "dry": [], "refused": [], "not": [], None: []}
    for command in doc_commands():
        kinds[kind_of(command)].append(command)
    return kinds


def test_every_page_is_in_the_readme_table():
    listed = set(doc_pages())
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "no docs/*.md pages"
    missing = [str(p.relative_to(ROOT)) for p in pages if p not in listed]
    assert not missing, f"{missing} are not linked from README.md's table of pages: their commands would never run"


def test_the_lists_match_the_docs():
    commands = doc_commands()
    assert len(commands) >= 12
    for listed in [*TRAINED_FOR_REAL, *NOT_RUN]:
        assert listed in commands, f"{listed!r} is no longer in README.md or docs/: update tests/test_readme.py"


def test_every_command_has_a_kind():
    uncovered = command_kinds()[None]
    assert not uncovered, (f"{uncovered}: tests/test_readme.py has no kind for these: add each to TRAINED_FOR_REAL, "
                           "RUN_FOR_REAL or NOT_RUN (or name a /models/ download), and say so in docs/development.md")


def test_the_docs_say_exactly_which_of_their_commands_run():
    kinds, text = command_kinds(), " ".join(DEVELOPMENT.read_text().split())
    claims = [f"runs the {len(doc_commands())} `asyncrl` commands of README.md and the pages of docs/",
              f"{len(kinds['real'])} for real (the {len(TRAINED_FOR_REAL)} CPU trainings",
              f"{len(kinds['dry'])} `train` commands with `--dry-run`",
              f"{len(kinds['refused'])} naming `{NEEDS_DOWNLOAD}…`", f"{len(kinds['not'])} not at all"]
    for claim in claims:
        assert claim in text, f"docs/development.md no longer says {claim!r} of tests/test_readme.py: update it"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but for `-` and `_`, spaces as `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def linked_pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_link_points_to_a_file_that_exists():
    broken = []
    for page in linked_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_benchmark_report_is_indexed():
    """BENCHMARKS.md lists every dated report of docs/benchmarks/, and the archive's README every superseded one."""
    reports, archive = ROOT / "docs" / "benchmarks", ROOT / "docs" / "benchmarks" / "archive"
    for index, folder in ((ROOT / "BENCHMARKS.md", reports), (archive / "README.md", archive)):
        linked = {(index.parent / target).resolve() for target in re.findall(r"\]\(([^)#\s]+\.md)", index.read_text())}
        dated = [p for p in sorted(folder.glob("*.md")) if p.name != "README.md"]
        assert dated, folder
        missing = [str(p.relative_to(ROOT)) for p in dated if p.resolve() not in linked]
        assert not missing, f"{missing} are not linked from {index.relative_to(ROOT)}"


def test_every_path_the_pages_name_exists():
    """Paths of the repository named in backticks in README.md and docs/*.md (the benchmark reports keep the
    paths of their day)."""
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in re.findall(r"`((?:asyncrl|asyncrl_bench|scripts|tests|examples)/[\w./-]*)`", page.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing


@pytest.fixture
def workdir(tmp_path, smollm2_tokenizer, gsm8k_test_file):
    """A fresh directory with what the docs' commands expect around them: GSM8K's raw files (here its test
    split, cut in two: 1,000 rows as train.jsonl, 319 as test.jsonl, so that a split excluding the other's
    expressions keeps some), the examples, and a Hugging Face cache (hf-home, read offline) holding the Hub model
    and dataset the docs name (tests/hub_helpers.py)."""
    from tests.hub_helpers import readme_hub
    (tmp_path / "gsm8k").mkdir()
    lines = gsm8k_test_file.read_text().splitlines(keepends=True)
    (tmp_path / "gsm8k" / "train.jsonl").write_text("".join(lines[:1000]))
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(lines[1000:]))
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    rows = [json.loads(line) for line in lines]
    readme_hub(tmp_path / "hf-home", smollm2_tokenizer, rows)
    return tmp_path


def _env(cwd: pathlib.Path) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "HF_HOME": str(cwd / "hf-home"), "HF_HUB_OFFLINE": "1"}


@pytest.mark.e2e
@pytest.mark.slow
def test_every_doc_command_runs(workdir):
    commands = []
    for command in doc_commands():
        kind = kind_of(command)
        assert kind is not None, f"{command!r} has no kind (test_every_command_has_a_kind says how to give it one)"
        if kind == "not":
            continue
        args = shlex.split(command)[1:]
        if command in TRAINED_FOR_REAL:
            args += TRAINED_FOR_REAL[command]  # at the end: after a subcommand such as algorithm:dapo too
        elif kind == "dry" and "--dry-run" not in args:
            args.insert(2, "--dry-run")  # before a subcommand such as algorithm:dapo; a command whose run dir
            # another one used before it is refused, as it would be for a reader running them in order
        args += SMALLER.get(args[0], [])
        commands.append((command, args))
    ran = []
    outs = cli_forks([args for _, args in commands], cwd=workdir, env=_env(workdir), timeout=limit(600))
    for (command, args), out in zip(commands, outs, strict=True):
        if NEEDS_DOWNLOAD in command:
            path = next(a for a in args if a.startswith(NEEDS_DOWNLOAD))
            assert out.returncode != 0 and f"{path}: does not exist" in out.stderr, (command, out.stderr[-3000:])
            assert "Traceback" not in out.stderr, (command, out.stderr[-3000:])
        else:
            assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-3000:])
        ran.append(command)
    assert (workdir / "runs" / "cpu-demo" / "checkpoints" / "step_00000002").is_dir()  # the final one (d813b06)
    assert (workdir / "runs" / "cpu-demo" / "report.md").is_file()
    assert (workdir / "runs" / "word_length" / "summary.json").is_file()
    assert (workdir / "runs" / "cpu-demo-lora" / "merged" / "config.json").is_file()
    assert (workdir / "runs" / "dapo" / "summary.json").is_file()
    last = json.loads((workdir / "runs" / "guess_number" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["env/episodes"] > 0 and last["env/errors"] == 0, last  # the example environment ran its episodes
    assert len(ran) == len(doc_commands()) - len(NOT_RUN)
