"""``cakeops.helpers.new_output``: a plain fresh tensor, whose large CPU memory is advised into huge
pages (whole 2 MiB pages inside the tensor only), and a switch that turns the advice off."""

import pytest
import torch

from cakeops import helpers

MiB = 1 << 20


@pytest.fixture
def advice(monkeypatch):
    """Record the ``madvise`` calls instead of making them."""
    calls = []
    monkeypatch.setattr(helpers, "_madvise", lambda: lambda *a: calls.append(a) or 0)
    return calls


def test_a_large_cpu_output_is_advised_inside_its_own_memory(advice):
    out = helpers.new_output((64 * MiB // 4 + 3,), torch.float32)
    assert out.shape == (64 * MiB // 4 + 3,) and out.dtype == torch.float32
    [(start, length, flag)] = advice
    assert flag == 14  # MADV_HUGEPAGE
    assert start % (2 * MiB) == 0 and length % (2 * MiB) == 0 and length > 0
    assert out.data_ptr() <= start and start + length <= out.data_ptr() + out.nbytes
    assert length >= out.nbytes - 4 * MiB  # every whole huge page inside it


@pytest.mark.parametrize("shape", [(1024,), (helpers.HUGE_PAGES_MIN_BYTES // 4 - 1,), (0, 7)])
def test_a_small_output_is_not_advised(advice, shape):
    assert helpers.new_output(shape, torch.float32).shape == shape
    assert advice == []


def test_the_advice_can_be_turned_off(advice, monkeypatch):
    monkeypatch.setenv(helpers.HUGE_PAGES_ENV, "0")
    helpers.new_output((32 * MiB,), torch.bfloat16)
    assert advice == []


def test_the_advice_reaches_the_kernel_where_it_takes_it():
    """On Linux with transparent huge pages in ``madvise`` mode the tensor's mapping is marked
    ``hg`` (VmFlags in /proc/self/smaps)."""
    if helpers._madvise() is None:
        pytest.skip("this system takes no huge-page advice (not Linux, or THP not in madvise mode)")
    out = helpers.new_output((32 * MiB,), torch.float32)
    inside = -(-out.data_ptr() // (2 * MiB)) * (2 * MiB)
    flags = None
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split()[0] and not line.startswith("VmFlags"):
                lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
                current = lo <= inside < hi
            elif line.startswith("VmFlags") and current:
                flags = line.split()[1:]
    assert flags is not None and "hg" in flags
