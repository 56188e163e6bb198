"""The numba backend's own plumbing on the CPU: its njit causal_dot_product and
rmsnorm_silu_gate kernels (the conformance suite runs them too), their conversion path,
selection and thread safety.

Its CUDA kernels are certified in numba's simulator (``nox -s tests``) and on a GPU
(``nox -s gpu``, with ``tests/gpu``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

import cakeops
from cakeops import registry
from cakeops.ops import causal_dot_product as causal
from cakeops.ops import gated_delta_rule as delta
from cakeops.ops import rmsnorm_silu_gate as rmsnorm
from cakeops.testing import assert_default_dtype_changes_nothing
from cakeops.testing import test_causal_dot_product as suite
from cakeops.testing import test_rmsnorm_silu_gate as norm_suite
from cakeops_numba import SIMULATOR
from cakeops_numba import backend as numba_backend
from cakeops_numba.cpu import _njit as njit_module
from cakeops_numba.cpu import causal_dot_product as cpu_kernels
from cakeops_numba.cpu import rmsnorm_silu_gate as norm_kernels
from cakeops_numba.cpu.causal_dot_product import decode_step as step_kernels
from cakeops_numba.cpu.causal_dot_product import plain as plain_kernels

pytestmark = pytest.mark.skipif(
    SIMULATOR, reason="NUMBA_ENABLE_CUDASIM=1 sends CPU tensors to the simulated CUDA kernels"
)


def run(q, k, v, g):
    out = cakeops.causal_dot_product(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), g))


# (N, H), dtype, strided, the heads each kernel call gets with blocks of 2 heads
BLOCK_CASES = {
    "heads-of-one-row": ((1, 5), torch.float32, True, [2, 2, 1]),
    "whole-rows": ((5, 1), torch.float16, False, [2, 2, 1]),
    "one-row-per-block": ((3, 2), torch.float16, True, [2, 2, 2]),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_converted_blocks_of_heads_match_reference(monkeypatch, case):
    """float16 or strided inputs go through float32 copies a few heads at a time (the copies
    bounded, never a whole-tensor copy): every block, including a shorter last one, lands in
    its place."""
    (N, H), dtype, strided, expected = BLOCK_CASES[case]
    L, E, M = 19, 6, 8
    monkeypatch.setattr(plain_kernels, "BLOCK_ELEMENTS", 2 * L * M)  # 2 heads per block
    q, k, v, g = suite.make_inputs(N, H, L, E, M, dtype, "cpu")
    if strided:  # heads and positions swapped in memory
        q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        assert not q.is_contiguous()
    calls = {"_forward": [], "_backward": []}

    def counting(name):
        kernel = getattr(plain_kernels, name)

        def call(*args):
            calls[name].append(args[0].shape[0])
            return kernel(*args)

        return call

    for name in calls:
        monkeypatch.setattr(plain_kernels, name, counting(name))
    with cakeops.use_backend("numba"):
        got = run(q, k, v, g)
    assert calls == {"_forward": expected, "_backward": expected}
    suite.check_against_reference(q, k, v, g, got)


def test_automatic_choice_on_cpu():
    """The njit kernel is the CPU choice for causal_dot_product in every 16- and 32-bit dtype
    (bfloat16 converted to float32 in blocks); float64 and the ops without a CPU kernel stay
    with torch."""
    q = torch.zeros(1, 1, 4, 2)
    for dtype, expected in ((torch.float32, "numba"), (torch.float16, "numba"),
                            (torch.bfloat16, "numba"), (torch.float64, "torch")):  # fmt: skip
        t = q.to(dtype)
        picked = registry.select("causal_dot_product", causal.Inputs(t, t, t))
        assert picked.name == expected, dtype


def test_delta_rule_cpu_kernel_is_chosen_from_a_few_positions():
    """gated_delta_rule's njit recurrence is the implicit CPU choice from CPU_DELTA_RULE_FROM
    positions on, both gate forms (explain says why shorter calls go to torch); named, it runs
    a decode step too."""
    from cakeops_numba.gated_delta_rule import CPU_DELTA_RULE_FROM

    def inputs(L, kda=False):
        x = torch.randn(1, 2, L, 8)
        g = -torch.rand(1, 2, L, 8) if kda else -torch.rand(1, 2, L)
        return delta.Inputs(x, x, x, g, torch.rand(1, 2, L))

    op = "gated_delta_rule"
    for kda in (False, True):
        assert registry.select(op, inputs(CPU_DELTA_RULE_FROM, kda)).name == "numba"
        assert registry.select(op, inputs(CPU_DELTA_RULE_FROM - 1, kda)).name == "torch"
    why = registry.explain_inputs(op, inputs(1))
    assert why.reasons["numba"] == [
        f"its CPU kernel is chosen implicitly from {CPU_DELTA_RULE_FROM} positions on (a decode "
        "step goes to torch), got 1"
    ]
    with cakeops.use_backend("numba"):
        assert registry.select(op, inputs(1)).name == "numba"


def test_norm_cpu_kernel_is_chosen_for_a_decode_steps_inputs():
    """rmsnorm_silu_gate's njit kernel is the implicit CPU choice for inputs of up to
    CPU_NORM_ELEMENTS elements in every dtype it takes (explain says why it is passed over for
    the others); named, it runs any input."""
    from cakeops_numba.rmsnorm_silu_gate import CPU_NORM_ELEMENTS

    def inputs(rows, dtype=torch.float32):
        x = torch.randn(rows, 1024, dtype=dtype)
        return rmsnorm.Inputs(x, x, torch.ones(1024, dtype=dtype), group_size=1024)

    op, rows = "rmsnorm_silu_gate", CPU_NORM_ELEMENTS // 1024
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert registry.select(op, inputs(rows, dtype)).name == "numba"
    assert registry.select(op, inputs(rows + 1)).name == "torch"
    assert registry.select(op, inputs(1, torch.float64)).name == "torch"
    why = registry.explain_inputs(op, inputs(rows + 1))
    assert why.reasons["numba"] == [
        f"its CPU kernel is chosen implicitly for up to {CPU_NORM_ELEMENTS} elements (a decode "
        f"step's), got {CPU_NORM_ELEMENTS + 1024}"
    ]
    with cakeops.use_backend("numba"):
        assert registry.select(op, inputs(rows + 1)).name == "numba"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nbg", [True, False])
def test_norm_rows_on_threads_in_blocks_match_reference(monkeypatch, dtype, nbg):
    """At SERIAL_BELOW elements and more the rows run on numba's threads, a block of
    BLOCK_ELEMENTS at a time (converted to float32 when they are not): every block, a shorter
    last one too, lands in its place, and dweight sums every block's rows."""
    calls = []

    def counting(name):
        kernel = getattr(norm_kernels, name)

        def run(*args):
            calls.append(name)
            return kernel(*args)

        return run

    for name in ("_forward_parallel", "_backward_parallel"):
        monkeypatch.setattr(norm_kernels, name, counting(name))
    monkeypatch.setattr(norm_kernels, "SERIAL_BELOW", 1)
    monkeypatch.setattr(norm_kernels, "BLOCK_ELEMENTS", 2 * 32)  # two rows a block
    x, z, w, g = norm_suite.make_inputs((5, 32), dtype, "cpu")
    with cakeops.use_backend("numba"):
        got = norm_suite.run(x, z, w, g, 8, nbg)
    norm_suite.check_against_reference(x, z, w, g, 8, nbg, got)
    assert calls == ["_forward_parallel"] * 3 + ["_backward_parallel"] * 3


