"""Float64 reference math of ``routed_experts``: the plain loop over experts (``moe_experts``'
reference is its routing followed by this)."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

#: act(g) of each activation name, in plain PyTorch (``silu`` takes its slope ``alpha``)
ACT = {
    "silu": lambda g, alpha: g * torch.sigmoid(alpha * g),
    "gelu": lambda g, alpha: F.gelu(g),
    "gelu_tanh": lambda g, alpha: F.gelu(g, approximate="tanh"),
    "relu": lambda g, alpha: F.relu(g),
    "relu2": lambda g, alpha: F.relu(g).square(),
}


def expert(rows, e, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, alpha, limit,
           up_offset):  # fmt: skip
    """Expert ``e`` on ``rows``: the spec's formula, term by term."""
    up = rows @ w_up[e].T + (0 if b_up is None else b_up[e])
    if w_gate is None:
        h = ACT[activation](up, alpha)
    else:
        gate = rows @ w_gate[e].T + (0 if b_gate is None else b_gate[e])
        h = gated(gate, up, activation, alpha, limit, up_offset)
    return h @ w_down[e].T + (0 if b_down is None else b_down[e])


def gated(gate, up, activation="silu", alpha=1.0, limit=None, up_offset=0.0):
    """``h`` from the gate and up pre-activations: ``act(min(gate, L)) * (clamp(up, -L, L) +
    up_offset)``."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ACT[activation](gate, alpha) * (up + up_offset)


def math(x, top_k_index, top_k_weights, w_gate, w_up, w_down, b_gate=None, b_up=None,
         b_down=None, activation="silu", alpha=1.0, limit=None, up_offset=0.0):  # fmt: skip
    """The op in float64 (ids ``>= E`` add nothing); autograd of this is the reference
    gradient. Only the experts the routing uses are visited: the cost follows the tokens, not
    ``E``."""
    x, top_k_weights = x.double(), top_k_weights.double()
    used = top_k_index.unique()
    used = used[(used >= 0) & (used < w_up.shape[0])]
    # the used experts' weights, gathered once (one scatter of each gradient, not one per expert)
    tensors = [None if t is None else t.index_select(0, used).double()
               for t in (w_gate, w_up, w_down, b_gate, b_up, b_down)]  # fmt: skip
    out = torch.zeros_like(x)
    for i, e in enumerate(used.tolist()):
        _check_cancelled()
        token, slot = (top_k_index == e).nonzero(as_tuple=True)
        y = expert(x[token], i, *tensors, activation, alpha, limit, up_offset)
        out = out.index_add(0, token, y * top_k_weights[token, slot, None])
    return out


def forward(x, top_k_index, top_k_weights, *rest):
    return math(x, top_k_index, top_k_weights, *rest).to(x.dtype)


_worker = threading.local()
_POLL_S = 0.05


def _check_cancelled() -> None:
    """In a reference backward's worker: stop at the next expert once the caller is gone."""
    cancel = getattr(_worker, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise _Cancelled


class _Cancelled(Exception):
    pass


def grads_by_autograd(fn, g, inputs, fixed):
    """Gradients of ``fn(*float64 inputs, **fixed)`` for ``g``, on a fresh thread (autograd is
    switched off, thread-locally, inside a custom op's kernel); unused inputs get zeros, inputs
    that are None get None. An interruption of the caller (Ctrl-C) stops the worker and waits
    for it before it propagates: no thread outlives the call."""
    result: list = []
    errors: list[BaseException] = []
    given = [t for t in inputs if t is not None]
    cancel, done = threading.Event(), threading.Event()

    def work():
        _worker.cancel = cancel
        try:
            leaves = [t.detach().double().requires_grad_() for t in given]
            it = iter(leaves)
            out = fn(*(None if t is None else next(it) for t in inputs), **fixed)
            if out.requires_grad:
                result.extend(torch.autograd.grad(out, leaves, g.double(), allow_unused=True))
            else:  # nothing reaches the output (every slot dropped): zero gradients
                result.extend([None] * len(leaves))
        except _Cancelled:
            pass
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=work, name="cakeops-reference-backward")

    # Events, not Thread.join: an interrupted join marks a live thread as finished (CPython
    # 3.10-3.12), and the process then aborts at exit. The interruption may come while start()
    # waits for the thread to run, too. The wait polls: a Ctrl-C that the kernel hands to
    # another thread does not wake a blocked wait, and Python runs its handler in this thread
    # only once it runs bytecode again.
    def wait() -> None:
        while not done.wait(_POLL_S):
            pass

    try:
        thread.start()
        wait()
    except BaseException:
        cancel.set()
        if thread.ident is not None:  # it runs, and sets `done` whatever happens
            while True:
                try:
                    wait()
                    break
                except KeyboardInterrupt:  # another Ctrl-C: it stops at its next expert
                    continue
            thread.join()
        raise
    thread.join()
    if errors:
        raise errors[0]
    grads = iter(result)
    return tuple(
        None
        if t is None
        else (torch.zeros_like(t) if (d := next(grads)) is None else d.to(t.dtype))
        for t in inputs
    )


def backward(g, x, top_k_index, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down,
             activation, alpha, limit, up_offset):  # fmt: skip
    def fn(x, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down):
        return math(x, top_k_index, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down,
                    activation, alpha, limit, up_offset)  # fmt: skip

    inputs = (x, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down)
    return grads_by_autograd(fn, g, inputs, {})
