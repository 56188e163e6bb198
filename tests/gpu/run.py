"""The GPU check: one script for a machine with a CUDA GPU, no network and nothing but the image's
packages (torch, Triton, numba-cuda, pytest with pytest-xdist and pytest-timeout; no nox).

    python3 tests/gpu/run.py [--out DIR] [--dry-run]

Four steps, each a process under its own time limit, each writing its results under ``DIR``
(default ``$OUT``, else ``bench-results/gpu``) as they come, so that a step cut short loses only
itself; the whole run stops within 9 minutes:

a. preflight (110 s): ``cakeops info``, one small forward+backward per op, backend and dtype
   against the reference (first-call times: Triton's compiles, numba-cuda's first compile); with
   no CUDA device, one line and exit status 3, and nothing else runs;
b. benchmarks (150 s): ``python -m cakeops.bench.gpu`` at the H200 shapes;
c. conformance (220 s): ``triton`` and ``torch`` on CUDA in full, ``numba`` on a subset, and the
   device-only checks of ``tests/gpu``; ``pytest -n 8 --timeout=120``, each test's outcome
   appended to a JSON-lines file as it ends and the JUnit file written even when the step is
   cut short (pytest is interrupted first, killed only if it does not stop);
d. the Hugging Face models' training step (50 s).

The peers (flash-linear-attention, Liger-Kernel) are not in the image and the machine has no
network: their wheels travel with the working tree in ``.whl/`` (``--wheels DIR``; the download
commands are in docs/content/gpu.md) and are installed into a folder of this run's own, put on
every step's ``PYTHONPATH``; a peer that still does not import is a row saying why.

``--dry-run`` runs the same steps on the CPU (Triton's interpreter, numba's CUDA simulator, tiny
shapes, a subset of the suite) within 3 minutes: CI runs it, so the script itself has run before
a GPU sees it. The in-tree distributions run from their ``src`` folders when they are not
installed (a ``.dist-info`` shim per distribution makes their entry points visible).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NO_DEVICE = 3  # preflight's status when the device is not there
MISSING_TOOLS = 4  # the script's status when pytest or pytest-xdist is not installed
#: module -> the package that brings it: what every step but preflight runs under
TOOLS = {"pytest": "pytest", "xdist": "pytest-xdist"}
GRACE_S = 20  # after an interrupt, how long a step may take to write its files


@dataclass
class Step:
    """One step: its commands (run in turn), its time limit, and how a status reads."""

    name: str
    limit_s: float
    commands: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)
    ok_codes: tuple[int, ...] = (0,)


@dataclass
class Outcome:
    name: str
    status: str
    seconds: float
    codes: list[int | None]


def source_tree_paths() -> list[str]:
    """``PYTHONPATH`` entries for the in-tree distributions when ``cakeops`` is not installed:
    their ``src`` folders, plus a ``.dist-info`` shim per distribution so that entry points (the
    backends, the pytest plugin) are discovered as if installed; none when it is installed."""
    if importlib.util.find_spec("cakeops") is not None:
        return []
    shims = Path(tempfile.mkdtemp(prefix="cakeops-shims-"))
    paths = [str(shims)]
    projects = [ROOT / "spec" / "pyproject.toml", *sorted(ROOT.glob("packages/*/pyproject.toml"))]
    version = (ROOT / "VERSION").read_text().strip()  # every distribution's one version
    for project in projects:
        text = project.read_text()
        name = re.search(r'^name = "([^"]+)"', text, re.M).group(1)
        groups = re.findall(
            r'^\[project\.entry-points\."?([\w.]+)"?\]\n((?:\w+ = "[^"]+"\n)+)', text, re.M
        )
        info = shims / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        entries = "".join(f"[{group}]\n{body}\n" for group, body in groups)
        (info / "entry_points.txt").write_text(entries.replace('"', ""))
        paths.append(str(project.parent / "src"))
    return paths


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


#: The whole run's stop, in seconds (on a GPU; ``--dry-run``): the steps' limits fit within it.
TOTAL_S = {False: 540, True: 340}


def plan(out: Path, dry_run: bool) -> list[Step]:
    """The four steps, on CUDA, or on the CPU with tiny shapes for ``--dry-run``."""
    py = sys.executable
    device = "cpu" if dry_run else "cuda"
    kernel_env = {"TRITON_INTERPRET": "1", "NUMBA_ENABLE_CUDASIM": "1"} if dry_run else {}
    bench = [py, "-m", "cakeops.bench.gpu", "--device", device, "--out", str(out / "bench")]
    hf = [py, "-m", "cakeops.bench.hf_models", "--device", device,
          "--markdown", str(out / "hf_models.md")]  # fmt: skip

    def pytest(name: str, *args: str) -> list[str]:
        cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "progress",
               "-o", "addopts=", "-W", "ignore::DeprecationWarning",
               f"--junitxml={out / f'{name}.xml'}", *args]  # fmt: skip
        if _have("xdist"):
            cmd += ["-n", "2" if dry_run else "8"]
        if _have("pytest_timeout"):
            cmd += ["--timeout=120"]
        return cmd

    suite = ["--pyargs", "cakeops.testing", f"--cakeops-device={device}"]
    if dry_run:
        # the plumbing on a sample: every op on the interpreter, the simulator and torch
        sample = "test_saves_exactly_the_inputs or test_deterministic"
        conformance = [
            pytest("suite-triton-torch", *suite, "--cakeops-backend=triton,torch", "-k", sample),
            pytest("suite-numba", *suite, "--cakeops-backend=numba", "-k",
                   "test_saves_exactly_the_inputs"),
        ]  # fmt: skip
        # the bench's budget stops it starting a contender, not one running: a CPU's compile of
        # a torch.compile contender ran 20 s past a 40 s budget (a 60 s limit cut it short).
        # Twice what a quiet 2-core machine takes (hf 9-13 s, conformance 40-67 s): the dry
        # run checks the script, and a busy machine cut hf short at 21 s of 20
        limits = {"preflight": 60, "bench": 90, "conformance": 130, "hf": 60}
        bench += ["--quick", "--budget", "30"]
        hf += ["--quick"]
    else:
        conformance = [
            # the checks that exist only on a GPU (zero-copy, streams, no host synchronisation)
            pytest("plumbing", str(HERE / "test_numba_cuda.py"), str(HERE / "test_triton_cuda.py")),
            pytest("suite-triton-torch", *suite, "--cakeops-backend=triton,torch"),
            pytest("suite-numba", *suite, "--cakeops-backend=numba", "-k",
                   "test_matches_reference or test_deterministic or test_non_finite"),
        ]  # fmt: skip
        # within the whole run's 540 s, so that the last step has its time too (the first
        # H200 run: preflight cut short at 45 s, conformance 176 s, hf 21 s)
        limits = {"preflight": 110, "bench": 150, "conformance": 220, "hf": 50}
        bench += ["--budget", str(limits["bench"] - 40)]
    progress = {"CAKEOPS_PROGRESS": str(out / "conformance-progress.jsonl")}
    # what the GPU run needs of preflight: Triton and torch, in bfloat16 (the conformance step
    # checks every backend and dtype)
    preflight = [py, str(HERE / "preflight.py"), "--device", device, "--out", str(out),
                 "--backend", "triton", "--backend", "torch", "--dtype", "bfloat16"]  # fmt: skip
    preflight += ["--once"] if dry_run else []
    return [
        Step("preflight", limits["preflight"],
             [[py, "-m", "cakeops", "info"], preflight], kernel_env),
        Step("bench", limits["bench"], [bench], kernel_env),
        Step("conformance", limits["conformance"], conformance, {**kernel_env, **progress}),
        # without transformers hf_models exits 2 and says so: not a failure of the GPU
        Step("hf", limits["hf"], [hf], kernel_env, ok_codes=(0, 2)),
    ]  # fmt: skip


#: What each of preflight's findings (``environment.json``) stops: backends that cannot run.
NEEDED_BY = {"c_compiler": "triton", "python_h": "triton", "nvvm": "numba"}
#: The conformance commands and plumbing files of each backend.
PLUMBING = {"triton": "test_triton_cuda.py", "numba": "test_numba_cuda.py"}


def missing_backends(out: Path) -> dict[str, str]:
    """``backend -> why it cannot run here``, from preflight's ``environment.json``."""
    path = out / "environment.json"
    if not path.exists():
        return {}
    found = json.loads(path.read_text())
    skipped: dict[str, str] = {}
    for key, why in found.items():
        if why and key in NEEDED_BY:
            skipped.setdefault(NEEDED_BY[key], why)
    return skipped


