"""The multi-process launcher: roles, torch.distributed.rpc, process groups, weight transfer.

    summary = launch(spec)              # one machine: spawns trainer + agent processes, returns the summary
    torchrun --nnodes ... -m asyncrl.rpc.launch_torchrun ...   # across nodes: same code, roles from RANK

Ranks `0 .. T−1` are trainers (rank 0 hosts the controller, the queue and the parameter server; ranks
`1 .. T−1` follow its commands as an FSDP2 group), ranks `T .. T+A−1` are rollout agents. Control and
samples travel by RPC: rank 0 creates each agent with `rpc.remote` (the agent builds its own engine on
its device) and hands it the controller's RRef; agents call `request` / `submit` / `heartbeat` on it.
Weights travel by torch.distributed: one two-member group {rank 0, agent} per agent (NCCL on GPU, gloo
on CPU), so a dead agent never blocks the others; the full weights go in flat buckets, the agent side
receiving in an RPC thread while its engine waits paused at a step boundary.

Colocated placement (`colocate=True`): no agent processes; trainer rank i also hosts agent i on its own
device (both GPUs generate, then both train). A publication gathers the full weights on every trainer rank
(FSDP2 all-gathers) and each rank copies them into its own engine: no transfer between processes.

Fail loud: every RPC carries a timeout; process groups are created with a timeout so a collective whose
peer is gone raises; agents that fall silent are declared dead by the controller. RPC uses pickle: the
launcher binds to loopback (127.0.0.1) unless `master_addr` says otherwise — never expose it to an
untrusted network.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.config import AlgorithmConfig, AsyncConfig, RolloutConfig, TrainerConfig
from asyncrl.data.scoring import Scorer
from asyncrl.data.sources import PromptSource
from asyncrl.learner import build_learner, full_weights, memory_metrics, train_step
from asyncrl.policies.engine import Engine, EngineConfig
from asyncrl.policies.loading import load_model, random_model
from asyncrl.policies.model import CausalLM
from asyncrl.rpc.agent import RolloutAgent
from asyncrl.rpc.controller import Controller, RunSummary
from asyncrl.rpc.param_server import AgentSet, SyncFailed
from asyncrl.rpc.queue import SampleQueue

__all__ = ["ModelSpec", "AgentSpec", "RunSpec", "launch", "run_worker", "run_torchrun", "CollectivePublisher",
           "ColocatedPublisher"]

log = logging.getLogger("asyncrl.launch")

_GROUPS: dict[str, Any] = {}  # this process's weight groups, filled at bootstrap
_HOSTED: dict[str, "AgentServer"] = {}  # colocated placement: the agent this trainer process hosts


# ------------------------------------------------------------------------------------------- specs
@dataclasses.dataclass
class ModelSpec:
    """How to build the model in any process: a path for `load_model`, or a config dict for random weights."""

    path: str = "smollm2"
    config: dict | None = None
    seed: int = 0
    dtype: str = "float32"

    def build(self, device: str | torch.device = "cpu", dtype: str | None = None) -> CausalLM:
        torch_dtype = getattr(torch, dtype or self.dtype)
        if self.config is not None:
            return random_model(self.config, seed=self.seed, dtype=torch_dtype, device=device)
        return load_model(self.path, dtype=torch_dtype, device=device, seed=self.seed)


@dataclasses.dataclass
class AgentSpec:
    """One rollout agent: its device, engine size, and (tests) injected faults."""

    device: str = "cpu"
    engine_dtype: str = "float32"
    max_len: int | None = None
    step_delay_s: float = 0.0
    die_after_groups: int | None = None
    """Fault injection: SIGKILL this agent's own process after submitting this many groups."""
    hang_after_groups: int | None = None
    """Fault injection: stop the generation loop forever (no heartbeats) after this many groups."""


