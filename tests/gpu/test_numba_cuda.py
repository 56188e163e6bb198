"""numba backend on a real CUDA device: zero-copy hand-over and PyTorch's stream.

Run by ``nox -s gpu`` (``pytest tests/gpu``); the default test run ignores this folder because
it needs a GPU, numba-cuda and no simulator.
"""

from __future__ import annotations

import pytest
import torch

import cakeops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run by nox -s gpu)"
)


def _inputs(rows=512, D=1024, dtype=torch.float16):
    x = torch.randn(rows, D, device="cuda", dtype=dtype)
    z = torch.randn(rows, D, device="cuda", dtype=dtype)
    w = torch.rand(D, device="cuda", dtype=dtype) + 0.5
    return x, z, w


def test_handover_shares_memory_and_keeps_strides():
    from cakeops_numba._launch import view

    packed = torch.randn(64, 3 * 256, device="cuda")
    z = packed[:, 256:512]
    arr = view(z)
    assert arr.__cuda_array_interface__["data"][0] == z.data_ptr()
    assert arr.strides == tuple(s * z.element_size() for s in z.stride())


def test_bfloat16_handover_is_an_int16_view_of_the_same_memory():
    from cakeops_numba._launch import view

    t = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)[:, :48]
    arr = view(t)
    assert arr.dtype.itemsize == 2 and arr.__cuda_array_interface__["data"][0] == t.data_ptr()
    assert arr.strides == tuple(s * 2 for s in t.stride())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_copies_of_the_inputs(dtype):
    x, z, w = _inputs(dtype=dtype)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with cakeops.use_backend("numba"):
        y = cakeops.rmsnorm_silu_gate(x, z, w)
    torch.cuda.synchronize()
    # Only the output is allocated (the allocator rounds it up to its block size).
    assert torch.cuda.max_memory_allocated() - before <= y.numel() * y.element_size() + 2**20


def test_runs_on_pytorchs_current_stream():
    """Work queued on a side stream before the op, and read after it on the same stream, sees
    the op's results without any synchronisation: the kernel ran on that stream, in order."""
    x, z, w = _inputs(rows=4096, D=4096)
    expected = cakeops.rmsnorm_silu_gate(x, z, w)  # any backend, default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), cakeops.use_backend("numba"):
        x2 = x * 1.0  # queued on the side stream; the op must wait for it
        y = cakeops.rmsnorm_silu_gate(x2, z, w)
        same = (y - expected).abs().max()
    side.synchronize()
    assert same.item() < 1e-2
