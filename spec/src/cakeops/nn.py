"""``torch.nn`` modules around the ops."""

from __future__ import annotations

from typing import Any

import torch

from cakeops.ops.moe_experts import SPEC as SPEC_MOE
from cakeops.ops.moe_experts import moe_experts
from cakeops.ops.rmsnorm_silu_gate import SPEC as SPEC_NORM
from cakeops.ops.rmsnorm_silu_gate import rmsnorm_silu_gate


def _options(module: torch.nn.Module, *names: str) -> dict[str, Any]:
    return {name: getattr(module, name) for name in names}


def _described(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items())


def _check_sizes(module: str, **sizes: Any) -> None:
    """Each size an int >= 0, checked before a tensor is made (torch's own error names none)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{module}: argument '{name}' expected an int, got "
                            f"{type(value).__name__} {value!r}")  # fmt: skip
        if value < 0:
            raise ValueError(f"{module}: argument '{name}' expected an int >= 0, got {value}")


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


class RMSNormSiLUGate(torch.nn.Module):
    """Gated RMSNorm: ``forward(x, z) = rmsnorm_silu_gate(x, z, self.weight, ...)``.

    Drop-in for the gated norms of Qwen3-Next (``norm_before_gate=True``) and Mamba2
    (``norm_before_gate=False``, usually with ``group_size``).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_sizes("RMSNormSiLUGate", hidden_size=hidden_size)
        # the op's own checks of the options, on meta tensors of this size: an error now, not
        # at the first forward
        D, like = hidden_size, {"dtype": dtype or torch.get_default_dtype()}
        SPEC_NORM.bind(_meta(0, D, **like), _meta(0, D, **like), _meta(D, **like), eps,
                       group_size=group_size, norm_before_gate=norm_before_gate)  # fmt: skip
        self.hidden_size = hidden_size
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight`` to ones (also after meta-device construction and ``to_empty()``)."""
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        options = _options(self, "group_size", "norm_before_gate")
        return rmsnorm_silu_gate(x, z, self.weight, self.eps, **options)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, " + _described(
            _options(self, "eps", "group_size", "norm_before_gate")
        )


class MoEExperts(torch.nn.Module):
    """The routed SwiGLU experts of an MoE layer: ``forward(x, router_logits) -> (T, D)``.

    Holds ``w_gate``, ``w_up`` ``(E, F, D)`` and ``w_down`` ``(E, D, F)`` (float32 by default:
    with 16-bit ``x`` they act as master weights, cast on the fly). The router itself (a linear
    layer producing ``router_logits``) stays with the model. Mixtral: ``renormalize=True``;
    Qwen2/3-MoE: ``renormalize=norm_topk_prob``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        renormalize: bool = True,
        scale: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        E, D, F = num_experts, hidden_size, intermediate_size
        _check_sizes("MoEExperts", num_experts=E, hidden_size=D, intermediate_size=F)
        like = {"dtype": dtype or torch.float32}
        SPEC_MOE.bind(*(_meta(*shape, **like) for shape in ((0, D), (0, E), (E, F, D), (E, F, D),
                                                             (E, D, F))),
                      top_k=top_k, renormalize=renormalize, scale=scale)  # fmt: skip
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size, self.top_k = intermediate_size, top_k
        self.renormalize, self.scale = renormalize, scale
        kw = {"device": device, "dtype": dtype or torch.float32}
        self.w_gate = torch.nn.Parameter(torch.empty(E, F, D, **kw))
        self.w_up = torch.nn.Parameter(torch.empty(E, F, D, **kw))
        self.w_down = torch.nn.Parameter(torch.empty(E, D, F, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation, expert by expert."""
        for w in (self.w_gate, self.w_up, self.w_down):
            bound = max(1, w.shape[-1]) ** -0.5
            torch.nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights = (self.w_gate, self.w_up, self.w_down)
        options = _options(self, "top_k", "renormalize", "scale")
        return moe_experts(x, router_logits, *weights, **options)

    def extra_repr(self) -> str:
        sizes = ("num_experts", "hidden_size", "intermediate_size")
        return _described(_options(self, *sizes, "top_k", "renormalize", "scale"))
