"""Compile every numba-cuda kernel for a GPU that is not here.

``record`` runs the real ops on CPU tensors in numba's CUDA simulator with launches that only
note each kernel and the numba types of its arguments; ``compile`` then compiles each noted
kernel signature to PTX with ``numba.cuda.compile_ptx`` (NVVM from the ``nvidia-cuda-nvcc-cu12``
wheel) and runs ``ptxas -v`` for registers, spills and shared memory.

    NUMBA_ENABLE_CUDASIM=1 python tests/gpu_compile/numba_check.py record --out sigs.json
    python tests/gpu_compile/numba_check.py compile --sigs sigs.json --arch 90 --out part.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from shapes import calls, inputs

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _arg_type(arg) -> list:
    import numpy as np

    array = getattr(arg, "_ary", arg)
    if isinstance(array, np.ndarray):
        if array.flags.c_contiguous:
            layout = "C"
        elif array.flags.f_contiguous and array.ndim > 1:
            layout = "F"
        else:
            layout = "A"
        return ["array", array.dtype.str, array.ndim, layout]
    if isinstance(arg, (bool, np.bool_)):
        return ["bool"]
    # a NumPy scalar (numba's float32(x) gives one) launches with its own width, as on a GPU;
    # a Python int or float as numba types it, int64 or float64
    if isinstance(arg, (np.integer, np.floating)):
        return [np.dtype(type(arg)).name]
    if isinstance(arg, int):
        return ["int64"]
    if isinstance(arg, float):
        return ["float64"]
    raise TypeError(f"kernel argument of type {type(arg).__name__} is not handled")


def record(out: Path, dtypes) -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        sys.exit("record runs in numba's CUDA simulator: set NUMBA_ENABLE_CUDASIM=1")
    from numba.cuda.simulator import kernel as sim

    seen: dict[tuple, dict] = {}
    original = sim.FakeCUDAKernel.__call__

    def launch(self, *args):
        if self._device or sim._kernel_context:
            return original(self, *args)
        types = [_arg_type(a) for a in args]
        key = (self.fn.__module__, self.fn.__qualname__, json.dumps(types))
        seen.setdefault(key, {"module": key[0], "kernel": key[1], "types": types, "calls": []})
        seen[key]["calls"].append(context)
        return None  # noted, not run

    sim.FakeCUDAKernel.__call__ = launch
    for call in calls(dtypes):
        context = f"{DTYPES[call.dtype]} {call.label()}"
        module = importlib.import_module(f"cakeops_numba.{call.op}")
        fwd, bwd = inputs(call)
        module.forward(*fwd)
        module.backward(*bwd)
    rows = list(seen.values())
    for row in rows:
        row["calls"] = sorted(set(row["calls"]))
    out.write_text(json.dumps(rows))
    print(f"numba: {len(rows)} kernel signatures noted")


def _numba_type(spec):
    import numpy as np
    from numba import from_dtype, types

    if spec[0] == "array":
        return types.Array(from_dtype(np.dtype(spec[1])), spec[2], spec[3])
    if spec[0] == "bool":
        return types.boolean
    return from_dtype(np.dtype(spec[0]))


def _ptxas() -> str:
    import nvidia.cuda_nvcc

    found = [Path(p) / "bin" / "ptxas" for p in nvidia.cuda_nvcc.__path__]
    found = [p for p in found if p.exists()]
    return str(found[0]) if found else shutil.which("ptxas")


def compile_all(sigs: Path, arch: int, out: Path) -> None:
    from numba import cuda
    from numba.cuda import dispatcher

    class Device:  # the GPU that is not here
        compute_capability = (arch // 10, arch % 10)

    # numba-cuda compiles a kernel's device functions for the current device's capability,
    # which asks the driver even under compile_ptx: answer for the target instead.
    dispatcher.get_current_device = Device
    ptxas = _ptxas()
    rows = []
    start = time.perf_counter()
    for entry in json.loads(sigs.read_text()):
        kernel = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        sig = tuple(_numba_type(t) for t in entry["types"])
        # the op's dtype: bfloat16 arrives as int16 bits, beside float32 scratch arrays
        arrays = {t[1] for t in entry["types"] if t[0] == "array"}
        dtype = next((d for d in ("<i2", "<f2", "<f4") if d in arrays), "")
        row = {
            "target": f"sm_{arch}",
            "dtype": {"<f4": "float32", "<f2": "float16", "<i2": "bfloat16"}.get(dtype, dtype),
            "call": entry["calls"][0],
            "kernel": entry["kernel"],
            "module": entry["module"],
            "config": {"signature": ", ".join(str(t) for t in sig)},
            "dots": [],
        }
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(arch // 10, arch % 10))
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "k.ptx"
                src.write_text(ptx)
                log = subprocess.run(
                    [ptxas, "-v", f"--gpu-name=sm_{arch}", str(src), "-o", str(Path(tmp) / "k")],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stderr
            regs = re.search(r"Used (\d+) registers", log)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            smem = re.search(r"(\d+) bytes smem", log)
            row.update(
                ok=True,
                error=None,
                registers=int(regs.group(1)) if regs else None,
                spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else None,
                shared_bytes=int(smem.group(1)) if smem else 0,
            )
        except Exception as exc:  # a compile error is a result here
            stderr = getattr(exc, "stderr", "") or ""
            row.update(ok=False, error=f"{type(exc).__name__}: {exc} {stderr}".strip()[:2000])
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    import numba

    out.write_text(json.dumps({"backend": "numba", "numba": numba.__version__, "rows": rows}))
    print(f"numba sm_{arch}: {len(rows)} compilations in {time.perf_counter() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", type=Path, required=True)
    comp = sub.add_parser("compile")
    comp.add_argument("--sigs", type=Path, required=True)
    comp.add_argument("--arch", type=int, required=True)
    comp.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "record":
        from cakeops_numba import DTYPES as SERVED

        record(args.out, [d for d in DTYPES if d in SERVED])
    else:
        compile_all(args.sigs, args.arch, args.out)


if __name__ == "__main__":
    main()
