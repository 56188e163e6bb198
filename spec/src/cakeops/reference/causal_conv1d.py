"""Float64 reference math of ``causal_conv1d``: each sequence extended by its state, then the
sum over the kernel's taps, as the op's page writes it.

The oracle of the conformance suite; its backward is autograd through these few lines.
"""

from __future__ import annotations

import itertools

import torch


def conv(x, weight, bias=None, activation=None, initial_state=None, cu_seqlens=None):
    """``(out (N, C, L), final_state (sequences, C, W - 1))`` in float64, differentiable."""
    x, weight = x.double(), weight.double()
    N, C, L = x.shape
    W = weight.shape[1]
    if cu_seqlens is None:
        sequences = [(n, 0, L) for n in range(N)]
    else:
        sequences = [(0, s, e) for s, e in itertools.pairwise(cu_seqlens.tolist())]
    pieces: dict[int, list[torch.Tensor]] = {n: [] for n in range(N)}
    finals = []
    for i, (n, start, end) in enumerate(sequences):
        past = x.new_zeros(C, W - 1) if initial_state is None else initial_state[i].double()
        extended = torch.cat([past, x[n, :, start:end]], dim=1)  # (C, W - 1 + length)
        length = end - start
        y = sum(weight[:, j, None] * extended[:, j : j + length] for j in range(W))
        if bias is not None:
            y = y + bias.double()[:, None]
        if activation in ("silu", "swish"):
            y = torch.nn.functional.silu(y)
        pieces[n].append(y)
        finals.append(extended[:, length:])
    out = torch.stack([torch.cat(pieces[n], dim=1) for n in range(N)])
    return out, torch.stack(finals) if finals else x.new_zeros(0, C, W - 1)


def forward(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
            cu_seqlens=None):  # fmt: skip
    out, final = conv(x, weight, bias, activation, initial_state, cu_seqlens)
    if not output_final_state:
        return out.to(x.dtype), x.new_empty(0)
    dtype = x.dtype if initial_state is None else initial_state.dtype
    return out.to(x.dtype), final.to(dtype)


def backward(g_out, g_final, x, weight, bias=None, activation=None, initial_state=None,
             output_final_state=False, cu_seqlens=None):  # fmt: skip
    from cakeops._autograd import grads_by_autograd

    def fn(x, weight, bias, initial_state):
        out, final = conv(x, weight, bias, activation, initial_state, cu_seqlens)
        loss = (out * g_out.double()).sum()
        if output_final_state and g_final.numel():
            loss = loss + (final * g_final.double()).sum()
        return loss

    one = torch.ones((), dtype=torch.float64)
    return grads_by_autograd(fn, one, (x, weight, bias, initial_state), {})
