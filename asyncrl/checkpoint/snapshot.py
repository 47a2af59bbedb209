"""A trainer rank's restore point in host memory: its shard of the learner at a version boundary, so that after a
peer's death the surviving ranks go back to the same boundary and train the version again (trainer failover).

    snapshot = ShardSnapshot(state)     # host buffers shaped like this rank's shards (pinned when on a GPU)
    state, metrics = train_step(state, groups)
    snapshot.take(state)                # after the step: copies start (on a side stream on a GPU)
    snapshot.settle()                   # before the next step touches the weights: the copies are ordered first
    ...
    snapshot.restore(state)             # back to the boundary: weights, optimizer moments, schedule, counters, RNG
    text, flat = snapshot.packed()      # as JSON text and one byte tensor (no pickle), e.g. for
    replica = exchange_in_ring(snapshot.packed(), group)   # ... a copy of the ring predecessor's, over gloo
    snapshot.load_packed(*packed)       # the contents of a packed snapshot of this learner's layout

What a rank holds is its own part: the local shard of every trained parameter of the policy (and critic), the
optimizer state of those shards (AdamW's moments and step), the learning-rate schedules, the learner's counters
(`step`, `version`, KL coefficient, skipped updates) and the RNG states. Frozen tensors (a LoRA policy's base, the
reference model) never change during a run and are not copied. The copies are taken after a training step, while
the trainer waits for its next batch, so on a GPU they overlap that wait; `settle` only orders the next step's work
after them on the device (the host does not block). A restore is bitwise: the rank continues exactly as it did
from the boundary (tests/checkpoint/test_snapshot.py, one process and FSDP2 over gloo).

Cost: 16 bytes a trained parameter over the ranks (fp32 weights and AdamW's two moments) in host memory
(`nbytes`), plus the optimizer's scalar steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

import torch.distributed as dist

from asyncrl.checkpoint.packing import pack, pack_parts, unpack
from asyncrl.checkpoint.save_load import COUNTERS, rng_state, set_rng_state
from asyncrl.learner import LearnerState

__all__ = ["ShardSnapshot", "COUNTERS", "exchange_in_ring", "transfer_packed", "all_gather_packed"]


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of a (possibly FSDP2-sharded) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclasses.dataclass
class _Trained:
    """A model's trained parameters and the optimizer and schedule that update them."""

    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def _trained(state: LearnerState) -> list[_Trained]:
    out = [_Trained([p for p in state.policy.parameters() if p.requires_grad], state.optimizer, state.scheduler)]
    if state.critic is not None:
        out.append(_Trained([p for p in state.critic.parameters() if p.requires_grad], state.critic_optimizer,
                            state.critic_scheduler))
    return out


def _like_param(p: nn.Parameter, saved: Tensor, scalar_on_device: bool) -> Tensor:
    """An optimizer-state tensor for `p` from its saved local part: sharded like `p` where it has `p`'s local shape
    (AdamW's moments), else a plain tensor where optimizers keep scalars (its step: on the host, or on `p`'s device
    for a capturable or fused optimizer)."""
    local = _local(p)
    if tuple(saved.shape) == tuple(local.shape) and saved.dim() > 0:
        value = saved.to(local.device, copy=True)
        if isinstance(p, DTensor):
            return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return value
    return saved.to(local.device, copy=True) if scalar_on_device else saved.clone()


