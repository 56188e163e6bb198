"""The fixed cost of one op call: each op on tiny CPU inputs, forward alone and forward+backward,
beside the chosen backend's kernels called directly (no validation, no selection, no autograd).

    python spec/benchmarks/call_overhead.py

On tiny inputs the kernels' arithmetic is negligible, so the difference between the two columns
is what the spec adds per call (argument checks, backend selection, the custom op and its
autograd).
"""

from __future__ import annotations

import torch

from cakeops.measure import alternating_medians
from cakeops.ops import SPECS
from cakeops.registry import select

CPU = torch.device("cpu")


def microseconds(name: str) -> tuple[str, dict[str, float]]:
    """The chosen backend's name and the median microseconds of each way of calling ``name``."""
    spec = SPECS[name]
    inputs = spec.validate(tuple(spec.example(CPU, torch.float32).values()))  # defaults resolved
    backend = select(name, inputs)
    kernels = backend.kernels(name)
    values = tuple(inputs.values())
    leaves = tuple(
        v.detach().requires_grad_() if n in spec.differentiable and v is not None else v
        for n, v in zip(spec.names, values, strict=True)
    )
    wanted = tuple(leaves[spec.names.index(n)] for n in spec.differentiable_given(inputs))
    g = torch.randn_like(spec.output_like(inputs))

    def op_forward():
        with torch.no_grad():
            return spec.positional(*values)

    def op_step():
        return torch.autograd.grad(spec.positional(*leaves), wanted, g)

    def kernel_step():
        kernels.forward(*values)
        return kernels.backward(g, *values)

    steps = {
        "op fwd": op_forward,
        "kernel fwd": lambda: kernels.forward(*values),
        "op fwd+bwd": op_step,
        "kernels fwd+bwd": kernel_step,
    }
    times = alternating_medians(steps, CPU, repeats=2000, warmup=50)
    return backend.name, {label: t * 1e6 for label, t in times.items()}


def main() -> None:
    print(f"{torch.get_num_threads()} threads; microseconds per call, median of alternating runs")
    columns = ("op fwd", "kernel fwd", "op fwd+bwd", "kernels fwd+bwd")
    print(f"{'op':<20} {'backend':<8} " + " ".join(f"{c:>15}" for c in columns))
    for name in ("rmsnorm_silu_gate", "causal_dot_product", "moe_experts"):
        backend, us = microseconds(name)
        print(f"{name:<20} {backend:<8} " + " ".join(f"{us[c]:15.0f}" for c in columns))


if __name__ == "__main__":
    main()
