"""Benchmarks of asyncrl against its baselines, kept beside the library, not inside it: `asyncrl` never imports
this package (the `asyncrl bench` command loads `asyncrl_bench.cli` when it runs).

    engine.py      our rollout engine vs transformers `generate` and vLLM       asyncrl bench engine
    learner.py     our GRPO train_step vs a transformers training step           asyncrl bench learner
    lora.py        the learner benchmark with LoRA adapters vs peft             asyncrl bench learner --lora.rank R
    async_runs.py  colocated sync vs one-step-off / stream / stale+partial runs  asyncrl bench async
    shared.py      what engine.py and learner.py share (device clock, HF copy, --out JSON)
    cli.py         `asyncrl bench BENCHMARK [...]`: picks one and parses its flags

Nothing runs at import; import the module you need.
"""