def without(steps: list[Step], skipped: dict[str, str]) -> list[Step]:
    """The steps after preflight without what needs a missing backend: the bench lists its rows
    as skipped with the reason, the conformance step leaves out its suite and plumbing tests."""
    if not skipped:
        return steps
    files = [PLUMBING[n] for n in skipped if n in PLUMBING]
    kept = []
    for step in steps:
        commands = []
        for cmd in step.commands:
            if "cakeops.bench.gpu" in cmd:
                cmd = [*cmd, *(a for n, why in skipped.items() for a in ("--skip", f"{n}={why}"))]
            elif "pytest" in cmd:
                tests = [a for a in cmd if a.endswith(".py") and not a.endswith(tuple(files))]
                had_tests = any(a.endswith(".py") for a in cmd)
                cmd = [a for a in cmd if not a.endswith(tuple(files))]
                for i, a in enumerate(cmd):
                    if a.startswith("--cakeops-backend="):
                        left = [n for n in a.split("=", 1)[1].split(",") if n not in skipped]
                        cmd[i] = f"--cakeops-backend={','.join(left)}" if left else ""
                if "" in cmd or (had_tests and not tests):
                    continue  # nothing of it can run here
            commands.append(cmd)
        kept.append(Step(step.name, step.limit_s, commands, step.env, step.ok_codes))
    return kept


