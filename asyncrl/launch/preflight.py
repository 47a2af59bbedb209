"""Every check of a run that needs no process: made before anything is spawned or written.

    report = preflight(cfg)
    if report.problems: ...        # each names the flag (or file and row), the value and the fix
    print(report.render())         # what `asyncrl train ... --dry-run` prints

Checked: the config's values (`RunConfig.validate`), the devices, the model path and its architecture (which
implementation trains it and what that allows, and the engine: `asyncrl.launch.model_checks`; LoRA's targets and
rank against its layers, `asyncrl.launch.lora_check`), the
run directory, the reward plug-ins and that every data source has a reward, the data (file exists and
parses, fields, empty prompts, prompt lengths against `--rollout.max-prompt-length`, data size against the
learner step), the trainer host's memory for the sample queue and a learner step (`asyncrl.launch.step_checks`:
a --trainer.mini-batch-size too large is refused with the largest that fits), every GPU's memory
(`asyncrl.launch.memory_checks`: a layout that cannot fit is refused, a
--rollout.max-slots the user did not give is lowered to fit) and a resume's checkpoint. Checks that depend on a
failed one are skipped rather than reported twice. Notes are facts worth knowing that do not stop the run.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable, Collection

from asyncrl.checkpoint import list_checkpoints
from asyncrl.config import RunConfig
from asyncrl.data.files import load_prompt_file
from asyncrl.launch.device_checks import check_devices, check_tensor_parallel
from asyncrl.launch.lora_check import check_lora
from asyncrl.launch.memory_checks import CudaMemory, DeviceMemory, check_memory, cuda_index
from asyncrl.launch.network_checks import check_network
from asyncrl.launch.step_checks import check_step_memory, host_available
from asyncrl.launch.model_checks import check_model_path, engine_checks, implementation_problems, resolved_backend
from asyncrl.envs import ChatRenderer, env_tool_schemas, load_env
from asyncrl.config.flags import flag, shown
from asyncrl.planning.command import model_shape
from asyncrl.tools.hub import Resolved, model_name
from asyncrl.launch.hub_run import resolve_run_names
from asyncrl.launch.resume_check import check_resume
from asyncrl.rewards.plugin import RewardTable
from asyncrl.rpc.assembly import resume_checkpoint
from asyncrl.rpc.spec import RunSpec
from asyncrl.launch.run_dir import overwrite_note, owns_run_dir, run_dir_problem
from asyncrl.launch.run_spec import build_spec, row_keys, run_tokenizer, task_of, tokenizer_path, with_system

__all__ = ["CheckedRun", "preflight", "check_devices", "check_model_path", "check_run_dir", "check_tensor_parallel",
           "check_lora"]


@dataclasses.dataclass
class CheckedRun:
    """What the checks found (problems stop the run; notes and facts are printed) and, once the config
    validated, the run it describes: `asyncrl.launch.train.train` launches that spec."""

    config: RunConfig
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    facts: list[str] = dataclasses.field(default_factory=list)
    """What was checked and found fine ("data: 7473 rows, 7473 kept")."""
    spec: RunSpec | None = None
    """The run `config` describes (`asyncrl.launch.run_spec.build_spec`), built once; None when it did not validate."""
    named: dict[str, Resolved] = dataclasses.field(default_factory=dict)
    """The Hub names `config` was given, by field, and what they resolved to (`config` holds the local paths)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        lines = [f"  ok    {f}" for f in self.facts] + [f"  note  {n}" for n in self.notes]
        lines += [f"  error {p}" for p in self.problems]
        return "\n".join(lines)

    def failure(self, prog: str) -> str:
        """The message a command exits with: one line per problem."""
        head = f"{prog}: " + ("" if len(self.problems) == 1 else f"{len(self.problems)} problems:\n  ")
        return head + "\n  ".join(self.problems)


def check_run_dir(run_dir: str) -> str | None:
    """A problem when the run directory cannot be created or written."""
    p = pathlib.Path(run_dir)
    if p.exists() and not p.is_dir():
        return f"--run-dir {run_dir}: is a file, not a directory"
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"--run-dir {run_dir}: {existing} is not writable; point --run-dir somewhere you can write"
    return None


