"""What the check before launch predicts for mixture-of-experts recipes on 1, 2, 4 and 8 GPUs of 80 GB (an idle
H100: 79.1 of 79.6 GiB free), and whether each fits: python3 scripts/moe_memory_table.py. Predictions of
`asyncrl/launch/memory_checks.py` (the same arithmetic `asyncrl train` runs before it spawns anything), not runs.
Shapes from scripts/moe_shapes.py; GSM8K-like lengths (512-token prompts, 1,024 new tokens), n 8, whole-layer
recompute at 8,192-token micro-batches, fully async with vLLM agents on GPUs of their own."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import tempfile

from asyncrl.config import RunConfig
from asyncrl.launch.memory_checks import check_memory, device_needs
from asyncrl.planning.command import model_shape

GIB = 2**30
FREE, TOTAL = int(79.1 * GIB), int(79.6 * GIB)


class IdleH100:
    def free_and_total(self, index: int) -> tuple[int, int]:
        return FREE, TOTAL


def recipe(path: str, *, trainers: int, agents: int, lora: int, utilization: float) -> RunConfig:
    cfg = RunConfig()
    devices = [f"cuda:{i}" for i in range(trainers + agents)]
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=path),
        rollout=dataclasses.replace(cfg.rollout, backend="vllm", max_prompt_length=512, max_new_tokens=1024,
                                    vllm=dataclasses.replace(cfg.rollout.vllm, gpu_memory_utilization=utilization)),
        trainer=dataclasses.replace(cfg.trainer, gradient_checkpointing=True, checkpoint_scope="layer",
                                    max_tokens_per_micro_batch=8192),
        lora=dataclasses.replace(cfg.lora, rank=lora),
        async_training=dataclasses.replace(cfg.async_training, colocated=False),
        placement=dataclasses.replace(cfg.placement, trainer_devices=tuple(devices[:trainers]),
                                      agent_devices=tuple(devices[trainers:])))


def main() -> None:
    root = pathlib.Path(tempfile.mkdtemp(prefix="moe-shapes-"))
    rows = []
    for shape, lora in (("qwen3-30b-a3b", 32), ("olmoe-1b-7b", 0)):
        subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("moe_shapes.py")), shape,
                        str(root / shape)], check=True, stdout=subprocess.DEVNULL)
        path = f"random:{root / shape / 'config.json'}"
        dims = model_shape(path)
        for trainers, agents in ((1, 1), (2, 2), (4, 4), (1, 3), (3, 1), (6, 2)):
            cfg = recipe(path, trainers=trainers, agents=agents, lora=lora, utilization=0.9)
            check = check_memory(cfg, dims, IdleH100(), vllm=True)
            needs = device_needs(cfg, dims, cfg.rollout.max_slots, {i: TOTAL for i in range(trainers + agents)},
                                 vllm=True)
            trainer = max(needs[i].total for i in range(trainers)) / GIB
            engine = max(needs[i].total for i in range(trainers, trainers + agents)) / GIB
            verdict = "fits" if not check.problems else "refused: " + check.problems[0].split("; ", 1)[1]
            rows.append((shape, "LoRA r32" if lora else "full", f"{trainers} + {agents}", f"{trainer:.1f}",
                         f"{engine:.1f}", verdict))
    print("| shape | training | trainer + rollout GPUs | trainer GiB a GPU | vLLM GiB a GPU | check before launch |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
