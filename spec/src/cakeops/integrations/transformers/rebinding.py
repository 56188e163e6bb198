"""How a layer's forward comes to call cakeops where its code calls a hub kernel.

transformers' layers call the hub kernels (``chunk_gated_delta_rule``, ``causal_conv1d_fn``,
...) as globals of their model module, wrapped by ``use_kernel_func_from_hub_with_fallback``.
:func:`served_names` finds those globals in ``cls.forward`` (and the functions it wraps) by the
kernel name in the wrapper's closure. :func:`kernels_class` then builds a subclass whose
``forward`` is the same code object over a copy of the module's globals in which those names
are cakeops' adapters (:mod:`.hub_kernels`): nothing in transformers is modified, other models
of the family keep its functions, and the copy is registered as a module
(``cakeops._served.<model module>``) because ``torch.compile`` guards a function's globals
through its module's name. Whole forwards (the gated norms, MiniMax's attention) are swapped by
:func:`patched_class`. Patched modules pickle as their model class and are rebuilt on load."""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch

from cakeops.integrations.transformers.hub_kernels import (
    DECLINED_CALLS,
    SERVED_KERNELS,
    decline,
    hub_name,
)
from cakeops.integrations.transformers.linear_attention import LINEAR_ATTENTIONS
from cakeops.integrations.transformers.norms import GATED_NORMS

#: every module class apply_cakeops swaps, by name
PATCHED = {**GATED_NORMS, **LINEAR_ATTENTIONS}
_patched: dict[type, type] = {}


def _layers(fn: Any) -> list[Any]:
    """``fn`` and the functions it wraps (``functools.wraps`` chains: transformers wraps some
    forwards in hooks)."""
    chain = []
    while callable(fn) and hasattr(fn, "__code__") and fn not in chain:
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return chain


def served_names(cls: type, kernels=tuple(SERVED_KERNELS)) -> dict[str, str]:
    """The globals ``cls.forward`` (or a function it wraps) calls that are transformers' hub
    kernels among ``kernels`` (by default every one cakeops serves): name -> kernel name."""
    names = {}
    for fn in _layers(cls.__dict__.get("forward")):
        scope = fn.__globals__
        for n in fn.__code__.co_names:
            kernel = hub_name(scope.get(n))
            if kernel in kernels:
                names[n] = kernel
    if "mamba_chunk_scan_combined" not in names.values():  # Mamba1's state update: not served
        names = {n: k for n, k in names.items() if k != "selective_state_update"}
    return names


def _originals(cls: type) -> dict[str, Any]:
    """The functions the names of :func:`served_names` are bound to in ``cls.forward``'s
    module (what an adapter falls back to)."""
    found = {}
    for fn in _layers(cls.__dict__.get("forward")):
        found.update({n: fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__})
    return found


def _served_module(scope: dict[str, Any], served: dict[str, Any]) -> types.ModuleType:
    """A module copying the model module whose globals are ``scope``, with the ``served`` names
    from cakeops, importable as ``cakeops._served.<model module>``: torch.compile guards a
    function's globals through the module they belong to, by name."""
    name = f"cakeops._served.{scope['__name__']}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__dict__.update(scope)
        module.__dict__.update(served, __name__=name)
        sys.modules[name] = module
    return module


def _rebound(fn: Any, served: dict[str, Any]) -> Any:
    """A copy of ``fn`` reading the ``served`` names from cakeops: the same code over a copy of
    its globals (and the function it wraps, held in its closure, rebound the same way)."""
    cells = fn.__closure__
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None and cells:
        new_inner = _rebound(inner, served)

        def swap(cell):
            try:
                return types.CellType(new_inner) if cell.cell_contents is inner else cell
            except ValueError:  # an empty cell
                return cell

        cells = tuple(swap(c) for c in cells)
    scope = fn.__globals__
    if any(n in fn.__code__.co_names for n in served):
        scope = _served_module(scope, served).__dict__
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.wraps(fn)(copy) if inner is None else functools.update_wrapper(
        copy, fn, updated=())  # fmt: skip


def kernels_class(cls: type) -> type:
    """``cls`` with its forward reading the hub kernels cakeops serves (the delta rules, the
    convolutions) from cakeops (other models of the family keep transformers' functions)."""
    if cls not in _patched:
        originals = _originals(cls)
        served = {}
        declined = DECLINED_CALLS.get(cls.__name__, {})
        for name, kernel in served_names(cls).items():
            adapter = decline if kernel in declined else SERVED_KERNELS[kernel]
            if getattr(adapter, "wants_original", False):
                adapter = functools.partial(adapter, originals[name])
            served[name] = adapter
        forward = _rebound(cls.__dict__["forward"], served)
        body = {"forward": forward, "__reduce_ex__": _reduce_ex, "__cakeops_original__": cls}
        _patched[cls] = type(f"Cakeops{cls.__name__}", (cls,), body)
    return _patched[cls]


def _new_patched(cls: type) -> torch.nn.Module:
    """Unpickling: an empty instance of ``cls``'s patched class (its state comes after)."""
    patched = patched_class(cls) if cls.__name__ in PATCHED else kernels_class(cls)
    return object.__new__(patched)


def _reduce_ex(self: torch.nn.Module, protocol: int):
    """Pickle a patched module by its model class, which is importable (the patched class is
    built at run time and is not): unpickling, in any process, rebuilds the patched class."""
    reduced = object.__reduce_ex__(self, max(protocol, 2))
    return (_new_patched, (type(self).__cakeops_original__,), *reduced[2:])


def patched_class(cls: type) -> type:
    if cls not in _patched:
        body = {"forward": PATCHED[cls.__name__], "__reduce_ex__": _reduce_ex,
                "__cakeops_original__": cls}  # fmt: skip
        _patched[cls] = type(f"Cakeops{cls.__name__}", (cls,), body)
    return _patched[cls]


def swap_class(module: torch.nn.Module) -> None:
    """Give ``module`` its patched class where cakeops serves its forward or a kernel it calls
    (a module already patched, or of no such class, is left as it is)."""
    cls = type(module)
    if cls.__name__ in PATCHED:
        module.__class__ = patched_class(cls)
    elif cls not in _patched.values() and served_names(cls):
        module.__class__ = kernels_class(cls)