@dataclasses.dataclass
class RunSpec:
    """Everything a multi-process run needs, picklable (sent to every process)."""

    model: ModelSpec
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    rollout: RolloutConfig
    async_: AsyncConfig
    source_factory: Callable[[], PromptSource]
    scorer_factory: Callable[[], Scorer]
    agents: list[AgentSpec] = dataclasses.field(default_factory=lambda: [AgentSpec()])
    trainer_devices: list[str] = dataclasses.field(default_factory=lambda: ["cpu"])
    reference: bool = False
    """Build a frozen reference model (needed by KL losses)."""
    seed: int = 0
    run_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    """Resume from the newest checkpoint in run_dir."""
    log_fn: Callable[[dict, int], None] | None = None
    rpc_timeout_s: float = 120.0
    bucket_mb: int = 256
    master_addr: str = "127.0.0.1"
    threads_per_process: int = 1
    colocate: bool = False
    """Host agent i inside trainer rank i's process, on its device (needs one agent per trainer)."""

    def __post_init__(self):
        if self.colocate and len(self.agents) != len(self.trainer_devices):
            raise ValueError(f"colocate=True hosts one agent per trainer rank: got {len(self.agents)} agents for "
                             f"{len(self.trainer_devices)} trainer devices; give one AgentSpec per trainer device")

    @property
    def num_trainers(self) -> int:
        return len(self.trainer_devices)

    @property
    def world_size(self) -> int:
        return self.num_trainers if self.colocate else self.num_trainers + len(self.agents)

    def agent_name(self, i: int) -> str:
        return f"agent{i}"

    def agent_worker(self, i: int) -> str:
        """The RPC worker hosting agent i: its own process, or trainer rank i's when colocated."""
        return f"trainer{i}" if self.colocate else self.agent_name(i)


