"""The ``cakeops`` command: ``cakeops info``, ``cakeops explain`` and ``cakeops bench``.

Arguments are parsed before torch is imported: ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pkgutil
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def _op_names() -> tuple[str, ...]:
    """The ops' names, for ``--op`` without importing torch: the modules of ``cakeops/ops/``,
    found as :data:`cakeops.ops.SPECS` finds them, without importing them (a test checks the
    two agree)."""
    found = pkgutil.iter_modules([str(Path(__file__).parent / "ops")])
    return tuple(sorted(m.name for m in found if not m.name.startswith("_")))


OP_NAMES = _op_names()

DESCRIPTION = (
    "cakeops: fused training ops with pluggable backends. 'cakeops info' shows what is installed "
    "and which backend each op picks; 'cakeops explain' why, for the sizes you give; 'cakeops "
    "bench' measures the ops beside what you would write instead."
)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def gather_info() -> dict[str, Any]:
    """Versions, devices, every backend with availability and reasons, and the pick per op."""
    import torch

    from cakeops import _spec, registry
    from cakeops.ops import SPECS

    installed = registry.backends()
    info: dict[str, Any] = {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cakeops": _version("cakeops"),
        },
        "devices": _devices(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "backends": {},
        "picks": {},
        "forced": {},
    }
    for name, backend in installed.items():
        info["backends"][name] = {
            "distribution": backend.distribution,
            "version": _version(backend.distribution),
            "available": registry.why_unavailable(backend) is None,
            "reason": registry.why_unavailable(backend),
            "description": backend.description,
            "ops": {
                op: {
                    "devices": {d: p for d, p in k.devices.items()},
                    "dtypes": [_spec.dtype_name(t) for t in k.dtypes],
                }
                for op, k in backend.ops.items()
            },
        }
    for name, dist in registry.KNOWN_DISTRIBUTIONS.items():
        if name not in installed:
            reason = registry.load_errors().get(name, registry.missing_reason(name))
            info["backends"][name] = {"distribution": dist, "available": False, "reason": reason}
    for name, reason in registry.load_errors().items():  # broken third-party entry points
        if name not in info["backends"]:
            info["backends"][name] = {
                "distribution": "(failed to load)",
                "available": False,
                "reason": reason,
            }
    for op, spec in SPECS.items():
        try:
            forced = registry.forced_choice(op)
        except ValueError as exc:  # a malformed CAKEOPS_BACKEND*: every call of the op says so
            info["forced"][op] = f"error: {exc}"
        else:
            if forced is not None:
                unknown = [n for n in forced[0] if n not in registry.backends()]
                notes = "".join(f"; {n!r}: {registry.missing_reason(n)}" for n in unknown)
                info["forced"][op] = f"{','.join(forced[0])} (from {forced[1]}){notes}"
        info["picks"][op] = {}
        for device in info["devices"]:
            picks = {}
            for dtype in spec.dtypes:
                try:
                    inputs = spec.bind(**spec.example(device, dtype))
                    explanation = registry.explain_inputs(op, inputs)
                    picks[_spec.dtype_name(dtype)] = explanation.backend or "none"
                except Exception as exc:  # a device that cannot even allocate the example
                    picks[_spec.dtype_name(dtype)] = f"error: {exc}"
            info["picks"][op][device] = picks
    return info


def _print_info(info: dict[str, Any]) -> None:
    v = info["versions"]
    print(f"cakeops {v['cakeops']}  torch {v['torch']}  python {v['python']}")
    devices = ", ".join(info["devices"])
    print(f"devices: {devices}" + (f" ({info['cuda']})" if info["cuda"] else ""))
    print("\nbackends:")
    for name, b in info["backends"].items():
        state = "available" if b["available"] else f"unavailable: {b['reason']}"
        version = f" {b['version']}" if "version" in b else ""
        print(f"  {name:<10} {b['distribution']}{version}  {state}")
        for op, k in b.get("ops", {}).items():
            where = ", ".join(
                f"{d}: {'explicit only' if p is None else f'priority {p}'}"
                for d, p in k["devices"].items()
            )
            print(f"    {op}: {where}; dtypes {', '.join(k['dtypes'])}")
    for op, forced in info["forced"].items():
        print(f"\nforced for {op}: {forced}")
    print(
        "\npicks (op, device: backend per dtype) for each op's small example call; a backend "
        "may serve only some sizes (`cakeops explain OP NAME=SHAPE ...` for yours):"
    )
    for op, per_device in info["picks"].items():
        for device, picks in per_device.items():
            row = "  ".join(f"{dt}={name}" for dt, name in picks.items())
            print(f"  {op:<20} {device:<5} {row}")


def _device_problem(device: str) -> str | None:
    """Why ``--device`` names no device this machine has, or None."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"argument --device: expected a device such as cpu, cuda or cuda:1, got {device!r}"
    if dev.type == "cpu":
        return None
    module = getattr(torch, dev.type, None)
    available = getattr(module, "is_available", None)
    count = module.device_count() if callable(available) and available() else 0
    if not count:
        return f"argument --device: no {dev.type} device here (got {device!r})"
    if dev.index is not None and dev.index >= count:
        return f"argument --device: {device!r} is past the {count} {dev.type} device(s) here"
    return None


def _record_problem(paths: list[str] | None) -> str | None:
    """Why a ``--from-json`` names no benchmark record, or None."""
    for path in paths or ():
        problem = _one_record_problem(path)
        if problem:
            return problem
    return None


