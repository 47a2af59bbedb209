"""Benchmarks of asyncrl against its baselines, kept beside the library, not inside it: `asyncrl` never imports
this package nor names it, not even by a string. This package declares the `bench` command itself, as the
entry point `bench = "asyncrl_bench.cli:bench_main"` of the `asyncrl.commands` group (pyproject.toml);
`asyncrl`'s command line lists the commands installed packages declare there and imports `asyncrl_bench.cli`
only when `asyncrl bench ...` runs.

    engine.py        our rollout engine vs transformers `generate` and vLLM       asyncrl bench engine
    learner.py       our GRPO train_step vs a transformers training step           asyncrl bench learner
    lora.py          the learner benchmark with LoRA adapters vs peft             asyncrl bench learner --lora.rank R
    async_runs.py    colocated sync vs one-step-off / stream / stale+partial runs  asyncrl bench async
    attention.py     decode-attention kernels on a KV cache vs the HBM roofline    asyncrl bench attention
    plan.py          `asyncrl plan` with the rates no JSON file gives measured     asyncrl bench plan
    cli.py           `asyncrl bench BENCHMARK [...]`: picks one and parses its flags
    learner_args.py  the learner benchmark's flags, its knobs read from `TrainerConfig`
    train_steps.py   the two training steps the learner benchmarks time (ours, Hugging Face's)
    flops.py         useful model FLOPs (the MFU numerator)
    roofline.py      the devices' peak FLOP/s and bandwidth
    timing.py        warm-up and timed steps, with torch.compile's counts
    shared.py        the device clock and name, a Hugging Face copy of our model, the --out JSON file
    staleness_stats.py  scripts/staleness_analysis.py's statistics: drift fit, partial F, TOST, bootstrap
    plots.py         the scripts' figures, where matplotlib is installed
    wallclock.py     scripts/wallclock_race.py's curves, times to a target and the async / sync ratio

A benchmark's flag that is a run's knob reads its default from the run's config (`asyncrl.config`,
`EngineConfig`), so a benchmark measures what `asyncrl train` runs unless a flag says otherwise.
Nothing runs at import; import the module you need.
"""
