"""Compile every Triton kernel for a GPU that is not here: the real ops run on CPU tensors through
Triton's own launch path with a compile-only driver (it reports the target's architecture,
compiles, and launches nothing), so every kernel, autotune config and heuristic value the host
code reaches at the checked shapes is compiled, with ``ptxas -v``'s resource report.

    python tests/gpu_compile/triton_check.py --arch 90 --out part.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).parent))
from shapes import calls, inputs, sweep_calls

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class CompileOnly(DriverBase):
    """A driver for a GPU of compute capability ``arch`` that is not present."""

    def __init__(self, arch: int):
        super().__init__()
        self.arch = arch

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return self.arch  # keys Triton's per-device kernel caches

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_benchmarker(self):
        def bench(kernel_call, quantiles=None, **_):
            kernel_call()  # compiles this config; the first one is then "chosen"
            return [1.0, 1.0, 1.0]

        return bench


class NotLaunched:
    """What the launch path gets instead of a loaded kernel: launching it does nothing."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        return None


class Recorder:
    """Wraps ``JITFunction._do_compile``: records each compilation (or its error) under the
    current op call and returns a kernel that does not launch."""

    def __init__(self):
        self.rows: list[dict] = []
        self.context: dict = {}
        self._original = JITFunction._do_compile

    def install(self) -> None:
        recorder = self

        def _do_compile(fn, key, signature, device, constexprs, options, attrs, warmup):
            log = io.StringIO()
            start = time.perf_counter()
            kernel, error = None, None
            try:
                with contextlib.redirect_stdout(log):
                    kernel = recorder._original(
                        fn, key, signature, device, constexprs, options, attrs, warmup
                    )
            except Exception as exc:  # a compile error is a result here
                error = f"{type(exc).__name__}: {exc}".strip()[:2000]
            recorder.record(fn, constexprs, options, kernel, error, log.getvalue(), start)
            stub = NotLaunched()
            fn.device_caches[device][0][key] = stub
            return stub

        JITFunction._do_compile = _do_compile
        knobs.nvidia.dump_ptxas_log = True

    def record(self, fn, constexprs, options, kernel, error, log, start) -> None:
        names = fn.arg_names
        config = {names[path[0]]: _plain(value) for path, value in constexprs.items()}
        row = {
            **self.context,
            "kernel": fn.fn.__name__,
            "module": fn.fn.__module__,
            "config": {**config, "num_warps": options.num_warps, "num_stages": options.num_stages},
            "ok": error is None,
            "error": error,
            "seconds": round(time.perf_counter() - start, 2),
        }
        if kernel is not None:
            row.update(_resources(log))
            row["shared_bytes"] = kernel.metadata.shared
            row["dots"] = dots(kernel.asm["ttgir"])
            # max/min that return the other operand for a NaN (tl.maximum's default on a GPU;
            # the interpreter's NumPy propagates it, so only the GPU's IR shows them)
            ir = kernel.asm["ttgir"]
            row["nan_dropping"] = len(re.findall(r"arith\.(?:maxnumf|minnumf)", ir))
        self.rows.append(row)


def _plain(value):
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _resources(log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None,
    }


_LOC = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$", re.M)
_FILE_LINE = re.compile(r'"([^"]+)":(\d+):\d+')
_OPERAND = re.compile(r"[<x](bf16|f16|f32|tf32|f8\w*|i8)[,>]")


