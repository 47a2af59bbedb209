"""Optimizer state in host memory (`--trainer.offload optimizer`).

`HostAdamW` is AdamW whose moments — and, for weights kept in bf16, an fp32 master copy of them — live in
(pinned) CPU memory. The GPU keeps only the weights and their gradients: for an 8B model in bf16 that is
2 + 2 bytes a parameter on the GPU instead of 2 + 2 + 12. The update itself runs on the GPU: a bucket of
states is copied in, updated with the gradients there, and copied back, while the next bucket is already
on its way in on a second stream (the link carries both directions at once). The step then costs about
2 × 12 bytes a parameter over the host link, not a CPU AdamW.

The update is torch's AdamW (decoupled weight decay, bias-corrected moments), in fp32:

    w ← w·(1 − lr·λ)
    m ← β₁·m + (1 − β₁)·g          v ← β₂·v + (1 − β₂)·g²
    w ← w − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)

with w the fp32 master when the parameter is bf16 (the parameter then takes w rounded), else the parameter.
Its state dict has torch's keys (`step`, `exp_avg`, `exp_avg_sq`, plus `master`), so checkpoints move
between runs with and without offload.
"""

from __future__ import annotations

import math
import weakref
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

__all__ = ["HostAdamW", "host_state_bytes"]


def host_state_bytes(params: Iterable[nn.Parameter]) -> int:
    """Host memory HostAdamW takes for `params`: two fp32 moments, and an fp32 master copy of every parameter
    that is not fp32 itself."""
    return sum(p.numel() * (8 + (4 if p.dtype != torch.float32 else 0)) for p in params)


