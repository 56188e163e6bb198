"""The demo's side-by-side (docs/examples/demo.py): each backend first in the preference list,
and under its row which backend ran each op."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_side_by_side_says_which_backend_ran_each_op(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    monkeypatch.delenv("CAKEOPS_BACKEND", raising=False)
    import demo

    torch.manual_seed(0)
    demo.backend_table(demo.Model(), steps=1)
    out = capsys.readouterr().out
    sys.modules.pop("demo", None)
    rows = out.split("\n  numba")[1]
    # numba's CPU kernels run causal_dot_product and the norm; its CUDA-only ops fall back to
    # torch, saying so
    assert "causal_dot_product on numba\n" in rows
    assert "rmsnorm_silu_gate on numba\n" in rows
    assert "moe_experts on torch (numba: serves devices cuda" in rows
    assert out.split("\n  reference")[0].endswith("      moe_experts on torch")  # torch first
    assert "triton" in out and "unavailable: no CUDA or ROCm device" in out


def test_progress_in_a_log_says_the_rate_and_the_time_left(capsys, monkeypatch):
    """In a log (not a terminal) a progress line every 5 seconds at most, each with the rate
    and the time left, and the last step's: never minutes of silence."""
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    import demo

    sys.modules.pop("demo", None)
    clock = iter([10.0, 11.0, 16.5, 17.0])  # seconds after a start at 0
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(demo.sys.stdout, "isatty", lambda: False, raising=False)
    monkeypatch.setitem(demo._logged, "at", 0.0)
    for step in (100, 110, 165, 170):
        demo.progress(step, 170, 1.5, 0.5, start=0.0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # at 10 s, at 16.5 s, and the last step (not at 11 s)
    assert "100/170   10.0 steps/s     7 s left" in lines[0]
    assert lines[-1].lstrip().startswith("[" + "#" * 30 + "]") and "0 s left" in lines[-1]
