"""Every benchmark script in the repository runs (``--quick``: tiny shapes, seconds), so that a
change of a kernel's signature or a helper cannot leave one broken (#37: ``call_overhead.py``
crashed on a backward's old argument order and nothing ran it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cakeops.ops import SPECS

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("spec/benchmarks/*.py"), *ROOT.glob("packages/*/benchmarks/*.py")])


def test_the_scripts_are_found():
    assert {p.name for p in SCRIPTS} >= {"call_overhead.py", "cpu_rmsnorm_passes.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_benchmark_script_runs_quick(script):
    done = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the script printed nothing"
    if script.name == "family_decode.py":  # both quick families built, the same tokens
        assert "not measured" not in done.stdout and "| NO |" not in done.stdout, done.stdout
    if script.name == "call_overhead.py":
        for name in SPECS:  # every op: forward, forward with caches cold and forward+backward
            assert done.stdout.count(f"`{name}` (") == 3, done.stdout
            # and a row in the bare Function's table and the phases' table
            assert done.stdout.count(f"| `{name}` | ") == 2, done.stdout
