"""The GPU script's plumbing on the CPU: its steps' limits, a step cut short, the GPU benchmark's
rows and the conformance plugin's refusal of a missing device. (The whole dry run is run by the
tests session: ``python tests/gpu/run.py --dry-run``.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cakeops import bench
from cakeops.bench import gpu
from cakeops.ops import SPECS
from cakeops.testing.plugin import device_missing

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "tests" / "gpu" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_run"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dry_run, total", [(False, 480), (True, 180)])
def test_steps_fit_the_whole_run(tmp_path, dry_run, total):
    steps = _script().plan(tmp_path, dry_run)
    assert [s.name for s in steps] == ["preflight", "bench", "conformance", "hf"]
    limits = {s.name: s.limit_s for s in steps}
    if not dry_run:  # the per-step limits
        assert limits == {"preflight": 60, "bench": 180, "conformance": 240, "hf": 60}
    # the sum may exceed the whole run's limit only because the run stops at its own deadline
    assert all(s.limit_s <= total for s in steps)


def test_a_step_past_its_limit_is_cut_short_and_keeps_what_it_wrote(tmp_path):
    script = _script()
    marker = tmp_path / "wrote"
    code = f"open({str(marker)!r}, 'w').write('x'); import time; time.sleep(60)"
    step = script.Step("slow", 2, [[sys.executable, "-c", code]])
    start = time.monotonic()
    outcome = script.run_step(step, {}, tmp_path / "slow.log", deadline=start + 100)
    assert outcome.status.startswith("cut short")
    assert outcome.codes == [None]
    assert time.monotonic() - start < 30
    assert marker.read_text() == "x"


def test_the_bench_step_differentiates_only_what_the_spec_does():
    inputs = SPECS["routed_experts"].example("cpu")
    given = SPECS["routed_experts"].differentiable_given(inputs)
    for name in given:
        inputs[name].requires_grad_()
    step = bench.step_of("routed_experts", inputs, lambda: SPECS["routed_experts"](**inputs))
    grads = step()
    assert "top_k_index" not in SPECS["routed_experts"].differentiable
    assert "b_down" in SPECS["routed_experts"].differentiable and "b_down" not in given
    assert len(grads) == len(given) == 5


def test_bench_rows_are_written_as_they_come(tmp_path):
    recorder = gpu.Recorder(tmp_path, {"device": "cpu", "torch": torch.__version__, "rows": []})
    row = {"op": "x", "case": "c", "impl": "cakeops [torch]", "time_s": 1e-3,
           "back_to_back_s": 1e-3, "host_s": 1e-3, "kernels_s": None,
           "graph": "no GPU"}  # fmt: skip
    recorder.add(row)
    recorder.add({"op": "x", "case": "c", "impl": "peer", "skipped": "does not import"})
    lines = (tmp_path / "gpu-rows.jsonl").read_text().splitlines()
    assert [json.loads(line)["impl"] for line in lines] == ["cakeops [torch]", "peer"]
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["rows"][0]["speedup_vs_torch"] == 1.0
    assert "not compared: does not import" in (tmp_path / "gpu.md").read_text()


def test_missing_devices_are_named():
    assert device_missing("cpu") is None
    assert "not a device" in device_missing("bogus")
    if not torch.cuda.is_available():
        assert "no cuda device" in device_missing("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the device")
def test_suite_stops_at_once_without_the_device():
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "cakeops.testing", "--cakeops-device=cuda",
         "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 4
    assert "no cuda device on this machine" in run.stdout + run.stderr
    assert "failed" not in run.stdout
    assert time.monotonic() - start < 60


def test_source_tree_shims_on_a_machine_without_cakeops_installed(monkeypatch, tmp_path):
    """The GPU image runs the sources uninstalled: a ``.dist-info`` shim per distribution with
    the one version (VERSION) and the entry points, and each ``src`` folder on the path."""
    script = _script()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cakeops" else real(name, *a))  # fmt: skip
    paths = script.source_tree_paths()
    shims = Path(paths[0])
    version = (ROOT / "VERSION").read_text().strip()
    infos = sorted(p.name for p in shims.iterdir())
    dists = ("cakeops", "cakeops_numba", "cakeops_torch", "cakeops_triton")
    assert infos == sorted(f"{d}-{version}.dist-info" for d in dists)
    entry_points = (shims / f"cakeops_numba-{version}.dist-info" / "entry_points.txt").read_text()
    assert "[cakeops.backends]\nnumba = cakeops_numba:backend" in entry_points
    assert str(ROOT / "spec" / "src") in paths