# ------------------------------------------------------------------------------------ agent process
class AgentServer:
    """Lives in an agent process (created by rank 0 with `rpc.remote`): builds the engine, runs the
    generation loop, and receives weights."""

    def __init__(self, spec: RunSpec, index: int, controller_rref: rpc.RRef):
        self.spec, self.index = spec, index
        self.name = spec.agent_name(index)
        aspec = spec.agents[index]
        model = spec.model.build(aspec.device, aspec.engine_dtype)
        max_len = aspec.max_len or (spec.rollout.max_prompt_length + spec.rollout.max_new_tokens)
        engine = Engine(model, EngineConfig(max_slots=spec.rollout.max_slots, max_len=max_len,
                                            cuda_graphs=spec.rollout.cuda_graphs, seed=spec.seed + index))
        handle = _RemoteController(controller_rref, spec.rpc_timeout_s, aspec)
        self.agent = RolloutAgent(self.name, engine, spec.scorer_factory(), spec.rollout, handle,
                                  colocated=spec.async_.colocated and spec.async_.colocated_sleep,
                                  step_delay_s=aspec.step_delay_s)
        handle.agent = self.agent
        self.group = _GROUPS.get(self.name)  # None when colocated: weights are copied in-process
        self.device = torch.device(aspec.device)
        if spec.colocate:
            _HOSTED["agent"] = self

    def ready(self) -> bool:
        return True

    def start(self) -> None:
        self.agent.start()

    def stop(self) -> dict:
        self.agent.stop()
        return {"versions_seen": self.agent.versions_seen, "submitted": self.agent.submitted,
                "error": repr(self.agent.error) if self.agent.error else None}

    def window_metrics(self) -> dict:
        return {**self.agent.window_metrics(), **memory_metrics(self.device, "rollouter")}

    @rpc.functions.async_execution
    def prepare(self, partial: bool, timeout: float) -> torch.futures.Future:
        """Reach a swappable state without parking an RPC thread: drain waits in a helper thread."""
        future: torch.futures.Future = torch.futures.Future()

        def work():
            try:
                self.agent.pause_for_sync(partial, timeout)
                future.set_result(True)
            except BaseException as err:  # noqa: BLE001 - returned to the caller
                future.set_exception(err)

        threading.Thread(target=work, daemon=True).start()
        return future

    def receive(self, version: int, layout: list[list[tuple[str, tuple, str]]], on_cuda: bool) -> float:
        """Receive the weight buckets broadcast by rank 0 and load them; returns the seconds it took."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # an RPC thread: its current device is not the engine's
        start = time.perf_counter()
        buffer_device = self.device if on_cuda else torch.device("cpu")
        for bucket in layout:
            dtype = getattr(torch, bucket[0][2])
            numel = sum(_numel(shape) for _, shape, _ in bucket)
            flat = torch.empty(numel, dtype=dtype, device=buffer_device)
            dist.broadcast(flat, src=0, group=self.group)
            self.agent.load_weights(_unflatten(flat, bucket), None)
        self.agent.load_weights([], version)
        self.agent.resume()
        return time.perf_counter() - start


class _RemoteController:
    """The controller as seen from an agent process: RPCs with timeouts, plus injected faults."""

    def __init__(self, rref: rpc.RRef, timeout: float, spec: AgentSpec):
        self.rref, self.timeout, self.spec = rref, timeout, spec
        self.agent: RolloutAgent | None = None
        self.submitted = 0

    def request(self, agent: str, n: int):
        return self.rref.rpc_sync(timeout=self.timeout).request(agent, n)

    def submit(self, agent: str, group) -> None:
        self.rref.rpc_sync(timeout=self.timeout).submit(agent, group)
        self.submitted += 1
        if self.spec.die_after_groups is not None and self.submitted >= self.spec.die_after_groups:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.spec.hang_after_groups is not None and self.submitted >= self.spec.hang_after_groups:
            threading.Event().wait()  # never returns: the loop (and its heartbeats) stops here

    def heartbeat(self, agent: str) -> None:
        self.rref.rpc_sync(timeout=self.timeout).heartbeat(agent)

    def agent_failed(self, agent: str, why: str) -> None:
        self.rref.rpc_sync(timeout=self.timeout).agent_failed(agent, why)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _unflatten(flat: torch.Tensor, bucket) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for name, shape, _ in bucket:
        n = _numel(shape)
        out.append((name, flat[offset:offset + n].view(shape)))
        offset += n
    return out


# ------------------------------------------------------------------------------- the publisher
class CollectivePublisher(AgentSet):
    """Rank 0's side of a publication to agents in other processes."""

    def __init__(self, agents: dict[str, rpc.RRef], *, partial_rollout: bool, timeout: float, bucket_mb: int,
                 dtype: torch.dtype, on_cuda: bool, weights_fn: Callable):
        super().__init__(agents)
        self.partial, self.timeout, self.bucket_bytes = partial_rollout, timeout, bucket_mb * 2**20
        self.dtype, self.on_cuda, self.weights_fn = dtype, on_cuda, weights_fn

    def _buckets(self, weights: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        buckets, size = [[]], 0
        for name, t in weights:
            if buckets[-1] and (size + t.numel() * t.element_size() > self.bucket_bytes or t.dtype != buckets[-1][0][1].dtype):
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += t.numel() * t.element_size()
        return buckets

    def publish(self, state, version: int) -> dict:
        start = time.perf_counter()
        weights = self.weights_fn(state, self.dtype)
        buckets = self._buckets(weights)
        device = weights[0][1].device if self.on_cuda else torch.device("cpu")
        flats = [torch.cat([t.reshape(-1).to(device) for _, t in b]) for b in buckets]
        layout = [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in b] for b in buckets]
        gathered = time.perf_counter()
        prepares = {name: rref.rpc_async(timeout=self.timeout).prepare(self.partial, self.timeout)
                    for name, rref in self._agents.items()}
        failed, transfer = [], []
        for name, future in prepares.items():
            try:
                future.wait()
            except Exception as err:  # noqa: BLE001
                failed.append(SyncFailed(name, err))
        for f in failed:
            self.remove(f.agent)
        for name, rref in list(self._agents.items()):
            err = None
            for attempt in (1, 2):
                try:
                    transfer.append(self._send(rref, name, version, layout, flats))
                    err = None
                    break
                except Exception as e:  # noqa: BLE001 - retried once, then reported
                    err = e
                    log.error("weight sync to %s failed (attempt %d): %r", name, attempt, e)
            if err is not None:
                failed.append(SyncFailed(name, err))
                self.remove(name)
        if failed and not self._agents:
            raise failed[0]
        self.failed = failed
        done = time.perf_counter()
        return {"timing_s/param_sync": done - start, "timing_s/param_gather": gathered - start,
                "timing_s/param_transfer": max(transfer, default=0.0), "fully_async/sync_failures": len(failed)}

    def _send(self, rref, name: str, version: int, layout, flats) -> float:
        future = rref.rpc_async(timeout=self.timeout).receive(version, layout, self.on_cuda)
        group = _GROUPS[name]
        for flat in flats:
            dist.broadcast(flat, src=0, group=group)
        return future.wait()


class ColocatedPublisher(AgentSet):
    """Rank 0's side of a publication when every trainer rank hosts its own agent: pause them all over RPC,
    then every rank gathers the full weights and copies them into its own engine (`_load_hosted`)."""

    def __init__(self, agents: dict[str, rpc.RRef], *, partial_rollout: bool, timeout: float, load_fn: Callable):
        super().__init__(agents)
        self.partial, self.timeout, self.load_fn = partial_rollout, timeout, load_fn

    def publish(self, state, version: int) -> dict:
        start = time.perf_counter()
        prepares = [rref.rpc_async(timeout=self.timeout).prepare(self.partial, self.timeout)
                    for rref in self._agents.values()]
        for future in prepares:  # a colocated agent shares its trainer's process: a failure here is fatal
            future.wait()
        paused = time.perf_counter()
        self.load_fn(state, version)
        done = time.perf_counter()
        return {"timing_s/param_sync": done - start, "timing_s/param_drain": paused - start,
                "timing_s/param_transfer": done - paused, "fully_async/sync_failures": 0}


