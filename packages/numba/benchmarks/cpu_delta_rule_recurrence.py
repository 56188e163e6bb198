"""Would a numba CPU kernel serve ``gated_delta_rule``? The recurrence step by step as an
``njit`` kernel (value heads in parallel, the ``K x V`` state of a head in a thread's cache, two
passes over it a step), against the torch backend's chunked forward, both gate forms (scalar
gates and KDA's per key channel), float32, in alternation.

    python packages/numba/benchmarks/cpu_delta_rule_recurrence.py [--quick]

The recurrence does ``4 K V`` multiply-adds a position as scalar loops; the chunked form does
about as many as matrix products. The op page (``docs/content/ops/gated_delta_rule.md``) quotes
this script's figures. ``--quick``: one tiny shape, two repeats (CI runs it so that it keeps
running).
"""

from __future__ import annotations

import argparse
import statistics

import numba
import numpy as np
import torch

import cakeops
from cakeops.measure import alternating_times

#: (N, value heads, L, K = V)
SHAPE = (1, 16, 4096, 128)
QUICK_SHAPE = (1, 2, 64, 16)


@numba.njit(parallel=True, cache=False)
def recurrence(q, k, v, g, beta, scale, out):  # pragma: no cover - compiled
    """``out`` ``(NH, L, V)`` of the gated delta rule from a zero state: ``q``, ``k``
    ``(NH, L, K)`` (normalised), ``v`` ``(NH, L, V)``, ``g`` ``(NH, L, 1 or K)``, ``beta``
    ``(NH, L)``."""
    NH, L, K = q.shape
    V = v.shape[2]
    per_channel = g.shape[2] == K
    for h in numba.prange(NH):
        S = np.zeros((K, V), dtype=np.float32)
        u = np.empty(V, dtype=np.float32)
        for t in range(L):
            # S <- exp(g) S, and S^T k, in one pass
            for j in range(V):
                u[j] = v[h, t, j]
            for i in range(K):
                a = np.exp(g[h, t, i if per_channel else 0])
                ki = k[h, t, i]
                for j in range(V):
                    s = S[i, j] * a
                    S[i, j] = s
                    u[j] -= s * ki
            b = beta[h, t]
            for j in range(V):
                u[j] *= b
                out[h, t, j] = 0.0
            # S <- S + k u^T, and S^T q, in one pass
            for i in range(K):
                ki = k[h, t, i]
                qi = q[h, t, i] * scale
                for j in range(V):
                    s = S[i, j] + ki * u[j]
                    S[i, j] = s
                    out[h, t, j] += s * qi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny shape, two repeats")
    quick = parser.parse_args().quick
    N, Hv, L, D = QUICK_SHAPE if quick else SHAPE
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, Hv, L, D, generator=gen) for _ in "qkv")
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    beta = torch.rand(N, Hv, L, generator=gen)
    print(f"gated_delta_rule forward, N {N}, {Hv} heads of {D}, L {L}, float32, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for form, g in (("scalar gates", -torch.rand(N, Hv, L, generator=gen) * 0.1),
                    ("KDA", -torch.rand(N, Hv, L, D, generator=gen) * 0.1)):  # fmt: skip
        arrays = [x.reshape(N * Hv, L, -1).numpy() for x in (q, k, v, g.reshape(N, Hv, L, -1))]
        out = np.empty((N * Hv, L, D), dtype=np.float32)
        scale = np.float32(D**-0.5)

        def njit_step(arrays=arrays, out=out, scale=scale):
            recurrence(*arrays, beta.reshape(N * Hv, L).numpy(), scale, out)

        def torch_step(g=g):
            with torch.no_grad(), cakeops.use_backend("torch"):
                return cakeops.gated_delta_rule(q, k, v, g, beta)

        njit_step()  # compile
        with torch.no_grad(), cakeops.use_backend("torch"):
            want = cakeops.gated_delta_rule(q, k, v, g, beta)
        got = torch.from_numpy(out).reshape(N, Hv, L, D)
        agree = torch.allclose(got, want, rtol=1e-3, atol=1e-4)
        times = alternating_times({"njit recurrence": njit_step, "torch chunked": torch_step},
                                  torch.device("cpu"), repeats=2 if quick else 5,
                                  warmup=1)  # fmt: skip
        ms = {label: statistics.median(t) * 1e3 for label, t in times.items()}
        print(f"  {form}: " + ", ".join(f"{name} {t:.1f} ms" for name, t in ms.items())
              + f" (the same outputs: {agree})")  # fmt: skip


if __name__ == "__main__":
    main()
