"""The demo's side-by-side (docs/examples/demo.py): each backend first in the preference list,
and under its row which backend ran each op."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


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
