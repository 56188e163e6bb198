"""Step a of the GPU script: is this machine ready? One small forward+backward per op, backend
and dtype on the device, each checked against the float64 reference, with the time of its first
call (Triton's compile and tuning, numba-cuda's first compile) and of its second.

    python tests/gpu/preflight.py --device cuda --out DIR [--backend B] [--dtype D] [--once]

First, in its first seconds, what the image may lack (a C compiler and ``Python.h`` for
Triton, libNVVM for numba-cuda, writable caches): a line each, and ``DIR/environment.json``
for the steps after it. Exits 3 with one line when the device is not there, 1 when any call
fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

import cakeops
from cakeops import registry
from cakeops.measure import sync
from cakeops.ops import SPECS
from cakeops.testing.plugin import device_missing

NO_DEVICE = 3


def call(op: str, inputs, backend: str, device: torch.device) -> tuple[list[torch.Tensor], float]:
    """Output and gradients of one forward+backward on ``backend``, and its seconds."""
    spec = SPECS[op]
    wrt = tuple(inputs[name] for name in spec.differentiable_given(inputs))
    start = time.perf_counter()
    with cakeops.use_backend(backend):
        out = spec(**inputs)
        grads = torch.autograd.grad(out, wrt, torch.ones_like(out))
    sync(device)
    return [out, *grads], time.perf_counter() - start


def check_one(
    op: str, backend: str, dtype: torch.dtype, device: torch.device, again: bool = True
) -> dict:
    spec = SPECS[op]
    torch.manual_seed(0)
    inputs = spec.example(device, dtype)
    for name in spec.differentiable_given(inputs):
        inputs[name].requires_grad_()
    row: dict = {"op": op, "backend": backend, "dtype": str(dtype).removeprefix("torch.")}
    try:
        got, row["first_s"] = call(op, inputs, backend, device)
        if again:
            _, row["second_s"] = call(op, inputs, backend, device)
        want, _ = call(op, inputs, "reference", device)
        worst = max(
            ((g.double() - w.double()).abs().max() / (w.double().abs().max() + 1)).item()
            for g, w in zip(got, want, strict=True)
            if g.numel()
        )
        row["max_relative_error"] = worst
        # a loose bound: this is a smoke test; the conformance suite owns the tolerances
        row["ok"] = bool(worst < (0.1 if dtype != torch.float32 else 1e-3))
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    return row


def environment(simulated: bool) -> dict[str, str | None]:
    """What the image may lack, each ``None`` when present or why it is missing: a C compiler
    and ``Python.h`` (Triton builds its launchers with them, on first use of each kernel),
    libNVVM (numba-cuda compiles through it; not needed by the simulator), writable cache
    directories (Triton's, inductor's, numba's). ``environment.json`` carries them to run.py,
    which skips what needs a missing one."""
    found: dict[str, str | None] = {}
    cc = os.environ.get("CC") or next(
        (shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None
    )
    found["c_compiler"] = None if cc else "no C compiler (cc, gcc, clang, or $CC) on PATH"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    found["python_h"] = None if header.exists() else f"no Python.h at {header}"
    if simulated:
        found["nvvm"] = None
    else:
        try:
            from numba.cuda.cudadrv import nvvm

            nvvm.NVVM().get_version()
            found["nvvm"] = None
        except Exception as exc:
            found["nvvm"] = f"libNVVM not usable: {type(exc).__name__}: {exc}"[:300]
    caches = {
        "triton": os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache"),
        "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir(),
        "numba": os.environ.get("NUMBA_CACHE_DIR") or tempfile.gettempdir(),
    }
    unwritable = []
    for name, path in caches.items():
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path):
                pass
        except OSError as exc:
            unwritable.append(f"{name} ({path}: {exc.strerror or exc})")
    found["cache"] = f"not writable: {', '.join(unwritable)}" if unwritable else None
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", action="append", help="only these (default: every one)")
    parser.add_argument("--dtype", action="append", choices=["bfloat16", "float16", "float32"],
                        help="only these (default: every one the backend serves)")  # fmt: skip
    parser.add_argument("--once", action="store_true", help="one call each (for the simulator)")
    args = parser.parse_args(argv)
    missing = device_missing(args.device)
    if missing:
        print(f"preflight: device {missing}: nothing can run", file=sys.stderr)
        return NO_DEVICE
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    # the image's unknowns first, each a line: the steps that need a missing one skip it
    found = environment(simulated=device.type == "cpu")
    (args.out / "environment.json").write_text(json.dumps(found, indent=2))
    for name, why in found.items():
        print(f"  {'ok  ' if why is None else 'MISS'} {name}" + (f": {why}" if why else ""),
              flush=True)  # fmt: skip
    rows = []
    for name, backend in registry.backends().items():
        if name == "reference" or (args.backend and name not in args.backend):
            continue
        if registry.why_unavailable(backend) is not None:
            print(f"  {name}: unavailable ({registry.why_unavailable(backend)})")
            continue
        for op, kernels in backend.ops.items():
            if op not in SPECS or not kernels.serves(device.type):
                continue
            for dtype in kernels.dtypes_on(device.type):
                wanted = args.dtype is None or str(dtype).removeprefix("torch.") in args.dtype
                if dtype == torch.float64 or not wanted:
                    continue
                # said before the call: a step cut short shows which call it was in (the first
                # Triton call builds the launcher and compiles: 45 s on the first H200 run)
                print(f"  ...  {op} {name} {str(dtype).removeprefix('torch.')}", flush=True)
                row = check_one(op, name, dtype, device, again=not args.once)
                rows.append(row)
                first = f"{row.get('first_s', 0):.2f} s first" + (
                    f", {row['second_s']:.3f} s then" if "second_s" in row else ""
                )
                print(f"  {'ok  ' if row['ok'] else 'FAIL'} {op} {name} {row['dtype']}: "
                      f"{row.get('error') or first}", flush=True)  # fmt: skip
                (args.out / "preflight.json").write_text(json.dumps(rows, indent=2))
    if not rows:
        print("preflight: no backend serves this device", file=sys.stderr)
        return 1
    failed = [r for r in rows if not r["ok"]]
    print(f"preflight: {len(rows) - len(failed)} of {len(rows)} calls ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
