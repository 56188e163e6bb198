"""The generated glue on an op declared here (one tensor argument, one gradient), as a new op
module would declare it: the custom ops, autograd, torch.func, torch.compile and opcheck."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cakeops
from cakeops.ops import SPECS
from cakeops.opspec import OpInputs, OpSpec


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    op = "test_scaled_square"
    x: torch.Tensor
    _: dataclasses.KW_ONLY
    scale: float = 1.0


def _check(a: Inputs) -> Inputs:
    if a.x.dim() != 1:
        raise ValueError(f"{Inputs.op}: argument 'x' expected 1 dimension, got {a.x.dim()}")
    return a


SPEC = OpSpec(
    inputs=Inputs,
    check=_check,
    output=lambda a: (a.x.shape, a.x.dtype),
    no_work=lambda a: a.x.numel() == 0,
    example=lambda device="cpu", dtype=torch.float32: Inputs(torch.randn(5, device=device)),
)


@pytest.fixture(autouse=True)
def toy_backend():
    module = types.ModuleType("_cakeops_toy_kernels")
    module.forward = lambda x, scale: scale * x * x
    module.backward = lambda g, x, scale: (2 * scale * x * g,)
    sys.modules[module.__name__] = module
    kernels = cakeops.OpKernels(module=module.__name__, devices={"cpu": 1}, dtypes=(torch.float32,))
    cakeops.register_backend(
        cakeops.Backend("toy", "cakeops-toy", ops={Inputs.op: kernels}), replace=True
    )
    yield
    cakeops.unregister_backend("toy")
    sys.modules.pop(module.__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class Copied(OpInputs):
    op = "test_contiguous_double"
    x: torch.Tensor


COPIED = OpSpec(
    inputs=Copied,
    check=lambda a: a if a.x.is_contiguous() else dataclasses.replace(a, x=a.x.contiguous()),
    example=lambda device="cpu", dtype=torch.float32: Copied(torch.randn(3, device=device)),
)


def test_a_check_that_replaces_a_tensor_runs_on_every_call():
    """A signature is remembered without its tensors: when ``check`` replaced one (here a
    contiguous copy of a transposed input), every later call of the signature runs it again and
    the kernel gets the replacement, with autograd or without."""
    seen = []
    module = types.ModuleType("_cakeops_copied_kernels")
    module.forward = lambda x: seen.append(x.is_contiguous()) or 2 * x
    module.backward = lambda g, x: (2 * g,)
    sys.modules[module.__name__] = module
    kernels = cakeops.OpKernels(module=module.__name__, devices={"cpu": 1}, dtypes=(torch.float32,))
    cakeops.register_backend(cakeops.Backend("copied", "cakeops-copied", ops={Copied.op: kernels}))
    try:
        x = torch.randn(3, 4).t()
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(COPIED(x=x), 2 * x)
        leaf = x.detach().requires_grad_()
        for _ in range(2):
            (grad,) = torch.autograd.grad(COPIED(x=leaf).sum(), leaf)
            torch.testing.assert_close(grad, torch.full_like(x, 2.0))
        assert seen == [True] * 5
    finally:
        cakeops.unregister_backend("copied")
        sys.modules.pop(module.__name__)


def test_forward_backward_and_the_contract():
    x = torch.randn(6, requires_grad=True)
    y = SPEC(x=x, scale=1.5)
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, 1.5 * x * x)
    torch.testing.assert_close(dx, 3 * x)
    assert SPEC.saved == ("x",)
    with pytest.raises(ValueError, match="argument 'x' expected 1 dimension"):
        SPEC(x=torch.randn(2, 2))
    with pytest.raises(TypeError, match="argument 'scale' expected a float"):
        SPEC(x=x, scale="2")


@pytest.mark.parametrize(
    "grads, message",
    [
        (
            lambda g, x, scale: (g[:-1],),
            "returned dx as a float32 tensor of shape \\(5,\\) on cpu, "
            "expected float32 of shape \\(6,\\) on cpu",
        ),
        (lambda g, x, scale: (g.double(),), "returned dx as a float64 tensor of shape \\(6,\\)"),
        (lambda g, x, scale: ("nothing",), "returned dx as str 'nothing', expected float32"),
        (lambda g, x, scale: (g, g), "returned 2 gradients, expected 1 \\(x\\)"),
    ],
    ids=["shape", "dtype", "not-a-tensor", "count"],
)
def test_a_backward_that_returns_wrong_gradients_is_named(monkeypatch, grads, message):
    """A backend's backward whose gradients are not its inputs' (shape, dtype, type, count)
    raises a RuntimeError naming the op, the backend and the gradient, on a signature's first
    call and on later ones (the remembered signature's lean backward)."""
    monkeypatch.setattr(sys.modules["_cakeops_toy_kernels"], "backward", grads)
    x = torch.randn(6, requires_grad=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=f"{Inputs.op}: backend 'toy' {message}"):
            torch.autograd.grad(SPEC(x=x, scale=1.5).sum(), x)


@pytest.mark.parametrize("which", ["the output", "the second output"])
def test_a_forward_that_returns_wrong_outputs_is_named(monkeypatch, which):
    """A backend's forward whose output or final state is not what the call expects raises a
    RuntimeError naming the op, the backend and the output, on a signature's first call and on
    later ones, with autograd recording or not."""
    from cakeops.reference import causal_dot_product as kernels

    forward, at = kernels.forward, ("the output", "the second output").index(which)

    def wrong(*arguments):
        outputs = list(forward(*arguments))
        outputs[at] = outputs[at].double()
        return tuple(outputs)

    monkeypatch.setattr(kernels, "forward", wrong)
    q, k, v = (torch.randn(1, 2, 1, 4, requires_grad=True) for _ in range(3))
    state = torch.randn(1, 2, 4, 4)
    message = f"causal_dot_product: backend 'reference' returned {which} as a float64 tensor"
    with cakeops.use_backend("reference"):
        for recording in (False, False, True, True):
            with torch.set_grad_enabled(recording), pytest.raises(RuntimeError, match=message):
                cakeops.causal_dot_product(q, k, v, initial_state=state, output_final_state=True)


@pytest.mark.parametrize("step, kept", [(3, False), (2, True)], ids=["another", "the-input's"])
def test_a_gradient_is_laid_out_like_its_input(monkeypatch, step, kept):
    """A backend's gradient in a layout neither its input's nor ``torch.empty_like``'s of it
    (the backward's fake kernel's, which a compiled graph relies on) is copied to the latter, on
    a signature's first call and later ones; one with the input's own strides stays as it is."""

    def backward(g, x, scale):
        return (torch.zeros(step * x.numel())[::step].copy_(2 * scale * x * g),)

    monkeypatch.setattr(sys.modules["_cakeops_toy_kernels"], "backward", backward)
    x = torch.randn(12)[::2].requires_grad_()  # a leaf with strides (2,)
    for _ in range(2):
        (dx,) = torch.autograd.grad(SPEC(x=x, scale=1.5).sum(), x)
        assert dx.stride() == ((step,) if kept else torch.empty_like(x).stride())
        torch.testing.assert_close(dx, 3 * x)


def test_a_contiguous_gradient_of_a_contiguous_input_is_kept(monkeypatch):
    """A size-1 dimension's stride does not matter: a backend's gradient that is contiguous,
    like its input, is kept as returned (no copy) whatever that stride, on a signature's first
    call and on later ones (where each gradient is checked against what the signature
    remembers)."""
    returned = []

    def backward(g, x, scale):
        returned.append(torch.zeros(3)[::2][:1].copy_(2 * scale * x * g))  # strides (2,)
        return (returned[-1],)

    monkeypatch.setattr(sys.modules["_cakeops_toy_kernels"], "backward", backward)
    x = torch.randn(1, requires_grad=True)
    for _ in range(3):
        (dx,) = torch.autograd.grad(SPEC(x=x, scale=1.5).sum(), x)
        assert dx.data_ptr() == returned[-1].data_ptr() and dx.stride() == (2,)
        torch.testing.assert_close(dx, 3 * x)


@pytest.mark.parametrize("apply", ["C", "Function.apply"])
def test_a_tensor_escaped_from_a_functorch_transform_is_its_own_tensor_again(monkeypatch, apply):
    """A tensor kept from inside a ``torch.func`` transform that has ended (PyTorch's "dead
    wrapper") is the tensor it wrapped, as for any autograd Function: a call recording
    gradients on it, first or later of its signature, sends its gradient to that tensor,
    through the Function's C ``apply`` or (a PyTorch without it) ``Function.apply``."""
    from cakeops import opspec

    if apply == "Function.apply":
        monkeypatch.setattr(opspec, "_lean_apply", None)
    escaped = []
    x = torch.randn(2, 8, requires_grad=True)
    z, w = torch.randn(2, 8), torch.randn(8)
    torch.func.grad(lambda t: escaped.append(t) or (t * t).sum())(x)
    (want,) = torch.autograd.grad(cakeops.rmsnorm_silu_gate(x, z, w).sum(), x)
    SPECS["rmsnorm_silu_gate"]._plans.clear()
    for _ in range(2):
        y = cakeops.rmsnorm_silu_gate(escaped[0], z, w)
        (got,) = torch.autograd.grad(y.sum(), x, allow_unused=True)
        assert got is not None
        torch.testing.assert_close(got, want)


def test_autocast_is_seen_on_every_device():
    """Whether autocast is on for a call's devices: the one-call check where it sees them all
    (CPU, CUDA), each device asked where it does not (MPS)."""
    from cakeops.opspec import _autocasting, _Plan

    def planned(device):
        return _Plan((), (), no_work=False, out=None, second=None, devices=frozenset({device}))

    plans = {d: planned(d) for d in ("cpu", "mps")}
    assert not any(map(_autocasting, plans.values()))
    for device, plan in plans.items():
        torch.set_autocast_enabled(device, True)
        try:
            assert _autocasting(plan), device
        finally:
            torch.set_autocast_enabled(device, False)
    assert not _autocasting(planned("meta"))


def test_one_gradient_through_torch_func_compile_and_opcheck():
    x = torch.randn(6)
    grad = torch.func.grad(lambda t: SPEC(x=t, scale=2.0).sum())(x)
    torch.testing.assert_close(grad, 4 * x)
    torch._dynamo.reset()
    xc = x.clone().requires_grad_()
    compiled = torch.compile(lambda t: SPEC(x=t, scale=2.0), fullgraph=True)
    (dx,) = torch.autograd.grad(compiled(xc).sum(), xc)
    torch.testing.assert_close(dx, 4 * x)
    torch.library.opcheck(torch.ops.cakeops.test_scaled_square.default, (xc, 2.0))
    torch.library.opcheck(torch.ops.cakeops.test_scaled_square_backward.default, (x, x, 2.0))


def test_no_work_gives_zeros_without_a_backend():
    x = torch.randn(0, requires_grad=True)
    y = SPEC(x=x)
    (dx,) = torch.autograd.grad(y, x, torch.zeros(0))
    assert y.shape == (0,) and dx.shape == (0,)


class Ops(TorchDispatchMode):
    """Records the cakeops ops the dispatcher sees, by name."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "cakeops":
            self.seen.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_options_at_their_defaults_take_the_short_op():
    """``routed_experts`` with its options at their defaults (left out or passed) runs
    ``cakeops::routed_experts_defaults`` (six arguments through the dispatcher); with an option
    set, the full op; both give the same result when the option is neutral."""
    import cakeops

    inputs = cakeops.ops.SPECS["routed_experts"].example()
    tensors = [inputs[n] for n in ("x", "top_k_index", "top_k_weights", "w_gate", "w_up", "w_down")]
    zero_bias = torch.zeros(inputs["w_down"].shape[:2])
    runs = {
        "left out": ({}, "routed_experts_defaults"),
        "passed": (
            {"activation": "silu", "alpha": 1.0, "up_offset": 0.0},
            "routed_experts_defaults",
        ),
        "a bias": ({"b_down": zero_bias}, "routed_experts"),
    }
    outs = {}
    for name, (kwargs, op) in runs.items():
        with Ops() as mode:
            outs[name] = cakeops.routed_experts(*tensors, **kwargs)
        assert mode.seen == [op], name
    torch.testing.assert_close(outs["a bias"], outs["left out"])


def _custom_op_calls(fn):
    """``fn()`` and how many ``cakeops::`` ops the profiler saw it run."""
    with torch.profiler.profile() as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key.startswith("cakeops::"))


def test_a_call_without_autograd_skips_the_dispatcher_unless_something_watches_it():
    """With nothing for autograd to record (grad mode off, or no input requiring a gradient), an
    eager call runs its kernel without the custom op (a decode step's fixed cost); the result is
    the same, and a dispatch mode still sees the op as one node."""

    x = torch.randn(5)
    leaf = x.clone().requires_grad_()
    with torch.no_grad():
        plain, calls = _custom_op_calls(lambda: SPEC(x=leaf, scale=2.0))
    assert calls == 0
    not_requiring, calls = _custom_op_calls(lambda: SPEC(x=x, scale=2.0))
    assert calls == 0
    torch.testing.assert_close(not_requiring, plain)
    with torch.no_grad(), Ops() as mode:
        SPEC(x=x, scale=2.0)
    assert mode.seen == ["test_scaled_square"]
    with pytest.raises(ValueError, match="test_scaled_square: argument 'x'"), torch.no_grad():
        SPEC(x=torch.randn(2, 2))


def test_a_call_autograd_records_runs_the_kernels_without_the_custom_op(monkeypatch):
    """An eager call that records a gradient, in a plain context: its forward and backward run
    the backend's kernels with no ``cakeops::`` op dispatched (a small training call's fixed
    cost), with the custom op's results and contract: the gradient, exactly the input saved, a
    backward run by the backend that ran the forward, a refused second derivative, a refused
    backward after the input changed in place; a dispatch mode still sees the op and its
    backward as nodes."""
    x = torch.randn(5)
    leaf = x.clone().requires_grad_()
    kernels = sys.modules["_cakeops_toy_kernels"]
    backward, calls = kernels.backward, []
    monkeypatch.setattr(kernels, "backward", lambda *a: calls.append(1) or backward(*a))

    def step():
        y = SPEC(x=leaf, scale=2.0)
        return y, torch.autograd.grad(y.sum(), leaf)[0]

    (y, dx), ops = _custom_op_calls(step)
    assert ops == 0 and calls == [1] and y.requires_grad
    torch.testing.assert_close(y, 2.0 * x * x)
    torch.testing.assert_close(dx, 4.0 * x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        saved = []
        SPEC(x=leaf, scale=2.0)
    assert len(saved) == 1 and saved[0] is leaf
    (dx2,) = torch.autograd.grad(SPEC(x=leaf, scale=2.0).sum(), leaf, create_graph=True)
    torch.testing.assert_close(dx2, 4.0 * x)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        dx2.sum().backward()
    changed = leaf.clone()
    y = SPEC(x=changed, scale=2.0)
    with torch.no_grad():
        changed.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with Ops() as mode:
        torch.autograd.grad(SPEC(x=leaf, scale=2.0).sum(), leaf)
    assert mode.seen == ["test_scaled_square", "test_scaled_square_backward"]


def test_a_final_state_no_gradient_reached_gets_an_empty_gradient(monkeypatch):
    """A final state asked for and left out of the loss: the kernel's backward gets an empty
    ``g_final`` (no state of zeros made and read), and zeros for an output left out when the
    final state is used; the gradients are those of the zeros given explicitly."""
    from cakeops.reference import causal_dot_product as kernels

    backward, seen = kernels.backward, []

    def spy(g, g_final, *arguments):
        seen.append((g, g_final))
        return backward(g, g_final, *arguments)

    monkeypatch.setattr(kernels, "backward", spy)
    q, k, v = (torch.randn(1, 2, 3, 4, requires_grad=True) for _ in range(3))
    state = torch.randn(1, 2, 4, 4, requires_grad=True)
    tensors = (q, k, v, state)

    def call():
        return cakeops.causal_dot_product(q, k, v, initial_state=state, output_final_state=True)

    with cakeops.use_backend("reference"):
        out, final = call()
        g, g_final = torch.randn_like(out), torch.randn_like(final)
        unused = torch.autograd.grad(out, tensors, g)
        ((got_g, got_final),) = seen
        assert got_g is g and got_final.numel() == 0
        out, final = call()
        zeros = torch.autograd.grad((out, final), tensors, (g, torch.zeros_like(final)))
        for a, b in zip(unused, zeros, strict=True):
            torch.testing.assert_close(a, b)
        seen.clear()
        torch.autograd.grad(call()[1], tensors, g_final)
        ((got_g, got_final),) = seen
        assert got_final is g_final and got_g.shape == out.shape and not got_g.any()


def _with(name, value):
    return lambda kwargs: {**kwargs, name: value(kwargs)}


_GDR_CU = torch.tensor([0, 3, 5, 8])
_CDP_GATES = _with("log_gates", lambda a: -torch.rand(a["q"].shape[:3]))


@pytest.mark.parametrize(
    "op, name, good, bad",
    [
        ("gated_delta_rule", "g", None, lambda a: a["g"].abs() + 0.1),
        # a NaN beside a positive log gate: the positive one is still found
        ("gated_delta_rule", "g", None,
         lambda a: a["g"].abs().index_fill(-1, torch.tensor([0]), float("nan")) + 0.1),
        ("gated_delta_rule", "cu_seqlens", _with("cu_seqlens", lambda a: _GDR_CU),
         lambda a: _GDR_CU[[0, 2, 1, 3]]),
        ("causal_dot_product", "log_gates", _CDP_GATES, lambda a: a["log_gates"].abs() + 0.1),
        ("routed_experts", "top_k_index", None, lambda a: a["top_k_index"] - 100),
    ],
)  # fmt: skip
@pytest.mark.parametrize("entry", ["public", "spec"])
def test_a_signature_checked_before_still_checks_its_values(op, name, good, bad, entry):
    """A call without autograd skips the checks its signature passed before (types, shapes,
    dtypes): not those that read values (log gates <= 0, sorted offsets, ids >= 0), whether
    through the public function (``OpSpec.call``) or the spec by name (``OpSpec.__call__``);
    a call recording gradients runs them with grad mode off, and leaves it on when they
    raise."""
    spec = SPECS[op]
    call = getattr(cakeops, op) if entry == "public" else spec
    kwargs = dict(spec.example())
    if good is not None:
        kwargs = good(kwargs)
    wrong = {**kwargs, name: bad(kwargs)}
    with torch.no_grad():
        call(**kwargs)
        call(**kwargs)
        with pytest.raises(ValueError, match=f"^{op}: argument '{name}' expected"):
            call(**wrong)
    leaf = spec.differentiable[0]  # the same signatures, recording gradients
    call(**{**kwargs, leaf: kwargs[leaf].detach().requires_grad_()})
    with pytest.raises(ValueError, match=f"^{op}: argument '{name}' expected"):
        call(**{**wrong, leaf: wrong[leaf].detach().requires_grad_()})
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_public_functions_take_the_arguments_in_declaration_order(name):
    """The public function passes its arguments to ``OpSpec.call`` by position: its parameters
    are the inputs' fields, in order, with their defaults and keyword-only marks."""
    import inspect

    empty = inspect.Parameter.empty
    public = inspect.signature(getattr(cakeops, name)).parameters.values()
    got = [(p.name, p.default, p.kind == p.KEYWORD_ONLY) for p in public]
    expected = [(n, empty if d is dataclasses.MISSING else d, kw)
                for n, _, d, kw in SPECS[name].arguments]  # fmt: skip
    assert got == expected


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_known_signature_runs_in_one_function(name, monkeypatch):
    """A known signature's call (a decode step, a training step's op) runs in
    ``OpSpec._quick`` alone, with the result of the full path, through the lean autograd
    Function when it records gradients; a call of a new signature takes the full path."""
    spec = SPECS[name]
    op = getattr(cakeops, name)
    kwargs = dict(spec.example())
    with torch.no_grad():
        first = op(**kwargs)  # the full path: makes the signature's plan
    full, taken = OpSpec._call, []

    def spy(self, arguments):
        taken.append(self is spec)
        return full(self, arguments)

    monkeypatch.setattr(OpSpec, "_call", spy)
    with torch.no_grad():
        again = op(**kwargs)
    tensor = next(n for n in spec.differentiable if kwargs[n] is not None)
    recorded = op(**{**kwargs, tensor: kwargs[tensor].detach().requires_grad_()})
    assert not taken
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(recorded.detach(), first, rtol=0, atol=0)
    assert type(recorded.grad_fn).__name__ == "_LeanFunctionBackward"
    spec._plans.clear()
    with torch.no_grad():
        op(**kwargs)  # a signature not seen (since the plans were forgotten)
    assert taken == [True]


def _tensors_and_the_rest(spec: OpSpec) -> tuple[dict, list[str], dict]:
    """The spec's example inputs, the names of its tensors, and its other arguments."""
    inputs = dict(spec.example())
    names = [n for n, v in inputs.items() if isinstance(v, torch.Tensor)]
    return inputs, names, {n: v for n, v in inputs.items() if n not in names}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_fx_symbolic_trace_records_the_custom_op(name):
    """``torch.fx.symbolic_trace`` (FX quantisation and other tools trace models) records a
    call as one node of the op's custom op, with the second output's node when the call asks for
    it; the traced function gives the eager call's results and gradients, and its bad inputs
    the op's own errors. (A ``Proxy`` is no tensor: the call raised a ``TypeError`` before.)"""
    spec = SPECS[name]
    inputs, names, fixed = _tensors_and_the_rest(spec)
    if spec.second is not None:
        fixed[spec.second_flag] = True
    op = getattr(cakeops, name)
    # a function of named tensors (symbolic_trace takes no *args)
    fn = eval(f"lambda {', '.join(names)}: op({', '.join(f'{n}={n}' for n in names)}, **fixed)",
              {"op": op, "fixed": fixed})  # fmt: skip
    traced = torch.fx.symbolic_trace(fn)
    called = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    custom = getattr(torch.ops.cakeops, name).default
    assert called[0] == custom and all(t is not custom for t in called[1:])
    leaves = [inputs[n].detach().clone().requires_grad_(n in spec.differentiable) for n in names]
    results = []
    for run in (fn, traced):
        args = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        out = run(*args)
        outs = out if isinstance(out, tuple) else (out,)
        g = [torch.ones_like(o) for o in outs if o.requires_grad]
        wrt = [a for a in args if a.requires_grad]
        grads = torch.autograd.grad([o for o in outs if o.requires_grad], wrt, g, allow_unused=True)
        results.append([*(o.detach() for o in outs), *(d for d in grads if d is not None)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a)
    bad = [t.detach().int() if i == 0 else t for i, t in enumerate(leaves)]
    with pytest.raises((ValueError, TypeError), match=f"^{name}: "):
        traced(*bad)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_torch_export_records_the_custom_op(name):
    """``torch.export`` (deployment, AOTInductor) of a module that calls the op: one node of its
    custom op in the exported graph, and the exported module gives the eager call's result."""
    spec = SPECS[name]
    inputs, names, fixed = _tensors_and_the_rest(spec)
    op = getattr(cakeops, name)

    class Model(torch.nn.Module):
        def forward(self, *tensors):
            return op(**dict(zip(names, tensors, strict=True)), **fixed)

    args = tuple(inputs[n] for n in names)
    exported = torch.export.export(Model(), args)
    called = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert called.count(getattr(torch.ops.cakeops, name).default) == 1, called
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(*args), Model()(*args))


def _spy(ran, name, kernel, *args):
    ran.append(name)
    return kernel(*args)


@pytest.mark.parametrize("recording", [False, True], ids=["no-grad", "recording"])
def test_a_call_runs_the_backend_chosen_under_the_state_it_read(monkeypatch, recording):
    """Threads share a signature's plan, each under its own selection state (``use_backend()``
    is per thread): a call runs, forward and backward, the backend chosen under the state it
    read, though another thread's call replaces the signature's choice meanwhile (here: as this
    thread reads its state)."""
    from cakeops import opspec
    from cakeops.registry import backends

    monkeypatch.delenv("CAKEOPS_BACKEND", raising=False)
    monkeypatch.delenv("CAKEOPS_BACKEND_RMSNORM_SILU_GATE", raising=False)
    x, z, w = torch.randn(2, 8, requires_grad=recording), torch.randn(2, 8), torch.randn(8)
    implicit = cakeops.explain(cakeops.rmsnorm_silu_gate, x, z, w).backend
    ran = []
    for name in (implicit, "reference"):
        module = backends()[name].kernels("rmsnorm_silu_gate")
        for kind in ("forward", "backward"):
            spy = functools.partial(_spy, ran, (name, kind), getattr(module, kind))
            monkeypatch.setattr(module, kind, spy)
    SPECS["rmsnorm_silu_gate"]._plans.clear()
    cakeops.rmsnorm_silu_gate(x, z, w)  # the signature's plan, the implicit choice
    (plan,) = SPECS["rmsnorm_silu_gate"]._plans.values()
    reference = backends()["reference"]
    elsewhere = (("another thread's state",), reference, reference.kernels("rmsnorm_silu_gate"))
    token = opspec.selection_token

    def meanwhile(op):
        plan.choice = elsewhere
        return token(op)

    monkeypatch.setattr(opspec, "selection_token", meanwhile)
    ran.clear()
    y = cakeops.rmsnorm_silu_gate(x, z, w)
    if recording:
        y.sum().backward()
    assert ran == [(implicit, "forward")] + [(implicit, "backward")] * recording


def test_a_remembered_signature_still_follows_the_backend_choice(monkeypatch):
    """A call without autograd of a signature seen before chooses its backend again when
    ``use_backend()``, ``CAKEOPS_BACKEND`` or the installed backends changed."""
    from cakeops.registry import backends

    x, z, w = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    monkeypatch.delenv("CAKEOPS_BACKEND", raising=False)
    monkeypatch.delenv("CAKEOPS_BACKEND_RMSNORM_SILU_GATE", raising=False)
    implicit = cakeops.explain(cakeops.rmsnorm_silu_gate, x, z, w).backend
    ran = []
    for name in (implicit, "reference"):
        module = backends()[name].kernels("rmsnorm_silu_gate")
        forward = module.forward
        monkeypatch.setattr(
            module, "forward", lambda *a, name=name, f=forward: ran.append(name) or f(*a)
        )

    def which():
        with torch.no_grad():
            cakeops.rmsnorm_silu_gate(x, z, w)
        return ran.pop()

    assert which() == implicit and which() == implicit
    with cakeops.use_backend("reference"):
        assert which() == "reference"
    assert which() == implicit
    monkeypatch.setenv("CAKEOPS_BACKEND_RMSNORM_SILU_GATE", "reference")
    assert which() == "reference"
    monkeypatch.delenv("CAKEOPS_BACKEND_RMSNORM_SILU_GATE")
    assert which() == implicit
    monkeypatch.setenv("CAKEOPS_BACKEND", "reference")
    assert which() == "reference"
    monkeypatch.delenv("CAKEOPS_BACKEND")
    assert which() == implicit
    with monkeypatch.context() as m:  # an os.environ replaced by another mapping: read there
        m.setattr(os, "environ", {**os.environ, "CAKEOPS_BACKEND": "reference"})
        assert which() == "reference"
    assert which() == implicit
    first = backends()["reference"]
    ops = {"rmsnorm_silu_gate": dataclasses.replace(first.ops["rmsnorm_silu_gate"],
                                                    devices={"cpu": 1000})}  # fmt: skip
    cakeops.register_backend(cakeops.Backend("eager-first", first.distribution, ops=ops))
    try:
        ran_before = len(ran)
        with torch.no_grad():
            cakeops.rmsnorm_silu_gate(x, z, w)
        assert len(ran) == ran_before + 1 and ran[-1] == "reference"  # its kernels: reference's
    finally:
        cakeops.unregister_backend("eager-first")
    assert which() == implicit


@pytest.mark.parametrize("name", sorted(SPECS))
def test_inputs_made_without_init_read_like_the_dataclass(name):
    """The lean path fills an op's inputs directly (its ``__init__`` costs a decode step): they
    read exactly as the dataclass built them."""
    spec = SPECS[name]
    built = spec.validate(tuple(spec.example().values()))
    made = spec._make(tuple(built.values()))
    assert type(made) is type(built)
    assert made.values() == built.values() and list(made) == list(built)
    assert made.tensors.keys() == built.tensors.keys() and made.selecting is built.selecting
    for field in dataclasses.fields(built):
        assert getattr(made, field.name) is getattr(built, field.name)


def test_device_value_checks_follow_the_environment(monkeypatch):
    """``CAKEOPS_CHECK_VALUES``: unset or 0, a GPU's log multipliers are not read; 1, they are;
    anything else is a clear error naming the variable. ``cu_seqlens`` is read on every device,
    a fake or meta tensor never (no values), a CPU tensor always."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cakeops import _spec

    monkeypatch.delenv(_spec.CHECK_VALUES_ENV, raising=False)
    assert not _spec.device_values_checked()
    for raw, want in (("0", False), ("1", True), (" 1 ", True), ("", False)):
        monkeypatch.setenv(_spec.CHECK_VALUES_ENV, raw)
        assert _spec.device_values_checked() is want
    monkeypatch.setenv(_spec.CHECK_VALUES_ENV, "yes")
    with pytest.raises(ValueError, match="CAKEOPS_CHECK_VALUES expected 0 or 1, got 'yes'"):
        _spec.device_values_checked()
    meta = torch.empty(3, device="meta")
    assert not _spec.readable(meta, on_device=True)
    with FakeTensorMode():
        assert not _spec.readable(torch.empty(3), on_device=True)
    assert _spec.readable(torch.zeros(3), on_device=False)
    # a meta cu_seqlens: its shape checked, its values not read
    assert _spec.check_cu_seqlens("op", torch.empty(4, dtype=torch.int64, device="meta"), 1, 8) == 3


@pytest.mark.parametrize("size", [8, 200], ids=["listed", "reduced"])
def test_log_multipliers_checked_whatever_their_order(size):
    """A positive log multiplier is refused (the op, the argument, the value) wherever it is,
    after a NaN too (a NaN maximum hides it), whether the few values are read as a list or many
    through a reduction; NaN, zeros and negatives pass."""
    from cakeops._spec import LISTED_VALUES, check_log_multipliers

    assert (size <= LISTED_VALUES) == (size == 8)
    t = -torch.rand(size)
    t[1] = 0.0
    check_log_multipliers("op", "g", t)
    check_log_multipliers("op", "g", torch.empty(0))
    t[0] = float("nan")  # first: Python's max() and a reduction may then answer NaN
    check_log_multipliers("op", "g", t)
    for at in (0, 1, size - 1):  # the NaN itself replaced, right after it, last
        bad = t.clone()
        bad[at] = 0.25
        with pytest.raises(ValueError, match=r"op: argument 'g' expected log multipliers <= 0, "
                                             r"got 0\.25"):  # fmt: skip
            check_log_multipliers("op", "g", bad.view(2, -1))
