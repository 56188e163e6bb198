"""Backend discovery and selection: entry points, priorities, env vars, use_backend, errors."""

from __future__ import annotations

import sys
import textwrap
import threading
import types
from importlib import metadata

import pytest
import torch

import cakeops
from cakeops import registry
from cakeops.ops.rmsnorm_silu_gate import Inputs as rmsnorm_inputs
from cakeops.reference import rmsnorm_silu_gate as ref_kernels

OP = "rmsnorm_silu_gate"
CALLS: list[tuple[str, str, int]] = []  # (backend, "forward"/"backward", thread id)


def _spy_module(name: str) -> types.ModuleType:
    """A kernel module that records its calls, then runs the reference math."""
    module = types.ModuleType(f"_cakeops_spy_{name}")

    def forward(*args):
        CALLS.append((name, "forward", threading.get_ident()))
        return ref_kernels.forward(*args)

    def backward(*args):
        CALLS.append((name, "backward", threading.get_ident()))
        return ref_kernels.backward(*args)

    module.forward, module.backward = forward, backward
    sys.modules[module.__name__] = module
    return module


class Unavailable(cakeops.Backend):
    def unavailable_reason(self):
        return "needs a device this machine lacks"


@pytest.fixture
def spies():
    """Two spy backends above ``torch`` on CPU; spy_a takes float32 only, spy_b everything."""
    made = []
    for name, prio, dtypes in (
        ("spy_a", 100, (torch.float32,)),
        ("spy_b", 50, (torch.float32, torch.float64)),
    ):
        module = _spy_module(name)
        made.append(
            cakeops.Backend(
                name=name,
                distribution=f"cakeops-{name}",
                ops={
                    OP: cakeops.OpKernels(
                        module=module.__name__, devices={"cpu": prio}, dtypes=dtypes
                    )
                },
            )
        )
    for backend in made:
        cakeops.register_backend(backend)
    CALLS.clear()
    yield
    for backend in made:
        cakeops.unregister_backend(backend.name)
        sys.modules.pop(f"_cakeops_spy_{backend.name}", None)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("CAKEOPS_BACKEND", f"CAKEOPS_BACKEND_{OP.upper()}"):
        monkeypatch.delenv(var, raising=False)


def inputs(dtype=torch.float32):
    x = torch.randn(3, 8, dtype=dtype, requires_grad=True)
    return x, torch.randn(3, 8, dtype=dtype), torch.ones(8, dtype=dtype)


def ran(x, z, w) -> str:
    CALLS.clear()
    cakeops.rmsnorm_silu_gate(x, z, w)
    (call,) = CALLS
    return call[0]


def test_installed_backends_are_discovered_through_entry_points():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="cakeops.backends")}
    assert eps["torch"] == "cakeops_torch:backend"
    assert eps["example"] == "cakeops_example:backend"  # the installed third-party package
    found = cakeops.backends()
    assert found["torch"].distribution == "cakeops-torch"
    assert found["example"].distribution == "cakeops-example"
    assert "reference" in found


