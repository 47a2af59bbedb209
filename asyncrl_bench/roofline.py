"""The limits a benchmark row is measured against, printed in the row itself: the device's nominal peak dense
bf16 FLOP/s for a training step (MFU = model FLOPs / time / peak) and its HBM bandwidth for a decode step.
On CPU, or a GPU not in the tables, the peak is unknown: the row says null and why (`roofline_note`).

    peak_flops("cuda")                          # 989e12 on an H100 or H200
    flop_roofline(flops_per_step=6.1e15, device="cuda")
    # {"model_flops_per_step": 6.1e15, "peak_flops": 989e12, "roofline_step_s": 6.17, ...}
"""

from __future__ import annotations

from asyncrl_bench.shared import device_name

__all__ = ["PEAK_BF16_FLOPS", "PEAK_BANDWIDTH", "peak_flops", "peak_bandwidth", "mfu", "flop_roofline",
           "unknown_peak_note"]

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, SXM parts
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # HBM bytes/s, SXM parts


def _lookup(table: dict[str, float], device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = device_name(device)
    return next((value for key, value in table.items() if key in name), None)


def peak_flops(device: str) -> float | None:
    """Nominal dense bf16 FLOP/s of `device` when it is a GPU we know; None on CPU or an unknown GPU."""
    return _lookup(PEAK_BF16_FLOPS, device)


def peak_bandwidth(device: str) -> float | None:
    """Nominal HBM bandwidth (bytes/s) of `device` when it is a GPU we know; None on CPU or an unknown GPU."""
    return _lookup(PEAK_BANDWIDTH, device)


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak (None without a peak)."""
    return None if peak is None else flops / seconds / peak


def unknown_peak_note(device: str, what: str) -> str:
    """Why a row's roofline is null."""
    return (f"no known peak {what} for {device_name(device)} (tables in asyncrl_bench/roofline.py cover H100, "
            "H200, A100): the roofline and the fraction of it are null")


def flop_roofline(flops_per_step: float, device: str) -> dict:
    """A training step's roofline fields: its model FLOPs, the device's peak, the step time at that peak
    (null with `roofline_note` on CPU or an unknown GPU)."""
    peak = peak_flops(device)
    row = {"model_flops_per_step": flops_per_step, "peak_flops": peak,
           "roofline_step_s": None if peak is None else flops_per_step / peak}
    if peak is None:
        row["roofline_note"] = unknown_peak_note(device, "bf16 FLOP/s")
    return row