def _load_hosted(state, dtype: torch.dtype, version: int) -> None:
    """Every trainer rank (together: FSDP2 gathers): copy the full weights into the engine this process hosts."""
    server = _HOSTED["agent"]
    for name, tensor in full_weights(state.policy, dtype=dtype):
        server.agent.load_weights([(name, tensor.to(server.device))], None)
    server.agent.load_weights([], version)
    server.agent.resume()


# --------------------------------------------------------------------------------- bootstrap
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_device(device: str) -> str:
    """'cuda' alone means this node's GPU number LOCAL_RANK (torchrun); anything else is taken as is."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device == "cuda" else device


def _bootstrap(spec: RunSpec, rank: int, port_pg: int, port_rpc: int) -> None:
    """torch.distributed (weights, FSDP2) and RPC (control, samples), with timeouts; weight groups."""
    torch.set_num_threads(spec.threads_per_process)
    devices = [_local_device(d) for d in spec.trainer_devices + ([] if spec.colocate else [a.device for a in spec.agents])]
    backend = "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"
    timeout = datetime.timedelta(seconds=spec.async_.sync_timeout_s)
    # under torchrun, MASTER_PORT already hosts torchrun's store: join it through env:// (port_pg = 0)
    init = "env://" if port_pg == 0 else f"tcp://{spec.master_addr}:{port_pg}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=spec.world_size, timeout=timeout)
    if devices[rank].startswith("cuda"):
        torch.cuda.set_device(torch.device(devices[rank]))
    trainers = list(range(spec.num_trainers))
    _GROUPS["trainer"] = dist.new_group(trainers, timeout=timeout)
    # rank 0's commands to the other trainer ranks travel on a CPU group whose timeout covers the longest
    # wait between two commands (the trainer waiting for samples), so idle followers never time out
    idle = datetime.timedelta(seconds=spec.async_.take_timeout_s + 2 * spec.async_.sync_timeout_s)
    _GROUPS["commands"] = dist.new_group(trainers, timeout=idle, backend="gloo")
    if not spec.colocate:
        for i in range(len(spec.agents)):  # every rank creates every group, in the same order
            _GROUPS[spec.agent_name(i)] = dist.new_group([0, spec.num_trainers + i], timeout=timeout)
    _GROUPS["backend"] = backend
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{spec.master_addr}:{port_rpc}",
                                              rpc_timeout=spec.rpc_timeout_s, num_worker_threads=16)
    name = f"trainer{rank}" if rank < spec.num_trainers else spec.agent_name(rank - spec.num_trainers)
    # RPC gets its own store on port_rpc, served by rank 0; under torchrun the rendezvous would otherwise
    # make every rank a client of torchrun's agent store (which does not listen on port_rpc)
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        rpc.init_rpc(name, rank=rank, world_size=spec.world_size, rpc_backend_options=options)
    finally:
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store


def _build_learner(spec: RunSpec, rank: int):
    device = spec.trainer_devices[rank]
    policy = spec.model.build(device, spec.trainer.param_dtype)
    reference = spec.model.build(device, "bfloat16" if device.startswith("cuda") else "float32") \
        if spec.reference else None
    group = _GROUPS["trainer"] if spec.num_trainers > 1 else None
    if group is not None:  # shard over the trainer ranks only (the default group also holds the agents)
        from torch.distributed.device_mesh import DeviceMesh
        from asyncrl.learner import shard_model
        shard_model(policy, DeviceMesh.from_group(group, torch.device(_local_device(device)).type))
    return build_learner(policy, spec.trainer, spec.algorithm, reference=reference, group=group)


def _run_controller(spec: RunSpec) -> RunSummary:
    state = _build_learner(spec, 0)
    trainers = _TrainerCommands(spec)
    max_required = verl_max_required_samples(spec.trainer.mini_batch_size, spec.async_.require_batches,
                                             spec.async_.staleness_threshold, spec.async_.trigger_parameter_sync_step)
    queue = SampleQueue(spec.source_factory(), max_required_samples=max_required, seed=spec.seed,
                        max_version_lag=spec.async_.max_version_lag, lag_policy=spec.async_.lag_policy)
    if spec.resume and spec.run_dir:
        from asyncrl.checkpoint import latest_checkpoint, load_checkpoint
        path = latest_checkpoint(spec.run_dir)
        if path is not None:
            trainers.command("load", str(path))
            queue.load_state_dict(load_checkpoint(path, state)["queue"])
            queue.version = state.version
    controller = Controller(queue, state, None, spec.async_, log_metrics=spec.log_fn, run_dir=spec.run_dir,
                            checkpoint_every=spec.checkpoint_every)
    me = rpc.RRef(controller)
    agents = {spec.agent_name(i): rpc.remote(spec.agent_worker(i), AgentServer, args=(spec, i, me),
                                             timeout=max(spec.rpc_timeout_s, 600))
              for i in range(len(spec.agents))}
    for rref in agents.values():
        rref.rpc_sync(timeout=max(spec.rpc_timeout_s, 600)).ready()  # waits until every engine is built
    engine_dtype = getattr(torch, spec.agents[0].engine_dtype)
    if spec.colocate:
        controller.publisher = ColocatedPublisher(
            agents, partial_rollout=spec.async_.partial_rollout, timeout=spec.async_.sync_timeout_s,
            load_fn=lambda state, version: trainers.load_hosted(state, engine_dtype, version))
    else:
        controller.publisher = CollectivePublisher(
            agents, partial_rollout=spec.async_.partial_rollout, timeout=spec.async_.sync_timeout_s,
            bucket_mb=spec.bucket_mb, dtype=engine_dtype, on_cuda=_GROUPS["backend"] == "nccl",
            weights_fn=trainers.weights)
    controller.last_heard = {name: time.monotonic() for name in agents}
    controller.step_fn = trainers.step
    controller.on_step = getattr(spec.log_fn, "log_samples", None)
    if trainers.multi:
        controller.checkpoint_fn = lambda: trainers.checkpoint(controller)
    controller.agent_metrics = lambda: _agent_metrics(controller, agents, spec.rpc_timeout_s)
    if state.version > 0:
        controller.publisher.publish(state, state.version)
    for rref in agents.values():
        rref.rpc_sync(timeout=spec.rpc_timeout_s).start()
    try:
        summary = controller.run()
    finally:
        trainers.command("stop")
        for name, rref in agents.items():
            if name not in controller.dead:
                try:
                    rref.rpc_sync(timeout=spec.rpc_timeout_s).stop()
                except Exception as err:  # noqa: BLE001
                    log.error("could not stop agent %s cleanly: %r", name, err)
                    controller.dead.append(name)  # died or hung late: report it, and shut RPC down without it
    summary.ledger = controller.finish()
    summary.dead_agents = list(controller.dead)
    return summary


def _agent_metrics(controller: Controller, agents: dict, timeout: float) -> dict:
    windows = []
    for name, rref in agents.items():
        if name in controller.dead:
            continue
        try:
            windows.append(rref.rpc_sync(timeout=timeout).window_metrics())
        except Exception as err:  # noqa: BLE001 - a dying agent: the health check will name it
            log.warning("no metrics from %s: %r", name, err)
    return {k: sum(w[k] for w in windows) / len(windows) for k in windows[0]} if windows else {}


class _TrainerCommands:
    """Rank 0 drives the trainer followers (ranks 1..T−1) by broadcasting commands over the trainer group."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.multi = spec.num_trainers > 1

    def command(self, *cmd) -> None:
        if self.multi:
            dist.broadcast_object_list([cmd], src=0, group=_GROUPS["commands"])

    def step(self, state, groups):
        self.command("step", groups, state.version)  # followers learn the version only through commands
        return train_step(state, groups)

    def weights(self, state, dtype):
        self.command("weights", str(dtype).removeprefix("torch."))
        return list(full_weights(state.policy, dtype=dtype))

    def load_hosted(self, state, dtype, version: int) -> None:
        self.command("load_hosted", str(dtype).removeprefix("torch."), version)
        _load_hosted(state, dtype, version)

    def checkpoint(self, controller: Controller):
        self.command("checkpoint", controller.run_dir, controller.state.version)
        return controller.checkpoint()


