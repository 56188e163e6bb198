"""The gated delta rule (and KDA) in plain PyTorch, chunked in the UT/WY form: every call but
the shortest (see :mod:`cakeops_torch.gated_delta_rule`).

Within a chunk of ``C`` positions (:data:`CHUNK`, :data:`KDA_CHUNK` for KDA), starting from
the state ``S0``, with ``E_tj`` the gate product over the steps ``(j, t]`` (per key channel for
KDA), ``Gamma_t`` over ``[1, t]`` and ``Gc_t`` over ``(t, C]``::

    A_tj = beta_t sum_c k_tc k_jc E_tjc   (j < t)      P_tj = sum_c q_tc k_jc E_tjc   (j <= t)
    U = (I + A)^{-1} diag(beta) (V - (Gamma k) S0)     (one triangular solve per chunk)
    O = scale ((Gamma q) S0 + P U)                     S_C = Gamma_C S0 + (Gc k)^T U

Every gate factor is the ``exp`` of a sum of log gates over the steps it spans (a cumulative sum
down the columns of a masked matrix): never the ``exp`` of a positive number, never a difference
of running sums, so a gate of ``-inf`` is an exact reset. The backward is written out by hand:
it recomputes the chunk-start states with one forward pass over the chunks and walks back,
without an autograd graph. Packed sequences (``cu_seqlens``) are laid out each from a chunk
start; value heads that share a key head read it through a broadcast, never a repeated copy.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from cakeops import compute_dtype
from cakeops.helpers import (
    LOG_FACTOR_FLOOR,
    drop_tiny_,
    gate_factors,
    state_floor,
)

from .._causal import causal_mm as _causal_mm
from ._common import _inverse_norms

#: Positions per chunk with scalar gates: the state's chain makes ``L / CHUNK`` rounds of
#: products, each chunk ``C x C`` pairs.
CHUNK = 64
#: ... with KDA's gates, whose pairs are ``C x C x K`` factors (a gate per key channel): short
#: chunks make ``C K`` factors a position where 64 made ``64 K``, at the cost of more, smaller
#: rounds of the chain (measured on the CPU: ``docs/content/ops/gated_delta_rule.md``).
KDA_CHUNK = 8
#: Bytes of the state-independent quantities of one group of chunks, computed at once (the
#: backward keeps a state per chunk of one group, and one per group).
GROUP_BYTES = 32 << 20


# --------------------------------------------------------------------------------------------
# Layout: (N, H, L, D) <-> chunks (B, H, G, n, C, D)


class _Layout:
    """Where each chunk's positions come from: ``B`` rows of ``n`` chunks; per chunk, whether a
    sequence starts or ends there and which sequence it belongs to."""

    def __init__(self, N: int, L: int, cu_seqlens: torch.Tensor | None, C: int = CHUNK):
        self.C = C
        if cu_seqlens is None:
            self.B, self.n = N, -(-L // C)
            self.index = None
            self.pad = self.n * C - L
            self.starts = {0: list(range(N))} if self.n else {}
            self.ends = {self.n - 1: list(range(N))} if self.n else {}
            self.sequences = N
            return
        bounds = [int(x) for x in cu_seqlens.tolist()]
        self.B, self.sequences = 1, len(bounds) - 1
        index, self.starts, self.ends, chunk = [], {}, {}, 0
        for i, (s, e) in enumerate(itertools.pairwise(bounds)):
            if e == s:
                continue
            count = -(-(e - s) // C)
            self.starts[chunk] = [i]
            self.ends[chunk + count - 1] = [i]
            positions = list(range(s, e)) + [-1] * (count * C - (e - s))
            index.extend(positions)
            chunk += count
        self.n = chunk
        self.index = torch.tensor(index, dtype=torch.long, device=cu_seqlens.device)
        self.valid = self.index >= 0
        self.L = L

    def chunks(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` ``(N, Hx, L, *rest)`` as ``(B, Hx, n, C, *rest)`` in ``dtype``, zeros past
        each sequence's end."""
        x = x.to(dtype)
        rest = x.shape[3:]
        if rest and x.stride(-1) != 1:
            # features not adjacent (a convolution's output, transposed, as the models give
            # it): one copy here, not one per product
            x = x.contiguous()
        if self.index is None:
            if self.pad:
                x = F.pad(x, (0, 0) * len(rest) + (0, self.pad))
            return x.reshape(x.shape[0], x.shape[1], self.n, self.C, *rest)
        mask = self.valid.view(-1, *([1] * len(rest)))
        x = x[:, :, self.index.clamp(min=0)] * mask
        return x.reshape(1, x.shape[1], self.n, self.C, *rest)

    def unchunk(self, x: torch.Tensor, L: int) -> torch.Tensor:
        """The inverse of :meth:`chunks`: ``(B, Hx, n, C, *rest)`` -> ``(N, Hx, L, *rest)``."""
        rest = x.shape[4:]
        x = x.reshape(x.shape[0], x.shape[1], self.n * self.C, *rest)
        if self.index is None:
            return x[:, :, :L]
        out = x.new_zeros(1, x.shape[1], L, *rest)
        return out.index_copy(2, self.index[self.valid], x[:, :, self.valid])


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """``(B, Hv, ...)`` as ``(B, H, G, ...)``: value head ``h`` under key head ``h // G``."""
    return x.unflatten(1, (H, x.shape[1] // H))


# --------------------------------------------------------------------------------------------
# Within chunks


class _Intra:
    """A group of chunks' quantities that do not depend on the state (``(..., n, C, ...)``)."""

    def __init__(self, q, k, v, g, beta, guard: bool, T: torch.Tensor | None = None,
                 floor: float | torch.Tensor = LOG_FACTOR_FLOOR):  # fmt: skip
        C = q.shape[-2]
        self.guard = guard
        self.q, self.k, self.v, self.beta = q, k, v, beta  # q, k: (B, H, 1, n, C, K)
        gk = g if g.dim() == q.dim() else g.unsqueeze(-1)  # (B, H, G, n, C, Kg)
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        self.lower, self.strict = lower, lower.tril(-1)
        # pair[t, j] = sum of g over (j, t]: a cumulative sum down each column of the masked
        # steps (exact pair sums, no difference of running sums)
        steps = gk.unsqueeze(-2).expand(*gk.shape[:-2], C, C, gk.shape[-1])
        pair = steps.masked_fill(~self.strict[..., None], 0).cumsum(-3)
        # every factor here reaches the states (S, and its gradient in the backward: through
        # gamma and, along the paths of (I + A)^{-1}, through E): floored at their scale
        # (cakeops.helpers.state_floor; LOG_FACTOR_FLOOR itself without a given state)
        self.E = gate_factors(pair, floor).masked_fill_(~lower[..., None], 0)  # (.., C, C, Kg)
        self.gamma = gate_factors(gk.cumsum(-2), floor)  # over [1, t]
        self.gamma_c = gate_factors(pair[..., -1, :, :], floor)  # over (t, C]
        self.kda = g.dim() == q.dim()
        self.Mkk = self._pairs(k, k)
        self.A = (beta.unsqueeze(-1) * self.Mkk).masked_fill(~self.strict, 0)
        self.qg, self.kg = q * self.gamma, k * self.gamma  # Gamma q, Gamma k
        self.kc = k * self.gamma_c  # Gc k
        bv, bk = beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * self.kg
        if guard:  # solves: an explicit inverse would spread a NaN row into later columns
            self.T = None
            self.Uv, self.Wk = (torch.linalg.solve_triangular(self.A, x, upper=False,
                                                              unitriangular=True)
                                for x in (bv, bk))  # fmt: skip
        else:  # (I + A)^{-1} once, then products (the backward's too)
            if T is None:
                eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(self.A.shape)
                T = torch.linalg.solve_triangular(self.A, eye, upper=False, unitriangular=True)
                drop_tiny_(T, floor)
            self.T = T
            self.Uv, self.Wk = T @ bv, drop_tiny_(T @ bk, floor)  # Wk meets the state

    def solve_transposed(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``(I + A_i)^{-T} x`` for chunk ``i`` of the group."""
        if self.T is None:
            A = self.A.select(3, i).transpose(-1, -2)
            return torch.linalg.solve_triangular(A, x, upper=True, unitriangular=True)
        return self.T.select(3, i).transpose(-1, -2) @ x

    @functools.cached_property
    def P(self) -> torch.Tensor:
        return self._pairs(self.q, self.k)

    def _pairs(self, a, b):
        """``sum_c a_tc b_jc E_tjc`` for ``j <= t`` (zero above, by selection: a NaN of a
        later position stays out of an earlier row)."""
        if self.kda:
            m = torch.einsum("...tc,...jc,...tjc->...tj", a, b, self.E)
        else:
            m = (a @ b.transpose(-1, -2)) * self.E[..., 0]
        return m.where(self.lower, 0)

    def at(self, i: int) -> _Chunk:
        return _Chunk(self, i)


class _Chunk:
    """One chunk of a group (index ``i`` along ``n``): the group's quantities, selected when
    first read."""

    def __init__(self, intra: _Intra, i: int):
        self.intra, self.i = intra, i

    def __getattr__(self, name: str) -> torch.Tensor:
        value = getattr(self.intra, name).select(3, self.i)
        setattr(self, name, value)
        return value


# --------------------------------------------------------------------------------------------
# The scan over chunks


def _prepare(q, k, v, g, beta, cu_seqlens, use_qk_l2norm):
    """The layout and the inputs as chunk views (copies only to pad, gather or convert); with
    ``use_qk_l2norm``, q and k are normalised a group of chunks at a time (:func:`_intra`)."""
    N, H, L, _ = q.shape
    ct = compute_dtype(q.dtype)
    layout = _Layout(N, L, cu_seqlens, KDA_CHUNK if g.dim() == 4 else CHUNK)
    chunks = [layout.chunks(t, ct).unsqueeze(2) for t in (q, k)]  # (B, H, 1, n, C, K)
    chunks += [_heads(layout.chunks(t, ct), H) for t in (v, g, beta)]
    norms = None
    if use_qk_l2norm:
        norms = tuple(layout.chunks(_inverse_norms(t.to(ct)), ct).unsqueeze(2) for t in (q, k))
    return layout, norms, chunks


def _groups(layout: _Layout, shape: tuple[int, ...], kda: bool):
    """Ranges of chunks whose state-independent quantities are computed at once: about
    ``GROUP_BYTES`` of ``C x C (x K)`` factors and ``C x K`` products."""
    B, H, G, K, V = shape
    C = layout.C
    per_chunk = (
        B * H * G * 4 * (C * C * (3 * (K if kda else 1) + 4) + C * (6 * K + 5 * V) + 2 * K * V)
    )
    size = max(1, GROUP_BYTES // max(per_chunk, 1))
    return [range(s, min(s + size, layout.n)) for s in range(0, layout.n, size)]


def _initial(layout, initial_state, H, shape, dtype, device, sequences):
    """The state at the start of a chunk that starts ``sequences``."""
    B, G, K, V = shape
    if initial_state is None:
        return torch.zeros(B, H, G, K, V, dtype=dtype, device=device)
    s0 = _heads(initial_state.to(dtype), H)
    return s0 if layout.index is None else s0[sequences[0]].unsqueeze(0)


def _intra(chunks, norms, group: range, guard: bool, T=None, floor=LOG_FACTOR_FLOOR) -> _Intra:
    sl = slice(group.start, group.stop)
    q, k, v, g, beta = (t[:, :, :, sl] for t in chunks)
    if norms is not None:
        q, k = q * norms[0][:, :, :, sl], k * norms[1][:, :, :, sl]
    return _Intra(q, k, v, g, beta, guard, T, floor)


def _needs_guard(*tensors: torch.Tensor | None, g: torch.Tensor) -> bool:
    """Whether a call may have a non-finite value that a masked zero could spread: a sum that
    is not finite (one pass per tensor, no temporary; finite values summing past the float
    range only cost the slower, guarded path). A gate of ``-inf`` needs no guard: it only makes
    factors 0; a NaN gate does (``g`` is ``<= 0``: its sum is NaN only with a NaN)."""
    sums = [t.sum() for t in tensors if t is not None and t.numel()]
    bad = any(not bool(torch.isfinite(x)) for x in sums)
    return bad or (g.numel() > 0 and bool(torch.isnan(g.sum())))


def _step_state(c: _Chunk, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, S_C)`` of a chunk from its starting state."""
    U = c.Uv - c.Wk @ S
    gamma_last = c.gamma[..., -1, :]  # (..., Kg)
    S_next = gamma_last.unsqueeze(-1) * S + c.kc.transpose(-1, -2) @ U
    return U, S_next


def _group_states(layout, intra, group, S, initial_state, H, shape):
    """The chunk-start states and the ``U`` of a group's chunks, ``(..., n, K, V)`` and
    ``(..., n, C, V)``, from the state at its start (sequences starting inside it start from
    their initial state); and the state after it, and the final states of the sequences that
    end inside it."""
    states, us, finals = [], [], {}
    for i, chunk in enumerate(group):
        if chunk in layout.starts:
            S = _initial(layout, initial_state, H, shape, intra.v.dtype, intra.v.device,
                         layout.starts[chunk])  # fmt: skip
        states.append(S)
        U, S = _step_state(intra.at(i), S)
        us.append(U)
        for s in layout.ends.get(chunk, ()):
            finals[s] = S
    return torch.stack(states, 3), torch.stack(us, 3), S, finals


def _scan(layout, chunks, norms, initial_state, scale, H, guard, want_out=True, keep=False,
          floor=LOG_FACTOR_FLOOR):  # fmt: skip
    """The forward over the chunks: the output chunks, the final states, and (``keep``) per
    group its chunks, its start state and its chunks' ``(I + A)^{-1}``. Only the state's chain
    runs chunk by chunk; the outputs are products over a whole group."""
    qc, _, vc, gc, _ = chunks
    B, _, G, n, C, V = vc.shape
    K = qc.shape[-1]
    out = vc.new_empty(B, H, G, n, C, V) if want_out else None
    finals: dict[int, torch.Tensor] = {}
    group_starts = []
    S = None
    for group in _groups(layout, (B, H, G, K, V), gc.dim() == 6):
        intra = _intra(chunks, norms, group, guard, floor=floor)
        if keep:
            group_starts.append((group, S, intra.T))
        states, us, S, ended = _group_states(layout, intra, group, S, initial_state, H,
                                             (B, G, K, V))  # fmt: skip
        finals.update(ended)
        if want_out:
            sl = slice(group.start, group.stop)
            out[:, :, :, sl] = scale * (intra.qg @ states + _causal_mm(intra.P, us, guard=guard))
    return out, finals, group_starts


def _final_states(layout, finals, initial_state, shape, dtype, device):
    """``(sequences, Hv, K, V)``: each sequence's last state (its initial one when empty)."""
    Hv, K, V = shape
    if layout.index is None:
        if finals:
            return finals[0].reshape(layout.B, Hv, K, V)
        return (torch.zeros(layout.B, Hv, K, V, dtype=dtype, device=device)
                if initial_state is None else initial_state.to(dtype).clone())  # fmt: skip
    rows = []
    for s in range(layout.sequences):
        if s in finals:
            rows.append(finals[s].reshape(Hv, K, V))
        elif initial_state is None:
            rows.append(torch.zeros(Hv, K, V, dtype=dtype, device=device))
        else:
            rows.append(initial_state[s].to(dtype))
    return torch.stack(rows)


def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    _, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    layout, norms, chunks = _prepare(q, k, v, g, beta, cu_seqlens, use_qk_l2norm)
    guard = _needs_guard(q, k, v, beta, initial_state, g=g)
    floor = state_floor((initial_state, k, v), dtype=chunks[2].dtype)
    out, finals, _ = _scan(layout, chunks, norms, initial_state, scale, H, guard, floor=floor)
    out = layout.unchunk(out.flatten(1, 2), L).to(q.dtype)
    if not output_final_state:
        return out, q.new_empty(0)
    ct = chunks[2].dtype
    final = _final_states(layout, finals, initial_state, (Hv, K, V), ct, q.device)
    dtype = initial_state.dtype if initial_state is not None else ct
    return out, final.to(dtype)


# --------------------------------------------------------------------------------------------
# Backward


def _suffix(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``sum_{s >= t} x_s`` along ``dim``."""
    return x.flip(dim).cumsum(dim).flip(dim)


def _before(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``sum_{s < t} x_s`` along ``dim`` (shifted, not ``cumsum - x``: a NaN at ``t`` stays out
    of the sum before it)."""
    shifted = x.narrow(dim, 0, x.shape[dim] - 1)
    return torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), shifted.cumsum(dim)], dim)


def _group_backward(c: _Intra, S, U, sdO, dS, dW, kda):
    """The gradients of a group's chunks ``(dq, dk, dv, dg, dbeta)`` (``dq``, ``dk`` per value
    head), all chunks at once, from their chunk-start states ``S``, their ``U``, the scaled
    output gradient ``sdO``, the gradient of each chunk's end state ``dS`` and of its
    ``W = diag(beta) (V - (Gamma k) S0)``, ``dW`` (the two the chain gave)."""
    guard = c.guard
    dP = (sdO @ U.transpose(-1, -2)).where(c.lower, 0)
    dqg = sdO @ S.transpose(-1, -2)
    dkc = U @ dS.transpose(-1, -2)
    gamma_last = c.gamma[..., -1, :].unsqueeze(-1)  # (..., Kg, 1)
    state_term = (gamma_last * S * dS).sum(-1)  # d b_C through Gamma_C S0: (..., K)
    dA = -(dW @ U.transpose(-1, -2)).where(c.strict, 0)
    R = c.v - c.kg @ S
    dbeta = (dW * R).sum(-1) + (dA * c.Mkk).sum(-1)
    bdW = c.beta.unsqueeze(-1) * dW
    dv = bdW
    dkg = -bdW @ S.transpose(-1, -2)
    X = c.beta.unsqueeze(-1) * dA  # d Mkk (strictly lower)
    Y = dP  # d P (lower)
    if kda:
        XE, YE = X.unsqueeze(-1) * c.E, Y.unsqueeze(-1) * c.E
        rows = lambda a, b: torch.einsum("...tjc,...jc->...tc", a, b)  # noqa: E731
        cols = lambda a, b: torch.einsum("...tjc,...tc->...jc", a, b)  # noqa: E731
        dk = (_causal_mm(XE, c.k, False, rows, guard) + _causal_mm(XE, c.k, True, cols, guard)
              + _causal_mm(YE, c.q, True, cols, guard))  # fmt: skip
        dq = _causal_mm(YE, c.k, False, rows, guard)
        # F[t, j, c]: the pair terms' gradient of log E_tjc
        Fp = (XE * c.k.unsqueeze(-2) + YE * c.q.unsqueeze(-2)) * c.k.unsqueeze(-3)
    else:
        XE, YE = X * c.E[..., 0], Y * c.E[..., 0]
        if guard:
            dk = (_causal_mm(XE, c.k) + _causal_mm(XE.transpose(-1, -2), c.k, reverse=True)
                  + _causal_mm(YE.transpose(-1, -2), c.q, reverse=True))  # fmt: skip
        else:  # XE below the diagonal, its transpose above: one product for both
            dk = (XE + XE.transpose(-1, -2)) @ c.k + YE.transpose(-1, -2) @ c.q
        dq = _causal_mm(YE, c.k, guard=guard)
        Fp = (X * c.Mkk + Y * c.P).unsqueeze(-1)
    # dg_s += sum_{t >= s} sum_{j < s} F[t, j]: the pairs whose span (j, t] holds s
    Z = _before(Fp, -2)  # sum over j < s, at [t, s]
    dg = Z.where(c.lower[..., None], 0).sum(-3)  # t >= s
    dq = dq + c.gamma * dqg
    dk = dk + c.gamma * dkg + c.gamma_c * dkc
    over_start = dqg * c.qg + dkg * c.kg  # d b_t, b over [1, t]
    over_end = dkc * c.kc  # d of the sum over (t, C]
    if not kda:
        over_start, over_end = over_start.sum(-1, keepdim=True), over_end.sum(-1, keepdim=True)
        state_term = state_term.sum(-1, keepdim=True)
    dg = dg + _suffix(over_start, -2) + _before(over_end, -2) + state_term.unsqueeze(-2)
    return dq, dk, dv, (dg if kda else dg[..., 0]), dbeta


def backward(g_out, g_final, q, k, v, g, beta, scale, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    _, H, L, K = q.shape
    V = v.shape[3]
    has_final = output_final_state and g_final.numel() > 0
    layout, norms, chunks = _prepare(q, k, v, g, beta, cu_seqlens, use_qk_l2norm)
    _, _, vc, gc, bc = chunks
    ct = vc.dtype
    B, _, G, n, C, _ = vc.shape
    kda = gc.dim() == 6
    guard = _needs_guard(q, k, v, beta, initial_state, g_out, g_final, g=g)
    floor = state_floor((initial_state, k, v), (g_final if has_final else None, q, g_out),
                        dtype=ct)  # fmt: skip
    _, _, group_starts = _scan(layout, chunks, norms, initial_state, scale, H, guard,
                               want_out=False, keep=True, floor=floor)  # fmt: skip
    dO = _heads(layout.chunks(g_out, ct), H)
    gf = _heads(g_final.to(ct), H) if has_final else None
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if (
        layout.index is None
        and layout.pad == 0
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    ):
        # the gradients written in place, laid out like their inputs (a transposed view's
        # gradient is one too): no copy to unchunk, none for the spec to match the strides
        full = {n: torch.empty_like(t, dtype=ct) for n, t in inputs.items()}
        grads = {name: t.unflatten(2, (n, C)) for name, t in full.items()}
        grads.update({n: _heads(grads[n], H) for n in ("v", "g", "beta")})
    else:
        full = None
        grads = {name: torch.zeros(shape, dtype=ct, device=q.device) for name, shape in (
            ("q", (B, H, n, C, K)), ("k", (B, H, n, C, K)), ("v", vc.shape),
            ("g", gc.shape), ("beta", bc.shape))}  # fmt: skip
    d_init = None
    if initial_state is not None:
        d_init = torch.zeros(initial_state.shape, dtype=ct, device=q.device)
    dS = torch.zeros(B, H, G, K, V, dtype=ct, device=q.device)
    for group, S, T in reversed(group_starts):
        intra = _intra(chunks, norms, group, guard, T, floor)
        states, us, _, _ = _group_states(layout, intra, group, S, initial_state, H,
                                         (B, G, K, V))  # fmt: skip
        sl = slice(group.start, group.stop)
        sdO = scale * dO[:, :, :, sl]
        # the chain through the states, chunk by chunk: dU = P^T sdO + Gc k dS,
        # dW = (I + A)^{-T} dU, dS0 = Gamma_C dS + (Gamma q)^T sdO - (Gamma k)^T diag(beta) dW
        dU_out = _causal_mm(intra.P.transpose(-1, -2), sdO, reverse=True, guard=guard)
        dS_out = intra.qg.transpose(-1, -2) @ sdO
        gamma_last = intra.gamma[..., -1, :].unsqueeze(-1)
        dSs, dWs = [None] * len(group), [None] * len(group)
        for i, chunk in reversed(list(enumerate(group))):
            ends = layout.ends.get(chunk)
            if ends is not None:  # a sequence's last chunk: its final state's gradient
                if gf is None:
                    dS = torch.zeros_like(dS)
                else:
                    dS = gf if layout.index is None else gf[ends[0]].unsqueeze(0)
            c = intra.at(i)
            dSs[i] = dS
            dU = dU_out[:, :, :, i] + c.kc @ dS
            dW = intra.solve_transposed(i, dU)
            dWs[i] = dW
            bdW = c.beta.unsqueeze(-1) * dW
            dS = gamma_last[:, :, :, i] * dS + dS_out[:, :, :, i] - c.kg.transpose(-1, -2) @ bdW
            starts = layout.starts.get(chunk)
            if starts is not None and d_init is not None:
                d_hv = dS.flatten(1, 2)
                if layout.index is None:
                    d_init += d_hv
                else:
                    d_init[starts[0]] += d_hv[0]
        dq, dk, dv, dg, db = _group_backward(intra, states, us, sdO, torch.stack(dSs, 3),
                                             torch.stack(dWs, 3), kda)  # fmt: skip
        grads["v"][:, :, :, sl], grads["g"][:, :, :, sl], grads["beta"][:, :, :, sl] = dv, dg, db
        dq, dk = dq.sum(2), dk.sum(2)
        if norms is not None:  # through x / |x|: r (dx - x^ (x^ . dx))
            dq, dk = (r[:, :, 0, sl] * (d - x * torch.linalg.vecdot(x, d).unsqueeze(-1))
                      for d, x, r in ((dq, intra.q[:, :, 0], norms[0]),
                                      (dk, intra.k[:, :, 0], norms[1])))  # fmt: skip
        grads["q"][:, :, sl], grads["k"][:, :, sl] = dq, dk
    if d_init is not None and has_final:
        # empty sequences hand their initial state on as the final one
        ended = {s for ends in layout.ends.values() for s in ends}
        for s in range(layout.sequences):
            if s not in ended:
                d_init[s] += g_final[s].to(ct)
    if full is None:
        full = {n: layout.unchunk(grads[n] if n in "qk" else grads[n].flatten(1, 2), L)
                for n in inputs}  # fmt: skip
    dq, dk, dv, dg, dbeta = full.values()
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            None if d_init is None else d_init.to(initial_state.dtype))  # fmt: skip