class HostAdamW(torch.optim.Optimizer):
    """AdamW with its state in host memory, stepped on the parameters' device a bucket at a time.

    `bucket_bytes` bounds the device memory the step borrows: two buckets of states are on the device at once
    (one updating, one arriving). Plain tensors only: an FSDP2-sharded model keeps its state on the host with
    `--trainer.offload params` instead.
    """

    def __init__(self, params: Iterable[nn.Parameter], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, bucket_bytes: int = 256 << 20):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.bucket_bytes = bucket_bytes
        owned = [p for group in self.param_groups for p in group["params"]]
        if any(hasattr(p, "device_mesh") for p in owned):
            raise ValueError("HostAdamW takes plain tensors; a sharded (FSDP2) model offloads with "
                             "--trainer.offload params")
        self._arena = _HostArena(sum(p.numel() * _slots(p) for p in owned), pinned=any(p.is_cuda for p in owned))
        offset = 0
        for p in owned:
            slots = self._arena.flat[offset:offset + p.numel() * _slots(p)].view(_slots(p), *p.shape)
            offset += slots.numel()
            self.state[p] = {"step": torch.tensor(0.0), "exp_avg": slots[0], "exp_avg_sq": slots[1]}
            if _slots(p) == 3:
                self.state[p]["master"] = slots[2].copy_(p.detach())

    # ---------------------------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                self.state[p]["step"] += 1
            by_step: dict[float, list[nn.Parameter]] = {}
            for p in params:  # parameters stepped together share bias corrections
                by_step.setdefault(float(self.state[p]["step"]), []).append(p)
            for t, same in by_step.items():
                self._update_buckets(list(_buckets(same, self.bucket_bytes)), group, t)
        if any(p.is_cuda for group in self.param_groups for p in group["params"]):
            torch.cuda.current_stream().synchronize()  # the host copies are complete before anyone reads them
        return loss

    def _update_buckets(self, buckets: list[list[nn.Parameter]], group: dict, t: float) -> None:
        device = buckets[0][0].device
        if device.type != "cuda":
            for bucket in buckets:
                self._update(bucket, self._load(bucket, device), group, t)
            return
        compute, copier = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        copier.wait_stream(compute)  # the gradients are ready
        with torch.cuda.stream(copier):
            arriving = self._load(buckets[0], device)
        for i, bucket in enumerate(buckets):
            compute.wait_stream(copier)
            loaded = arriving
            for tensors in loaded.values():
                for x in tensors:
                    x.record_stream(compute)
            if i + 1 < len(buckets):
                with torch.cuda.stream(copier):
                    arriving = self._load(buckets[i + 1], device)
            self._update(bucket, loaded, group, t)

    def _load(self, bucket: list[nn.Parameter], device: torch.device) -> dict[str, list[Tensor]]:
        """The bucket's fp32 moments and master weights on `device` (the host tensors themselves on a CPU)."""
        states = [self.state[p] for p in bucket]
        return {"exp_avg": [s["exp_avg"].to(device, non_blocking=True) for s in states],
                "exp_avg_sq": [s["exp_avg_sq"].to(device, non_blocking=True) for s in states],
                "master": [s["master"].to(device, non_blocking=True) for s in states if "master" in s]}

    def _update(self, bucket: list[nn.Parameter], loaded: dict[str, list[Tensor]], group: dict, t: float) -> None:
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        masters = iter(loaded["master"])
        weights = [next(masters) if p.dtype != torch.float32 else p for p in bucket]
        grads = [p.grad if p.grad.dtype == torch.float32 else p.grad.float() for p in bucket]
        m, v = loaded["exp_avg"], loaded["exp_avg_sq"]
        if decay:
            torch._foreach_mul_(weights, 1.0 - lr * decay)
        torch._foreach_lerp_(m, grads, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1.0 - beta2 ** t))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(weights, m, denom, value=-lr / (1.0 - beta1 ** t))
        for p, w in zip(bucket, weights):
            if w is not p:
                p.copy_(w)  # the trained weight: the master rounded to the parameter's dtype
        for p, mm, vv, w in zip(bucket, m, v, weights):
            state = self._write_back(self.state[p], "exp_avg", mm)
            self._write_back(state, "exp_avg_sq", vv)
            if w is not p:
                self._write_back(state, "master", w)

    @staticmethod
    def _write_back(state: dict[str, Tensor], key: str, value: Tensor) -> dict[str, Tensor]:
        if value is not state[key]:
            state[key].copy_(value, non_blocking=True)
        return state

    # ----------------------------------------------------------------------------------- state dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format (from this optimizer or torch's AdamW): the settings of each group, and the saved
        moments copied into this optimizer's host tensors (torch's own loader would move them onto the
        parameters' device and cast a master copy to bf16). A state saved without a master copy keeps the one
        taken from the current (just loaded) weights."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the saved optimizer has {len(saved_groups)} parameter groups, this one "
                             f"{len(self.param_groups)}")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("the saved optimizer's parameter groups do not match this model's")
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
            for p, key in zip(group["params"], saved["params"]):
                old, state = state_dict["state"].get(key, {}), self.state[p]
                state["step"] = torch.tensor(float(old.get("step", 0.0)))
                for name in ("exp_avg", "exp_avg_sq"):
                    if name in old:
                        state[name].copy_(old[name])
                    else:
                        state[name].zero_()
                if "master" in state:
                    state["master"].copy_(old["master"] if "master" in old else p.detach())


def _slots(p: Tensor) -> int:
    """fp32 tensors of host state per parameter: the two moments, and a master copy unless it is fp32."""
    return 2 if p.dtype == torch.float32 else 3


class _HostArena:
    """One flat fp32 host buffer for every state tensor, page-locked with cudaHostRegister when the parameters
    are on a GPU (torch's pinned allocator rounds each block up to a power of two: for an 8B model's 98 GB of
    state that is more than the host has); unregistered when the arena is freed."""

    def __init__(self, elements: int, *, pinned: bool):
        self.flat = torch.zeros(elements, dtype=torch.float32)
        if pinned and elements:
            nbytes = self.flat.numel() * self.flat.element_size()
            if int(torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), nbytes, 0)) != 0:
                raise RuntimeError(f"could not page-lock {nbytes / 2**30:.1f} GiB of host memory for the optimizer "
                                   "state (--trainer.offload optimizer); free host memory or raise the locked-memory "
                                   "limit (ulimit -l)")
            weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, self.flat.data_ptr())


def _buckets(params: list[nn.Parameter], limit: int) -> Iterator[list[nn.Parameter]]:
    """Consecutive parameters whose host state (12 bytes an element, counting the gradient's fp32 copy) fits
    `limit` bytes; a larger parameter is a bucket of its own."""
    bucket, size = [], 0
    for p in params:
        cost = 12 * p.numel()
        if bucket and size + cost > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += cost
    if bucket:
        yield bucket