def test_norm_dweight_is_the_same_on_any_number_of_threads(monkeypatch):
    """The backward sums dweight over fixed ranges of rows, then the ranges in order: the
    same bits on one thread as on two."""
    monkeypatch.setattr(norm_kernels, "SERIAL_BELOW", 1)
    x, z, w, g = (t.detach() for t in norm_suite.make_inputs((40, 64), torch.float32, "cpu"))
    threads, got = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(norm_kernels.backward(g, x, z, w, 1e-6, 16, True)[2])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], got[1])


def test_norm_cpu_kernels_leave_their_arguments_storage_resizable():
    """The kernels read tensors by address, not through ``Tensor.numpy()``, which marks a
    storage as never to be resized again: FSDP2 frees a parameter's unsharded storage by
    resizing it to 0."""
    x, z, w, g = norm_suite.make_inputs((2, 32), torch.float32, "cpu")
    with cakeops.use_backend("numba"):
        norm_suite.run(x, z, w, g)
    for t in (x, z, w, g):
        t.untyped_storage().resize_(0)


def test_norm_rows_on_threads_under_another_default_dtype(monkeypatch):
    """The threads' path converts bfloat16 blocks to float32 scratch: allocated as float32,
    whatever PyTorch's default dtype (a bfloat16 default gave garbage there)."""
    monkeypatch.setattr(norm_kernels, "SERIAL_BELOW", 1)
    x, z, w, g = norm_suite.make_inputs((5, 32), torch.bfloat16, "cpu")
    with cakeops.use_backend("numba"):
        assert_default_dtype_changes_nothing(lambda: norm_suite.run(x, z, w, g, 8))