def _follow(spec: RunSpec, rank: int) -> None:
    """Trainer ranks 1..T−1: execute rank 0's commands (same groups, same collectives)."""
    state = _build_learner(spec, rank)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=_GROUPS["commands"])
        cmd, *args = box[0]
        if cmd == "step":
            state.version = args[1]
            state, _ = train_step(state, args[0])
        elif cmd == "weights":
            for _ in full_weights(state.policy, dtype=getattr(torch, args[0])):
                pass
        elif cmd == "load_hosted":
            _load_hosted(state, getattr(torch, args[0]), args[1])
            state.version = args[1]
        elif cmd == "load":
            from asyncrl.checkpoint import load_checkpoint
            load_checkpoint(args[0], state)
        elif cmd == "checkpoint":
            from asyncrl.checkpoint import save_checkpoint
            state.version = args[1]
            save_checkpoint(args[0], state, keep_last=3)
        elif cmd == "stop":
            return


def run_torchrun(spec: RunSpec) -> RunSummary | None:
    """Entry point under `torchrun`: this process's role comes from RANK (0 .. T−1 trainers, then agents),
    the rendezvous from MASTER_ADDR / MASTER_PORT (process groups) and MASTER_PORT + 1 (RPC).
    Returns the summary on rank 0, None elsewhere."""
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"placement.launcher=torchrun needs {', '.join(missing)} in the environment; "
                         "start the run with `torchrun --nnodes N --nproc-per-node P ... -m asyncrl.cli train ...`")
    if int(env["WORLD_SIZE"]) != spec.world_size:
        raise ValueError(f"torchrun started {env['WORLD_SIZE']} processes but the placement needs {spec.world_size} "
                         f"({spec.num_trainers} trainers + {len(spec.agents)} agents); fix --nproc-per-node/--nnodes "
                         "or placement.trainer_devices / agent_devices")
    spec = dataclasses.replace(spec, master_addr=env["MASTER_ADDR"])
    port = int(env["MASTER_PORT"])
    return run_worker(int(env["RANK"]), spec, 0, port + 1, exit_when_done=False)


