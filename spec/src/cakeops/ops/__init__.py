"""One module per op: validation, saved-tensor contract, custom-op and autograd glue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cakeops.ops import causal_dot_product, moe_experts, rmsnorm_silu_gate
from cakeops.registry import Explanation, explain_inputs

#: Spec module of each op, by op name.
SPECS = {
    "rmsnorm_silu_gate": rmsnorm_silu_gate,
    "causal_dot_product": causal_dot_product,
    "moe_experts": moe_experts,
}


def explain(op: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Explanation:
    """Explain the backend choice for ``op(*args, **kwargs)`` without running it.

    ``op`` is an op name or the public function (``cakeops.rmsnorm_silu_gate``). The arguments are
    validated exactly as the call would validate them.
    """
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"explain: op must be one of {', '.join(SPECS)}, got {op!r}")
    return explain_inputs(name, spec.bind(*args, **kwargs))