@pytest.mark.parametrize("threads", [False, True])
def test_decode_step_backward_on_the_calling_thread_and_on_threads(monkeypatch, threads):
    """A decode step's backward runs on the calling thread below STEP_SERIAL_BELOW state
    elements, on numba's threads from there: both against the float64 scan, every option."""
    calls = []
    for name in ("_step_serial", "_step_parallel"):
        kernel = getattr(step_kernels, name)
        monkeypatch.setattr(step_kernels, name,
                            lambda *a, n=name, k=kernel: calls.append(n) or k(*a))  # fmt: skip
    if threads:
        monkeypatch.setattr(step_kernels, "STEP_SERIAL_BELOW", 1)
    given = suite.OPTION_CASES["all"]
    (q, k, v), tensors, fixed, g, g_final = suite._option_inputs(given, torch.float32, "cpu", L=1)
    with cakeops.use_backend("numba"):
        suite.check_against_scan((q, k, v), tensors, fixed, g, g_final, plain_logs=True)
    assert calls == ["_step_parallel" if threads else "_step_serial"]


@pytest.mark.parametrize("numba_pass", [True, False])
def test_decode_step_forward_below_and_above_its_threshold(monkeypatch, numba_pass):
    """A decode step's forward is numba's one pass below STEP_FORWARD_BELOW state elements,
    PyTorch's few ops from there: both against the float64 scan, every option, grouped heads."""
    calls = []
    step = cpu_kernels.step
    monkeypatch.setattr(cpu_kernels, "step", lambda *a: calls.append("step") or step(*a))
    if not numba_pass:
        monkeypatch.setattr(cpu_kernels, "STEP_FORWARD_BELOW", 1)
    given = suite.OPTION_CASES["all"]
    for inputs in (suite._option_inputs(given, torch.float32, "cpu", L=1),
                   suite._grouped_inputs(given, torch.float32, "cpu", 1, L=1)):  # fmt: skip
        with cakeops.use_backend("numba"):
            suite.check_against_scan(*inputs, plain_logs=True)
    assert calls == (["step"] * 2 if numba_pass else [])


