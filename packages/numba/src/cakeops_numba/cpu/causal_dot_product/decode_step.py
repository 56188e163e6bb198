"""A decode step on the CPU (one position from a state): each value head's state read and
written once, forward (:func:`step`, below ``STEP_FORWARD_BELOW`` state elements) and backward
(:func:`step_backward`), handed the tensors' addresses."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from cakeops_numba.cpu._njit import F32 as _F32
from cakeops_numba.cpu._njit import as_float32, floats, launching
from cakeops_numba.cpu._njit import compiled as _compiled

# --------------------------------------------------------------------------------------------
# A decode step (one position, one sequence per row): each value head's state read once and
# written once, where PyTorch's ops pass over it four or five times (the step is memory-bound).


@njit(inline="always")
def _multiplier(ld, lg, has_ld, has_lg, H, i):  # pragma: no cover - compiled
    """What multiplies value head ``i``'s state: ``exp`` of its log decay (head ``i % H``)
    plus its log gate, summed in float32 (1 without either)."""
    x = np.float32(0.0)
    if has_ld:
        x += ld[i % H]
    if has_lg:
        x += lg[i]
    return np.exp(x)


@_compiled(parallel=False)
def _step_forward(q, k, v, ld, lg, s0, out, state, NH, G, H, E, M, has_ld, has_lg, has_s0,
                  scale):  # fmt: skip  # pragma: no cover - compiled
    """Value head ``i``'s ``S = a S_0 + k^T v`` and ``out = scale q S`` in one pass over its
    state, ``out`` summed along the state's rows as they are written. Addresses of C-contiguous
    float32 arrays: ``q``, ``k`` ``(NH // G, E)``; ``v``, ``out`` ``(NH, M)``; ``ld`` ``(H,)``,
    ``lg`` ``(NH,)``, ``s0`` ``(NH, E, M)`` read only when given; ``state`` ``(NH, E, M)``."""
    q, k = floats(q, (NH // G, E)), floats(k, (NH // G, E))
    v, out = floats(v, (NH, M)), floats(out, (NH, M))
    ld, lg = floats(ld, (H if has_ld else 0,)), floats(lg, (NH if has_lg else 0,))
    s0, state = floats(s0, (NH if has_s0 else 0, E, M)), floats(state, (NH, E, M))
    acc = np.empty(M, np.float32)
    for i in range(NH):
        j = i // G
        a = _multiplier(ld, lg, has_ld, has_lg, H, i)
        vi = v[i]
        acc[:] = 0.0
        for e in range(E):
            ke, qe, row = k[j, e], q[j, e], state[i, e]
            if has_s0:
                before = s0[i, e]
                for m in range(M):
                    x = a * before[m] + ke * vi[m]
                    row[m] = x
                    acc[m] += qe * x
            else:
                for m in range(M):
                    x = ke * vi[m]
                    row[m] = x
                    acc[m] += qe * x
        for m in range(M):
            out[i, m] = scale * acc[m]


#: A decode step's forward below this many state elements runs here, on the calling thread, faster
#: hot and cold; from there PyTorch's few ops (``cakeops.helpers.causal_step``), on its threads,
#: win on a hot loop, if not with caches cold.
STEP_FORWARD_BELOW = 1 << 16


def step(q, k, v, scale, log_decay, log_gates, initial_state, output_final_state):
    """``(out in q's dtype, final state in initial_state's dtype (float32 without one), empty
    unless output_final_state)`` of one position, as ``cakeops.helpers.causal_step``."""
    N, Hk, _, E = q.shape
    H, M = v.shape[1], v.shape[-1]
    NH = N * H
    out = torch.empty((N, H, 1, M), **_F32)
    state = torch.empty((N, H, E, M), **_F32)
    if NH:
        given = (q, k, v, log_decay, log_gates, initial_state)
        inputs = [None if t is None else as_float32(t) for t in given]
        addresses = (0 if t is None else t.data_ptr() for t in (*inputs, out, state))
        flags = (log_decay is not None, log_gates is not None, initial_state is not None)
        s = np.float32(1.0 if scale is None else scale)
        _step_forward(*addresses, NH, H // Hk, H, E, M, *flags, s)
    out = out.to(q.dtype)
    if not output_final_state:
        return out, out.new_empty(0)
    return out, state if initial_state is None else state.to(initial_state.dtype)


def _step_grads(g, q, k, v, ld, lg, s0, gf, dq, dk, dv, d_init, dlm, NH, G, H, E, M, has_ld,
                has_lg, has_s0, has_gf, scale):  # fmt: skip  # pragma: no cover - compiled
    """Value head ``i``'s gradients, with ``R = scale q g^T + G_f`` (the gradient reaching its
    state): ``dq = scale (a S_0 g + k (v . g))``, ``dk = R v``, ``dv = R^T k``, the initial
    state's ``a R`` and the log multiplier's ``a <R, S_0>`` (0 where ``a`` is); ``dq``, ``dk``
    per value head (a key head's group summed after).

    The addresses of C-contiguous float32 arrays: ``g``, ``v``, ``dv`` ``(NH, M)``; ``q``,
    ``k`` ``(NH // G, E)``; ``dq``, ``dk`` ``(NH, E)``; ``ld`` ``(H,)``; ``lg``, ``dlm``
    ``(NH,)``; ``s0``, ``gf``, ``d_init`` ``(NH, E, M)``, each read or written only when given
    (``has_*``; ``d_init`` with ``s0``)."""
    g, v, dv = floats(g, (NH, M)), floats(v, (NH, M)), floats(dv, (NH, M))
    q, k = floats(q, (NH // G, E)), floats(k, (NH // G, E))
    dq, dk, dlm = floats(dq, (NH, E)), floats(dk, (NH, E)), floats(dlm, (NH,))
    ld, lg = floats(ld, (H if has_ld else 0,)), floats(lg, (NH if has_lg else 0,))
    states = (NH if has_s0 else 0, E, M)
    s0, d_init = floats(s0, states), floats(d_init, states)
    gf = floats(gf, (NH if has_gf else 0, E, M))
    for i in prange(NH):
        j = i // G
        ai = _multiplier(ld, lg, has_ld, has_lg, H, i)
        vg = np.float32(0.0)
        for m in range(M):
            vg += v[i, m] * g[i, m]
        qk = np.float32(0.0)
        for e in range(E):
            qk += q[j, e] * k[j, e]
        for m in range(M):
            dv[i, m] = scale * qk * g[i, m]
        dot = np.float32(0.0)
        for e in range(E):
            sqe, ke = scale * q[j, e], k[j, e]
            s0g = np.float32(0.0)
            fv = np.float32(0.0)
            for m in range(M):
                r = sqe * g[i, m]
                if has_gf:
                    f = gf[i, e, m]
                    r += f
                    fv += f * v[i, m]
                    dv[i, m] += f * ke
                if has_s0:
                    x = s0[i, e, m]
                    s0g += x * g[i, m]
                    dot += r * x
                    d_init[i, e, m] = ai * r
            dq[i, e] = scale * (ai * s0g + ke * vg)
            dk[i, e] = sqe * vg + fv
        dlm[i] = 0.0 if ai == 0.0 else ai * dot


# One Python function, compiled twice: on the calling thread (``prange`` runs as ``range``, no
# launch lock) and on numba's threads.
_step_serial, _step_parallel = (_compiled(p)(_step_grads) for p in (False, True))
#: A step's backward below this many state elements runs on the calling thread: numba's
#: threads, asleep after the model's matrix products between two steps, took longer to wake
#: than the step (a MiniMax layer's decode was slower in parallel).
STEP_SERIAL_BELOW = 1 << 21


def step_backward(g, g_final, q, k, v, log_decay, log_gates, initial_state, scale):
    """``(dq, dk, dv per value head, float32; the initial state's gradient float32, or None;
    the log multipliers' gradient (N, H, 1) float32, 0 where a multiplier is)`` of one
    position (:func:`step`; ``g_final`` None for none).

    The kernel takes the tensors' addresses: ``Tensor.numpy()`` costs several times as much
    (a dozen arrays a step), and marks a tensor's storage as never resizable again, which
    FSDP2 does to a parameter's (``initial_state`` or ``log_decay`` may be one)."""
    N, Hk, _, E = q.shape
    H, M = v.shape[1], v.shape[-1]
    NH = N * H
    dq, dk = torch.empty((N, H, 1, E), **_F32), torch.empty((N, H, 1, E), **_F32)
    dv = torch.empty((N, H, 1, M), **_F32)
    d_init = None if initial_state is None else torch.empty((N, H, E, M), **_F32)
    dlm = torch.empty((N, H, 1), **_F32)
    if NH:
        given = (g, q, k, v, log_decay, log_gates, initial_state, g_final)
        inputs = [None if t is None else as_float32(t) for t in given]
        addresses = (*inputs, dq, dk, dv, d_init, dlm)
        args = (*(0 if t is None else t.data_ptr() for t in addresses), NH, H // Hk, H, E, M,
                log_decay is not None, log_gates is not None, initial_state is not None,
                g_final is not None, np.float32(1.0 if scale is None else scale))  # fmt: skip
        if NH * E * M < STEP_SERIAL_BELOW:
            _step_serial(*args)
        else:
            with launching():
                _step_parallel(*args)
    return dq, dk, dv, d_init, dlm
