"""The run itself, with no process machinery: what the trainer and the agents do, testable in one process.

`queue` (admission within the staleness budget, streaming, the ledger every prompt ends in), `roster` (agents'
membership, liveness, fencing of late deliveries), `agent` (the engine loop: ask, generate, score, submit,
pause for weight updates), `controller` (the trainer's loop: take, train, publish, checkpoint, summarize),
`evaluation` (held-out evaluations pinned to versions) and `eval_schedule` (when the controller runs them),
`plan_view` (the split planner's view of each version), `run_log` (where metrics go: the `RunLog` seam),
`reward_tally` (reward calls counted as groups arrive), `lifecycle` (stop requests, signals, parent death).
`asyncrl.rpc` runs these in threads (`LocalRun`) or across processes, and moves weights and calls between them.
Import the modules themselves: this package imports none of them (a user-code worker needs `lifecycle` alone).
"""
