"""What a small call costs: every op at decode size (one token, a model's widths), on the CPU in
float32, beside the chosen backend's kernels called directly and the eager composite of the same
math a model would run instead.

    python spec/benchmarks/call_overhead.py [--quick] [--markdown docs/bench/cpu/call_overhead.md]

Three tables, medians of the contenders timed in alternation:

- **calls**: forward under ``no_grad`` and forward+backward, for the op, its kernels alone and
  the composite; the op's ratio to the composite (#37's goal: 1.0x or less) and its fixed cost,
  the op's time less its kernels' (the goal: at most 50 us). The forward twice: on a hot loop,
  and with caches cold, each call after a matrix product of 32 MiB of weights (what a model
  runs between two of a decode step's calls: there, a call's Python and small tensors come
  from memory, and a path of many small steps costs several times its hot figure).
- **the floor** of forward+backward: the same kernels in a bare ``torch.autograd.Function``
  (no checks, no signature, no selection), what any autograd wrapper in Python pays over the
  kernels, and the spec's share above it.
- **phases** of the forward: the lean call (a signature checked before; what a decode step
  runs), every check of a first call, the backend's selection, the custom op's dispatch (the
  dispatcher's boxing and redispatch, the difference between ``cakeops::<op>`` and the Python
  it runs) and the autograd node (the same custom op with inputs that require gradients), on
  tiny inputs: hot caches, so that the differences are readable.

Where the C library is glibc, its ``malloc`` is told to keep freed memory first (as
``MALLOC_TRIM_THRESHOLD_`` would): the experts' forward+backward allocates 48 MiB of weight
gradients a step, and whether a freed block went back to the system, to be faulted in and zeroed
again, depends on the order of the calls; it swung the kernels' time between 4.8 and 10 ms from
run to run, burying a fixed cost of microseconds (the other ops' calls allocate too little to
reach the system either way).

``--quick`` runs tiny shapes, few repeats: CI runs it so that a change of a kernel's signature
cannot leave this script broken.
"""

from __future__ import annotations

import argparse
import ctypes
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import cakeops
from cakeops.measure import alternating_medians
from cakeops.ops import SPECS
from cakeops.registry import select

CPU = torch.device("cpu")
EPS = 1e-6
#: a kernel's upstream gradient of a final state that no gradient reached (the kernel contract)
NO_GRADIENT = torch.zeros(0)


def _norm_case(quick: bool) -> tuple[dict[str, Any], Callable[..., Any]]:
    D = 256 if quick else 1024
    x, z = torch.randn(1, D), torch.randn(1, D)

    def composite(x, z, weight, eps):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h * F.silu(z)

    return {"x": x, "z": z, "weight": torch.rand(D) + 0.5, "eps": EPS}, composite


def _causal_case(quick: bool) -> tuple[dict[str, Any], Callable[..., Any]]:
    """MiniMax's lightning attention decoding a token: one decayed step from a state."""
    H, E = (2, 32) if quick else (8, 128)
    q, k, v = (torch.randn(1, H, 1, E) * E**-0.5 for _ in range(3))
    arguments = {"q": q, "k": k, "v": v, "log_decay": -torch.rand(H),
                 "initial_state": torch.randn(1, H, E, E), "output_final_state": True}  # fmt: skip

    def composite(q, k, v, log_decay, initial_state, output_final_state):
        state = initial_state * log_decay.exp()[:, None, None] + k.transpose(-1, -2) @ v
        return q @ state, state

    return arguments, composite


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + EPS)


