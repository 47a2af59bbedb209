"""A process that reaches a run's RPC port without its token, using torch alone (no asyncrl seal): it reads the RPC
port from the run's store, joins the RPC group and calls `os.getpid` in trainer0. Prints one line per outcome:
`joined` or `join refused: ...`, then `called: PID` or `call refused: ...`.

    python tests/rpc/stranger.py HOST STORE_PORT
"""

from __future__ import annotations

import datetime
import json
import os
import sys


def main(host: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
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
    main(sys.argv[1], int(sys.argv[2]))
