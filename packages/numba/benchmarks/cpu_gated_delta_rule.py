"""Where does the numba CPU kernel for ``gated_delta_rule`` beat the torch backend's?

The backend ships the recurrence (:mod:`cakeops_numba.cpu.gated_delta_rule`: value heads in
parallel, each head's ``K x V`` state in a thread's cache) as the implicit CPU choice from
``CPU_DELTA_RULE_FROM`` positions on. This script times both backends through the op
(``cakeops.use_backend``), forward and forward+backward, both gate forms (scalar gates and
KDA's per key channel), float32, the models' ``use_qk_l2norm``, from a decode step to the
benchmark shapes, and says which one implicit selection takes::

    python packages/numba/benchmarks/cpu_gated_delta_rule.py [--quick]

Medians of the two timed in alternation after the same warm-up; numba's time over torch's;
the peak of PyTorch's allocations during forward+backward (the numba kernel's work area, a
thread's ``~2.5 sqrt(L)`` states, is one of them). The op page
(``docs/content/ops/gated_delta_rule.md``) quotes this script's figures. ``--quick``: two tiny
shapes, two repeats (CI runs it so that it keeps running).
"""

from __future__ import annotations

import argparse

import torch

import cakeops
from cakeops.measure import alternating_medians, peak_memory
from cakeops_numba.gated_delta_rule import CPU_DELTA_RULE_FROM

#: (form, N, value heads, L, K = V): Qwen3-Next's heads (16 of 128), Kimi Linear's (32 of 128)
#: and the small KDA case (8 of 64), and short calls down to a decode step.
SHAPES = [
    ("scalar", 1, 16, 1, 128), ("scalar", 1, 16, 2, 128), ("scalar", 1, 16, 16, 128),
    ("scalar", 1, 16, 1024, 128), ("scalar", 1, 16, 4096, 128),
    ("KDA", 1, 32, 1, 128), ("KDA", 1, 32, 2, 128), ("KDA", 1, 32, 16, 128),
    ("KDA", 1, 32, 1024, 128), ("KDA", 1, 8, 1024, 64), ("KDA", 1, 8, 4096, 64),
]  # fmt: skip
QUICK_SHAPES = [("scalar", 1, 2, 8, 16), ("KDA", 1, 2, 8, 16)]


def inputs(form: str, N: int, H: int, L: int, D: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, H, L, D, generator=gen) for _ in "qkv")
    gate_shape = (N, H, L, D) if form == "KDA" else (N, H, L)
    g = torch.nn.functional.logsigmoid(torch.randn(gate_shape, generator=gen) + 4)
    beta = torch.rand(N, H, L, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def compare(form: str, N: int, H: int, L: int, D: int, repeats: int) -> None:
    """Prints one table row: both backends' medians, numba's over torch's, peak memory."""
    args = inputs(form, N, H, L, D)
    grad = torch.randn(N, H, L, D)

    def run(backend: str, backward: bool):
        def step():
            with cakeops.use_backend(backend):
                out = cakeops.gated_delta_rule(*args, use_qk_l2norm=True)
                if backward:
                    return torch.autograd.grad(out, args, grad)
                return out.detach()

        return step

    contenders = {f"{b} {p}": run(b, p == "fwd+bwd") for b in ("numba", "torch")
                  for p in ("fwd", "fwd+bwd")}  # fmt: skip
    for a, b in zip(contenders["numba fwd+bwd"](), contenders["torch fwd+bwd"](), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-4)
    ms = {
        k: t * 1e3
        for k, t in alternating_medians(contenders, torch.device("cpu"), repeats, warmup=2).items()
    }
    mib = {b: peak_memory(contenders[f"{b} fwd+bwd"], torch.device("cpu")) / 2**20
           for b in ("numba", "torch")}  # fmt: skip
    chosen = "numba" if L >= CPU_DELTA_RULE_FROM else "torch"
    print(
        f"| {form} | {H} x {D} | {L} | {ms['numba fwd']:.2f} | {ms['torch fwd']:.2f} | "
        f"{ms['numba fwd'] / ms['torch fwd']:.2f} | {ms['numba fwd+bwd']:.2f} | "
        f"{ms['torch fwd+bwd']:.2f} | {ms['numba fwd+bwd'] / ms['torch fwd+bwd']:.2f} | "
        f"{mib['numba']:.1f} | {mib['torch']:.1f} | {chosen} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two tiny shapes, two repeats")
    quick = parser.parse_args().quick
    threads = torch.get_num_threads()
    print(f"gated_delta_rule, float32, use_qk_l2norm, {threads} threads, milliseconds "
          "(medians); peak MiB of PyTorch's allocations, forward+backward\n")  # fmt: skip
    print("| gates | heads x D | L | numba fwd | torch fwd | ratio | numba fwd+bwd | torch "
          "fwd+bwd | ratio | numba peak MiB | torch peak MiB | implicit choice |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for form, N, H, L, D in QUICK_SHAPES if quick else SHAPES:
        compare(form, N, H, L, D, repeats=2 if quick else (3 if L >= 1024 else 50))


if __name__ == "__main__":
    main()