def cuda_missing(env: dict[str, str]) -> str | None:
    """Why CUDA is not usable here (None when it is), asked of torch in a process of its own
    (this script imports no torch), in seconds."""
    code = ("import torch, sys\n"
            "sys.exit(0 if torch.cuda.is_available() else 3)")  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "torch took over 120 s to answer whether CUDA is available"
    if proc.returncode == 0:
        return None
    if proc.returncode == NO_DEVICE:
        return "torch.cuda.is_available() is False: no CUDA device or driver"
    return f"torch does not import: {proc.stderr.strip().splitlines()[-1:]}"


def run_step(step: Step, base_env: dict[str, str], log: Path, deadline: float) -> Outcome:
    """The step's commands in turn, each in its own process group; at the step's limit the
    running one gets SIGINT (pytest then writes its JUnit file), SIGKILL ``GRACE_S`` later."""
    start = time.monotonic()
    stop_at = min(start + step.limit_s, deadline)
    env = {**base_env, **step.env}
    codes: list[int | None] = []
    status = "ok"
    with log.open("w") as out:
        for cmd in step.commands:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=ROOT, start_new_session=True)  # fmt: skip
            try:
                codes.append(proc.wait(timeout=max(1.0, stop_at - time.monotonic())))
            except subprocess.TimeoutExpired:
                status = f"cut short at {step.limit_s:.0f} s"
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                codes.append(None)
                break
            if codes[-1] not in step.ok_codes:
                status = f"failed (exit {codes[-1]})"
                if step.name == "preflight":
                    break
    return Outcome(step.name, status, time.monotonic() - start, codes)


def conformance_counts(out: Path) -> str:
    """``N passed, N failed, N skipped`` from the progress file (complete even if cut short)."""
    path = out / "conformance-progress.jsonl"
    if not path.exists():
        return "no tests ran"
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        outcome = json.loads(line)["outcome"]
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran"


