"""The depthwise causal convolution in plain PyTorch, as ``W`` shifted multiply-adds.

Each sequence is laid out behind its state (its ``W - 1`` previous inputs, zeros when none):
``xe`` is ``(N, C, W - 1 + L)``, or for packed sequences ``(1, C, L + S (W - 1))`` with every
sequence behind its own state, so that no window reaches into the sequence before. The output
is ``act(bias + sum_j w_j xe[j : j + L])``; the final state is the last ``W - 1`` columns of
each sequence's part of ``xe``. The backward recomputes ``xe`` (and the pre-activation) and
runs the same shifts the other way.

Everything keeps x's layout: a ``(N, L, C)`` tensor passed as ``transpose(1, 2)`` (the models'
way) is worked on as rows of channels, without the transposing copy a ``conv1d`` would need.
"""

from __future__ import annotations

import torch

from cakeops import compute_dtype

OP = "causal_conv1d"


class _Layout:
    """Where x's positions, the states and the outputs sit in ``xe``."""

    def __init__(self, x: torch.Tensor, W: int, cu_seqlens: torch.Tensor | None):
        C, L = x.shape[1:]
        self.W, self.L = W, L
        # channels adjacent in memory (the models' layout): keep them so in every tensor made
        self.rows = C > 1 and x.stride(1) < x.stride(2)
        self.packed = cu_seqlens is not None
        if not self.packed:
            self.P = W - 1 + L
            return
        S = cu_seqlens.numel() - 1
        self.S, self.P = S, L + S * (W - 1)
        cu = cu_seqlens.to(torch.long)
        t = torch.arange(L, device=x.device)
        seq = torch.searchsorted(cu[1:], t, right=True)
        self.positions = t + (seq + 1) * (W - 1)  # x[:, :, t] in xe
        taps = torch.arange(W - 1, device=x.device)
        shift = torch.arange(S, device=x.device)[:, None] * (W - 1) + taps
        self.starts = (cu[:-1, None] + shift).flatten()  # each state, in xe
        self.ends = (cu[1:, None] + shift).flatten()  # each final state, in xe

    def empty(self, N: int, C: int, P: int, dtype, device) -> torch.Tensor:
        """An ``(N, C, P)`` tensor in this layout."""
        if self.rows:
            return torch.empty(N, P, C, dtype=dtype, device=device).transpose(1, 2)
        return torch.empty(N, C, P, dtype=dtype, device=device)

    def select(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``t[:, :, index]``, in this layout."""
        if self.rows:
            return t.transpose(1, 2).index_select(1, index).transpose(1, 2)
        return t.index_select(2, index)

    def put(self, t: torch.Tensor, index: torch.Tensor, values: torch.Tensor, add=False):
        """``t[:, :, index] = values`` (``+=`` with ``add``), in place."""
        if self.rows:
            t, values, dim = t.transpose(1, 2), values.transpose(1, 2), 1
        else:
            dim = 2
        (t.index_add_ if add else t.index_copy_)(dim, index, values.to(t.dtype))

    def states(self, s: torch.Tensor) -> torch.Tensor:
        """``(S, C, W - 1)`` states as ``(1, C, S (W - 1))``, sequence by sequence."""
        return s.permute(1, 0, 2).reshape(1, s.shape[1], -1)

    def extended(self, x, initial_state, dtype) -> torch.Tensor:
        """``xe``: x behind each sequence's state, in ``dtype``."""
        N, C = x.shape[:2]
        W = self.W
        xe = self.empty(N, C, self.P, dtype, x.device)
        if not self.packed:
            xe[:, :, W - 1 :] = x
            if initial_state is None:
                xe[:, :, : W - 1] = 0
            else:
                xe[:, :, : W - 1] = initial_state
            return xe
        if initial_state is None:
            xe.zero_()
        else:
            self.put(xe, self.starts, self.states(initial_state))
        self.put(xe, self.positions, x)
        return xe

    def final(self, xe: torch.Tensor, dtype) -> torch.Tensor:
        """Each sequence's last ``W - 1`` columns of ``xe``, ``(sequences, C, W - 1)``."""
        W = self.W
        if not self.packed:
            return _contiguous(xe[:, :, self.L :], dtype)
        C = xe.shape[1]
        ends = self.select(xe, self.ends).reshape(C, self.S, W - 1)
        return _contiguous(ends.permute(1, 0, 2), dtype)


def _as_input(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad`` in x's dtype and layout: the view itself where it already is (one row: the
    row's stride does not matter), else a copy."""
    if grad.dtype == x.dtype and x.shape[0] == 1 and grad.stride()[1:] == x.stride()[1:]:
        return grad.as_strided(x.shape, x.stride(), grad.storage_offset())
    return torch.empty_like(x).copy_(grad)


def _contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of ``t`` in ``dtype`` (a state: never a view of ``xe``)."""
    return t.to(dtype, memory_format=torch.contiguous_format, copy=True)


def _pre_activation(xe: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``bias + sum_j w_j xe[j : j + Lo]`` over every window of ``xe``."""
    W = weight.shape[1]
    Lo = xe.shape[2] - (W - 1)
    last = xe[:, :, W - 1 :]
    w = weight[:, :, None]
    pre = last * w[:, W - 1] if bias is None else torch.addcmul(bias[:, None], last, w[:, W - 1])
    for j in range(W - 1):
        pre.addcmul_(xe[:, :, j : j + Lo], w[:, j])
    return pre


def _step(x, weight, bias, activation, initial_state, output_final_state):
    """One position per row from a given state (a decode step): the window as one small
    tensor, a handful of ops."""
    dtype = compute_dtype(x.dtype)
    window = torch.cat([initial_state.to(dtype), x.to(dtype)], 2)  # (N, C, W)
    pre = (window * weight.to(dtype)).sum(2, keepdim=True)
    if bias is not None:
        pre += bias.to(dtype)[:, None]
    out = torch.nn.functional.silu(pre) if activation == "silu" else pre
    out = out.to(x.dtype)
    if not output_final_state:
        return out, x.new_empty(0)
    return out, window[:, :, 1:].to(initial_state.dtype)


def forward(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens):
    W = weight.shape[1]
    if x.shape[2] == 1 and initial_state is not None and cu_seqlens is None and W > 1:
        return _step(x, weight, bias, activation, initial_state, output_final_state)
    dtype = compute_dtype(x.dtype)
    layout = _Layout(x, W, cu_seqlens)
    xe = layout.extended(x, initial_state, dtype)
    b = None if bias is None else bias.to(dtype)
    pre = _pre_activation(xe, weight.to(dtype), b)
    if layout.packed:
        pre = layout.select(pre, layout.positions - (W - 1))
    if activation == "silu":
        torch.nn.functional.silu(pre, inplace=True)
    out = pre.to(x.dtype)
    if not output_final_state:
        return out, x.new_empty(0)
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    return out, layout.final(xe, state_dtype)


def backward(g_out, g_final, x, weight, bias, activation, initial_state, output_final_state,
             cu_seqlens):  # fmt: skip
    dtype = compute_dtype(x.dtype)
    C, L = x.shape[1:]
    W = weight.shape[1]
    layout = _Layout(x, W, cu_seqlens)
    xe = layout.extended(x, initial_state, dtype)
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    Lo = layout.P - (W - 1)
    # Every big buffer is made once and worked on in place: a fresh one costs its pages' faults,
    # about as much as a pass over it.
    if activation == "silu":
        dpre = _pre_activation(xe, w, b)
        if layout.packed:
            dpre = layout.select(dpre, layout.positions - (W - 1))
        s = torch.sigmoid(dpre)
        # silu'(p) = s (1 + p - p s), then times the upstream gradient: all in dpre's buffer
        dpre.addcmul_(dpre, s, value=-1).add_(1).mul_(s).mul_(g_out)
    else:
        dpre = g_out.to(dtype, copy=True)
    if layout.packed:  # the windows behind each sequence's state have no output
        spread = layout.empty(1, C, Lo, dtype, x.device).zero_()
        layout.put(spread, layout.positions - (W - 1), dpre)
        dpre = spread
    products = s if activation == "silu" and not layout.packed else torch.empty_like(dpre)
    dweight = torch.stack([torch.mul(dpre, xe[:, :, j : j + Lo], out=products).sum((0, 2))
                           for j in range(W)], 1)  # fmt: skip
    dbias = None if bias is None else dpre.sum((0, 2)).to(bias.dtype)
    dxe = xe  # read for the last time above: its buffer takes the gradient
    torch.mul(dpre, w[:, W - 1, None], out=dxe[:, :, W - 1 :])
    dxe[:, :, : W - 1] = 0
    for j in range(W - 1):
        dxe[:, :, j : j + Lo].addcmul_(dpre, w[:, j, None])
    if output_final_state and g_final.numel():
        if layout.packed:
            layout.put(dxe, layout.ends, layout.states(g_final), add=True)
        else:
            dxe[:, :, L:] += g_final
    dinitial = None
    if layout.packed:
        dx = torch.empty_like(x).copy_(layout.select(dxe, layout.positions))
        if initial_state is not None:
            starts = layout.select(dxe, layout.starts).reshape(C, layout.S, W - 1)
            dinitial = _contiguous(starts.permute(1, 0, 2), initial_state.dtype)
    else:
        if initial_state is not None:
            dinitial = _contiguous(dxe[:, :, : W - 1], initial_state.dtype)
        dx = _as_input(dxe[:, :, W - 1 :], x)
    return dx, dweight.to(weight.dtype), dbias, dinitial
