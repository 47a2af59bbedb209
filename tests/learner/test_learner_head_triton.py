"""The head's one-pass Triton statistics (`asyncrl.learner.head_triton`) against the PyTorch ones
(`head._chunk_forward`): log π(target), lse and Σ p·z. On CPU through Triton's interpreter (a subprocess
with TRITON_INTERPRET=1); on CUDA the compiled head is checked against the eager one in test_learner_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from asyncrl.learner.head import _chunk_forward
from asyncrl.learner.head_triton import chunk_forward
gen = torch.Generator().manual_seed(0)
# vocab sizes below, at and off the kernel's 2,048-wide block; bf16 and fp32; a large spread of logits
for rows, vocab, dtype, spread in ((5, 3000, torch.float32, 4.0), (3, 4096, torch.bfloat16, 4.0),
                                   (2, 17, torch.float32, 1.0), (4, 2500, torch.float32, 60.0)):
    logits = (torch.randn(rows, vocab, generator=gen) * spread).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    want = _chunk_forward(logits, targets, 1 / 0.7)
    got = chunk_forward(logits, targets, 1 / 0.7)
    for name, w, g in zip(("logp", "lse", "mean_z"), want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4, msg=f"{name} {rows}x{vocab} {dtype}")
print("ok")
"""


@pytest.mark.e2e
def test_one_pass_statistics_equal_the_pytorch_ones():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
