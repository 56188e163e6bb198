"""The H200 forecast's peer side (``tests/gpu_compile/peers.py``): the interpreter's count of a
launch's ``tl.dot`` FLOPs and the generic work model the peer's launches are priced with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
GPU_COMPILE = Path(__file__).resolve().parents[1] / "gpu_compile"

COUNT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch, triton, triton.language as tl
    import peers

    @triton.jit
    def kernel(A, B, C, STEPS: tl.constexpr, PRECISION: tl.constexpr):
        rows, inner = tl.arange(0, 16), tl.arange(0, 32)
        a = tl.load(A + rows[:, None] * 32 + inner[None, :])
        b = tl.load(B + inner[:, None] * 16 + rows[None, :])
        acc = tl.zeros((16, 16), tl.float32)
        for i in range(STEPS):  # as fla's loops: .to() on the index
            acc += tl.dot(a, b, input_precision=PRECISION) * i.to(tl.float32)
        tl.store(C + rows[:, None] * 16 + rows[None, :], acc)

    def run(dtype, programs, steps, precision):
        a, b = torch.randn(16, 32).to(dtype), torch.randn(32, 16).to(dtype)
        kernel[(programs,)](a, b, torch.empty(16, 16), STEPS=steps, PRECISION=precision)

    with peers.counted_dots() as counted:
        run(torch.bfloat16, 3, 2, "tf32")
        run(torch.float32, 1, 1, "ieee")
        run(torch.float32, 1, 1, "tf32")
    print(json.dumps(counted))
    """
)


def test_the_interpreter_counts_each_launchs_products_at_their_rate():
    """Each launch's products: programs x steps x 2MNK, a float32 product weighted by its rate
    against the bf16 one (IEEE on FMA, TF32 at half), and a loop index that takes ``.to()``."""
    sys.path.insert(0, str(GPU_COMPILE))
    try:
        import predict
    finally:
        sys.path.remove(str(GPU_COMPILE))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", COUNT, str(GPU_COMPILE)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    counted = json.loads(out.stdout.strip().splitlines()[-1])
    product = 2 * 16 * 32 * 16
    fma = predict.BF16_RATE / predict.FP32_FMA_RATE
    assert [c["kernel"] for c in counted] == ["kernel"] * 3
    flops = [c["flops"] for c in counted]
    assert flops == pytest.approx([3 * 2 * product, product * fma, 2 * product])


def test_the_generic_model_counts_each_tensor_once_and_walks_only_the_named_kernels(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU_COMPILE))
    import peers

    x, y = torch.empty(64, 128, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float32)
    args = {"x": x, "again": x, "y": y, "none": None, "T": 64, "_grid": (4, 2), "num_warps": 8}
    walk = peers.generic(peers.WALKS[0], args, 1e9, chunks=64)
    assert walk["bytes"] == 64 * 128 * 2 + 8 * 4
    assert (walk["programs"], walk["per_sm"], walk["chain"]) == (8, 1, 64)
    local = peers.generic("chunk_fwd_kernel_o", args, 1e9, chunks=64)
    assert local["chain"] == 0 and local["flops"] == 1e9
