"""A process that reaches a run without its token, using torch alone (no asyncrl seal, no key).

    python tests/rpc/stranger.py HOST STORE_PORT          # join the RPC group, call os.getpid in trainer0
    python tests/rpc/stranger.py HOST STORE_PORT --forge  # write the run's control records in its store

The first reads the RPC port from the run's store, joins and calls; it prints `joined` or `join refused: ...`, then
`called: PID` or `call refused: ...`. The second forges what would stop the run or kill its agents: the shutdown
mark, a dead report naming every announced agent (with its pid: the launcher would kill it), a refusal and an exit
for each, unsigned and with a made-up MAC; it prints `forged: N records`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys


def forge(store) -> int:
    """Write forged control records (see the module's docstring); returns how many."""
    announced = []
    for i in range(store.add("asyncrl/join/count", 0)):
        entry = json.loads(store.get(f"asyncrl/join/{i}"))
        announced.append(json.loads(entry["body"]) if "body" in entry else entry)
    written = 0
    for record in announced:
        name, pid = record["name"], record["pid"]
        forged = (("dead", {"name": name, "pid": pid, "why": "forged"}), ("exit", {"pid": pid, "code": -9}),
                  ("leave", {"name": name, "reason": "forged"}))
        for sequence, body in forged:
            for value in (json.dumps(body), json.dumps({"body": json.dumps(body), "mac": "0" * 64})):
                index = store.add(f"asyncrl/{sequence}/count", 1) - 1
                store.set(f"asyncrl/{sequence}/{index}", value)
                written += 1
        store.set(f"asyncrl/refused/{name}", json.dumps({"body": json.dumps({"why": "forged"}), "mac": "0" * 64}))
        written += 1
    store.set("asyncrl/shutdown", "1")
    return written + 1


def main(host: str, port: int, forging: bool = False) -> None:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    if forging:
        print(f"forged: {forge(store)} records", flush=True)
        os._exit(0)
    info = json.loads(store.get("asyncrl/info"))
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{host}:{info['rpc_port']}", rpc_timeout=30,
                                              _transports=["uv"])
    try:
        rpc.init_rpc("stranger", rank=30_000, world_size=None, rpc_backend_options=options)
        print("joined", flush=True)
    except Exception as err:  # noqa: BLE001 - the outcome is the output
        print(f"join refused: {err}".replace("\n", " ")[:3000], flush=True)
        os._exit(0)
    try:
        print(f"called: {rpc.rpc_sync('trainer0', os.getpid, timeout=30)}", flush=True)
    except Exception as err:  # noqa: BLE001
        print(f"call refused: {err}".replace("\n", " ")[:3000], flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), forging="--forge" in sys.argv[3:])
