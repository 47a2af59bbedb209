"""Write the config.json of a mixture-of-experts shape, for `random:<config.json>` runs and benchmarks (random
weights, no download): python3 scripts/moe_shapes.py NAME DIR [--layers N] [--weights --device cuda].

    qwen3-30b-a3b   Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts of 768, 8 a token, 32 / 4 heads of 128
    olmoe-1b-7b     OLMoE-1B-7B-0924: 16 layers, hidden 2048, 64 experts of 1024, 8 a token, 16 heads of 128

--layers keeps the first N decoder layers (the shape of each layer unchanged), for a run that must fit in less.

--weights also writes random bf16 weights beside the config (transformers' own initialisation, seeded by --seed,
built on --device and saved with the checkpoint's names): an HF directory that `--model.path DIR` opens in every
process. A `random:` path instead builds the model in float32 on the host in each process, and writes it once
more for a vLLM agent; for a whole Qwen3-30B-A3B (30.5 B parameters: 122 GB in float32) that is more than a host
holds twice. Built on a GPU, the 48-layer shape's 61 GB take about a minute."""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

SHAPES = {
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
    "olmoe-1b-7b": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304, hidden_size=2048,
                        intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, max_position_embeddings=4096,
                        rope_theta=10000.0, rms_norm_eps=1e-5, clip_qkv=None, tie_word_embeddings=False,
                        pad_token_id=1, eos_token_id=50279, torch_dtype="bfloat16"),
}


def write_random_weights(config: dict, directory: pathlib.Path, *, seed: int = 0, device: str = "cpu",
                         shard_gb: float = 4.0) -> pathlib.Path:
    """`config`'s model with transformers' random initialisation in bfloat16, built on `device` (seeded), saved
    to `directory` as safetensors shards of at most `shard_gb` with the checkpoint's names (experts unfused where
    the checkpoint keeps them apart), with its config.json."""
    from transformers import AutoModelForCausalLM

    from asyncrl.policies.hf_model import transformers_config
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(transformers_config(config), dtype=torch.bfloat16)
    model.save_pretrained(str(directory), max_shard_size=f"{int(shard_gb * 1024)}MB")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    parser.add_argument("--weights", action="store_true", help="also write random bf16 weights (an HF directory)")
    parser.add_argument("--device", default="cpu", help="where --weights builds them (cuda: fast)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --weights")
    args = parser.parse_args()
    config = dict(SHAPES[args.name])
    if args.layers is not None:
        if not 1 <= args.layers <= config["num_hidden_layers"]:
            parser.error(f"--layers {args.layers}: give 1..{config['num_hidden_layers']}")
        config["num_hidden_layers"] = args.layers
    args.directory.mkdir(parents=True, exist_ok=True)
    (args.directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if args.weights:
        write_random_weights(config, args.directory, seed=args.seed, device=args.device)
        print(args.directory)
    else:
        print(args.directory / "config.json")


if __name__ == "__main__":
    main()