def run_worker(rank: int, spec: RunSpec, port_pg: int, port_rpc: int, results=None, *,
               exit_when_done: bool = True) -> RunSummary | None:
    """The body of every process: bootstrap, play the rank's role, shut down.

    Agent ranks have no role of their own here: their `AgentServer` is created and driven by rank 0 over
    RPC while this thread blocks in `rpc.shutdown`, which keeps serving until rank 0 shuts down.
    """
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    dump_every = os.environ.get("ASYNCRL_STACK_DUMP_S")
    if dump_every:  # diagnosing a hang: every process prints every thread's stack to stderr periodically
        faulthandler.dump_traceback_later(float(dump_every), repeat=True)
    _bootstrap(spec, rank, port_pg, port_rpc)
    graceful, summary = True, None
    try:
        if rank == 0:
            summary = _run_controller(spec)
            graceful = not summary.dead_agents  # a dead worker would make a graceful shutdown wait forever
            if results is not None:
                results.put(pickle.dumps(summary))
        elif rank < spec.num_trainers:
            _follow(spec, rank)
    except BaseException as err:
        graceful = False
        log.exception("rank %d failed", rank)  # the exit below would swallow the traceback
        if results is not None:
            results.put(pickle.dumps(RuntimeError(f"rank {rank} failed: {err!r}")))
        raise
    finally:
        try:
            rpc.shutdown(graceful=graceful)
        except Exception as err:  # noqa: BLE001 - rank 0 left without waiting for us
            log.info("rpc shutdown: %r", err)
        if rank != 0 and exit_when_done:
            os._exit(0)
    return summary


def launch(spec: RunSpec, *, timeout_s: float = 3600.0) -> RunSummary:
    """Spawn one process per role on this machine; return rank 0's summary. Agents that die are tolerated
    (the controller re-admits their work); any other failure raises."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port_pg, port_rpc = _free_port(), _free_port()
    procs = [ctx.Process(target=run_worker, args=(r, spec, port_pg, port_rpc, results if r == 0 else None),
                         name=f"asyncrl-rank{r}", daemon=False) for r in range(spec.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                outcome = pickle.loads(results.get(timeout=1.0))
                break
            except Exception:  # noqa: BLE001 - queue.Empty
                if not procs[0].is_alive() and results.empty():
                    raise RuntimeError(f"rank 0 exited with code {procs[0].exitcode} before reporting a result")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the run did not finish within {timeout_s} s")
        procs[0].join(timeout=60.0)
        for p in procs[1:]:  # they exit when rank 0 shuts RPC down; one waiting on a dead peer is ended below
            p.join(timeout=10.0 if outcome.dead_agents else 30.0) if isinstance(outcome, RunSummary) else p.join(5.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
