"""The checks every op with a state along its sequence shares (``initial_state``,
``output_final_state``, packed ``cu_seqlens``: ``causal_conv1d`` and ``gated_delta_rule``): packed
sequences equal separate calls, a prefill continued from its final state equals the whole, and
PyTorch's default dtype reaches no kernel. An op's test class subclasses
:class:`StatefulOpChecks` and says how to make and run its inputs."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch

import cakeops
from cakeops.testing import assert_default_dtype_changes_nothing, assert_matches


class StatefulOpChecks:
    """Mixed into an op's ``Test...`` class, which sets:

    - ``op``: the op's name (the plugin parametrises by it);
    - ``make_inputs(given, dtype, device, L=...)`` and ``run(tensors, fixed, g_out, g_final)``,
      as static methods: ``(tensors by name, fixed options, g_out, g_final)`` for a set of
      options, and ``(out, final_state, *gradients in the tensors' order)`` of them;
    - ``L`` and ``CU_SEQLENS``: the checks' length and packed offsets;
    - ``ALONG``: the tensors along the positions (their dim 2); the others are shared by the
      sequences, and their gradients (sums over the sequences) are not compared per sequence;
    - ``PACKED``, ``CONTINUED``, ``EVERY_OPTION``: the options of the three checks (``PACKED``
      and ``EVERY_OPTION`` with ``"packed"``, ``CONTINUED`` with ``"final"`` and without an
      initial state)."""

    op: ClassVar[str]
    make_inputs: ClassVar[Any]
    run: ClassVar[Any]
    L: ClassVar[int]
    CU_SEQLENS: ClassVar[list[int]]
    ALONG: ClassVar[tuple[str, ...]]
    PACKED: ClassVar[tuple[str, ...]]
    CONTINUED: ClassVar[tuple[str, ...]]
    EVERY_OPTION: ClassVar[tuple[str, ...]]

    def _part(self, name: str, t: torch.Tensor, i: int, s: int, e: int) -> torch.Tensor:
        """Sequence ``i``'s part of input ``name`` (positions ``s:e``)."""
        if name == "initial_state":
            return t[i : i + 1]
        return t[:, :, s:e] if name in self.ALONG else t

    def test_packed_sequences_equal_separate_calls(self, cakeops_backend, dtype, cakeops_device):
        """A packed batch (empty sequences, and sequences shorter than a state or a chunk,
        included) gives, per sequence, the output, final state and gradients of that sequence
        run alone."""
        tensors, fixed, g_out, g_final = self.make_inputs(self.PACKED, dtype, cakeops_device)
        packed = self.run(tensors, fixed, g_out, g_final)
        options = {n: v for n, v in fixed.items() if n != "cu_seqlens"}
        for i, (s, e) in enumerate(itertools.pairwise(self.CU_SEQLENS)):
            alone = {n: self._part(n, t.detach(), i, s, e).requires_grad_()
                     for n, t in tensors.items()}  # fmt: skip
            got = self.run(alone, options, g_out[:, :, s:e], g_final[i : i + 1])
            assert_matches(packed[0][:, :, s:e], got[0], "out", dtype)
            assert_matches(packed[1][i : i + 1], got[1], "final_state", packed[1].dtype)
            for j, name in enumerate(tensors):
                if name in self.ALONG or name == "initial_state":
                    part = self._part(name, packed[2 + j], i, s, e)
                    assert_matches(part, got[2 + j], f"d{name}", dtype)

    @pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
    def test_default_dtype_changes_nothing(self, cakeops_backend, cakeops_device, decode):
        """Every option, a prefill and a decode step: PyTorch's default dtype (bfloat16 in many
        inference scripts) reaches no kernel."""
        given = tuple(g for g in self.EVERY_OPTION if not (decode and g == "packed"))
        inputs = self.make_inputs(given, device=cakeops_device, L=1 if decode else self.L)
        assert_default_dtype_changes_nothing(lambda: self.run(*inputs))

    def test_prefill_then_continuation_equals_the_whole(
        self, cakeops_backend, dtype, cakeops_device
    ):
        """Prefill, then continuing from its final state (one step at a time, then a block)
        gives the whole sequence's outputs, final state and gradients (decoding's path)."""
        tensors, fixed, g_out, g_final = self.make_inputs(self.CONTINUED, dtype, cakeops_device)
        whole = self.run(tensors, fixed, g_out, g_final)
        leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
        options = {n: v for n, v in fixed.items() if n != "output_final_state"}
        cut = 2 * self.L // 3
        parts = ((0, cut), (cut, cut + 1), (cut + 1, cut + 2), (cut + 2, self.L))
        state, outs = None, []
        for s, e in parts:
            piece = {n: t[:, :, s:e] if n in self.ALONG else t for n, t in leaves.items()}
            out, state = getattr(cakeops, self.op)(**piece, **options, initial_state=state,
                                                   output_final_state=True)  # fmt: skip
            outs.append(out)
        out = torch.cat(outs, 2)
        loss = (out.double() * g_out.double()).sum() + (state.double() * g_final).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        assert_matches(out, whole[0].double(), "out", dtype)
        assert_matches(state, whole[1].double(), "final_state", state.dtype)
        for name, a, b in zip(leaves, grads, whole[2:], strict=True):
            assert_matches(a, b.double(), f"d{name}", dtype)
