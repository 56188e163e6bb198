"""Conformance checks every op shares, generated from its spec (``cakeops.ops.<op>.SPEC``): one
test class per op, on the spec's example inputs. An op added to ``cakeops.ops`` is checked here
with no edit; its own module (``test_<op>.py``) holds the checks only it has.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils.checkpoint import checkpoint

from cakeops.ops import SPECS
from cakeops.opspec import OpSpec
from cakeops.testing import (
    EMULATED,
    assert_autocast_changes_nothing,
    assert_bad_input_raises,
    assert_compiled_matches,
    assert_default_dtype_changes_nothing,
    assert_func_grad_matches_autograd,
    assert_matches,
    assert_saves_exactly,
    run_with_grads,
)


def example(spec: OpSpec, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The spec's example inputs: the differentiable tensors (cloned, requiring grad), an
    upstream gradient, the op as a function of those tensors alone, and the inputs."""
    torch.manual_seed(seed)
    inputs = spec.example(device, dtype)
    return _as_function(spec, inputs)


def _as_function(spec: OpSpec, inputs):
    names = spec.differentiable_given(inputs)
    tensors = tuple(inputs[n].detach().clone().requires_grad_() for n in names)
    fixed = {k: v for k, v in inputs.items() if k not in names}

    def op(*ts: torch.Tensor) -> torch.Tensor:
        return spec(**dict(zip(names, ts, strict=True)), **fixed)

    g = torch.randn_like(spec.output_like(inputs))
    return tensors, g, op, spec.inputs(**{**inputs, **dict(zip(names, tensors, strict=True))})


class Contract:
    """What every op promises, whatever the backend (the ``op`` attribute names the op)."""

    op: str

    @property
    def spec(self) -> OpSpec:
        return SPECS[self.op]

    def test_saves_exactly_the_inputs(self, cakeops_backend, cakeops_device):
        tensors, g, op, inputs = example(self.spec, cakeops_device)
        names = [n for n in self.spec.saved if inputs[n] is not None]
        saved = tuple(inputs[n] for n in names)
        out = assert_saves_exactly(lambda *_: op(*tensors), saved, names)
        out.backward(g)

    def test_checkpoint_gives_same_gradients(self, cakeops_backend, cakeops_device):
        tensors, g, op, _ = example(self.spec, cakeops_device)
        plain = run_with_grads(op, tensors, g)
        ckpt = run_with_grads(lambda *t: checkpoint(op, *t, use_reentrant=False), tensors, g)
        for a, b in zip(plain, ckpt, strict=True):
            assert torch.equal(a, b)

    def test_deterministic(self, cakeops_backend, dtype, cakeops_device):
        if EMULATED and dtype != torch.float32:
            # a kernel's order of summation does not depend on the dtype; under an emulator
            # (minutes per experts op) one dtype, natively and on a GPU every one
            pytest.skip("under an emulator, determinism is checked in float32 only")
        tensors, g, op, _ = example(self.spec, cakeops_device, dtype)
        first = run_with_grads(op, tensors, g)
        second = run_with_grads(op, tensors, g)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b)

    def test_autocast_does_not_reach_the_kernels(self, cakeops_backend, cakeops_device):
        """The ops have no autocast rule: inside an autocast region, float32 inputs give exactly
        the float32 results and gradients, forward and backward alike."""
        tensors, g, op, _ = example(self.spec, cakeops_device)
        assert_autocast_changes_nothing(op, tensors, g)

    def test_default_dtype_changes_nothing(self, cakeops_backend, cakeops_device):
        """PyTorch's default dtype (bfloat16 in many inference scripts) reaches no kernel."""
        tensors, g, op, _ = example(self.spec, cakeops_device)
        assert_default_dtype_changes_nothing(lambda: run_with_grads(op, tensors, g))

    def test_torch_func_grad(self, cakeops_backend, cakeops_device):
        tensors, g, op, _ = example(self.spec, cakeops_device)
        assert_func_grad_matches_autograd(op, tensors, g)

    def test_forward_mode_ad_is_refused(self, cakeops_backend, cakeops_device):
        """No silent zero tangents: jvp and dual tensors get a clear error."""
        tensors, _, op, inputs = example(self.spec, cakeops_device)
        first, *rest = (t.detach() for t in tensors)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jvp(lambda a: op(a, *rest), (first,), (torch.ones_like(first),))
        last = self.spec.differentiable_given(inputs)[-1]
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match=f"argument '{last}'"):
            plain = (first, *rest)
            op(*plain[:-1], fwAD.make_dual(plain[-1], torch.ones_like(plain[-1])))

    def test_opcheck(self, cakeops_backend, cakeops_device):
        _, g, _, inputs = example(self.spec, cakeops_device)
        values = list(inputs.values())
        torch.library.opcheck(getattr(torch.ops.cakeops, self.op).default, tuple(values))
        detached = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
        backward = getattr(torch.ops.cakeops, f"{self.op}_backward").default
        # an op with a second output takes its gradient too (an empty one: not asked for)
        grads = (g, g.new_empty(0)) if self.spec.second is not None else (g,)
        torch.library.opcheck(backward, (*grads, *detached))
        n = self.spec.leading  # the short op of the options at their defaults, if any
        # (under an emulator, not again: the short op runs the same kernels through the spec's
        # own registration, which the native backends and the GPU run check)
        if n and not EMULATED:
            short = getattr(torch.ops.cakeops, f"{self.op}_defaults")
            torch.library.opcheck(short.default, tuple(values[:n]))
            backward = getattr(torch.ops.cakeops, f"{self.op}_defaults_backward").default
            torch.library.opcheck(backward, (*grads, *detached[:n]))

    def test_compile_fullgraph(self, cakeops_backend, cakeops_device):
        tensors, g, op, _ = example(self.spec, cakeops_device)
        torch._dynamo.reset()
        eager = run_with_grads(op, tensors, g)
        compiled = run_with_grads(torch.compile(op, fullgraph=True), tensors, g)
        assert_compiled_matches(eager, compiled)

    def test_empty_first_dimension(self, cakeops_backend, dtype, cakeops_device):
        """No rows: an empty output and gradients, zero where they have elements."""
        _, _, _, inputs = example(self.spec, cakeops_device, dtype)
        first = self.spec.tensor_names[0]
        rows = inputs[first].shape[0]
        empty = {  # the tensors sharing the first dim shrink with it
            name: t.detach()[:0]
            for name, t in inputs.items()
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows
        }
        tensors, _, op, _ = _as_function(self.spec, self.spec.inputs(**{**inputs, **empty}))
        out, *grads = run_with_grads(op, tensors, torch.zeros_like(op(*tensors)))
        assert out.numel() == 0
        for grad, t in zip(grads, tensors, strict=True):
            assert grad.shape == t.shape and not grad.any()

    @pytest.mark.parametrize("kind", ["not-a-tensor", "integer", "other-device", "bad-type",
                                      "huge-number"])  # fmt: skip
    def test_bad_argument_types(self, cakeops_backend, cakeops_device, kind):
        """Generic bad inputs from the argument schema: each raises naming the argument."""
        _, _, _, inputs = example(self.spec, cakeops_device)
        for name, bad, error in _bad_arguments(self.spec, inputs, kind):
            args = tuple(bad if k == name else v for k, v in inputs.items())
            assert_bad_input_raises(self.op, lambda a=args: self.spec.positional(*a), error, name)