@pytest.mark.parametrize(
    ("L", "options", "layout"),
    [(1, True, "contiguous"), (45, True, "contiguous"), (45, True, "transposed"),
     (45, False, "contiguous"), (45, False, "bfloat16"), (45, False, "transposed")],
)  # fmt: skip
def test_calls_leave_their_arguments_storage_resizable(L, options, layout):
    """The CPU kernels read the caller's tensors by address or through numpy views made from
    addresses, never ``Tensor.numpy()``, which marks a storage as never resizable: q, k, v, the
    initial state and the log decay may be FSDP2 parameters (or views of them), whose storage
    it resizes. A decode step, a prefill with every option and without (the kernels' in-place
    and blocked paths, bfloat16 as its bits), forward and backward."""
    given = suite.OPTION_CASES["all"] if options else ()
    (q, k, v), tensors, fixed, g, g_final = suite._option_inputs(given, torch.float32, "cpu", L=L)
    if layout == "bfloat16":
        q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    if layout == "transposed":  # (N, H, L, E) views of (N, L, H, E) tensors
        q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                   for t in (q, k, v))  # fmt: skip
    with cakeops.use_backend("numba"):
        result = cakeops.causal_dot_product(q, k, v, **tensors, **fixed,
                                            output_final_state=options)  # fmt: skip
    if options:
        torch.autograd.backward(result, (g, g_final.float()))
    else:
        result.backward(g.to(result.dtype))
    for t in (q, k, v, *tensors.values(), g):
        t.untyped_storage().resize_(0)


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ("NUMBA_DISABLE_JIT=1", "NUMBA_DISABLE_JIT is set"),
        ("NUMBA_NUM_THREADS=0", "numba does not import here: ValueError: Number of threads"),
        ("NUMBA_THREADING_LAYER=bogus", "numba's threads do not start here: ValueError: The "
                                        "threading layer requested 'bogus' is unknown"),
    ],
)  # fmt: skip
def test_cpu_kernels_step_aside_when_numba_cannot_run_them(setting, reason):
    """numba's environment can leave its CPU kernels unable to run: as Python under
    ``NUMBA_DISABLE_JIT`` (where their intrinsics do not exist), numba failing its import
    (``NUMBA_NUM_THREADS=0``), its threads failing to start (an unknown or missing
    ``NUMBA_THREADING_LAYER``; these two failed every call with numba's traceback). torch runs
    both ops, forward and backward, and numba named gives the reason."""
    code = textwrap.dedent(
        f"""
        import torch, cakeops
        x = torch.randn(2, 64, requires_grad=True)
        q = torch.randn(1, 2, 5, 8, requires_grad=True)
        assert cakeops.explain(cakeops.rmsnorm_silu_gate, x, x, torch.ones(64)).backend == "torch"
        assert cakeops.explain(cakeops.causal_dot_product, q, q, q).backend == "torch"
        cakeops.rmsnorm_silu_gate(x, x, torch.ones(64)).sum().backward()
        cakeops.causal_dot_product(q, q, q, log_decay=torch.tensor([-0.1, -0.2])).sum().backward()
        try:
            with cakeops.use_backend("numba"):
                cakeops.rmsnorm_silu_gate(x, x, torch.ones(64))
        except cakeops.BackendError as e:
            assert {reason!r} in str(e), e
        else:
            raise AssertionError("numba ran")
        """
    )
    name, value = setting.split("=")
    env = {**os.environ, name: value}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("how", ["OMP_NUM_THREADS=1", "torch.set_num_threads(1)", "default"])
