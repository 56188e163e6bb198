"""One module per op, each declaring its ``Inputs``, ``Kernels`` protocol and ``SPEC``
(:mod:`cakeops.opspec` builds the rest). A module added here is an op: nothing else lists them."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from cakeops.opspec import OpSpec
from cakeops.registry import Explanation, explain_inputs

#: Every op's spec by name, in the order the op modules sort.
SPECS: dict[str, OpSpec] = {}
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        _spec = importlib.import_module(f"{__name__}.{_info.name}").SPEC
        SPECS[_spec.name] = _spec


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