def _bad_arguments(spec: OpSpec, inputs, kind: str) -> list[tuple[str, Any, type]]:
    tensors = inputs.tensors
    if kind == "not-a-tensor":
        return [(name, t.tolist(), TypeError) for name, t in tensors.items()]
    if kind == "integer":
        first = spec.tensor_names[0]
        return [(first, tensors[first].long(), TypeError)]
    if kind == "other-device":
        return [(name, t.to("meta"), ValueError) for name, t in list(tensors.items())[1:]]
    if kind == "huge-number":  # a Python int past the float range (it was an OverflowError)
        return [(name, 10**400, ValueError) for name, k, _, _ in spec.arguments
                if k.removesuffix("?") == "float"]  # fmt: skip
    # a string where a number or a flag goes, a number where a string goes
    return [
        (name, 0 if k.removesuffix("?") == "str" else "0", TypeError)
        for name, k, _, _ in spec.arguments
        if k != "Tensor"
    ]


class FinalStateContract(Contract):
    """What an op with a final state promises besides."""

    def test_final_state_without_gradient(self, cakeops_backend, cakeops_device):
        """A final state asked for that the loss leaves out: the gradients are those of a zero
        gradient for it given explicitly (the kernel's backward gets an empty ``g_final``, the
        kernel contract's "no gradient", instead of a state of zeros)."""
        _, _, _, inputs = example(self.spec, cakeops_device)
        asked = self.spec.inputs(**{**inputs, self.spec.second_flag: True})
        tensors, g, op, _ = _as_function(self.spec, asked)
        unused = torch.autograd.grad(op(*tensors)[0], tensors, g)
        out, final = op(*tensors)
        explicit = torch.autograd.grad((out, final), tensors, (g, torch.zeros_like(final)))
        for name, a, b in zip(self.spec.differentiable_given(asked), unused, explicit,
                              strict=True):  # fmt: skip
            assert_matches(a, b, f"d{name}")


for _name, _spec in SPECS.items():
    _cls = f"TestContract_{_name}"
    _base = Contract if _spec.second is None else FinalStateContract
    globals()[_cls] = type(_cls, (_base,), {"op": _name})
