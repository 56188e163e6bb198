"""``cakeops info`` as a console script and as ``python -m cakeops``."""

import json
import os
import subprocess
import sys

import pytest


def run(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    full_env.pop("CAKEOPS_BACKEND", None) if env is None else None
    return subprocess.run(args, capture_output=True, text=True, env=full_env, check=True).stdout


@pytest.mark.parametrize("cmd", [["cakeops"], [sys.executable, "-m", "cakeops"]])
def test_info_lists_versions_backends_and_picks(cmd):
    out = run(*cmd, "info")
    assert "torch " in out and "cakeops " in out
    assert "devices: cpu" in out
    assert "torch      cakeops-torch" in out
    assert "numba      cakeops-numba 0.1.0  unavailable: no CUDA device" in out
    assert "triton     cakeops-triton 0.1.0  unavailable: no CUDA or ROCm device" in out
    assert "rmsnorm_silu_gate    cpu   float16=torch  bfloat16=torch  float32=torch" in out
    assert "causal_dot_product   cpu   float16=torch  bfloat16=torch  float32=torch" in out


def test_info_json_reflects_a_forced_backend():
    info = json.loads(run("cakeops", "info", "--json", env={"CAKEOPS_BACKEND": "reference"}))
    assert info["picks"]["rmsnorm_silu_gate"]["cpu"]["float32"] == "reference"
    assert info["forced"]["rmsnorm_silu_gate"] == "reference (from CAKEOPS_BACKEND)"
    assert info["backends"]["torch"]["ops"]["rmsnorm_silu_gate"]["devices"] == {"*": 10}
    # example declares float32 only, so a forced example leaves float64 with no backend
    info = json.loads(run("cakeops", "info", "--json", env={"CAKEOPS_BACKEND": "example"}))
    assert info["picks"]["rmsnorm_silu_gate"]["cpu"]["float64"] == "none"
