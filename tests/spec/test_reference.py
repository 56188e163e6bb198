"""The float64 reference backend as a tool people run: its cost follows the routing, and an
interrupted backward leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import cakeops

INTERRUPTED = textwrap.dedent(
    """
    import signal, threading, time
    import torch, cakeops
    from cakeops import _autograd
    from cakeops.reference import routed_experts as ref

    main_saw = threading.Event()
    original = ref.expert

    sent = []

    def expert(*args):
        # The first expert of the backward's recomputation: one Ctrl-C (while the caller waits
        # for the worker, or still starts it), which the kernel hands to the caller's thread or
        # to this one (a process-wide SIGINT goes to either), then this waits until the caller
        # has seen it (or the op cancelled the work).
        if threading.current_thread() is not threading.main_thread() and not sent:
            sent.append(1)
            to = threading.main_thread() if TO == "caller" else threading.current_thread()
            signal.pthread_kill(to.ident, signal.SIGINT)
            cancel = _autograd._worker
            while not main_saw.is_set() and not (
                getattr(cancel, "cancel", None) is not None and cancel.cancel.is_set()
            ):
                time.sleep(0.01)
        return original(*args)

    ref.expert = expert
    if WHEN == "starting":  # the Ctrl-C arrives while start() still runs in the caller

        class SlowStart(threading.Thread):
            def start(self):
                super().start()
                time.sleep(5)

        threading.Thread = SlowStart
    T, D, F, E, K = 4, 8, 8, 4, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    ws = [torch.randn(E, F, D, generator=g, requires_grad=True) for _ in range(2)]
    wd = torch.randn(E, D, F, generator=g, requires_grad=True)
    with cakeops.use_backend("reference"):
        if OP == "routed":
            idx = torch.randint(0, E, (T, K), generator=g)
            w = torch.rand(T, K, generator=g, requires_grad=True)
            out = cakeops.routed_experts(x, idx, w, *ws, wd)
        else:
            logits = torch.randn(T, E, generator=g, requires_grad=True)
            out = cakeops.moe_experts(x, logits, *ws, wd, top_k=K)
        try:
            out.sum().backward()
            print("finished")
        except KeyboardInterrupt:
            main_saw.set()
            print("interrupted", [t.name for t in threading.enumerate()])
    """
)


@pytest.mark.parametrize(
    ("when", "to"), [("waiting", "caller"), ("waiting", "worker"), ("starting", "caller")]
)
@pytest.mark.parametrize("op", ["routed", "moe"])
def test_interrupted_reference_backward_leaves_no_thread(op, when, to):
    """Ctrl-C during a reference backward of the expert ops, while the caller waits for the
    worker or still starts it, delivered to the caller's thread or to the worker's: a
    KeyboardInterrupt in the caller, no worker thread left, a clean exit (it aborted at exit
    with SIGABRT before; a signal handed to the worker left the caller waiting forever)."""
    proc = subprocess.run(
        [sys.executable, "-c", f"OP, WHEN, TO = {op!r}, {when!r}, {to!r}\n" + INTERRUPTED],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.strip() == "interrupted ['MainThread']", proc.stdout


def _sparse_routing(E: int = 65536):
    """3 tokens over ``E`` experts (D = F = 8, top 2), one slot dropped (id >= E)."""
    T, D, F, K = 3, 8, 8, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    idx = torch.tensor([[5, E + 4464], [E - 1, 5], [123, 40000]])
    w = torch.rand(T, K, generator=g, requires_grad=True)
    weights = [torch.randn(E, F, D, generator=g, requires_grad=True) for _ in range(2)]
    wd = torch.randn(E, D, F, generator=g, requires_grad=True)
    return (x, idx, w, *weights, wd), torch.tensor([5, 123, 40000, E - 1])


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_routed_experts_cost_follows_the_used_experts_not_e(monkeypatch, backend):
    """The work of a forward+backward visits the 4 experts 3 tokens use out of 65,536 (before,
    the reference looped over every expert, minutes; torch's grouped matmuls took every expert
    as a group, 1.6 s); unused experts get exact zero gradients, used ones not."""
    from cakeops.reference import routed_experts as ref

    args, used = _sparse_routing()
    visited: list[int] = []
    expert = ref.expert
    monkeypatch.setattr(ref, "expert", lambda *a: visited.append(a[1]) or expert(*a))
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None:  # the torch backend's path for float32 on a CPU

        def counted(a, b, offs=None, **kw):
            visited.extend([-1] * len(offs))
            return grouped(a, b, offs=offs, **kw)

        monkeypatch.setattr(torch, "_grouped_mm", counted)
    with cakeops.use_backend(backend):
        cakeops.routed_experts(*args).sum().backward()
    # reference: one visit per used expert (forward, recomputed once in the backward);
    # torch: one group per used expert and grouped matmul (3 forward, 8 backward)
    per_expert = {"reference": 2, "torch": 11}[backend]
    assert 0 < len(visited) <= per_expert * len(used)
    E = args[3].shape[0]
    unused = torch.ones(E, dtype=torch.bool)
    unused[used] = False
    for p in args[3:]:
        assert p.grad[unused].abs().max() == 0
        assert p.grad[used].abs().amax(dim=(1, 2)).min() > 0
