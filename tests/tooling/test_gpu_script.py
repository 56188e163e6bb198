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

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "tests" / "gpu" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_run"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dry_run, total", [(False, 540), (True, 340)])
def test_steps_fit_the_whole_run(tmp_path, dry_run, total):
    """The steps' limits add up to at most the run's (the last step once had 540 s of limits
    against a 480 s stop); on a GPU the plumbing checks run first in the conformance step, and
    preflight checks only Triton and torch in bfloat16."""
    script = _script()
    assert script.TOTAL_S[dry_run] == total
    steps = script.plan(tmp_path, dry_run)
    assert [s.name for s in steps] == ["preflight", "bench", "conformance", "hf"]
    assert sum(s.limit_s for s in steps) <= total
    preflight = steps[0].commands[-1]
    assert preflight[preflight.index("--dtype") + 1] == "bfloat16"
    assert [preflight[i + 1] for i, a in enumerate(preflight) if a == "--backend"] == [
        "triton", "torch"]  # fmt: skip
    if not dry_run:
        first = steps[2].commands[0]
        assert str(ROOT / "tests" / "gpu" / "test_numba_cuda.py") in first
        assert str(ROOT / "tests" / "gpu" / "test_triton_cuda.py") in first


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of a module ``name`` (what ``pip download`` saves)."""
    import zipfile

    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": "WHERE = 'peer'\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for f, text in files.items():
            zf.writestr(f, text)
    return path


def test_the_peers_wheels_are_installed_for_the_run_without_the_network(tmp_path):
    """The wheels carried in ``.whl/`` (no network on the GPU machine) land in a folder of the
    run's own, which the steps import from; a broken wheel is a line saying so, not a crash."""
    script = _script()
    wheels, target = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    assert script.install_wheels(wheels, target).startswith("no wheels")
    _wheel(wheels, "cakeops_test_peer")
    line = script.install_wheels(wheels, target)
    assert line.startswith("installed cakeops_test_peer"), line
    found = subprocess.run([sys.executable, "-c", "import cakeops_test_peer as m; print(m.WHERE)"],
                           env={"PYTHONPATH": str(target), "PATH": ""}, capture_output=True,
                           text=True)  # fmt: skip
    assert found.stdout.strip() == "peer", found.stderr
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    assert script.install_wheels(wheels, tmp_path / "other").startswith("pip could not install")


def test_what_preflight_finds_missing_is_skipped_with_its_reason(tmp_path):
    """No C compiler: Triton cannot build its launchers, so the bench lists Triton's rows with
    the reason and the conformance step runs torch alone, without Triton's plumbing; no
    libNVVM: numba's suite and plumbing are left out."""
    script = _script()
    (tmp_path / "environment.json").write_text(json.dumps(
        {"c_compiler": "no C compiler on PATH", "python_h": None, "nvvm": "libNVVM not usable",
         "cache": None}))  # fmt: skip
    skipped = script.missing_backends(tmp_path)
    assert skipped == {"triton": "no C compiler on PATH", "numba": "libNVVM not usable"}
    steps = script.without(script.plan(tmp_path, dry_run=False)[1:], skipped)
    bench, conformance = steps[0].commands[0], steps[1].commands
    assert bench[-4:] == ["--skip", "triton=no C compiler on PATH", "--skip",
                          "numba=libNVVM not usable"]  # fmt: skip
    flat = [a for cmd in conformance for a in cmd]
    assert "--cakeops-backend=torch" in flat
    assert not any("triton" in a or "numba" in a for a in flat if a.startswith("--cakeops"))
    assert not any(a.endswith(("test_triton_cuda.py", "test_numba_cuda.py")) for a in flat)
    assert len(conformance) == 1


