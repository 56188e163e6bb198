"""The whole offline GPU compile check (``nox -s gpu_compile``): Triton kernels for sm_90 and
sm_80, numba-cuda kernels for compute capability 9.0 (and 8.0 with --full), then the report,
which fails on what a GPU would reject or run badly. Independent parts run side by side.

    python tests/gpu_compile/run_all.py [--out bench-results] [--docs docs/content/gpu.md]
                                        [--triton-only | --sweep] [--full]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ARCHS = (90, 80)


def start(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    merged = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    merged.update(env)
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=merged
        )


def wait(procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    failed = []
    for name, (proc, log) in procs.items():
        code = proc.wait()
        text = log.read_text()
        print(f"--- {name} (exit {code})\n{text[-3000:] if code else text.strip()[-300:]}")
        if code:
            failed.append(name)
    if failed:
        sys.exit(f"the compile check could not run: {', '.join(failed)}")


def triton_args(args) -> list[str]:
    """The Triton check's options: the dtypes asked for, or for ``--triton-only`` bfloat16 (the
    GPU benchmark's dtype; float16 too with ``--full``), and ``--full`` passed on."""
    sixteen = ["bfloat16", "float16"] if args.full else ["bfloat16"]
    dtypes = args.dtype or (sixteen if args.triton_only else [])
    return [a for d in dtypes for a in ("--dtype", d)] + (["--full"] if args.full else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--docs", type=Path)
    parser.add_argument(
        "--triton-only",
        action="store_true",
        help="the Triton kernels alone, 16-bit (another Triton version: numba's kernels do not "
        "change, and what fails the check besides a compile error is 16-bit)",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=["float32", "float16", "bfloat16"],
        help="only these input dtypes (repeatable; default: all the check takes)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="compile the resource sweep's shapes instead (16-bit and mixed)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="float16 too where a default run takes one 16-bit dtype (see triton_check.py)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-compile-"))
    # A fresh Triton cache: every kernel is compiled (and ptxas reports on it) in this run.
    cache = str(work / "triton-cache")
    parts = [work / f"triton-{arch}.json" for arch in ARCHS]
    sigs = work / "numba-signatures.json"
    procs = {
        f"triton sm_{arch}": (
            start([str(HERE / "triton_check.py"), "--arch", str(arch), "--out", str(part),
                   *(["--sweep"] if args.sweep else []),
                   *triton_args(args)],
                  work / f"triton-{arch}.log", TRITON_CACHE_DIR=cache),
            work / f"triton-{arch}.log",
        )
        for arch, part in zip(ARCHS, parts, strict=True)
    }  # fmt: skip
    if args.sweep or args.triton_only:  # the Triton kernels' configs only
        wait(procs)
        report = [str(HERE / "report.py"), *map(str, parts)]
        name = "gpu-compile-sweep.json" if args.sweep else "gpu-compile.json"
        report += ["--json", str(args.out / name)]
        sys.exit(subprocess.run([sys.executable, *report]).returncode)
    record = start(
        [str(HERE / "numba_check.py"), "record", "--out", str(sigs)],
        work / "numba-record.log",
        NUMBA_ENABLE_CUDASIM="1",
    )
    wait({"numba record": (record, work / "numba-record.log")})
    # numba's kernels for sm_90 (no spill, at most 164 registers on both targets when both
    # ran); sm_80 too with --full
    numba_archs = ARCHS if args.full else ARCHS[:1]
    numba_parts = [work / f"numba-{arch}.json" for arch in numba_archs]
    for arch, part in zip(numba_archs, numba_parts, strict=True):
        log = work / f"numba-{arch}.log"
        cmd = [str(HERE / "numba_check.py"), "compile", "--sigs", str(sigs), "--arch", str(arch)]
        procs[f"numba sm_{arch}"] = (start([*cmd, "--out", str(part)], log), log)
    wait(procs)
    report = [str(HERE / "report.py"), *map(str, parts + numba_parts)]
    report += ["--json", str(args.out / "gpu-compile.json")]
    report += ["--docs", str(args.docs)] if args.docs else []
    sys.exit(subprocess.run([sys.executable, *report]).returncode)


if __name__ == "__main__":
    main()