class _Checks:
    """One pass of checks over a config; `report` collects the results."""

    def __init__(self, cfg: RunConfig, say: Callable[[str], None], given: Collection[str] | None,
                 memory: DeviceMemory | None, host: Callable[[], int] | None):
        self.cfg, self.say, self.report = cfg, say, CheckedRun(cfg)
        self.given, self.memory, self.host = given, memory, host or host_available

    def run(self) -> CheckedRun:
        if not self._hub_names():
            return self.report
        cfg = self.cfg
        try:
            cfg.validate()
            self.report.spec = build_spec(cfg, validated=True)
            valid = True
        except ValueError as err:
            self.report.problems.append(str(err))
            valid = False  # the data checks read the values validate refused: they wait for a fix
        devices_ok = self._devices()
        self._network()
        self._backend()
        model_ok = self._model()
        if (problem := check_run_dir(cfg.run_dir)) is not None:
            self.report.problems.append(problem)
        else:
            self._run_dir()
        if cfg.trainer.param_dtype == "bfloat16":
            self.report.notes.append(
                f"--trainer.param-dtype bfloat16 keeps no fp32 copy of the weights: an update smaller than half a "
                f"bf16 step of its weight is lost (at --trainer.optim.lr 1e-6 a step moves under 1% of the weights: "
                f"tests/learner/test_learner.py); --trainer.optim.lr is {cfg.trainer.optim.lr:g}; float32 (the default) "
                "keeps every update")
        if model_ok and valid:
            lora = check_lora(cfg)
            self.report.problems += lora.problems
            self.report.facts += lora.facts
            self.report.notes += lora.notes
        if model_ok and valid and devices_ok:
            self._memory()
        if valid and (problem := check_step_memory(self.cfg, available=self.host())) is not None:
            self.report.problems.append(problem)
        table = self._rewards()
        if model_ok and valid:
            self._data(table)
            self._eval(table)
        if not self.report.problems and (cfg.resume or cfg.resume_or_start):
            self._resume()
        self.report.problems = list(dict.fromkeys(self.report.problems))  # build_spec and a check may say the same
        return self.report

    def _hub_names(self) -> bool:
        """Hub names (`asyncrl.tools.hub`) resolve to local files before any other check reads them; False (with the
        problem) when one does not."""
        if any(model_name(p) for p in (self.cfg.model.path, self.cfg.model.tokenizer)) or any(
                p and p.startswith("hf:") for p in (self.cfg.data.path, *self.cfg.eval.data)):
            self.say("resolving Hugging Face Hub names through the local cache")
        try:
            self.cfg, self.report.named = resolve_run_names(self.cfg)
        except ValueError as err:
            self.report.problems.append(str(err))
            return False
        self.report.config = self.cfg
        for field, resolved in self.report.named.items():
            self.report.facts.append(f"{field.split('[')[0]}: {resolved.given} resolved to commit {resolved.commit[:12]} "
                                     f"of {resolved.name.repo_id} ({resolved.path})")
        return True

    def _devices(self) -> bool:
        placement = self.cfg.placement
        problems = check_devices({"--placement.trainer-devices": placement.trainer_devices,
                                  "--placement.agent-devices": placement.agent_devices})
        problems += self._repeated_gpus()
        self.report.problems += problems
        if not problems:
            self.report.facts.append(f"devices: trainer {' '.join(placement.trainer_devices)}; "
                                     f"agents {' '.join(placement.agent_devices)}")
        return not problems

    def _repeated_gpus(self) -> list[str]:
        """A GPU listed twice in --placement.trainer-devices: two ranks of one NCCL group on one GPU, which NCCL
        refuses ("Duplicate GPU detected") after every process has started (colocated runs list the same
        devices for their engines, so this covers them too). A torchrun job's 'cuda' is each rank's own GPU."""
        placement = self.cfg.placement
        names = [d for d in placement.trainer_devices if not (d == "cuda" and placement.launcher == "torchrun")]
        indices = [i for d in names if (i := cuda_index(d)) is not None]
        twice = sorted({i for i in indices if indices.count(i) > 1})
        if not twice:
            return []
        distinct = list(dict.fromkeys(f"cuda:{i}" for i in indices))
        return [f"--placement.trainer-devices {shown(placement.trainer_devices)}: cuda:{twice[0]} is listed twice; a "
                "trainer group runs one rank per GPU (NCCL refuses two ranks on one GPU: \"Duplicate GPU detected\"); "
                f"list each GPU once (--placement.trainer-devices {' '.join(distinct)})"]

    def _memory(self) -> None:
        """Every GPU's predicted peak against its free memory (`asyncrl.launch.memory_checks`); lowers a
        --rollout.max-slots the user did not give (`given`) to what fits."""
        cfg = self.cfg
        if not any(cuda_index(d) is not None for d in (*cfg.placement.trainer_devices, *cfg.placement.agent_devices)):
            return
        try:
            shape = model_shape(cfg.model.path)
        except (ValueError, OSError) as err:
            self.report.notes.append(f"memory: not predicted ({err})")
            return
        slots_given = self.given is None or "--rollout.max-slots" in self.given
        check = check_memory(cfg, shape, self.memory or CudaMemory(), slots_given=slots_given,
                             vllm=resolved_backend(cfg) == "vllm")
        self.report.problems += check.problems
        self.report.facts += check.facts
        self.report.notes += check.notes
        if check.max_slots is not None:
            rollout = dataclasses.replace(cfg.rollout, max_slots=check.max_slots)
            self.cfg = self.report.config = dataclasses.replace(cfg, rollout=rollout)
            if self.report.spec is not None:
                self.report.spec = dataclasses.replace(self.report.spec, rollout=rollout)

    def _network(self) -> None:
        check = check_network(self.cfg, backend=resolved_backend(self.cfg))
        self.report.problems += check.problems
        self.report.facts += check.facts

    def _backend(self) -> None:
        if resolved_backend(self.cfg) != "vllm":
            self._decode_attention()
            return
        problems, facts = engine_checks(self.cfg)
        self.report.problems += problems
        self.report.facts += facts

    def _decode_attention(self) -> None:
        off_cuda = [d for d in self.cfg.placement.agent_devices if not d.startswith("cuda")]
        if self.cfg.rollout.decode_attention == "triton" and off_cuda:
            self.report.problems.append(
                f"--rollout.decode-attention triton: the Triton decode kernel runs on CUDA, but agents run on "
                f"{' '.join(off_cuda)}; use --rollout.decode-attention auto (SDPA there) or sdpa")

    def _model(self) -> bool:
        ok = True
        paths = [("--model.path", self.cfg.model.path)]
        if self.cfg.model.tokenizer is not None:
            paths.append(("--model.tokenizer", self.cfg.model.tokenizer))
        for option, path in paths:
            problem, fact = check_model_path(path, option, impl=self.cfg.model.impl if option == "--model.path" else None)
            if problem is not None:
                self.report.problems.append(problem)
                ok = False
            else:
                self.report.facts.append(fact if option == "--model.path" else fact.replace("model:", "tokenizer:"))
        if ok:
            self._implementation()
        return ok

    def _implementation(self) -> None:
        found = implementation_problems(self.cfg)
        self.report.problems += [p for p in found if p not in self.report.problems]  # build_spec may say it too

    def _rewards(self):
        try:
            table = RewardTable.from_specs(self.cfg.reward.fn)
        except ValueError as err:
            self.report.problems.append(str(err))
            return None
        for spec in self.cfg.reward.fn:
            self.report.facts.append(f"reward: {spec}")
        return table

    def _tokenizer(self):
        path = tokenizer_path(self.cfg)
        if path.startswith("random:"):
            return None
        self.say("loading the tokenizer" + (" (a GGUF model is converted on first use, then cached)"
                                            if path == "smollm2" or path.endswith(".gguf") else ""))
        return run_tokenizer(path)

    def _data(self, table) -> None:
        cfg = self.cfg
        try:
            tokenizer = self._tokenizer()
        except (ValueError, OSError) as err:
            self.report.problems.append(f"{flag('model', 'path')} {cfg.model.path}: its tokenizer does not load: {err}")
            return
        step = cfg.trainer.mini_batch_size * cfg.async_training.require_batches
        tools = None
        if cfg.env.fn is not None:
            ok, tools = self._env(tokenizer)
            if not ok:
                return
        if cfg.data.path is not None:
            sources = self._prompt_file(tokenizer, step, tools)
            if sources is None:
                return
        else:
            sources = self._task(tokenizer, tools)
            if sources is None:
                return
        if table is not None:
            for source, where in sources.items():
                found = table.get(source)
                if found is None and cfg.env.fn is not None:
                    self.report.notes.append(
                        f"no reward function for data_source {source!r}: every episode's reward must come from "
                        f"--env.fn {cfg.env.fn} (an episode it gives no reward would stop the run)")
                elif found is None:
                    self.report.problems.append(
                        f"--reward.fn: no reward function for data_source {source!r} (first at {where}); known data sources "
                        f"{', '.join(table.known)}; pass --reward.fn PATH.py:NAME (or "
                        f"--reward.fn {source}=PATH.py:NAME for this data source only)")
                else:
                    self.report.facts.append(f"reward of {source!r}: {found.name}")

    def _eval(self, table) -> None:
        """--eval.*: the held-out prompts load and render, and every data source of them has a reward."""
        cfg, spec = self.cfg, self.report.spec
        if cfg.eval.enabled and not cfg.evaluates:
            self.report.notes.append(
                f"evaluation: none: the run trains on the prompt file --data.path {cfg.data.path} and no "
                "--eval.data names held-out prompts; pass --eval.data PATH [PATH ...] to evaluate (or turn the "
                "schedule off: --eval.every-versions 0 --eval.no-at-start --eval.no-at-end)")
        if spec is None or spec.eval_prompts is None:
            return
        for path in cfg.eval.data:
            if not pathlib.Path(path).is_file():
                self.report.problems.append(f"--eval.data {path}: no such file")
                return
        self.say("checking the held-out prompts (--eval.*)")
        try:
            prompts = spec.eval_prompts()
        except (ValueError, OSError) as err:
            self.report.problems.append(f"--eval.data: {err}" if cfg.eval.data else f"--eval: {err}")
            return
        sources = sorted({p.data_source for p in prompts})
        missing = [s for s in sources if table is not None and table.get(s) is None]
        if missing and cfg.env.fn is None:
            self.report.problems.append(f"--eval.data: no reward function for data_source {missing[0]!r}; pass "
                                        f"--reward.fn {missing[0]}=PATH.py:NAME")
            return
        schedules = []
        if cfg.eval.every_versions:
            schedules.append(f"every {cfg.eval.every_versions} versions")
        if cfg.eval.every_seconds:
            schedules.append(f"every {cfg.eval.every_seconds:g} s")
        every = " or ".join(schedules) or "once"
        self.report.facts.append(f"evaluation: {len(prompts)} held-out prompts ({', '.join(sources)}), {every}, "
                                 f"mean@{cfg.eval.n}, at most {cfg.eval.max_share:g} of an agent's sequence slots")

    def _env(self, tokenizer) -> tuple[bool, list[dict] | None]:
        """(loads, its tools' schemas): --env.fn imports, and observations render with this chat template."""
        fn = self.cfg.env.fn
        try:
            factory = load_env(fn)
            tools = env_tool_schemas(factory)
        except ValueError as err:
            self.report.problems.append(str(err))
            return False, None
        if tokenizer is None:
            self.report.facts.append(f"environment: {fn} (no tokenizer: observations must be token ids)")
            return True, tools
        try:
            ChatRenderer(tokenizer, tools=tools)
        except ValueError as err:
            self.report.problems.append(f"--env.fn {fn}: {err}")
            return False, None
        names = ", ".join(t["function"]["name"] for t in tools or ())
        if tools and getattr(tokenizer, "chat_template", None):
            probe = [{"role": "user", "content": "hi"}]
            plain = tokenizer.apply_chat_template(probe, tokenize=False)
            if plain == tokenizer.apply_chat_template(probe, tools=tools, tokenize=False):
                self.report.notes.append(
                    f"--env.fn {fn}: this model's chat template does not render tools, so prompts do not describe "
                    f"{names}; describe the call format in --data.system-prompt, or use a model whose template "
                    "knows tools (Qwen2.5, Llama 3.1+)")
        self.report.facts.append(f"environment: {fn}" + (f" (tools: {names})" if names else ""))
        return True, tools

    def _prompt_file(self, tokenizer, step: int, tools: list[dict] | None = None) -> dict[str, str] | None:
        cfg = self.cfg
        if tokenizer is None:
            self.report.problems.append(
                f"--data.path {cfg.data.path}: rendering its prompts needs a tokenizer, and --model.path "
                f"{cfg.model.path} has none; set --model.tokenizer or use --data.task toy")
            return None
        if not pathlib.Path(cfg.data.path).is_file():
            self.report.problems.append(f"--data.path {cfg.data.path}: " + (
                "is a directory; give a .jsonl or .parquet file" if pathlib.Path(cfg.data.path).is_dir()
                else "no such file"))
            return None
        self.say(f"checking {cfg.data.path}")
        try:
            prompts, stats = load_prompt_file(cfg.data.path, with_system(tokenizer, None, tools),
                                              max_prompt_length=cfg.rollout.max_prompt_length,
                                              on_long=cfg.data.on_long, on_empty=cfg.data.on_empty,
                                              system_prompt=cfg.data.system_prompt, keys=row_keys(cfg.data))
        except ValueError as err:
            named = self.report.named.get("data.path")
            self.report.problems.append(f"--data.path {named.given}: {err}" if named else str(err))
            return None
        if not stats["rows"]:
            self.report.problems.append(f"--data.path {cfg.data.path}: holds no rows")
            return None
        if not prompts:
            self.report.problems.append(
                f"--data.path {cfg.data.path}: all {stats['rows']} prompts are longer than --rollout.max-prompt-length "
                f"{cfg.rollout.max_prompt_length} tokens (the longest has {stats['longest']}); raise it or add "
                "--data.on-long truncate")
            return None
        self.report.facts.append(f"data: {cfg.data.path}: {stats['rows']} rows, {stats['kept']} kept, longest "
                                 f"prompt {stats['longest']} tokens")
        if stats["filtered_too_long"]:
            self.report.notes.append(
                f"{stats['filtered_too_long']} of {stats['rows']} prompts are longer than --rollout.max-prompt-length "
                f"{cfg.rollout.max_prompt_length} tokens and are left out (--data.on-long truncate keeps their ends)")
        if stats["truncated"]:
            self.report.notes.append(f"{stats['truncated']} prompts are left-truncated to "
                                     f"{cfg.rollout.max_prompt_length} tokens")
        if stats["empty"]:
            self.report.notes.append(f"{stats['empty']} rows with an empty prompt are dropped (--data.on-empty drop)")
        if len(prompts) < step:
            self.report.notes.append(
                f"the data holds {len(prompts)} prompts, fewer than a learner step's {step} groups "
                f"(--trainer.mini-batch-size × --async-training.require-batches): an epoch wraps inside a step, so "
                "prompts repeat within it")
        return stats["first_row_of_source"]

    def _task(self, tokenizer, tools: list[dict] | None = None) -> dict[str, str] | None:
        cfg = self.cfg
        task = task_of(cfg.data)
        try:
            prompt = task.prompt(0, with_system(tokenizer, cfg.data.system_prompt, tools))
        except ValueError as err:
            self.report.problems.append(f"--data.task {cfg.data.task}: {err}")
            return None
        if len(prompt.prompt_ids) > cfg.rollout.max_prompt_length:
            self.report.problems.append(
                f"--rollout.max-prompt-length {cfg.rollout.max_prompt_length} is invalid: the {cfg.data.task} task's "
                f"prompts take {len(prompt.prompt_ids)} tokens with this tokenizer and system prompt; raise it")
            return None
        self.report.facts.append(f"data: the {cfg.data.task} task (prompt 0 has {len(prompt.prompt_ids)} tokens)")
        return {prompt.data_source: f"the {cfg.data.task} task"}

    def _run_dir(self) -> None:
        """One run per run directory (`asyncrl.launch.run_dir`): a new run into a used one is refused."""
        problem = run_dir_problem(self.cfg)
        if problem is not None:
            self.report.problems.append(problem)
        elif (note := overwrite_note(self.cfg)) is not None:
            self.report.notes.append(note)

    def _resume(self) -> None:
        """The checkpoint a resume loads (nothing on disk is repaired here) and what the resume changes
        (`asyncrl.launch.resume_check`): refused changes are problems, the allowed ones one note."""
        if not owns_run_dir(self.cfg):
            return
        try:
            found = resume_checkpoint(self.report.spec, repair=False)
        except ValueError as err:
            self.report.problems.append(str(err))
            return
        if found is None:
            return
        check = check_resume(self.cfg, found, named=self.report.named)
        self.report.problems += check.problems
        self.report.notes += check.notes + ([check.line] if check.line and not check.problems else [])
        newest = list_checkpoints(self.cfg.run_dir)[-1:]
        skipped = [p.name for p in newest if p.name > check.name]
        self.report.facts.append(f"resume: from {found.with_name(check.name)}" + (
            f" (restored from {found.name})" if found.name != check.name else "")
            + (f"; the newer {skipped[0]} does not verify and is moved aside" if skipped else ""))


def preflight(cfg: RunConfig, *, say: Callable[[str], None] = lambda line: None, given: Collection[str] | None = None,
              memory: DeviceMemory | None = None, host: Callable[[], int] | None = None) -> CheckedRun:
    """Run every up-front check of `cfg`; `say` gets a line before each slow one (loading a tokenizer). `given`: the
    flags the user typed (`asyncrl.config.flags.given_flags`); a value not among them was the preset's, and the
    memory check may lower it (--rollout.max-slots) to fit. None: every value of `cfg` was chosen (the Python API),
    so a layout that does not fit is refused. `memory`: where GPUs' free memory is read (default: the driver);
    `host`: the bytes of host memory available (default: /proc/meminfo)."""
    return _Checks(cfg, say, given, memory, host).run()