def dots(ttgir: str) -> list[dict]:
    """Every ``tl.dot`` left in the GPU IR: how it lowers (``wgmma`` / ``mma`` tensor-core
    instructions, or ``fma``), its operand type and the kernel source line it comes from."""
    locs = dict(_LOC.findall(ttgir))

    def places(ref: str, depth: int = 0) -> list[tuple[str, str]]:
        """Every source position a location refers to, callers after callees."""
        text = locs.get(ref, "")
        found = _FILE_LINE.findall(text)
        for inner in re.findall(r"#(loc\d*)", text):
            if depth < 20:
                found += places(inner, depth + 1)
        return found

    def source(ref: str) -> str | None:
        # a call site's callee is a helper (cakeops_triton/_common.py); its caller is the kernel
        found = places(ref)
        kernel = [f for f in found if not f[0].endswith("_common.py")]
        file, line = (kernel or found or [(None, None)])[0]
        return f"{Path(file).name}:{line}" if file else None

    found = []
    for line in ttgir.splitlines():
        op = re.search(r"= (tt\.dot|ttng\.warp_group_dot) ", line)
        if not op:
            continue
        types = line.split(" : ", 1)[1] if " : " in line else ""
        operand = _OPERAND.search(types)
        if op.group(1) == "ttng.warp_group_dot":
            kind = "wgmma"
        else:
            result = types.rsplit("->", 1)[-1]
            kind = "mma" if "#mma" in result else "fma"
        ref = re.search(r"loc\(#(loc\d*)\)\s*$", line)
        found.append(
            {
                "lowering": kind,
                "operands": operand.group(1) if operand else None,
                "source": source(ref.group(1)) if ref else None,
            }
        )
    return found


#: The dtypes of the calls no GPU run makes (``other``: the CPU benchmarks' shapes, the GPU
#: benchmark's in other dtypes), compiled for their resources only: float16's registers are
#: bfloat16's within a few (the sweep's finding), so it takes ``--full``.
OTHER_DTYPES = (torch.float32, torch.bfloat16)


def run_calls(arch: int, dtypes, ops=None, sweep=False, full=False) -> list[dict]:
    import cakeops_triton.causal_conv1d
    import cakeops_triton.causal_dot_product
    import cakeops_triton.gated_delta_rule
    import cakeops_triton.moe_experts
    import cakeops_triton.rmsnorm_silu_gate
    import cakeops_triton.routed_experts

    modules = {
        "rmsnorm_silu_gate": cakeops_triton.rmsnorm_silu_gate,
        "causal_conv1d": cakeops_triton.causal_conv1d,
        "causal_dot_product": cakeops_triton.causal_dot_product,
        "gated_delta_rule": cakeops_triton.gated_delta_rule,
        "moe_experts": cakeops_triton.moe_experts,
        "routed_experts": cakeops_triton.routed_experts,
    }
    recorder = Recorder()
    recorder.install()
    driver.set_active(CompileOnly(arch))
    others = tuple(DTYPE_NAMES) if full else OTHER_DTYPES
    sixteen = [d for d in dtypes if d != torch.float32]
    todo = sweep_calls(sixteen) if sweep else calls(dtypes, others)
    for call in todo:
        if ops and call.op not in ops:
            continue
        # master weights make the products float32: not a 16-bit kernel
        dtype = DTYPE_NAMES[call.dtype] + (
            " x, float32 weights" if call.variant == "float32-weights" else ""
        )
        # float32 products also take TF32 where the user enables it: a path of its own
        products = call.op not in ("rmsnorm_silu_gate", "gated_delta_rule", "causal_conv1d")
        tf32_too = call.dtype == torch.float32 and products
        for tf32 in (False, True) if tf32_too else (False,):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            recorder.context = {
                "source": "sweep" if sweep else call.source,
                "target": f"sm_{arch}",
                "dtype": dtype + (" (TF32)" if tf32 else ""),
            }
            recorder.context["call"] = call.label()
            fwd, bwd = inputs(call)
            module = modules[call.op]
            module.forward(*fwd)
            module.backward(*bwd)
    torch.backends.cuda.matmul.allow_tf32 = False
    return recorder.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, required=True, help="compute capability, e.g. 90")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPE_NAMES.values()))
    parser.add_argument("--op", action="append", help="only these ops (default: all)")
    parser.add_argument("--sweep", action="store_true", help="the resource sweep's shapes")
    parser.add_argument("--full", action="store_true", help="the other calls in float16 too")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("the compile check compiles for a GPU: unset TRITON_INTERPRET")
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    dtypes = [by_name[d] for d in args.dtype] if args.dtype else list(DTYPE_NAMES)
    start = time.perf_counter()
    rows = run_calls(args.arch, dtypes, args.op, args.sweep, args.full)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"backend": "triton", "triton": triton.__version__, "rows": rows})
    )
    print(f"triton sm_{args.arch}: {len(rows)} compilations in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