def test_a_package_installed_at_run_time_is_found_and_a_broken_one_is_reported(
    tmp_path, monkeypatch
):
    (tmp_path / "late_backend.py").write_text(
        textwrap.dedent(
            """
            import torch
            from cakeops import Backend, OpKernels
            backend = Backend(name="late", distribution="late-backend", ops={
                "rmsnorm_silu_gate": OpKernels(
                    module="cakeops.reference.rmsnorm_silu_gate",
                    devices={"cpu": 1}, dtypes=(torch.float32,))})
            """
        )
    )
    for dist, value in (
        ("late_backend", "late_backend:backend"),
        ("broken", "no_such_module:backend"),
    ):
        info = tmp_path / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        name = dist.split("_")[0]
        (info / "entry_points.txt").write_text(f"[cakeops.backends]\n{name} = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = cakeops.rediscover()
        assert found["late"].distribution == "late-backend"
        assert "torch" in found  # a broken entry point does not hide the others
        assert "no_such_module" in registry.load_errors()["broken"]
        with (
            cakeops.use_backend("broken"),
            pytest.raises(cakeops.BackendError, match="no_such_module"),
        ):
            cakeops.rmsnorm_silu_gate(*inputs())
    finally:
        monkeypatch.undo()
        cakeops.rediscover()
    assert "late" not in cakeops.backends()


def test_highest_priority_backend_that_supports_the_inputs_runs(spies):
    assert ran(*inputs()) == "spy_a"
    # spy_a declares float32 only: float64 goes to the next one, and explain says why.
    assert ran(*inputs(torch.float64)) == "spy_b"
    why = cakeops.explain(OP, *inputs(torch.float64))
    assert why.backend == "spy_b" and why.source == "priority"
    assert any("float64" in r for r in why.reasons["spy_a"])
    assert "never chosen implicitly" in str(why)  # the reference backend's line


class Picky(cakeops.Backend):
    def not_preferred_reasons(self, op, inputs):
        return ["rows wider than 4 go elsewhere"] if inputs.x.shape[-1] > 4 else []


def test_a_backend_not_preferred_for_some_inputs_runs_them_only_when_named(spies):
    """``Backend.not_preferred_reasons``: implicit selection passes the backend over for those
    inputs (explain says why) and takes it for the others; named, it runs them all."""
    module = _spy_module("picky")
    kernels = cakeops.OpKernels(module.__name__, devices={"cpu": 200}, dtypes=(torch.float32,))
    cakeops.register_backend(Picky(name="picky", distribution="cakeops-picky", ops={OP: kernels}))
    try:
        narrow = (torch.randn(3, 4, requires_grad=True), torch.randn(3, 4), torch.ones(4))
        assert ran(*narrow) == "picky"
        assert ran(*inputs()) == "spy_a"
        why = cakeops.explain(OP, *inputs())
        assert why.backend == "spy_a" and why.reasons["picky"] == ["rows wider than 4 go elsewhere"]
        with cakeops.use_backend("picky"):
            assert ran(*inputs()) == "picky"
    finally:
        cakeops.unregister_backend("picky")
        sys.modules.pop(module.__name__, None)


def test_a_kernel_modules_own_rules_are_the_backends(spies):
    """A kernel module's ``not_supported_reasons(inputs)`` and ``not_preferred_reasons(inputs)``
    are added to a plain ``Backend``'s: unsupported inputs are refused even when named,
    unpreferred ones run only when named, and explain gives both reasons."""
    module = _spy_module("ruled")
    module.not_supported_reasons = lambda i: ["three rows only"] if i.x.shape[0] != 3 else []
    module.not_preferred_reasons = lambda i: ["wide rows go elsewhere"] if i.x.shape[1] > 4 else []
    kernels = cakeops.OpKernels(module.__name__, devices={"cpu": 200}, dtypes=(torch.float32,))
    cakeops.register_backend(cakeops.Backend(name="ruled", distribution="ruled", ops={OP: kernels}))
    try:
        narrow = (torch.randn(3, 4, requires_grad=True), torch.randn(3, 4), torch.ones(4))
        assert ran(*narrow) == "ruled"
        assert ran(*inputs()) == "spy_a"
        assert cakeops.explain(OP, *inputs()).reasons["ruled"] == ["wide rows go elsewhere"]
        with cakeops.use_backend("ruled"):
            assert ran(*inputs()) == "ruled"
            tall = (torch.randn(5, 4), torch.randn(5, 4), torch.ones(4))
            with pytest.raises(cakeops.BackendError, match="three rows only"):
                cakeops.rmsnorm_silu_gate(*tall)
        assert cakeops.explain(OP, *tall).reasons["ruled"] == ["three rows only"]
    finally:
        cakeops.unregister_backend("ruled")
        sys.modules.pop(module.__name__, None)


def test_env_vars_are_read_at_call_time(spies, monkeypatch):
    x, z, w = inputs()
    assert ran(x, z, w) == "spy_a"
    monkeypatch.setenv("CAKEOPS_BACKEND", "spy_b")
    assert ran(x, z, w) == "spy_b"
    monkeypatch.setenv(f"CAKEOPS_BACKEND_{OP.upper()}", "spy_a")  # the per-op variable wins
    assert ran(x, z, w) == "spy_a"
    monkeypatch.delenv(f"CAKEOPS_BACKEND_{OP.upper()}")
    monkeypatch.setenv("CAKEOPS_BACKEND", " missing , spy_b ")  # a preference list
    assert ran(x, z, w) == "spy_b"
    monkeypatch.delenv("CAKEOPS_BACKEND")
    assert ran(x, z, w) == "spy_a"


def test_use_backend_beats_env_and_nests(spies, monkeypatch):
    monkeypatch.setenv("CAKEOPS_BACKEND", "spy_a")
    x, z, w = inputs()
    with cakeops.use_backend("spy_b"):
        assert ran(x, z, w) == "spy_b"
        with cakeops.use_backend("spy_a", op=OP):
            assert ran(x, z, w) == "spy_a"
        assert ran(x, z, w) == "spy_b"
    assert ran(x, z, w) == "spy_a"


def test_use_backend_is_private_to_each_thread(spies):
    barrier = threading.Barrier(2, timeout=120)  # a failing worker breaks it: no hang
    seen: dict[str, set[str]] = {}
    errors = []

    def worker(name):
        try:
            with cakeops.use_backend(name):
                barrier.wait()  # both contexts are active at once from here on
                for _ in range(20):
                    cakeops.rmsnorm_silu_gate(*inputs())
                barrier.wait()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("spy_a", "spy_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for t, name in zip(threads, ("spy_a", "spy_b"), strict=True):
        seen[name] = {b for b, _, tid in CALLS if tid == t.ident}
        assert seen[name] == {name}
    assert ran(*inputs()) == "spy_a"  # the main thread never saw either context


def test_backward_runs_the_backend_the_forward_chose(spies):
    x, z, w = inputs()
    with cakeops.use_backend("spy_b"):
        y = cakeops.rmsnorm_silu_gate(x, z, w)
    CALLS.clear()
    y.sum().backward()  # outside the block
    assert [(b, kind) for b, kind, _ in CALLS] == [("spy_b", "backward")]


def test_backward_runs_the_forwards_backend_when_the_environment_changes(spies, monkeypatch):
    """An implicit forward (spy_a by priority), then CAKEOPS_BACKEND set before the backward:
    the backward still runs spy_a, which made the forward."""
    x, z, w = inputs()
    y = cakeops.rmsnorm_silu_gate(x, z, w)
    monkeypatch.setenv("CAKEOPS_BACKEND", "spy_b")
    CALLS.clear()
    y.sum().backward()
    assert [(b, kind) for b, kind, _ in CALLS] == [("spy_a", "backward")]


def test_use_backend_inside_a_compiled_function_says_where_to_put_it(spies):
    def f(x, z, w):
        with cakeops.use_backend("spy_b"):
            return cakeops.rmsnorm_silu_gate(x, z, w)

    torch._dynamo.reset()
    with pytest.raises(
        RuntimeError, match="enter it around the call of the compiled function"
    ) as e:
        torch.compile(f, fullgraph=True)(*inputs())
    # cakeops' message leads what the user reads (it was in Dynamo's debug context, after an
    # "Observed exception" explanation)
    first = str(e.value).strip().splitlines()[0]
    assert first.startswith(("use_backend() cannot", "RuntimeError: use_backend() cannot")), first


def test_use_backend_around_a_compiled_function_chooses_inside_it(spies):
    torch._dynamo.reset()
    compiled = torch.compile(cakeops.rmsnorm_silu_gate, fullgraph=True)
    x, z, w = inputs()
    CALLS.clear()
    with cakeops.use_backend("spy_b"):
        y = compiled(x, z, w)
        y.sum().backward()
    assert [(b, kind) for b, kind, _ in CALLS] == [("spy_b", "forward"), ("spy_b", "backward")]
    CALLS.clear()
    compiled(x, z, w)  # the same compiled code, no context: the priorities again
    assert [b for b, _, _ in CALLS] == ["spy_a"]


@pytest.mark.parametrize(
    "choice, expected",
    [
        ("nope", "nope: no backend of that name is installed"),
        ("tritn", "tritn: no backend of that name is installed; did you mean 'triton'?"),
        ("TORCH", "TORCH: no backend of that name is installed; did you mean 'torch'?"),
        (
            "ghost",
            "ghost: not installed; install it with `pip install ./packages/ghost` from a "
            "checkout of cakeops (`cakeops-ghost` is not on PyPI yet)",
        ),
        (
            "numba",
            "numba: supports dtypes float16, bfloat16, float32 for rmsnorm_silu_gate, got float64",
        ),
        ("triton", "triton: unavailable: no CUDA or ROCm device"),
        ("example", "supports dtypes float32 for rmsnorm_silu_gate, got float64"),
    ],
)
def test_explicit_choice_that_cannot_run_raises_with_every_reason(choice, expected, monkeypatch):
    # A backend the project knows by name but that is not installed gets the pip command.
    monkeypatch.setitem(registry.KNOWN_DISTRIBUTIONS, "ghost", "cakeops-ghost")
    if choice in registry.KNOWN_DISTRIBUTIONS and choice not in cakeops.backends():
        # an environment without this first-party backend (installed from the README's
        # optional lines): the install hint instead of the backend's own reasons
        expected = f"{choice}: not installed; install it with `pip install ./packages/{choice}`"
    monkeypatch.setenv("CAKEOPS_BACKEND", choice)
    with pytest.raises(cakeops.BackendError) as info:
        cakeops.rmsnorm_silu_gate(*inputs(torch.float64))
    message = str(info.value)
    assert expected in message
    assert "CAKEOPS_BACKEND" in message
    for name in cakeops.backends():  # every backend is listed with its reasons
        assert f"  {name}: " in message


def test_unavailable_backend_is_skipped_implicitly_and_refused_explicitly():
    module = _spy_module("gone")
    backend = Unavailable(
        name="gone",
        distribution="cakeops-gone",
        ops={
            OP: cakeops.OpKernels(
                module=module.__name__, devices={"cpu": 1000}, dtypes=(torch.float32,)
            )
        },
    )
    before = cakeops.explain(OP, *inputs()).backend
    cakeops.register_backend(backend)
    try:
        assert cakeops.explain(OP, *inputs()).backend == before
        with (
            cakeops.use_backend("gone"),
            pytest.raises(cakeops.BackendError, match="needs a device"),
        ):
            cakeops.rmsnorm_silu_gate(*inputs())
    finally:
        cakeops.unregister_backend("gone")


def test_dtypes_narrowed_per_device_give_their_reason():
    """``OpKernels.device_dtypes``: a backend serving fewer dtypes on one device says so."""
    kernels = cakeops.OpKernels(
        module="unused", devices={"cpu": 1, "cuda": 1}, dtypes=(torch.float32, torch.bfloat16),
        device_dtypes={"cpu": (torch.float32,)},
    )  # fmt: skip
    backend = cakeops.Backend(name="narrow", distribution="cakeops-narrow", ops={OP: kernels})
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    reasons = backend.not_supported_reasons(OP, rmsnorm_inputs(x, x, x[0]))
    assert reasons == [f"supports dtypes float32 for {OP} on cpu, got bfloat16"]
    assert kernels.dtypes_on("cuda") == (torch.float32, torch.bfloat16)
    assert not backend.not_supported_reasons(OP, rmsnorm_inputs(*(t.float() for t in (x, x, x[0]))))


def test_explain_validates_like_the_call():
    x, z, w = inputs()
    with pytest.raises(ValueError, match="argument 'group_size'"):
        cakeops.explain(cakeops.rmsnorm_silu_gate, x, z, w, group_size=3)
    assert cakeops.explain(cakeops.rmsnorm_silu_gate, x, z, w).backend == "numba"  # a decode step's
    with pytest.raises(ValueError, match="op must be one of"):
        cakeops.explain("no_such_op", x)


def test_use_backend_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend name"), cakeops.use_backend(" , "):
        pass
    with (
        pytest.raises(ValueError, match="op must be one of"),
        cakeops.use_backend("torch", op="nope"),
    ):
        pass


@pytest.mark.parametrize("names", [None, 3, {"torch"}, b"torch"])
def test_use_backend_names_what_it_takes(names):
    """Not a name, a string or a list: a TypeError saying what use_backend takes (it was
    "'NoneType' object is not iterable" from inside the registry)."""
    with pytest.raises(TypeError) as info, cakeops.use_backend(names):
        pass
    message = str(info.value)
    assert message.startswith("use_backend(): expected a backend name"), message
    assert repr(names) in message, message


@pytest.mark.parametrize("value", [",", " , ", "torch,,", ",torch"])
def test_a_malformed_backend_variable_is_named_in_the_error(value, monkeypatch):
    monkeypatch.setenv("CAKEOPS_BACKEND", value)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"CAKEOPS_BACKEND: expected a backend name"):
        cakeops.rmsnorm_silu_gate(x, x, torch.ones(4))
    with pytest.raises(ValueError, match=r"use_backend\(\): expected"), cakeops.use_backend([""]):
        pass


def _raising(name: str, method: str, error: str) -> str:
    """The source of a backend package whose ``method`` raises ``error`` (it serves the norm
    with the reference's kernels, first in the automatic choice)."""
    return f"""
        import torch
        from cakeops import Backend, OpKernels
        class Hostile(Backend):
            def {method}(self, *args):
                raise {error}
        backend = Hostile(name="{name}", distribution="{name}", ops={{
            "rmsnorm_silu_gate": OpKernels(module="cakeops.reference.rmsnorm_silu_gate",
                                           devices={{"cpu": 1000}}, dtypes=(torch.float32,))}})
        """


HOSTILE = {
    # module name -> source; each one's entry point is named after the module
    "impostor": """
        import torch
        from cakeops import Backend, OpKernels
        backend = Backend(name="torch", distribution="impostor", ops={
            "rmsnorm_silu_gate": OpKernels(module="impostor_kernels",
                                           devices={"cpu": 1000}, dtypes=(torch.float32,))})
        """,
    "quitter": "raise SystemExit(3)",
    "moody": _raising("moody", "unavailable_reason", 'RuntimeError("no idea")'),
    "picky": _raising("picky", "not_supported_reasons", 'KeyError("no shape")'),
    "fussy": _raising("fussy", "not_preferred_reasons", 'ValueError("no taste")'),
    "hollow": """
        import torch
        from cakeops import Backend, OpKernels
        backend = Backend(name="hollow", distribution="hollow", ops={
            "rmsnorm_silu_gate": OpKernels(module="hollow_kernels_missing",
                                           devices={"cpu": 1000}, dtypes=(torch.float32,))})
        """,
}


def test_hostile_backend_packages_break_nothing(tmp_path, monkeypatch):
    """A package that claims a first-party name, exits on import, raises in
    ``unavailable_reason``, ``not_supported_reasons`` or ``not_preferred_reasons`` or lacks its
    kernel module: each is reported, none is chosen, the automatic choice and ``cakeops info``
    still work (a raising ``not_supported_reasons`` failed every call)."""
    for module, source in HOSTILE.items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[cakeops.backends]\n{module} = {module}:backend\n")
    before = cakeops.explain(cakeops.rmsnorm_silu_gate, *inputs()).backend
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = cakeops.rediscover()
        errors = registry.load_errors()
        assert found["torch"].distribution == "cakeops-torch"
        assert "reserved for cakeops-torch" in errors["torch (from impostor)"]
        assert "SystemExit" in errors["quitter"] and "quitter" in errors["quitter"]
        x = inputs()
        assert cakeops.explain(cakeops.rmsnorm_silu_gate, *x).backend == before
        cakeops.rmsnorm_silu_gate(*x)
        why = cakeops.explain(cakeops.rmsnorm_silu_gate, *x).reasons
        assert "unavailable_reason() raised RuntimeError: no idea" in why["moody"][0]
        assert why["picky"] == ["not_supported_reasons() raised KeyError: 'no shape'"]
        assert why["fussy"] == ["not_preferred_reasons() raised ValueError: no taste"]
        with (
            cakeops.use_backend("picky"),
            pytest.raises(cakeops.BackendError, match="raised KeyError: 'no shape'"),
        ):
            cakeops.rmsnorm_silu_gate(*x)
        with (
            cakeops.use_backend("hollow"),
            pytest.raises(cakeops.BackendError, match="hollow_kernels_missing"),
        ):
            cakeops.rmsnorm_silu_gate(*x)
        from cakeops.cli import gather_info

        listed = gather_info()["backends"]
        assert (
            listed["quitter"]["available"] is False and "SystemExit" in listed["quitter"]["reason"]
        )
        assert not listed["moody"]["available"]
    finally:
        monkeypatch.undo()
        cakeops.rediscover()


def test_install_hint_of_numba_names_its_cuda_extra():
    """The distributions are not on PyPI yet: the hint installs from a checkout. numba's CUDA
    kernels come with its ``cuda`` extra, Triton's kernels run on GPUs: the hints say so."""
    hint = registry.install_hint("numba")
    assert hint.startswith("`pip install ./packages/numba` from a checkout")
    assert "not on PyPI yet" in hint
    assert "its CUDA kernels with `pip install './packages/numba[cuda]'`" in hint
    assert "[" not in registry.install_hint("torch")
    assert "GPU" not in registry.install_hint("torch")
    assert "its kernels run on NVIDIA and AMD GPUs" in registry.install_hint("triton")