class ShardSnapshot:
    """This rank's restore point (module docstring). Built for one learner state; `take` overwrites it."""

    def __init__(self, state: LearnerState):
        self._models = _trained(state)
        self._pinned = any(p.device.type == "cuda" for m in self._models for p in m.params)
        self._weights = [[self._host_like(_local(p)) for p in m.params] for m in self._models]
        self._sharded = [[isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)
                          for p in m.params] for m in self._models]  # split along dim 0 over the ranks (FSDP2)
        self._moments: list[list[dict[str, Tensor] | None]] = [[None] * len(m.params) for m in self._models]
        self._stream = torch.cuda.Stream() if self._pinned else None
        self._copied: torch.cuda.Event | None = None
        self.version: int | None = None  # the version this snapshot holds (None: nothing taken yet)
        self.step: int | None = None
        self._schedules: list[dict] = []
        self._groups: list[list[dict]] = []
        self._counters: dict = {}
        self._rng: dict = {}

    def _host_like(self, tensor: Tensor) -> Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pinned)

    @property
    def nbytes(self) -> int:
        """Host bytes the snapshot's tensors take."""
        tensors = [t for ws in self._weights for t in ws]
        tensors += [t for ms in self._moments for m in ms if m for t in m.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def take(self, state: LearnerState) -> torch.cuda.Event | None:
        """Copy this rank's part of `state` (after a training step: a version boundary). Returns the event the
        device's copies complete at (None off the GPU), for a reader on another thread."""
        self._check(state)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for m, model in enumerate(self._models):
                for i, p in enumerate(model.params):
                    self._weights[m][i].copy_(_local(p.detach()), non_blocking=self._pinned)
                    self._moments[m][i] = self._moments_of(model.optimizer.state.get(p), self._moments[m][i])
            if self._stream is not None:
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
        self._schedules = [copy.deepcopy(m.scheduler.state_dict()) for m in self._models]
        self._groups = [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                         for g in m.optimizer.param_groups] for m in self._models]
        self._counters = {k: getattr(state, k) for k in COUNTERS}
        self._rng = copy.deepcopy(rng_state())
        self.version, self.step = state.version, state.step
        return self._copied

    def _moments_of(self, held: dict | None, into: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        """Host copies of one parameter's optimizer state (None before its first optimizer step)."""
        if not held:
            return None
        tensors = {k: _local(v) for k, v in held.items() if isinstance(v, Tensor)}
        if into is None or into.keys() != tensors.keys():
            into = {k: self._host_like(v) for k, v in tensors.items()}
        for k, v in tensors.items():
            into[k].copy_(v, non_blocking=self._pinned and v.device.type == "cuda")
        return into

    def settle(self) -> None:
        """Order the device's next work after the copies (no host wait); a no-op off the GPU."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None

    def restore(self, state: LearnerState) -> None:
        """Put `state` back to the boundary `take` copied, in place: the same parameter and optimizer-state tensors
        (FSDP2 keeps its shards), their values, the schedules, counters and RNG states."""
        if self.version is None:
            raise RuntimeError("ShardSnapshot.restore: no snapshot was taken")
        self._check(state)
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        with torch.no_grad():
            for m, model in enumerate(self._models):
                for i, p in enumerate(model.params):
                    _local(p).copy_(self._weights[m][i])
                    self._restore_moments(model.optimizer, p, self._moments[m][i])
                for group, saved in zip(model.optimizer.param_groups, self._groups[m]):
                    group.update(copy.deepcopy(saved))
                model.scheduler.load_state_dict(copy.deepcopy(self._schedules[m]))
        for k, v in self._counters.items():
            setattr(state, k, v)
        set_rng_state(copy.deepcopy(self._rng))

    @staticmethod
    def _restore_moments(optimizer: torch.optim.Optimizer, p: nn.Parameter, saved: dict[str, Tensor] | None) -> None:
        if saved is None:  # the boundary came before this parameter's first optimizer step
            optimizer.state.pop(p, None)
            return
        held = optimizer.state.get(p)
        if not held or held.keys() != saved.keys():  # a fresh learner (a replacement rank): the state is made here
            group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
            on_device = bool(group.get("capturable") or group.get("fused"))
            optimizer.state[p] = {k: _like_param(p, v, on_device) for k, v in saved.items()}
            return
        for k, v in saved.items():
            _local(held[k]).copy_(v)

    def packed(self) -> tuple[str, Tensor]:
        """The snapshot as JSON text and one flat byte tensor (`asyncrl.checkpoint.packing`)."""
        return pack(self._tree())

    def packed_parts(self) -> tuple[str, list[Tensor]]:
        """`packed` without the concatenation: the host buffers' bytes as views (for a file, written part by part;
        nothing may `take` into them meanwhile)."""
        return pack_parts(self._tree())

    def _tree(self) -> dict:
        if self.version is None:
            raise RuntimeError("ShardSnapshot.packed: no snapshot was taken")
        if self._copied is not None:
            self._copied.synchronize()
        return {"version": self.version, "step": self.step, "weights": self._weights, "moments": self._moments,
                "schedules": self._schedules, "groups": self._groups, "counters": self._counters, "rng": self._rng,
                "sharded": self._sharded}

    def load_packed(self, text: str, flat: Tensor) -> None:
        """Take a packed snapshot's contents (one of a learner with this one's shards: the same rank's, or its
        replacement's); `restore` then applies them."""
        tree = unpack(text, flat)
        shapes = [[tuple(t.shape) for t in ws] for ws in self._weights]
        if [[tuple(t.shape) for t in ws] for ws in tree["weights"]] != shapes:
            raise ValueError("ShardSnapshot.load_packed: the packed shards have other shapes than this learner's")
        self._copied = None
        for ws, got in zip(self._weights, tree["weights"]):
            for w, g in zip(ws, got):
                w.copy_(g)
        self._moments = tree["moments"]
        self._take_state(tree, tree["rng"])

    def load_resharded(self, packed: Sequence[tuple[str, Tensor]], *, rank: int, world: int) -> None:
        """Take the contents of a whole group's packed snapshots (one per rank of the old group, in rank order)
        resharded for rank `rank` of a group of `world` (a shrink): each sharded tensor's parts are put together
        along dim 0 in rank order and chunked as FSDP2 chunks it for the new group; replicated tensors, the
        optimizer's step, schedules and counters come from the old rank 0, the RNG states from the old rank `rank`.
        `restore` then applies them to this learner (built for the new group)."""
        trees = [unpack(*p) for p in packed]
        if len({t["version"] for t in trees}) != 1:
            raise ValueError(f"ShardSnapshot.load_resharded: snapshots of versions {sorted({t['version'] for t in trees})}"
                             "; every rank's must be of one version boundary")

        def mine(parts: list[Tensor], sharded: bool, local: tuple[int, ...]) -> Tensor:
            if not sharded or parts[0].dim() == 0:
                return parts[0]
            chunks = torch.cat(parts, dim=0).chunk(world, dim=0)
            part = chunks[rank] if rank < len(chunks) else parts[0][:0]
            if tuple(part.shape) != local:
                raise ValueError(f"ShardSnapshot.load_resharded: a shard of shape {tuple(part.shape)} for a local "
                                 f"tensor of {local} (snapshots of another model, or another order of ranks)")
            return part

        self._copied = None
        # split as the old group split them (a group of one rank, unsharded, may take shards of a larger one)
        for m, (weights, sharded) in enumerate(zip(self._weights, trees[0]["sharded"])):
            for i, (w, split) in enumerate(zip(weights, sharded)):
                w.copy_(mine([t["weights"][m][i] for t in trees], split, tuple(w.shape)))
                held = [t["moments"][m][i] for t in trees]
                self._moments[m][i] = None if held[0] is None else {
                    k: mine([h[k] for h in held], split, tuple(w.shape) if held[0][k].dim() else ()).clone()
                    for k in held[0]}
        self._take_state(trees[0], trees[min(rank, len(trees) - 1)]["rng"])

    def _take_state(self, tree: dict, rng: dict) -> None:
        """A packed snapshot's schedules, optimizer settings, counters and boundary, and the RNG states `rng`."""
        self._schedules, self._groups, self._counters = tree["schedules"], tree["groups"], tree["counters"]
        self._rng = rng
        self.version, self.step = tree["version"], tree["step"]

    def _check(self, state: LearnerState) -> None:
        models = _trained(state)
        same = len(models) == len(self._models) and all(
            len(a.params) == len(b.params) and all(x is y for x, y in zip(a.params, b.params))
            for a, b in zip(models, self._models))
        if not same:
            raise ValueError("ShardSnapshot: this learner state is not the one the snapshot was built for")