def install_wheels(folder: Path, target: Path) -> str:
    """Install the wheels in ``folder`` into ``target`` without the network or their
    dependencies (each one needed is a wheel of the folder too); a line saying what came of it."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return f"no wheels in {folder}"
    names = ", ".join(w.name.split("-")[0] for w in wheels)
    try:  # out of the steps' minutes: a pure-Python wheel installs in about a second
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
             *map(str, wheels)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"pip did not install {names} within 60 s"
    if done.returncode != 0:
        return f"pip could not install {names}: {done.stderr.strip()[-400:]}"
    return f"installed {names} from {folder}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="results here (default $OUT or bench-results/gpu)")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny")
    parser.add_argument("--cache-dir", type=Path,
                        help="compile caches here (default: a fresh temporary folder)")  # fmt: skip
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                        help="peers' wheels to install for the run (default .whl/)")  # fmt: skip
    args = parser.parse_args(argv)
    missing = [package for module, package in TOOLS.items() if not _have(module)]
    if missing:
        print(f"cakeops GPU check: its steps run under {' and '.join(TOOLS.values())}; "
              f"missing here: {', '.join(missing)} (pip install {' '.join(missing)}); nothing "
              "runs", file=sys.stderr)  # fmt: skip
        return MISSING_TOOLS
    default = Path(os.environ.get("OUT") or ROOT / "bench-results" / "gpu")
    out = (args.out or (default / "dry-run" if args.dry_run else default)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "conformance-progress.jsonl").unlink(missing_ok=True)
    deadline = time.monotonic() + TOTAL_S[args.dry_run]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                            "NUMBA_ENABLE_CUDASIM")}  # fmt: skip
    # the distributions (when not installed), then tests/gpu for the progress plugin
    peers = Path(tempfile.mkdtemp(prefix="cakeops-gpu-peers-"))
    if args.wheels.is_dir():
        print(f"peers' wheels: {install_wheels(args.wheels, peers)}")
    paths = [*source_tree_paths(), str(HERE), str(peers), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env["PYTHONUNBUFFERED"] = "1"
    # fresh compile caches of this run's own (Triton's, inductor's, numba's), so that first-call
    # times are cold and a read-only home does not matter; not under the results, whose files
    # are few and come back whole
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="cakeops-gpu-cache-"))
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("NUMBA_CACHE_DIR", "numba")):  # fmt: skip
        env[var] = str(cache / sub)
    print(f"cakeops GPU check{' (dry run, on the CPU)' if args.dry_run else ''}: results in {out}"
          f", compile caches in {cache}")  # fmt: skip
    if not args.dry_run:
        why = cuda_missing(env)
        if why is not None:
            print(f"no CUDA: {why}; nothing runs")
            return NO_DEVICE
    outcomes = []
    steps = plan(out, args.dry_run)
    for index in range(len(steps)):
        if index == 1:  # what preflight found missing stops what needs it
            skipped = missing_backends(out)
            for name, why in skipped.items():
                print(f"skipping {name} in the steps after preflight: {why}")
            steps[1:] = without(steps[1:], skipped)
        step = steps[index]
        if time.monotonic() > deadline:
            outcomes.append(Outcome(step.name, "not run: out of time", 0.0, []))
            continue
        print(f"[{step.name}] at most {step.limit_s:.0f} s ...", flush=True)
        outcome = run_step(step, env, out / f"{step.name}.log", deadline)
        outcomes.append(outcome)
        print(f"[{step.name}] {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        if step.name == "preflight" and outcome.codes and outcome.codes[-1] == NO_DEVICE:
            print((out / "preflight.log").read_text().strip().splitlines()[-1])
            return NO_DEVICE
    lines = ["| step | status | seconds |", "| --- | --- | ---: |"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.0f} |" for o in outcomes]
    lines += ["", f"conformance: {conformance_counts(out)}"]
    for name in ("bench/gpu.md", "hf_models.md"):
        if (out / name).exists():
            lines += ["", (out / name).read_text().strip()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