def test_numba_leaves_pytorchs_thread_count_as_the_caller_set_it(how):
    """numba's OpenMP layer sets the process's OpenMP thread count as it starts its threads:
    PyTorch's count (1 under ``OMP_NUM_THREADS=1``) became the CPU count for the rest of the
    process. After numba's CPU kernels (the backend's first check starts its threads, and both
    ops run forward and backward) PyTorch's count is what it was, and numba's kernels ran on
    that many threads."""
    code = textwrap.dedent(
        f"""
        import torch, cakeops, cakeops_numba.cpu._njit as njit_module
        {"torch.set_num_threads(1)" if how.startswith("torch") else ""}
        before = torch.get_num_threads()
        launched = []
        real = njit_module.numba.set_num_threads
        njit_module.numba.set_num_threads = lambda n: (launched.append(n), real(n))
        x = torch.randn(2, 64, requires_grad=True)
        q = torch.randn(1, 2, 5, 8, requires_grad=True)
        with cakeops.use_backend("numba"):
            cakeops.rmsnorm_silu_gate(x, x, torch.ones(64)).sum().backward()
            cakeops.causal_dot_product(q, q, q).sum().backward()
        assert launched and max(launched) <= before, (launched, before)
        assert torch.get_num_threads() == before, (torch.get_num_threads(), before)
        print(before)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if how.startswith("OMP"):
        env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    if how != "default":
        assert int(done.stdout) == 1


def test_a_child_forked_after_numbas_openmp_threads_runs_the_ops_on_torch():
    """GNU OpenMP does not survive a fork: numba terminates a forked child at its first parallel
    launch (SIGTERM; a DataLoader worker or a server's preforked worker died at its first
    call, choices remembered from the parent included). In such a child the CPU kernels give
    that reason and torch runs the ops; numba named is a ``BackendError`` saying so."""
    code = textwrap.dedent(
        """
        import os, traceback
        import numba, torch, cakeops
        x, w = torch.randn(4, 64), torch.ones(64)
        q = torch.randn(2, 4, 300, 16)
        for _ in range(2):  # the second call of each signature: a remembered choice
            cakeops.causal_dot_product(q, q, q), cakeops.rmsnorm_silu_gate(x, x, w)
        assert cakeops.explain(cakeops.causal_dot_product, q, q, q).backend == "numba"
        assert numba.threading_layer() == "omp", numba.threading_layer()
        pid = os.fork()
        if pid == 0:
            try:
                torch.set_num_threads(1)  # (PyTorch's own OpenMP needs it in a fork)
                cakeops.causal_dot_product(q, q, q), cakeops.rmsnorm_silu_gate(x, x, w)
                assert cakeops.explain(cakeops.causal_dot_product, q, q, q).backend == "torch"
                try:
                    with cakeops.use_backend("numba"):
                        cakeops.causal_dot_product(q, q, q)
                except cakeops.BackendError as e:
                    assert "forked after numba's OpenMP threads started" in str(e), e
                else:
                    raise AssertionError("numba ran")
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    env = {**os.environ, "NUMBA_THREADING_LAYER": "omp"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "child 0", done.stderr[-3000:]


@pytest.mark.parametrize("lock", ["numba's launch lock", "the registry's lock"])
def test_a_child_forked_while_another_thread_holds_a_lock_runs(lock):
    """A process forked while another of its threads held numba's launch lock (a kernel running)
    or the registry's lock (discovering the backends) hands its child those locks held by no
    thread there: the child's first call waited forever. Both are new locks in a forked child. (The
    workqueue threading layer: numba runs in a forked child there, unlike GNU OpenMP's.)"""
    code = textwrap.dedent(
        f"""
        import os, signal, threading, traceback
        import torch, cakeops
        from cakeops import registry
        from cakeops_numba.cpu import _njit
        x, w = torch.randn(64, 4096), torch.ones(4096)  # not a serial call: it takes the lock
        cakeops.rmsnorm_silu_gate(x, x, w)  # numba's threads started
        held = {{"numba's launch lock": _njit.LAUNCH, "the registry's lock": registry._lock}}
        taken, release = threading.Event(), threading.Event()

        def hold(lock):
            with lock:
                taken.set()
                release.wait()

        thread = threading.Thread(target=hold, args=(held[{lock!r}],))
        thread.start()
        taken.wait()
        if {lock!r} == "the registry's lock":
            registry._backends = None  # as in rediscover(), the other thread discovering
        pid = os.fork()
        if pid == 0:
            signal.alarm(120)  # a wait forever fails the test instead of holding it
            try:
                torch.set_num_threads(1)
                with cakeops.use_backend("numba"):
                    cakeops.rmsnorm_silu_gate(x, x, w)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        release.set()
        thread.join()
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "child 0", (done.stdout, done.stderr[-3000:])


def test_norm_exp_is_within_two_ulp_of_float64():
    """The norm kernel's vectorisable float32 ``exp``: within 2 ulp of float64's where the
    result is a normal float32, inf above its range, 0 below, NaN for NaN."""
    exp = norm_kernels._exp

    @numba.njit
    def exp_all(a, out):
        for i in range(a.shape[0]):
            out[i] = exp(a[i])

    a = np.concatenate([np.linspace(-90, 90, 400_001, dtype=np.float32),
                        np.array([88.72, 88.73, -87.33, -87.34, np.inf, -np.inf, np.nan],
                                 np.float32)])  # fmt: skip
    out = np.empty_like(a)
    exp_all(a, out)
    want = np.exp(a.astype(np.float64))
    normal = (want >= np.finfo(np.float32).tiny) & (want <= np.finfo(np.float32).max)
    ulp = np.spacing(want[normal].astype(np.float32)).astype(np.float64)
    assert (np.abs(out[normal] - want[normal]) <= 2 * ulp).all()
    assert np.isinf(out[a > 88.7228394]).all() and (out[a < -87.3365402] == 0).all()
    assert out[-3] == np.inf and out[-2] == 0 and np.isnan(out[-1])


def test_cuda_reason_is_reported_without_a_device():
    if torch.cuda.is_available():
        assert numba_backend.cuda_unavailable_reason is None
    else:
        assert "no CUDA device" in numba_backend.cuda_unavailable_reason


def test_numba_cuda_loads_on_a_numpy_without_row_stack():
    """NumPy 2.5 removed ``np.row_stack``; numba-cuda 0.30 registers an overload of it when its
    target first loads, so every compile failed. Without ``row_stack`` (removed here, as 2.5
    does), importing cakeops_numba loads that module, and numpy is left as it was."""
    script = textwrap.dedent("""
        import importlib, sys
        import numpy
        del numpy.row_stack
        import cakeops_numba
        from cakeops_numba._compat import ARRAYOBJ
        assert ARRAYOBJ in sys.modules
        importlib.import_module(ARRAYOBJ)
        assert not hasattr(numpy, "row_stack")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    # without the stand-in, the import fails as it does on NumPy 2.5
    bare = "import numpy; del numpy.row_stack; import numba.cuda.np.arrayobj"
    proc = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0 and "row_stack" in proc.stderr, proc.stderr[-3000:]


def test_cuda_reason_reports_a_failing_first_compile(monkeypatch):
    """A device and a driver, but the first compile fails (no NVVM, an incompatible NumPy):
    the reason names the cause, and the backend is not chosen for CUDA tensors."""
    import numba.cuda

    import cakeops_numba

    def fail():
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(cakeops_numba, "SIMULATOR", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(numba.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cakeops_numba, "_first_compile", fail)
    backend = cakeops_numba.NumbaBackend(name="numba-probe", distribution="cakeops-numba",
                                         description="", ops={})  # fmt: skip
    assert backend.cuda_unavailable_reason == (
        "numba-cuda cannot compile a kernel here: AttributeError: module 'numpy' has no "
        "attribute 'row_stack'"
    )


def test_concurrent_calls_from_threads():
    """Two Python threads calling at once both get the right answer (the launches take turns:
    numba's workqueue threading layer would abort on concurrent parallel launches)."""
    inputs = [suite.make_inputs(2, 2, 33, 4, 5, torch.float32, "cpu", seed=s) for s in (1, 2)]
    results, errors = {}, []

    def work(i):
        try:
            with cakeops.use_backend("numba"):
                for _ in range(5):
                    results[i] = run(*inputs[i])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(2):
        suite.check_against_reference(*inputs[i], results[i])


def test_compiles_without_a_writable_cache(monkeypatch):
    """Where numba finds no place to cache (read-only install, no home directory), the kernels
    still compile, once per process."""
    real_njit = njit_module.njit

    def njit(**options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'x.py'")
        return real_njit(**options)

    monkeypatch.setattr(njit_module, "njit", njit)

    def double(a):
        for i in numba.prange(a.shape[0]):
            a[i] *= 2

    a = np.arange(4.0)
    njit_module.compiled(parallel=True)(double)(a)
    assert a.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_simulator_shared_arrays_are_one_per_block_under_contention():
    """numba's simulator allocates a block's shared array with an unlocked check-then-store;
    with a slow allocation every simulated thread would get its own array (the cause of rare
    wrong results in the simulator runs). cakeops_numba makes the allocation atomic."""
    code = textwrap.dedent(
        """
        import threading, time
        import numpy as np
        import cakeops_numba._launch  # noqa: F401
        from numba.cuda.simulator.kernelapi import FakeCUDAShared

        fast = np.empty
        np.empty = lambda *a, **k: (time.sleep(0.01), fast(*a, **k))[1]
        shared, got, barrier = FakeCUDAShared(0), [], threading.Barrier(8)

        def thread():
            barrier.wait()
            got.append(shared.array((4,), np.float32))

        threads = [threading.Thread(target=thread) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(a) for a in got}) == 1, len({id(a) for a in got})
        """
    )
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_cuda_priorities_follow_expected_speed():
    """On CUDA the numba kernels (no tensor cores) rank below torch's cuBLAS and grouped GEMMs
    for the matrix-product ops, above torch for the memory-bound norm, and below triton."""
    from cakeops_torch import backend as torch_backend
    from cakeops_triton import backend as triton_backend

    def prio(backend, op):
        return backend.ops[op].priority("cuda")

    for op in ("causal_dot_product", "moe_experts", "routed_experts"):
        assert prio(numba_backend, op) < prio(torch_backend, op) < prio(triton_backend, op)
    op = "rmsnorm_silu_gate"
    assert prio(torch_backend, op) < prio(numba_backend, op) < prio(triton_backend, op)


def test_cpu_kernel_without_numba_cuda(tmp_path):
    """``pip install cakeops-numba`` without the ``cuda`` extra: this environment less numba-cuda
    and its CUDA packages (the site-packages entries linked, those left out): the backend is
    available, the CPU kernel runs ``causal_dot_product``, and on CUDA the reason names the
    extra to install."""
    import site

    skipped = ("numba_cuda", "_numba_cuda", "cuda", "nvidia")
    paths = [str(tmp_path)]
    for sp in site.getsitepackages():
        if not os.path.isdir(sp):
            continue
        for name in os.listdir(sp):
            if name.lower().startswith(skipped) or (tmp_path / name).exists():
                continue
            if name.endswith(".pth"):  # editable installs: their source folders
                lines = (Path(sp) / name).read_text().splitlines()
                paths += [ln.strip() for ln in lines if os.path.isdir(ln.strip())]
                continue
            (tmp_path / name).symlink_to(Path(sp) / name)
    script = (
        "import importlib.util, torch, cakeops\n"
        "from cakeops import registry\n"
        "assert importlib.util.find_spec('numba_cuda') is None\n"
        "numba = registry.backends()['numba']\n"
        "assert registry.why_unavailable(numba) is None\n"
        "print(numba.cuda_unavailable_reason)\n"
        "q = torch.randn(1, 2, 16, 8)\n"
        "print(cakeops.explain(cakeops.causal_dot_product, q, q, q).backend)\n"
        "with cakeops.use_backend('numba'):\n"
        "    out = cakeops.causal_dot_product(q, q, q)\n"
        "with cakeops.use_backend('reference'):\n"
        "    want = cakeops.causal_dot_product(q, q, q)\n"
        "assert cakeops.relative_error(out, want) <= cakeops.tolerance(torch.float32)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "CAKEOPS_"))}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    proc = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reason, chosen = proc.stdout.split("\n")[:2]
    assert reason == "numba-cuda is not installed: pip install 'cakeops-numba[cuda]'"
    assert chosen == "numba"


def test_compile_check_records_the_scalar_types_a_launch_passes(monkeypatch):
    """The kernels take ``float32(scale)``: the compile check compiles them with a float32
    argument, as a GPU launch does (it recorded every float as float64, kernels with float64
    arithmetic that no launch runs); Python numbers keep numba's int64 and float64."""
    from numba import types

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "gpu_compile"))
    import numba_check

    for value, name in ((np.float32(0.5), "float32"), (0.5, "float64"), (np.int32(3), "int32"),
                        (3, "int64"), (True, "bool")):  # fmt: skip
        spec = numba_check._arg_type(value)
        assert spec == [name], (value, spec)
        assert numba_check._numba_type(spec) == getattr(types, name if name != "bool" else
                                                        "boolean")  # fmt: skip


@pytest.mark.parametrize("kda", [False, True])
def test_delta_rule_cpu_backward_across_stored_states(monkeypatch, kda):
    """The CPU backward recomputes each stretch of ``chunk`` steps from the state stored at its
    start: with stretches of 3 (packed sequences of 7 and 13 positions, a starting state,
    grouped heads), its gradients are the torch backend's."""
    from cakeops_numba.cpu import gated_delta_rule as cpu

    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 2, 20, 8, generator=gen) for _ in "qk")
    v = torch.randn(1, 4, 20, 6, generator=gen)
    g = -torch.rand((1, 4, 20, 8) if kda else (1, 4, 20), generator=gen)
    beta = torch.rand(1, 4, 20, generator=gen)
    state = torch.randn(2, 4, 8, 6, generator=gen)
    args = [x.requires_grad_() for x in (q, k, v, g, beta, state)]
    cu = torch.tensor([0, 7, 20])

    def grads(backend):
        with cakeops.use_backend(backend):
            out, final = cakeops.gated_delta_rule(
                *args[:5], initial_state=args[5], output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm=True,
            )  # fmt: skip
        return torch.autograd.grad((out.square().sum() + final.square().sum()), args)

    monkeypatch.setattr(cpu, "chunk_for", lambda length: 3)
    for got, want in zip(grads("numba"), grads("torch"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