def exchange_in_ring(packed: tuple[str, Tensor], group: dist.ProcessGroup) -> tuple[str, Tensor] | None:
    """Send `packed` (this rank's `ShardSnapshot.packed()`) to the next rank of `group` and return the previous rank's
    (rank r then holds shard r − 1 mod N as well as its own); None in a group of one. Every rank calls it together."""
    ranks = dist.get_world_size(group)
    if ranks == 1:
        return None
    me = dist.get_rank(group)
    return transfer_packed(group, packed, to=(me + 1) % ranks, source=(me - 1) % ranks)


def transfer_packed(group: dist.ProcessGroup, packed: tuple[str, Tensor] | None, *, to: int | None,
                    source: int | None) -> tuple[str, Tensor] | None:
    """Send `packed` to group rank `to` and/or receive one from group rank `source` (None: that half is skipped);
    returns what was received. Lengths go first, then the JSON's bytes and the tensor bytes; nothing received is
    unpickled."""
    sends: list[Tensor] = []
    if to is not None:
        text, flat = packed
        sends = [_text_bytes(text), flat]
    sizes = torch.tensor([s.numel() for s in sends] if sends else [0, 0], dtype=torch.int64)
    got = torch.empty(2, dtype=torch.int64)
    _swap(group, to, source, [sizes] if to is not None else [], [got] if source is not None else [])
    receives = [] if source is None else [torch.empty(int(n), dtype=torch.uint8) for n in got]
    _swap(group, to, source, sends, receives)
    return None if source is None else (_text_of(receives[0]), receives[1])