def _delta_case(quick: bool) -> tuple[dict[str, Any], Callable[..., Any]]:
    """A Gated DeltaNet layer decoding a token, in the models' ``(N, L, H, D)`` layout."""
    H, Hv, D = (2, 4, 16) if quick else (8, 16, 64)
    q, k = (torch.randn(1, 1, H, D).transpose(1, 2) for _ in range(2))
    v = torch.randn(1, 1, Hv, D).transpose(1, 2)
    g = -torch.rand(1, 1, Hv).transpose(1, 2)
    beta = torch.rand(1, 1, Hv).transpose(1, 2)
    arguments = {"q": q, "k": k, "v": v, "g": g, "beta": beta,
                 "initial_state": torch.randn(1, Hv, D, D) * 0.1, "output_final_state": True,
                 "use_qk_l2norm": True}  # fmt: skip

    def composite(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm):
        # transformers' torch_recurrent_gated_delta_rule, one step
        q, k = (_l2norm(t[:, :, 0]).repeat_interleave(Hv // H, 1) for t in (q, k))
        state = initial_state * g[:, :, 0].exp()[..., None, None]
        delta = (v[:, :, 0] - (state * k[..., None]).sum(-2)) * beta[:, :, 0, None]
        state = state + k[..., None] * delta[..., None, :]
        return (state * q[..., None]).sum(-2)[:, :, None] * D**-0.5, state

    return arguments, composite


def _conv_case(quick: bool) -> tuple[dict[str, Any], Callable[..., Any]]:
    """A Gated DeltaNet layer's convolution decoding a token (Qwen3-Next at hidden 1024: q, k
    and v's 2048 channels, width 4), x in the models' layout."""
    C, W = (128, 4) if quick else (2048, 4)
    arguments = {"x": torch.randn(1, 1, C).transpose(1, 2), "weight": torch.randn(C, W) * 0.5,
                 "bias": torch.randn(C) * 0.1, "activation": "silu",
                 "initial_state": torch.randn(1, C, W - 1), "output_final_state": True}  # fmt: skip

    def composite(x, weight, bias, activation, initial_state, output_final_state):
        # transformers' torch_causal_conv1d_update, the state returned instead of written
        extended = torch.cat([initial_state, x], -1)
        out = F.silu(F.conv1d(extended, weight[:, None], bias, groups=C))
        return out, extended[:, :, 1:]

    return arguments, composite


def _experts_loop(x, index, weights, w_gate, w_up, w_down):
    """Hugging Face's eager experts: one pass per expert a token chose."""
    y = torch.zeros_like(x)
    for e in index.unique().tolist():
        token, slot = torch.where(index == e)
        h = F.silu(x[token] @ w_gate[e].T) * (x[token] @ w_up[e].T)
        y = y.index_add(0, token, (h @ w_down[e].T) * weights[token, slot, None])
    return y


def _expert_weights(E: int, D: int, F_: int) -> dict[str, torch.Tensor]:
    return {"w_gate": torch.randn(E, F_, D) * D**-0.5, "w_up": torch.randn(E, F_, D) * D**-0.5,
            "w_down": torch.randn(E, D, F_) * F_**-0.5}  # fmt: skip


def _experts_case(quick: bool) -> tuple[dict[str, Any], Callable[..., Any]]:
    E, D, F_, k = (4, 64, 128, 2) if quick else (8, 1024, 512, 2)
    arguments = {"x": torch.randn(1, D), "router_logits": torch.randn(1, E),
                 **_expert_weights(E, D, F_), "top_k": k}  # fmt: skip

    def composite(x, router_logits, w_gate, w_up, w_down, top_k):
        weights, index = router_logits.softmax(-1).topk(top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        return _experts_loop(x, index, weights, w_gate, w_up, w_down)

    return arguments, composite


def _routed_case(quick: bool) -> tuple[dict[str, Any], Callable[..., Any]]:
    E, D, F_, k = (4, 64, 128, 2) if quick else (8, 1024, 512, 2)
    weights = torch.rand(1, k)
    arguments = {"x": torch.randn(1, D), "top_k_index": torch.randperm(E)[:k][None],
                 "top_k_weights": weights / weights.sum(), **_expert_weights(E, D, F_)}  # fmt: skip

    def composite(x, top_k_index, top_k_weights, w_gate, w_up, w_down):
        return _experts_loop(x, top_k_index, top_k_weights, w_gate, w_up, w_down)

    return arguments, composite


CASES = {
    "causal_conv1d": _conv_case,
    "rmsnorm_silu_gate": _norm_case,
    "causal_dot_product": _causal_case,
    "gated_delta_rule": _delta_case,
    "moe_experts": _experts_case,
    "routed_experts": _routed_case,
}


def keep_freed_memory() -> bool:
    """Tell glibc's ``malloc`` to keep freed memory: no trimming, and blocks up to 32 MiB (its
    limit) from the heap rather than mapped for each allocation. False where it is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def _prepared(name: str, quick: bool):
    """``name``'s case: the op, its arguments, the composite, the validated inputs, the chosen
    backend and its kernels, the arguments with leaves that require gradients."""
    spec = SPECS[name]
    arguments, composite = CASES[name](quick)
    inputs = spec.bind(**arguments)  # every check, defaults resolved (the kernels' arguments)
    backend = select(name, inputs)
    wanted = spec.differentiable_given(inputs)
    leaves = {n: t.detach().requires_grad_() if n in wanted else t for n, t in arguments.items()}
    return spec, arguments, composite, inputs, backend, leaves, tuple(leaves[n] for n in wanted)


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return fn()

    return run


def between_products(quick: bool) -> Callable[[], Any]:
    """A model's projections between two calls of an op in a decode step: one matrix product
    whose weights (32 MiB; 4 MiB with ``quick``) push what the call uses out of the caches."""
    weight, x = torch.randn((1 if quick else 8) << 10, 1024), torch.randn(1, 1024)
    return lambda: F.linear(x, weight)


def bare_function(spec: Any, kernels: Any, values: tuple[Any, ...]) -> Callable[..., Any]:
    """The op as a bare ``torch.autograd.Function`` around the same kernels: no checks, no
    signature, no selection, the gradients unchecked. Its forward+backward over the kernels' is
    what any autograd wrapper written in Python pays (the Function, its context, the engine's
    walk), the floor under the op's."""

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
            ctx.args = args
            # a final state no gradient reached arrives as None, not as a state of zeros
            # autograd made and the kernel would read (as the op's Function does)
            ctx.set_materialize_grads(False)
            return kernels.forward(*args)

        @staticmethod
        def backward(ctx: Any, *grads_out: Any) -> Any:
            _ = ctx.saved_tensors  # (as a real Function unpacks them: the version check)
            if len(grads_out) > 1 and grads_out[1] is None:
                grads_out = (grads_out[0], NO_GRADIENT)
            grads = kernels.backward(*grads_out, *ctx.args)
            out = [None] * len(ctx.args)
            for i, grad in zip(spec._differentiable_at, grads, strict=True):
                out[i] = grad if isinstance(ctx.args[i], torch.Tensor) else None
            return tuple(out)

    return lambda: Bare.apply(*values)


def measure(name: str, quick: bool) -> tuple[str, dict[str, float]]:
    """The chosen backend's name and the median microseconds of the op, its kernels and the
    composite, forward without autograd and forward+backward, at decode size."""
    spec, arguments, composite, inputs, backend, leaves, grads_of = _prepared(name, quick)
    op, kernels, values = getattr(cakeops, name), backend.kernels(name), tuple(inputs.values())
    g = torch.randn_like(_first(op(**arguments)))
    # the final state's gradient as the op hands it on when none reached it
    grads_out = (g,) if spec.second is None else (g, NO_GRADIENT)

    def kernels_step() -> Any:
        kernels.forward(*values)
        return kernels.backward(*grads_out, *values)

    forward = {
        "op fwd": _no_grad(lambda: op(**arguments)),
        "kernel fwd": lambda: kernels.forward(*values),
        "composite fwd": _no_grad(lambda: composite(**arguments)),
    }
    bare = bare_function(spec, kernels, tuple(leaves.get(n, v) for n, v in
                                              zip(spec.names, values, strict=True)))  # fmt: skip
    step = {
        "op fwd+bwd": lambda: torch.autograd.grad(_first(op(**leaves)), grads_of, g),
        "kernels fwd+bwd": kernels_step,
        "composite fwd+bwd": lambda: torch.autograd.grad(_first(composite(**leaves)), grads_of, g),
        "bare Function fwd+bwd": lambda: torch.autograd.grad(_first(bare()), grads_of, g),
    }
    # two groups, each in alternation: a forward timed right after a forward+backward would
    # start with the caches the backward's weight gradients emptied
    repeats = 20 if quick else 300
    cold = alternating_medians(forward, CPU, repeats, warmup=3, before=between_products(quick))
    times = {
        **alternating_medians(forward, CPU, repeats, warmup=3),
        **{f"{label}, cold": t for label, t in cold.items()},
        **alternating_medians(step, CPU, repeats, warmup=3),
    }
    return backend.name, {label: t * 1e6 for label, t in times.items()}


def phases(name: str, quick: bool) -> dict[str, float]:
    """Median microseconds of the forward's phases, on the tiny inputs of ``--quick`` (what the
    spec does per call does not depend on the sizes; tiny kernels keep the caches hot and the
    differences readable)."""
    spec, arguments, _, inputs, backend, leaves, _ = _prepared(name, True)
    op, kernels, values = getattr(cakeops, name), backend.kernels(name), tuple(inputs.values())
    recording = tuple(leaves.get(n, v) for n, v in zip(spec.names, values, strict=True))
    steps = {
        "lean call": _no_grad(lambda: op(**arguments)),
        "kernel": lambda: kernels.forward(*values),
        "every check": lambda: spec.validate(values),
        "selection": lambda: select(name, inputs),
        "custom op": _no_grad(lambda: spec.forward_op(*values)),
        "custom op's Python": _no_grad(lambda: spec._forward(*values)),
        "custom op, recording": lambda: spec.forward_op(*recording),
    }
    times = alternating_medians(steps, CPU, repeats=20 if quick else 2000, warmup=10)
    return {label: t * 1e6 for label, t in times.items()}


def tables(
    results: dict[str, tuple[str, dict[str, float]]], phase_results: dict[str, dict[str, float]]
) -> str:
    """The markdown tables of :func:`measure`'s and :func:`phases`' results."""
    lines = [
        "| op (backend) | | op (us) | kernels (us) | composite (us) | op / composite "
        "| fixed cost (us) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (backend, us) in results.items():
        for part, op, kernel, composite in (
            ("forward", "op fwd", "kernel fwd", "composite fwd"),
            ("forward, caches cold", "op fwd, cold", "kernel fwd, cold", "composite fwd, cold"),
            ("forward+backward", "op fwd+bwd", "kernels fwd+bwd", "composite fwd+bwd"),
        ):
            lines.append(
                f"| `{name}` ({backend}) | {part} | {us[op]:.0f} | {us[kernel]:.0f} | "
                f"{us[composite]:.0f} | {us[op] / us[composite]:.2f}x | "
                f"{us[op] - us[kernel]:.0f} |"
            )
    lines += [
        "",
        "Forward+backward through a bare `torch.autograd.Function` around the same kernels (no "
        "checks, no signature, no selection): what any autograd wrapper written in Python pays "
        "over the kernels, the floor under the op's fixed cost, and the spec's share above it.",
        "",
        "| op | kernels (us) | bare Function (us) | its cost over the kernels (us) | op (us) "
        "| the spec's share (us) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (_, us) in results.items():
        kernels, bare, op = us["kernels fwd+bwd"], us["bare Function fwd+bwd"], us["op fwd+bwd"]
        lines.append(
            f"| `{name}` | {kernels:.0f} | {bare:.0f} | {bare - kernels:.0f} | {op:.0f} "
            f"| {op - bare:.0f} |"
        )
    lines += [
        "",
        "The forward's phases on tiny inputs (those of `--quick`), microseconds: the lean "
        "call and its kernel; every check of a signature's first call; the selection; the "
        "dispatch (the custom op `cakeops::<op>` less the Python it runs); the autograd node "
        "(the custom op with inputs that require gradients, less without).",
        "",
        "| op | lean call | its kernel | every check | selection | dispatch | autograd node |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, us in phase_results.items():
        dispatch = us["custom op"] - us["custom op's Python"]
        node = us["custom op, recording"] - us["custom op"]
        lines.append(
            f"| `{name}` | {us['lean call']:.0f} | {us['kernel']:.0f} | {us['every check']:.0f} "
            f"| {us['selection']:.0f} | {dispatch:.0f} | {node:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repeats")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables there too")
    args = parser.parse_args(argv)
    kept = keep_freed_memory()
    torch.manual_seed(0)
    results = {name: measure(name, args.quick) for name in CASES}
    phase_results = {name: phases(name, args.quick) for name in CASES}
    text = (
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on a CPU ({torch.get_num_threads()} "
        f"threads), float32, torch {torch.__version__}, with `python "
        f"spec/benchmarks/call_overhead.py{' --quick' if args.quick else ''}`: microseconds "
        "per call, medians of the contenders timed in alternation"
        + (", glibc's malloc keeping freed memory" if kept else "")
        + ".\n\n"
        + tables(results, phase_results)
        + "\n"
    )
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