def test_preflight_names_the_images_unknowns():
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import preflight
    finally:
        sys.path.pop(0)
    found = preflight.environment(simulated=True)
    assert set(found) == {"c_compiler", "python_h", "nvvm", "cache"}
    assert all(v is None or isinstance(v, str) for v in found.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the device")
def test_the_script_stops_before_any_step_without_cuda(tmp_path, capsys):
    """No CUDA: one line and the no-device status before any step (under load, a machine
    without CUDA went through all four steps)."""
    start = time.monotonic()
    assert _script().main(["--out", str(tmp_path)]) == 3
    assert "no CUDA: torch.cuda.is_available() is False" in capsys.readouterr().out
    assert not (tmp_path / "preflight.log").exists()
    assert time.monotonic() - start < 60


def test_a_skipped_backend_is_a_row_with_its_reason(tmp_path):
    recorder = gpu.Recorder(tmp_path, {"device": "cpu", "torch": torch.__version__, "rows": []})
    case = gpu.GpuCase("bfloat16", SPECS["rmsnorm_silu_gate"].example("cpu", torch.bfloat16))
    inputs = gpu._inputs("rmsnorm_silu_gate", case)
    contender = gpu.Contender("rmsnorm_silu_gate", case, inputs, "cakeops [triton]",
                              lambda: None, "triton")  # fmt: skip
    gpu._time_contender(contender, torch.device("cpu"), 1, {}, recorder, time.monotonic() + 60,
                        {"triton": "no C compiler on PATH"})  # fmt: skip
    [row] = recorder.record["rows"]
    assert row["impl"] == "cakeops [triton]"
    assert row["skipped"] == "skipped: no C compiler on PATH"


def test_the_bench_times_every_ops_triton_row_first():
    """Every op's Triton row before any other (rmsnorm, moe, routed, causal), then torch's,
    then the other backends', the peers, torch.compile's, numba's matrix products last."""
    cases = [(op, case) for op in gpu.ORDER for case in gpu._cases(op, torch.device("cpu"), True)]
    order = gpu.schedule(cases)
    labels = [(c.op, c.label) for c in order]
    triton = [i for i, (_, label) in enumerate(labels) if label == "cakeops [triton]"]
    if triton:  # the interpreter (TRITON_INTERPRET=1) or a GPU
        assert triton == list(range(len(triton)))
        assert [labels[i][0] for i in triton] == [op for op, _ in cases]
    compiled = [i for i, (_, label) in enumerate(labels) if "torch.compile" in label]
    ours = [i for i, (_, label) in enumerate(labels) if label.startswith("cakeops")]
    slow = [i for i, (op, label) in enumerate(labels)
            if label == "cakeops [numba]" and op in gpu.NUMBA_MATMUL]  # fmt: skip
    assert compiled and max(i for i in ours if i not in slow) < min(compiled)
    assert all(i > max(compiled) for i in slow)


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


def test_a_triton_row_profiles_one_step(tmp_path):
    """Each Triton row profiles one step (on a GPU its kernels, here the CPU's operators): the
    launches and the busiest by time, in the row and in ``gpu-profile.md``."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    prof = gpu.profile_step(lambda: (a @ b).relu().sum(), torch.device("cpu"))
    names = [name for name, _, _ in prof["top"]]
    assert prof["launches"] >= 3 and "aten::mm" in names and prof["host_ms"] > 0
    assert all(n >= 1 and ms >= 0 for _, n, ms in prof["top"])
    recorder = gpu.Recorder(tmp_path, {"device": "cpu", "torch": torch.__version__, "rows": []})
    recorder.add({"op": "rmsnorm_silu_gate", "case": "bfloat16", "impl": "cakeops [triton]",
                  "back_to_back_s": 1e-3, "host_s": 1e-3, "kernels_s": None, "time_s": 1e-3,
                  "graph": "no GPU",
                  "profile": prof})  # fmt: skip
    text = (tmp_path / "gpu-profile.md").read_text()
    assert "### rmsnorm_silu_gate, bfloat16, cakeops [triton]" in text and "`aten::mm`" in text
    # the summary's row says how many launches one step makes
    row = next(line for line in (tmp_path / "gpu.md").read_text().splitlines()
               if "cakeops [triton]" in line)  # fmt: skip
    header = next(line for line in (tmp_path / "gpu.md").read_text().splitlines()
                  if line.startswith("| op |"))  # fmt: skip
    cells = dict(zip(header.split("|"), row.split("|"), strict=True))
    assert cells[" launches "].strip() == str(prof["launches"])


@pytest.mark.parametrize("absent", ["pytest", "xdist"])
def test_missing_pytest_stops_the_script_with_what_to_install(tmp_path, monkeypatch, capsys,
                                                               absent):  # fmt: skip
    """Without pytest (or pytest-xdist) every step but preflight would fail with a module
    error: the script says what to install and runs nothing."""
    script = _script()
    real = script._have
    monkeypatch.setattr(script, "_have", lambda module: module != absent and real(module))
    assert script.main(["--dry-run", "--out", str(tmp_path)]) == script.MISSING_TOOLS
    err = capsys.readouterr().err
    assert f"pip install {script.TOOLS[absent]}" in err and "nothing runs" in err
    assert not any(tmp_path.iterdir())