def _swap(group: dist.ProcessGroup, to: int | None, source: int | None, sends: list[Tensor],
          receives: list[Tensor]) -> None:
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=to) for t in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=source) for t in receives if t.numel()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def all_gather_packed(group: dist.ProcessGroup, held: dict[int, tuple[str, Tensor]]) -> dict[int, tuple[str, Tensor]]:
    """Every rank of `group` gives the packed snapshots it holds (old shard index -> packed: its own, and replicas of
    the dead) and gets everyone's; each rank broadcasts its own in turn, typed (no pickle). Every rank calls it."""
    out: dict[int, tuple[str, Tensor]] = {}
    for source in range(dist.get_world_size(group)):
        mine = source == dist.get_rank(group)
        count = torch.tensor([len(held) if mine else 0], dtype=torch.int64)
        dist.broadcast(count, group=group, group_src=source)
        items = sorted(held.items()) if mine else [None] * int(count)
        for item in items:
            raw = _text_bytes(item[1][0]) if mine else None
            header = torch.tensor([item[0], raw.numel(), item[1][1].numel()] if mine else [0, 0, 0], dtype=torch.int64)
            dist.broadcast(header, group=group, group_src=source)
            shard, raw_len, flat_len = (int(v) for v in header)
            raw = raw if mine else torch.empty(raw_len, dtype=torch.uint8)
            flat = item[1][1].contiguous() if mine else torch.empty(flat_len, dtype=torch.uint8)
            for t in (raw, flat):
                if t.numel():
                    dist.broadcast(t, group=group, group_src=source)
            out.setdefault(shard, (_text_of(raw), flat))
    return out


def _text_bytes(text: str) -> Tensor:
    """A packed snapshot's JSON as a byte tensor, to send."""
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def _text_of(raw: Tensor) -> str:
    """The JSON back from received bytes."""
    return bytes(raw.numpy()).decode()
