"""Gradients by autograd on a worker thread: how every float64 reference computes its backward
(autograd is switched off, thread-locally, inside a custom op's kernel)."""

from __future__ import annotations

import threading

import torch

_worker = threading.local()
_POLL_S = 0.05


def check_cancelled() -> None:
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