def _one_record_problem(path: str) -> str | None:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"argument --from-json: cannot read a record from {path}: {exc}"
    if not isinstance(record, dict) or not isinstance(record.get("results"), dict):
        return (f"argument --from-json: expected a record 'cakeops bench --json' wrote (an object "
                f"with 'results'), got {path}")  # fmt: skip
    return None


def _output_problem(json_path: str | None, *dirs: str | None) -> str | None:
    """Why an output folder cannot be written (made here, as the run would), or None."""
    folders = [*(d for d in dirs if d), *([str(Path(json_path).parent)] if json_path else [])]
    for folder in folders:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"cannot write to {folder}: {exc}"
        if not os.access(folder, os.W_OK):
            return f"cannot write to {folder}: not writable"
    return None


def _explain(parser: argparse.ArgumentParser, op: str, device: str, dtype: str,
             given: list[str]) -> str:  # fmt: skip
    """:func:`cakeops.explain` of the op's example call on ``device`` in ``dtype``, its
    arguments replaced by ``given`` (``NAME=2,4096,1024`` a tensor's shape, ``NAME=VALUE`` any
    other argument, as a Python literal)."""
    import ast

    import torch

    from cakeops import registry
    from cakeops.ops import SPECS

    spec = SPECS[op]
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype) or kind not in spec.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        parser.error(f"argument --dtype: expected one of {names} for {op}, got {dtype!r}")
    problem = _device_problem(device)
    if problem:
        parser.error(problem)
    arguments = dict(**spec.example(device, kind))
    for item in given:
        name, sep, value = item.partition("=")
        if not sep or name not in arguments:
            parser.error(f"expected NAME=SHAPE or NAME=VALUE with NAME one of "
                         f"{', '.join(arguments)}, got {item!r}")  # fmt: skip
        old = arguments[name]
        try:
            if isinstance(old, torch.Tensor):
                shape = tuple(int(n) for n in value.split(",") if n.strip())
                make = torch.randn if old.is_floating_point() else torch.zeros
                arguments[name] = make(shape, dtype=old.dtype, device=old.device)
            else:
                arguments[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError, RuntimeError) as exc:
            parser.error(f"{name}: cannot read {value!r}: {exc}")
    try:
        inputs = spec.bind(**arguments)
    except (TypeError, ValueError) as exc:  # the op's own check, naming the argument
        parser.error(str(exc))
    shapes = ", ".join(f"{n}={tuple(v.shape) if isinstance(v, torch.Tensor) else v!r}"
                       for n, v in arguments.items())  # fmt: skip
    return f"{op}({shapes}) on {device}, {dtype}\n{registry.explain_inputs(op, inputs)}"


def main(argv: list[str] | None = None) -> int:
    """The command; a closed pipe (``cakeops info | head``) ends it quietly."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader is gone: nothing more to say, and no traceback when Python flushes stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cakeops", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, devices, backends and the pick for each op")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_explain = sub.add_parser(
        "explain", help="which backend an op picks for the sizes you give, and why the others not"
    )
    p_explain.add_argument("op", choices=OP_NAMES)
    p_explain.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    p_explain.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, ...")
    p_explain.add_argument(
        "arguments", nargs="*", metavar="NAME=SHAPE",
        help="an argument of the op's example call replaced: a tensor by its shape "
        "(x=8,4096,1024), any other by its value (eps=1e-5)",
    )  # fmt: skip
    p_bench = sub.add_parser("bench", help="side-by-side benchmarks of the ops")
    p_bench.add_argument("--op", action="append", choices=OP_NAMES, help="op (repeatable)")
    p_bench.add_argument(
        "--device", default="cpu", help="where to run: cpu (default), cuda, cuda:1, ..."
    )
    p_bench.add_argument(
        "--quick", action="store_true", help="small shapes, few repeats: indicative figures only"
    )
    p_bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p_bench.add_argument(
        "--markdown", metavar="DIR", help="also write DIR/<op>.md tables and DIR/<op>.json records"
    )
    p_bench.add_argument(
        "--plots",
        metavar="DIR",
        help="also write DIR/<op>/<case>-<dtype>.png (time, peak memory; matplotlib)",
    )
    p_bench.add_argument(
        "--from-json",
        metavar="PATH",
        action="append",
        help="measure nothing: write --markdown/--plots from saved records (--json's, or "
        "--markdown's <op>.json; repeatable, one colour per contender over all of them)",
    )
    args = parser.parse_args(argv)
    if args.command == "explain":
        print(_explain(p_explain, args.op, args.device, args.dtype, args.arguments))
        return 0
    if args.command == "info":
        info = gather_info()
        if args.json:
            json.dump(info, sys.stdout, indent=2)
            print()
        else:
            _print_info(info)
        return 0
    from cakeops.bench import rerender, run
    from cakeops.ops import SPECS

    if args.plots and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plots needs matplotlib (pip install matplotlib); nothing was measured")
    # what a run would fail on only after measuring, or with a traceback: said before it starts
    problem = (_device_problem(args.device) or _record_problem(args.from_json)
               or _output_problem(args.json, args.markdown, args.plots))  # fmt: skip
    if problem:
        p_bench.error(problem + "; nothing was measured")
    if args.from_json:
        return rerender(args.from_json, args.op, args.markdown, args.plots)
    return run(
        ops=args.op or list(SPECS),
        device=args.device,
        quick=args.quick,
        json_path=args.json,
        markdown_dir=args.markdown,
        plots_dir=args.plots,
        command="cakeops " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
