"""A nested state (dicts with str keys, lists, tuples, numbers, str, bool, None and CPU tensors) as JSON text plus
one flat byte tensor, and back: how a shard snapshot travels to its replica over a process group without pickle.

    text, flat = pack(tree)          # JSON (tensors replaced by references, tuples marked) and a uint8 tensor
    text, parts = pack_parts(tree)   # the same JSON; the tensors' bytes as views, `flat` = their concatenation
    tree = unpack(text, flat)        # the same values; tensors come back as new CPU tensors

Nothing is evaluated or unpickled on the receiving side: the JSON names each tensor's dtype, shape and byte range.
"""

from __future__ import annotations

import json
import math

import torch
from torch import Tensor

__all__ = ["pack", "pack_parts", "unpack"]

_MARKERS = {"__tensor__", "__tuple__", "__float__"}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def pack(tree) -> tuple[str, Tensor]:
    text, parts = pack_parts(tree)
    return text, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def pack_parts(tree) -> tuple[str, list[Tensor]]:
    """`pack` without the concatenation: each tensor's bytes (a view where the tensor is contiguous)."""
    tensors: list[Tensor] = []

    def encode(value):
        if isinstance(value, Tensor):
            if value.device.type != "cpu" or value.layout != torch.strided:
                raise ValueError(f"pack: tensors must be dense CPU tensors, not {value.device} {value.layout}")
            dtype = str(value.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ValueError(f"pack: dtype {value.dtype} is not one of {sorted(_DTYPES)}")
            tensors.append(value.contiguous().reshape(-1).view(torch.uint8))
            return {"__tensor__": len(tensors) - 1, "dtype": dtype, "shape": list(value.shape)}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise ValueError(f"pack: dict keys must be str, got {sorted(map(repr, value))[:3]}")
            if _MARKERS & value.keys():
                raise ValueError("pack: a dict key collides with the format's markers")
            return {k: encode(v) for k, v in value.items()}
        if isinstance(value, tuple):
            return {"__tuple__": [encode(v) for v in value]}
        if isinstance(value, list):
            return [encode(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return {"__float__": repr(value)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise ValueError(f"pack: cannot carry a {type(value).__name__}")

    tree = encode(tree)
    return json.dumps({"tree": tree, "lengths": [t.numel() for t in tensors]}, allow_nan=False), tensors


def unpack(text: str, flat: Tensor):
    doc = json.loads(text, parse_constant=_refuse)
    lengths = doc["lengths"]
    if flat.dtype != torch.uint8 or flat.numel() != sum(lengths):
        raise ValueError(f"unpack: {flat.numel()} bytes for tensors of {sum(lengths)}")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)

    def decode(value):
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "__tensor__" in value:
            i, dtype = value["__tensor__"], _DTYPES[value["dtype"]]
            raw = flat[starts[i]:starts[i + 1]].clone()
            return raw.view(dtype).reshape(value["shape"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        return {k: decode(v) for k, v in value.items()}

    return decode(doc["tree"])


def _refuse(name: str):
    raise ValueError(f"unpack: {name} outside a float marker")
