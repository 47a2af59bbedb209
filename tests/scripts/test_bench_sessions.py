"""scripts/bench_sessions.py on CPU, small: both modes run the same episodes; held sessions prefill less."""

from scripts.bench_sessions import Args, main


def test_sessions_prefill_only_the_new_tokens_of_later_turns(capsys):
    args = Args(model="tiny-qwen2", device="cpu", dtype="float32", episodes=4, prompt_len=8, turns=3, turn_tokens=4,
                env_tokens=2, repeats=1)
    results = main(args)
    whole, sessions = results["whole"][2], results["sessions"][2]
    # whole: every turn prefills the episode so far; sessions: the prompt once, then 1 + 2 tokens per later turn
    assert whole == 4 * (8 + (8 + 6) + (8 + 12))
    assert sessions == 4 * (8 + 3 + 3)
    assert "sessions / whole:" in capsys.readouterr().out
