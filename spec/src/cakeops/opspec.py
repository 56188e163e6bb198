"""An op declared once: its arguments as a frozen :class:`OpInputs` dataclass, its rules as an
:class:`OpSpec`; everything else is built here from the two.

From the declaration this module builds, for every op alike: the custom op ``cakeops::<op>`` and
its fake, the backward op ``cakeops::<op>_backward`` and its fake, ``setup_context`` and the
backward, the ``torch.autograd.Function`` the public function calls under ``torch.func``
transforms (elsewhere it calls the custom op, whose autograd is the same), argument type checks
from the annotations, ``bind`` (what :func:`cakeops.explain` and the CLI validate with), the
backend choice per call and the checks on what a backend returns. An op with many options
(``OpSpec.leading``) also gets ``cakeops::<op>_defaults``, its leading arguments alone, which a
call with the options at their defaults takes (the dispatcher's cost grows with the arguments).

The contract every op shares:

- arguments are checked once, here, before any backend runs (types from the annotations, then
  the op's own ``check``);
- the op saves exactly its tensor inputs and recomputes everything else;
- the backward returns one gradient per tensor input, shaped like it, in its dtype (none for a
  tensor marked ``NO_GRAD``, such as integer ids);
- inputs with nothing to compute (``no_work``) give a zero output and zero gradients without
  asking a backend;
- kernels run with autocast off, in their inputs' dtypes; the backward runs on the backend that
  ran the forward; forward-mode AD is refused.

Kernel signature every backend implements for an op (arguments validated and in declaration
order; see each op's ``Kernels`` protocol)::

    forward(*inputs) -> output
    backward(grad_output, *inputs) -> one gradient per tensor input

Kernels read their arguments and never write into them (an op's empty "no gradient" for a final
state is one tensor, shared by the calls of a signature).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import threading
import types
import typing
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from cakeops import _spec
from cakeops.registry import Backend, forcing, select, selection_token

Shape = tuple[int, ...]


#: ``dataclasses.field(metadata=NO_GRAD)`` marks a tensor argument without a gradient (integer
#: ids): it is saved like the others, and the backward returns nothing for it.
NO_GRAD = {"grad": False}


ForwardT = TypeVar("ForwardT", covariant=True)
BackwardT = TypeVar("BackwardT", covariant=True)


class Kernels(Protocol[ForwardT, BackwardT]):
    """What a backend's kernel module for an op defines; each op parametrises it with its
    ``forward`` and ``backward`` signatures (``cakeops.ops.<op>.Kernels``), which a type checker
    verifies a module against (``_: cakeops.ops.<op>.Kernels = my_backend.<op>``)."""

    @property
    def forward(self) -> ForwardT: ...

    @property
    def backward(self) -> BackwardT: ...


class OpInputs(Mapping[str, Any]):
    """Base of each op's frozen ``Inputs`` dataclass: the validated arguments of one call, by
    name, in declaration order. Backends are asked about these (``not_supported_reasons``); they
    read like a mapping too (``inputs["x"]``), as the interface before them did."""

    op: ClassVar[str] = ""

    def __getitem__(self, name: str) -> Any:
        if name not in self._name_set():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def values(self) -> tuple[Any, ...]:  # type: ignore[override]
        """The arguments in declaration order (a tuple: read several times a call, so made
        once)."""
        return self._values

    @functools.cached_property
    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._names())

    @classmethod
    @functools.cache
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    @functools.cache
    def _name_set(cls) -> frozenset[str]:
        return frozenset(cls._names())

    @functools.cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor arguments by name (an optional tensor not given is left out)."""
        values = ((name, getattr(self, name)) for name in self._names())
        return {k: v for k, v in values if isinstance(v, torch.Tensor)}

    @property
    def selecting(self) -> torch.Tensor:
        """The first tensor argument: its device and dtype drive the backend choice."""
        return next(iter(self.tensors.values()))

    @property
    def device_type(self) -> str:
        return self.selecting.device.type

    @property
    def dtype(self) -> torch.dtype:
        return self.selecting.dtype


# --------------------------------------------------------------------------------------------
# Argument kinds, from the annotations


_KINDS = {torch.Tensor: "Tensor", float: "float", int: "int", bool: "bool", str: "str"}


def _kind(annotation: Any) -> str:
    """``Tensor``, ``float``, ``int``, ``bool``, ``str``, or one of ``Tensor?``, ``float?``,
    ``int?``, ``str?`` (the type or None): the custom-op schema type of an argument."""
    if annotation in _KINDS:
        return _KINDS[annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = set(typing.get_args(annotation)) - {type(None)}
        if len(args) == 1 and (base := args.pop()) in (torch.Tensor, float, int, str):
            return f"{_KINDS[base]}?"
    raise TypeError(f"unsupported argument annotation {annotation!r}")


def is_tensor_kind(kind: str) -> bool:
    """Whether an argument of this kind is a tensor (maybe an optional one)."""
    return kind in ("Tensor", "Tensor?")


def _checked_value(op: str, name: str, kind: str, value: Any) -> Any:
    """``value`` after the type check of its kind (numbers of kind ``float`` become floats)."""
    optional = kind.endswith("?")
    if optional and value is None:
        return None
    kind = kind.removesuffix("?")
    try:
        return _checked_present(op, name, kind, value)
    except TypeError as exc:
        if not optional:
            raise
        raise TypeError(str(exc).replace(", got", " or None, got", 1)) from None


def _checked_present(op: str, name: str, kind: str, value: Any) -> Any:
    if kind == "Tensor":
        _spec.check_tensor(op, name, value)
        return value
    if kind == "float":
        return _spec.check_number(op, name, value)
    if kind in ("bool", "str"):
        if not isinstance(value, bool if kind == "bool" else str):
            raise TypeError(
                f"{op}: argument '{name}' expected a {kind}, got {_spec.describe(value)}"
            )
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"{op}: argument '{name}' expected an int, got {_spec.describe(value)}")


# --------------------------------------------------------------------------------------------
# The backend of each call


#: Ops with at most this many arguments go through their custom op's own autograd outside
#: ``torch.func``; ops with more through the ``autograd.Function`` (torch's setup of the custom
#: op's autograd reads the schema's arguments in a loop that is quadratic in their number; the
#: Function is the cheaper for ``routed_experts``'s 13 arguments: the benchmarks page,
#: *Constants set by measurement*).
CUSTOM_OP_AUTOGRAD_UP_TO = 8

#: Marks a saved tensor's place among an autograd context's parameters.
_SAVED = "<saved tensor>"

# op -> the backend that ran this thread's latest forward of it (read by setup_context, which
# runs right after the forward, on the same thread)
_forward_choice = threading.local()


_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


#: the devices whose autocast ``torch._C._is_any_autocast_enabled`` sees (not MPS: measured)
_SEEN_BY_ANY = frozenset({"cpu", "cuda", "xpu"})
#: whether autocast is on for a device of :data:`_SEEN_BY_ANY` (or another), one C call where
#: asking a device costs half a microsecond (a PyTorch without it: assume so)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def _autocast_on(device: str) -> bool:
    """Whether autocast is on for ``device`` (a PyTorch that cannot say per device: assume so,
    and turn it off)."""
    try:
        return torch.is_autocast_enabled(device)
    except (TypeError, RuntimeError):
        return True


#: ``(selection token, backend, its kernel module for the op)``: a signature's backend as chosen
#: under that selection state, one tuple (a thread reads the three as one thread wrote them;
#: another thread's selection replaces the whole)
_Choice = tuple[tuple[Any, ...], Backend, Any]


class _Plan:
    """What one signature of an op decided (see ``OpSpec._lean``): the non-tensor arguments
    ``check`` resolved to other values (``(position, value)`` pairs), whether there is work, the
    outputs' ``(shape, dtype, device)``, the tensors' device types (and those autocast knows),
    and the latest :data:`_Choice` of a backend; for
    :class:`_LeanFunction`, the tensors' positions and the arguments a backward rebuilds its
    values from (:data:`_SAVED` in a tensor's place)."""

    __slots__ = ("autocast", "autocast_seen", "choice", "devices", "grads_like", "no_gradient",
                 "no_work", "out", "params", "resolutions", "second", "tensors_at")  # fmt: skip

    def __init__(self, values, given, no_work, out, second, devices):
        tensor = [isinstance(v, torch.Tensor) for v in values]
        changed = zip(values, given, tensor, strict=True)
        self.resolutions = tuple(
            (i, v) for i, (v, g, t) in enumerate(changed) if v is not g and not t
        )
        self.params = tuple(_SAVED if t else v for v, t in zip(values, tensor, strict=True))
        self.tensors_at = tuple(i for i, t in enumerate(tensor) if t)
        #: what each differentiable input's gradient is checked against (:func:`_grad_like`;
        #: None: not given), set by the first backward (:meth:`OpSpec._run_backward`)
        self.grads_like: tuple[Any, ...] | None = None
        self.no_work, self.out, self.second = no_work, out, second
        #: the second output's upstream gradient when none reached it (the kernel contract's
        #: "no gradient": an empty tensor, shared by the signature's calls; made by the first)
        self.no_gradient: torch.Tensor | None = None
        self.devices = devices
        #: those of the devices autocast knows (each asked per call whether it is on, unless
        #: :data:`_any_autocast` sees them all and says it is off)
        self.autocast = tuple(sorted(devices & _AUTOCAST_DEVICES))
        self.autocast_seen = _SEEN_BY_ANY.issuperset(self.autocast)
        #: the latest backend chosen (None: none yet, or nothing to compute)
        self.choice: _Choice | None = None


def _resolved(values: tuple[Any, ...], resolutions: tuple[tuple[int, Any], ...]) -> tuple[Any, ...]:
    """``values`` with a plan's resolutions in their places."""
    resolved = list(values)
    for i, value in resolutions:
        resolved[i] = value
    return tuple(resolved)


def _autocasting(plan: _Plan) -> bool:
    """Whether autocast is on for one of a plan's devices."""
    autocast = plan.autocast
    if not autocast or (plan.autocast_seen and not _any_autocast()):
        return False
    return any(map(_autocast_on, autocast))


def _run_kernel(
    backend: Backend, op: str, kind: str, *args: Any, devices: frozenset[str] | None = None
) -> Any:
    """``backend``'s ``forward`` or ``backward`` kernel with autocast off: the kernels compute in
    their inputs' dtypes whatever autocast region surrounds the op (the ops have no autocast
    rule, like a custom op: cast the inputs to run them in 16-bit), forward and backward alike."""
    kernel = getattr(backend.kernels(op), kind)
    if devices is None:
        devices = frozenset(a.device.type for a in args if isinstance(a, torch.Tensor))
    autocasting = [d for d in devices & _AUTOCAST_DEVICES if _autocast_on(d)]
    if not autocasting:  # the common case: no context to enter (a few microseconds each)
        return kernel(*args)
    with contextlib.ExitStack() as stack:
        for device in autocasting:
            stack.enter_context(torch.autocast(device, enabled=False))
        return kernel(*args)


def _checked(
    op: str,
    backend: Backend,
    name: str,
    got: Any,
    like: tuple[Shape, torch.dtype, torch.device],
    contiguous: bool = True,
) -> torch.Tensor:
    """``got`` (made contiguous unless told not to), after checking it has the shape, dtype and
    device in ``like``."""
    shape, dtype, device = like
    if (
        not isinstance(got, torch.Tensor)
        or got.shape != shape
        or got.dtype != dtype
        or got.device != device
    ):
        raise RuntimeError(
            f"{op}: backend {backend.name!r} returned {name} as {_spec.describe(got)}, expected "
            f"{_spec.dtype_name(dtype)} of shape {tuple(shape)} on {device}"
        )
    return got.contiguous() if contiguous else got


def _may_differentiate_backward() -> bool:
    """Whether a backward being run could itself be differentiated (``create_graph=True``, a
    ``torch.func`` transform): only then does it need the Function that refuses second
    derivatives, a quarter of a small backward's time."""
    return _grad_enabled() or _functorch_active()


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: the argument types a lean call takes (anything else: the full path, whose checks name it)
_PLAIN_VALUES = frozenset({*_PLAIN_TENSORS, type(None), bool, int, float, str})
#: what :meth:`OpSpec._lean` returns for a call it does not take
_NOT_LEAN = object()
#: signatures remembered per op (then forgotten all at once: a bound, not an eviction policy)
_PLANS = 512


# Bound once for :meth:`OpSpec._quick`: a decode step's call runs between a model's projections,
# with caches cold, where each module attribute chain (``torch._C.x``) costs microseconds.
_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_function_mode_on = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_tracing = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_forward_ad = torch.autograd.forward_ad
_Tensor, _Parameter = _PLAIN_TENSORS
_new_tuple = tuple.__new__
_SCALARS = _PLAIN_VALUES - set(_PLAIN_TENSORS)


def _signature(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """What ``check`` depends on besides tensor values: each tensor's dtype, device, shape and
    strides, every other argument's type and value."""
    return tuple(
        (v.dtype, v.device, v.shape, v.stride()) if isinstance(v, torch.Tensor) else (type(v), v)
        for v in values
    )


def _forward_ad_active() -> bool:
    """Whether a forward-AD level is open (a tensor may then carry a tangent)."""
    return torch.autograd.forward_ad._current_level >= 0


def _direct(tensors: Collection[torch.Tensor]) -> bool:
    """Whether an eager call may skip the custom op: no gradient to record (grad mode off or no
    input requiring one) and a plain context (:func:`_plain`)."""
    return not _records_grad(tensors) and _plain(tensors)


def _records_grad(tensors: Collection[torch.Tensor]) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode on and one requires a grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _plain(tensors: Collection[torch.Tensor]) -> bool:
    """Plain tensors only (a subclass dispatches through the op), and no torch function mode,
    dispatch mode or tracer that expects to see the op as one node."""
    if any(type(t) not in _PLAIN_TENSORS for t in tensors):
        return False
    return not (
        torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._get_tracing_state()
    )


def _with_signature(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its signature computed once: ``Function.apply`` asks for it on every call."""
    fn.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    return fn


def _returns(n: int) -> str:
    """The backward op's return schema: ``n`` gradients."""
    return "Tensor" if n == 1 else f"({', '.join(['Tensor'] * n)})"


class _Ops(typing.NamedTuple):
    """An op's forward and backward custom ops over some of its arguments (``names``: all of
    them, or the leading ones of the short op), and the Function around the backward."""

    names: tuple[str, ...]
    forward: Any
    backward: Any
    backward_function: type


def _at_default(value: Any, default: Any) -> bool:
    """Whether an argument is its default (the same object, or an equal one of the same type:
    ``1.0`` passed for a default ``1.0``)."""
    if value is default:
        return True
    if default is None or default is dataclasses.MISSING or isinstance(value, torch.Tensor):
        return False
    return type(value) is type(default) and value == default


def _first(grads: Any, n: int) -> Any:
    """The first ``n`` of the backward op's gradients (a lone one as itself)."""
    grads = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
    return _unwrapped(grads[:n])


def _absent(like: torch.Tensor) -> torch.Tensor:
    """The backward op's gradient for an optional tensor input that was not given (its schema
    returns tensors only): an empty tensor, turned into ``None`` by the autograd glue."""
    return torch.empty(0, dtype=like.dtype, device=like.device)


def _like(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out as ``torch.empty_like(t)`` (the backward's fake kernel): a backend
    may return any strides, but a compiled graph relies on the fake's (a copy only when they
    differ)."""
    got = grad.stride()
    if got == t.stride() or (grad.is_contiguous() and t.is_contiguous()):
        return grad
    if got == _empty_like_stride(t):
        return grad
    return torch.empty_like(t).copy_(grad)


def _grad_like(t: torch.Tensor) -> tuple[tuple[Any, ...], frozenset[tuple[int, ...]], bool]:
    """What :meth:`OpSpec._run_backward` checks a gradient of ``t`` against, once per
    signature: ``t``'s ``(shape, dtype, device)``, the strides :func:`_like` keeps as they are
    (``t``'s, ``torch.empty_like(t)``'s) and whether any contiguous strides do (``t`` is
    contiguous)."""
    kept = frozenset({t.stride(), _empty_like_stride(t)})
    return (t.shape, t.dtype, t.device), kept, t.is_contiguous()


def _saved_values(ctx: Any) -> tuple[Any, ...]:
    """A backward's argument values: the saved tensors in :data:`_SAVED`'s places of
    ``ctx.params`` (the custom op's context and :class:`_LeanFunction`'s alike)."""
    saved = iter(ctx.saved_tensors)
    return tuple([next(saved) if p is _SAVED else p for p in ctx.params])


def _empty_like_stride(t: torch.Tensor) -> tuple[int, ...]:
    """The strides ``torch.empty_like(t)`` gives (no memory: a meta tensor)."""
    return torch.empty_like(t, device="meta").stride()


def _unwrapped(grads: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The backward op's result: a lone gradient as itself (its schema returns a Tensor)."""
    return grads[0] if len(grads) == 1 else grads


# --------------------------------------------------------------------------------------------
# The spec


@dataclasses.dataclass(frozen=True, eq=False)
class OpSpec:
    """What the spec owns about one op, besides its arguments (the ``inputs`` dataclass).

    - ``check(inputs) -> inputs``: the op's own validation, after the type checks; raises
      ``ValueError``/``TypeError`` naming the op and the argument; returns the inputs with
      defaults resolved (``dataclasses.replace``), which is what backends get.
    - ``example(device, dtype) -> inputs``: small valid inputs (``cakeops info``, smoke tests).
    - ``output(inputs) -> (shape, dtype)``: the output's (on the inputs' device); by default
      those of the first tensor argument.
    - ``no_work(inputs)``: nothing to compute, the output and the gradients are zeros; by
      default when the first tensor argument is empty.
    - ``dtypes``: the dtypes of the selecting (first) tensor the spec accepts.
    """

    inputs: type[OpInputs]
    check: Callable[[Any], Any]
    example: Callable[..., Any]
    output: Callable[[Any], tuple[Shape, torch.dtype]] = lambda a: (a.selecting.shape, a.dtype)
    no_work: Callable[[Any], bool] = lambda a: a.selecting.numel() == 0
    dtypes: tuple[torch.dtype, ...] = _spec.FLOAT_DTYPES
    #: When > 0, the op also exists with its first ``leading`` arguments alone, the others at
    #: their defaults (``cakeops::<op>_defaults``): a call that leaves them at their defaults
    #: takes it. The dispatcher boxes every argument of a custom op on every call, so a short
    #: schema keeps the common call as cheap as it was before the options came.
    leading: int = 0
    #: An op with a second output (a final state): ``second(inputs) -> (shape, dtype)`` when the
    #: call asks for it, else None (the kernels then return an empty placeholder, so the schema
    #: is always two tensors); ``second_flag`` names the bool argument that asks for it, and
    #: ``second_no_work(inputs)`` gives it when there is nothing to compute.
    second: Callable[[Any], tuple[Shape, torch.dtype] | None] | None = None
    second_flag: str = ""
    second_no_work: Callable[[Any], torch.Tensor] | None = None
    #: The part of ``check`` that reads tensor values (log gates ``<= 0``, sorted offsets, ids
    #: in range): ``check_data(arguments)``, run on every call, reading the arguments as
    #: attributes only (it gets the inputs, or on a known signature's call a named tuple of the
    #: values, cheaper to build); the rest of ``check`` depends only on the signature (types,
    #: shapes, strides, dtypes, devices, the other arguments' values), and an eager call whose
    #: signature passed it before does not run it again.
    check_data: Callable[[Any], None] | None = None
    #: Whether backends get the upstream gradients contiguous (a copy when they are not); an op
    #: whose kernels take any strides says False (a transposed view's gradient is one too).
    contiguous_grads: bool = True
    #: The input whose layout the output takes (``torch.empty_like`` of it: a transposed view
    #: gives a transposed output, saving the models a copy each way), or "" for contiguous.
    output_layout_of: str = ""
    #: name, kind, default (``dataclasses.MISSING`` when required), keyword-only
    arguments: tuple[tuple[str, str, Any, bool], ...] = dataclasses.field(init=False)
    #: every argument, in declaration order
    names: tuple[str, ...] = dataclasses.field(init=False)
    #: the tensor arguments: saved for the backward (the saved-tensor contract), one gradient each
    tensor_names: tuple[str, ...] = dataclasses.field(init=False)
    #: the tensor arguments that get a gradient (all but those marked ``NO_GRAD``)
    differentiable: tuple[str, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(self.inputs)
        fields = dataclasses.fields(self.inputs)  # type: ignore[arg-type]
        arguments = tuple(
            (f.name, _kind(hints[f.name]), f.default, bool(f.kw_only)) for f in fields
        )
        tensors = tuple(name for name, kind, _, _ in arguments if is_tensor_kind(kind))
        grads = {f.name: f.metadata.get("grad", True) for f in fields}
        object.__setattr__(self, "arguments", arguments)
        object.__setattr__(self, "names", tuple(name for name, _, _, _ in arguments))
        object.__setattr__(self, "tensor_names", tensors)
        object.__setattr__(self, "differentiable", tuple(n for n in tensors if grads[n]))
        self._build()

    # -- names --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.inputs.op

    def differentiable_given(self, inputs: Mapping[str, Any]) -> tuple[str, ...]:
        """The differentiable tensors a call gives (an optional tensor may be None)."""
        return tuple(n for n in self.differentiable if inputs[n] is not None)

    @property
    def saved(self) -> tuple[str, ...]:
        """The saved-tensor contract: exactly the tensor inputs."""
        return self.tensor_names

    # -- validation -----------------------------------------------------------------------

    def typed(self, values: tuple[Any, ...]) -> OpInputs:
        """The inputs from positional ``values`` (declaration order) after the type checks of
        their annotations (cheap: no shapes)."""
        checked = {
            # an argument at its default is of its type by construction
            name: value
            if _at_default(value, default)
            else _checked_value(self.name, name, kind, value)
            for (name, kind, default, _), value in zip(self.arguments, values, strict=True)
        }
        return self.inputs(**checked)

    def validate(self, values: tuple[Any, ...]) -> OpInputs:
        """Every check, in declaration order: types, then the op's own."""
        return self.check(self.typed(values))

    def bind(self, *args: Any, **kwargs: Any) -> OpInputs:
        """Validate a call's arguments as the public function takes them."""
        try:
            inputs = self.inputs(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from None
        return self.validate(tuple(inputs.values()))

    def output_like(self, inputs: OpInputs) -> torch.Tensor:
        shape, dtype = self.output(inputs)
        if self.output_layout_of:
            return torch.empty_like(inputs[self.output_layout_of], dtype=dtype)
        return torch.empty(shape, dtype=dtype, device=inputs.selecting.device)

    def _laid_out(self, out: torch.Tensor, values: tuple[Any, ...]) -> torch.Tensor:
        """A checked output in the layout :meth:`output_like` gives (a copy only when a backend
        returned another)."""
        if not self.output_layout_of:
            return out.contiguous()
        return _like(out, values[self._layout_index])

    # -- the public call ------------------------------------------------------------------

    def __call__(self, **arguments: Any) -> Any:
        """The public function's body: ``op(**arguments)`` by argument name; with a second
        output, ``(out, second)`` when the call asks for it, else ``out``."""
        result = self._call(arguments)
        if self.second is None:
            return result
        wanted = arguments.get(self.second_flag, False)
        return result if wanted else result[0]

    def call(self, *values: Any) -> Any:
        """The public function's body with every argument passed in declaration order (the
        public functions' own order, defaults filled): :meth:`__call__` without building and
        reading a dict, and a known signature's call in one function (:meth:`_quick`)."""
        result = self._quick(values)
        if result is _NOT_LEAN:
            result = self._call(dict(zip(self.names, values, strict=True)))
        if self.second is None:
            return result
        return result if values[self._second_index] else result[0]

    def _quick(self, values: tuple[Any, ...]) -> Any:
        """What :meth:`_lean` does for a call of a signature whose plan is made and whose
        backend the selection state still gives, written out in one function (a decode step
        pays each Python frame and attribute lookup with caches cold: this halves the op's cold
        fixed cost); :data:`_NOT_LEAN` for any other call, which :meth:`_call` then takes. The
        key is :func:`_signature`'s."""
        if (
            _compiling()
            or _functorch_active()
            or _forward_ad._current_level >= 0
            or _function_mode_on()
            or _dispatch_modes()
            or _tracing()
        ):
            return _NOT_LEAN
        grad, records = _grad_enabled(), False
        key = []
        for v in values:
            kind = type(v)
            if kind is _Tensor or kind is _Parameter:
                records = records or (grad and v.requires_grad)
                key.append((v.dtype, v.device, v.shape, v.stride()))
            elif kind in _SCALARS:
                key.append((kind, v))
            else:
                return _NOT_LEAN
        plan = self._plans.get(tuple(key))
        if plan is None or (choice := plan.choice) is None:  # (none either: nothing to compute)
            return _NOT_LEAN
        if choice[0] != selection_token(self.name):
            return _NOT_LEAN
        if plan.resolutions:
            values = _resolved(values, plan.resolutions)
        if not records:
            if self.check_data is not None:
                self.check_data(_new_tuple(self._named, values))
            return self._lean_forward(plan, choice, values)
        if self.check_data is not None:
            # nothing of the checks in the autograd graph (grad mode is on here: a no_grad()
            # block would cost more than the switch)
            _set_grad_enabled(False)
            try:
                self.check_data(_new_tuple(self._named, values))
            finally:
                _set_grad_enabled(True)
        return _recorded(self, plan, choice, values)

    def _one_node(self, arguments: dict[str, Any]) -> Any:
        """The custom op on ``arguments`` (defaults filled): one node of a graph, with the op's
        registered autograd, which validates its arguments when it runs."""
        return self.forward_op(
            *(arguments.get(name, default) for name, _, default, _ in self.arguments)
        )

    def _call(self, arguments: dict[str, Any]) -> Any:
        if torch.compiler.is_compiling():
            return self._one_node(arguments)  # (Dynamo does not trace the Inputs dataclass)
        if not torch._C._are_functorch_transforms_active():
            result = self._lean(arguments)
            if result is not _NOT_LEAN:
                return result
        if any(isinstance(v, torch.fx.Proxy) for v in arguments.values()):
            return self._one_node(arguments)  # torch.fx.symbolic_trace
        try:
            given = self.inputs(**arguments)  # the defaults; a missing argument is a TypeError
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from None
        inputs = self.typed(tuple(given.values()))
        _spec.check_no_forward_ad(self.name, inputs.tensors)
        values = inputs.values()
        if torch._C._are_functorch_transforms_active():
            return self._function.apply(*values)
        if _direct(inputs.tensors.values()):
            # nothing for autograd to record and nothing watching the dispatcher: what the custom
            # op would run, without the dispatcher's boxing and redispatch (a decode step's cost)
            return self._run_forward(self.check(inputs))
        short = self._short
        options = zip(values[self.leading :], self.arguments[self.leading :], strict=True)
        if short is not None and all(_at_default(v, d) for v, (_, _, d, _) in options):
            # the options at their defaults: the short op (few arguments, its own autograd)
            return short.forward(*values[: self.leading])
        if len(self.arguments) > CUSTOM_OP_AUTOGRAD_UP_TO:
            return self._function.apply(*values)
        # With few arguments, outside torch.func, the custom op's own autograd does the same
        # job, a fifth cheaper.
        return self.forward_op(*values)

    def _lean(self, arguments: dict[str, Any]) -> Any:
        """An eager call of plain tensors (:func:`_plain`): the first of its signature checked
        in full and remembered (:class:`_Plan`), a later one with the checks that read values
        only, the backend chosen again only when the selection state changed, then the kernel,
        or with a gradient to record, :class:`_LeanFunction` around the kernels.
        :data:`_NOT_LEAN` when the call is not one (the full path then runs, and raises what it
        raises)."""
        if not arguments.keys() <= self.inputs._name_set() or _forward_ad_active():
            return _NOT_LEAN
        values = tuple([arguments.get(name, default) for name, default in self._defaults])
        tensors = []
        for v in values:
            kind = type(v)
            if kind not in _PLAIN_VALUES:
                return _NOT_LEAN  # missing, a list, a NumPy number, a subclass: the full path says
            if kind in _PLAIN_TENSORS:
                tensors.append(v)
        if not _plain(tensors):
            return _NOT_LEAN
        if not _records_grad(tensors):
            plan, choice, values, inputs = self._lean_plan(values)
            if choice is None:  # nothing to compute
                return self._run_forward(inputs or self._make(values))
            return self._lean_forward(plan, choice, values)
        with torch.no_grad():  # the checks: nothing of them in the autograd graph
            plan, choice, checked, _ = self._lean_plan(values)
        if choice is None or any(a is not b for a, b in zip(values, checked, strict=True)
                                 if isinstance(a, torch.Tensor)):  # fmt: skip
            # zeros and gradients for them, or a check that replaced a tensor: the custom op
            return _NOT_LEAN
        return _recorded(self, plan, choice, checked)

    def _lean_plan(self, values: tuple[Any, ...]) -> tuple[_Plan, Any, tuple[Any, ...], Any]:
        """``(plan, choice, values as checked, the inputs when made)`` of a lean call: its
        signature's plan (made by every check on the first call, else the value checks), the
        backend chosen again if the selection state changed (no choice: nothing to compute)."""
        key = _signature(values)
        plan = self._plans.get(key)
        inputs = None
        if plan is None:
            inputs = self.check(self.typed(values))
            plan = self._plan(values, inputs)
            if len(self._plans) >= _PLANS:
                self._plans.clear()
            checked = inputs.values()
            if all(b is a for a, b in zip(values, checked, strict=True)
                   if isinstance(a, torch.Tensor)):  # fmt: skip
                # (a plan keeps no tensors: a check that replaced one runs on every call)
                self._plans[key] = plan
            values = checked
        else:
            if plan.resolutions:
                values = _resolved(values, plan.resolutions)
            if self.check_data is not None:
                self.check_data(_new_tuple(self._named, values))
        if plan.no_work:
            return plan, None, values, inputs
        choice, token = plan.choice, selection_token(self.name)
        if choice is None or choice[0] != token:
            backend = select(self.name, inputs or self._make(values))
            choice = plan.choice = (token, backend, backend.kernels(self.name))
        return plan, choice, values, inputs

    def _lean_forward(self, plan: _Plan, choice: _Choice, values: tuple[Any, ...]) -> Any:
        """The chosen backend's forward of checked ``values``, its outputs checked (the common
        case, no autocast to turn off and the output as expected, without further calls)."""
        _, backend, kernels = choice
        if _autocasting(plan):
            result = _run_kernel(backend, self.name, "forward", *values, devices=plan.devices)
        else:
            result = kernels.forward(*values)
        out = result if self.second is None else result[0]
        if not isinstance(out, torch.Tensor) or (out.shape, out.dtype, out.device) != plan.out:
            _checked(self.name, backend, "the output", out, plan.out)  # raises
        out = self._laid_out(out, values)
        if self.second is None:
            return out
        second = result[1]
        if type(second) is not torch.Tensor or (
            second.shape, second.dtype, second.device) != plan.second:  # fmt: skip
            second = _checked(self.name, backend, "the second output", second, plan.second)
        return out, second.contiguous()

    def _lean_backward(self, ctx: Any, grads_out: tuple[torch.Tensor, ...]) -> list[Any]:
        """A :class:`_LeanFunction`'s gradients, one (or None) for every argument: its values
        rebuilt from the saved tensors and the plan's arguments, :meth:`_run_backward` with
        what the plan knows."""
        values = _saved_values(ctx)
        plan = ctx.plan
        grads = self._run_backward(ctx.kernels, grads_out, values, plan.devices, plan)
        result: list[Any] = [None] * len(values)
        for i, grad in zip(self._differentiable_at, grads, strict=True):
            result[i] = grad
        return result

    def _plan(self, given: tuple[Any, ...], inputs: OpInputs) -> _Plan:
        """What a checked call's signature decides (``given`` its values as passed, ``inputs``
        as ``check`` returned them), for the next call of that signature."""
        device = inputs.selecting.device
        shape, dtype = self.output(inputs)
        second = None
        if self.second is not None:
            wanted = self.second(inputs)
            shape2, dtype2 = wanted if wanted is not None else ((0,), inputs.dtype)
            second = (torch.Size(shape2), dtype2, device)
        return _Plan(
            values=inputs.values(),
            given=given,
            no_work=self.no_work(inputs),
            out=(torch.Size(shape), dtype, device),
            second=second,
            devices=frozenset(t.device.type for t in inputs.tensors.values()),
        )

    def _make(self, values: tuple[Any, ...]) -> OpInputs:
        """The inputs from values in declaration order (no checks): filled in directly, as
        the frozen dataclass's ``__init__`` would (which costs a decode step several times
        this)."""
        inputs = object.__new__(self.inputs)
        inputs.__dict__.update(zip(self.names, values, strict=True))
        return inputs

    def positional(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The op with every argument positional too, in declaration order (an autograd
        ``Function.apply`` shape); the missing ones take their defaults."""
        names = [name for name, _, _, _ in self.arguments]
        if len(args) > len(names):
            raise TypeError(f"{self.name}: takes {len(names)} arguments, got {len(args)}")
        return self(**dict(zip(names, args, strict=False)), **kwargs)

    # -- what is built --------------------------------------------------------------------

    def _schema(self, prefix: str, returns: str, n: int | None = None) -> str:
        args = ", ".join(f"{kind} {name}" for name, kind, _, _ in self.arguments[:n])
        return f"({prefix}{args}) -> {returns}"

    def _build(self) -> None:
        full = self._ops(self.name, len(self.arguments))
        short = self._ops(f"{self.name}_defaults", self.leading) if self.leading else None
        for name, value in (
            ("forward_op", full.forward),
            ("backward_op", full.backward),
            ("_full", full),
            ("_short", short),
            ("_function", self._autograd_function(full)),
            ("_plans", {}),
            # the arguments as a named tuple, for check_data (a fifth of _make's cost, cold)
            ("_named", collections.namedtuple(f"{self.name}_arguments", self.names)),
            ("_defaults", tuple((name, default) for name, _, default, _ in self.arguments)),
            # the position of output_layout_of among the arguments (unread when it is "")
            ("_layout_index", self.names.index(self.output_layout_of or self.names[0])),
            # the position of second_flag (unread without a second output)
            ("_second_index", self.names.index(self.second_flag) if self.second else 0),
            # the differentiable arguments' positions, in the order of their gradients
            ("_differentiable_at", tuple(self.names.index(n) for n in self.differentiable)),
        ):
            object.__setattr__(self, name, value)

    def _ops(self, name: str, n: int) -> _Ops:
        """The forward and backward custom ops ``cakeops::<name>`` of the first ``n`` arguments
        (the others at their defaults), the forward's autograd registered."""
        rest = tuple(default for _, _, default, _ in self.arguments[n:])
        grads = sum(1 for d in self.differentiable if d in self.names[:n])

        def forward(*values: Any) -> torch.Tensor:
            return self._forward(*values, *rest)

        def forward_fake(*values: Any) -> torch.Tensor:
            return self._forward_fake(*values, *rest)

        def backward(g: torch.Tensor, *values: Any) -> Any:
            return _first(self._backward_kernel(g, *values, *rest), grads)

        def backward_fake(g: torch.Tensor, *values: Any) -> Any:
            return _first(self._backward_fake(g, *values, *rest), grads)

        two = self.second is not None
        forward_op = torch.library.custom_op(
            f"cakeops::{name}",
            forward,
            mutates_args=(),
            schema=self._schema("", "(Tensor, Tensor)" if two else "Tensor", n),
        )
        forward_op.register_fake(forward_fake)
        backward_op = torch.library.custom_op(
            f"cakeops::{name}_backward",
            backward,
            mutates_args=(),
            # one gradient: a Tensor (a schema's 1-tuple is not a tuple)
            schema=self._schema(
                "Tensor grad_output, " + ("Tensor grad_second, " if two else ""), _returns(grads), n
            ),
        )
        backward_op.register_fake(backward_fake)
        ops = _Ops(
            self.names[:n], forward_op, backward_op, self._double_backward_refused(backward_op)
        )
        forward_op.register_autograd(
            functools.partial(self._backward, ops), setup_context=self._setup_context
        )
        return ops

    def _forward(self, *values: Any) -> Any:
        return self._run_forward(self.validate(values))

    def _run_forward(self, inputs: OpInputs) -> Any:
        """The forward of validated inputs: zeros without work, else the chosen backend's kernel,
        its outputs checked."""
        if self.no_work(inputs):
            out = self.output_like(inputs).zero_()
            if self.second is None:
                return out
            wanted = self.second(inputs) is not None and self.second_no_work is not None
            return out, (self.second_no_work(inputs) if wanted else self._second_like(inputs))
        backend = select(self.name, inputs)
        _forward_choice.__dict__[self.name] = backend.name
        result = _run_kernel(backend, self.name, "forward", *inputs.values())
        out = result if self.second is None else result[0]
        shape, dtype = self.output(inputs)
        like = (torch.Size(shape), dtype, inputs.selecting.device)
        out = self._laid_out(
            _checked(self.name, backend, "the output", out, like, False), inputs.values()
        )
        if self.second is None:
            return out
        wanted = self.second(inputs)  # type: ignore[misc]
        shape, dtype = wanted if wanted is not None else ((0,), inputs.dtype)
        like = (torch.Size(shape), dtype, inputs.selecting.device)
        return out, _checked(self.name, backend, "the second output", result[1], like)

    def _second_like(self, inputs: OpInputs) -> torch.Tensor:
        """An uninitialised tensor of the second output's shape and dtype (an ``(0,)``
        placeholder when the call does not ask for it)."""
        device = inputs.selecting.device
        wanted = self.second(inputs)  # type: ignore[misc]
        if wanted is None:
            return torch.empty(0, dtype=inputs.dtype, device=device)
        shape, dtype = wanted
        return torch.empty(shape, dtype=dtype, device=device)

    def _forward_fake(self, *values: Any) -> Any:
        inputs = self.validate(values)
        out = self.output_like(inputs)
        return out if self.second is None else (out, self._second_like(inputs))

    def _check_grad_output(self, g: Any, inputs: OpInputs) -> None:
        shape, dtype = self.output(inputs)
        _spec.check_tensor(self.name, "grad_output", g)
        if g.shape != shape or g.dtype != dtype:
            raise ValueError(
                f"{self.name}: argument 'grad_output' expected {_spec.dtype_name(dtype)} of "
                f"shape {tuple(shape)}, got {_spec.describe(g)}"
            )

    def _backward_kernel(self, g: torch.Tensor, *values: Any) -> tuple[torch.Tensor, ...]:
        grads_out, values = self._split_grads(g, values)
        g = grads_out[0]
        inputs = self.validate(values)
        self._check_grad_output(g, inputs)
        tensors = {name: inputs[name] for name in self.differentiable}
        if self.no_work(inputs):
            return _unwrapped(
                tuple(_absent(g) if t is None else torch.zeros_like(t) for t in tensors.values())
            )
        backend = select(self.name, inputs)
        grads = self._run_backward(backend, grads_out, inputs.values())
        return _unwrapped(tuple(_absent(g) if t is None else d
                                for t, d in zip(tensors.values(), grads, strict=True)))  # fmt: skip

    def _run_backward(
        self,
        backend: Backend,
        grads_out: tuple[torch.Tensor, ...],
        values: tuple[Any, ...],
        devices: frozenset[str] | None = None,
        plan: _Plan | None = None,
    ) -> list[torch.Tensor | None]:
        """``backend``'s backward kernel of checked ``values``: each differentiable input's
        gradient in :attr:`differentiable`'s order, checked and laid out like it (None for an
        input not given). ``plan``: a remembered signature's, whose autocast devices and
        gradients' layouts are known (each gradient then checked in one comparison)."""
        if self.contiguous_grads:
            grads_out = tuple([t.contiguous() for t in grads_out])
        if plan is None or _autocasting(plan):
            grads = _run_kernel(backend, self.name, "backward", *grads_out, *values,
                                devices=devices)  # fmt: skip
        else:  # the common case: autocast off
            grads = backend.kernels(self.name).backward(*grads_out, *values)
        at = self._differentiable_at
        if len(grads) != len(at):
            raise RuntimeError(
                f"{self.name}: backend {backend.name!r} returned {len(grads)} gradients, "
                f"expected {len(at)} ({', '.join(self.differentiable)})"
            )
        likes = None if plan is None else plan.grads_like
        if plan is not None and likes is None:  # (a signature's: the same each call)
            likes = plan.grads_like = tuple(
                None if values[i] is None else _grad_like(values[i]) for i in at
            )
        result: list[torch.Tensor | None] = []
        for j, (i, grad) in enumerate(zip(at, grads, strict=True)):
            t = values[i]
            if t is None:
                result.append(None)
                continue
            like = (t.shape, t.dtype, t.device) if likes is None else likes[j][0]
            if type(grad) is not torch.Tensor or (grad.shape, grad.dtype, grad.device) != like:
                grad = _checked(self.name, backend, f"d{self.names[i]}", grad, like, False)
            # laid out as _like lays it out: a gradient with its input's strides stays as it is
            if likes is None:
                grad = _like(grad, t)
            elif not (grad.stride() in likes[j][1] or (likes[j][2] and grad.is_contiguous())):
                grad = torch.empty_like(t).copy_(grad)
            result.append(grad)
        return result

    def _split_grads(self, g: torch.Tensor, values: tuple[Any, ...]):
        """``((grad_output[, grad_second]), the op's arguments)`` of the backward op's."""
        if self.second is None:
            return (g,), values
        return (g, values[0]), values[1:]

    def _backward_fake(self, g: torch.Tensor, *values: Any) -> tuple[torch.Tensor, ...]:
        (g, *_), values = self._split_grads(g, values)
        inputs = self.validate(values)
        self._check_grad_output(g, inputs)
        return _unwrapped(
            tuple(
                _absent(g) if inputs[name] is None else torch.empty_like(inputs[name])
                for name in self.differentiable
            )
        )

    def _setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors = tuple(v for v in inputs if isinstance(v, torch.Tensor))
        ctx.save_for_backward(*tensors)
        ctx.params = tuple(_SAVED if isinstance(v, torch.Tensor) else v for v in inputs)
        # The backend that ran the forward, whatever chose it (a use_backend() context, an
        # environment variable or the priorities): an eager backward may run on another thread
        # (CUDA), where that context is not visible, and the environment may have changed since.
        # A compiled graph is cached and reused across contexts, so under torch.compile nothing
        # is recorded and the backward selects again when it runs.
        ctx.backend = (
            "" if torch.compiler.is_compiling() else _forward_choice.__dict__.get(self.name, "")
        )

    def _backward(self, ops: _Ops, ctx: Any, *grads_out: torch.Tensor) -> tuple[Any, ...]:
        values = _saved_values(ctx)
        with forcing(ctx.backend, self.name) if ctx.backend else contextlib.nullcontext():
            if torch.compiler.is_compiling() or not _may_differentiate_backward():
                grads = ops.backward(*grads_out, *values)
            else:
                grads = ops.backward_function.apply(*grads_out, *values)
        grads = iter((grads,) if isinstance(grads, torch.Tensor) else grads)
        differentiable = self.differentiable
        result = []
        for name, value in zip(ops.names, values, strict=True):
            grad = next(grads) if name in differentiable else None
            # an optional tensor not given (None) got the backward op's placeholder
            result.append(None if value is None else grad)
        return tuple(result)

    def _autograd_function(self, ops: _Ops) -> type:
        """The ``torch.autograd.Function`` the public function calls under ``torch.func``
        transforms: the custom op forward, the same ``setup_context`` and backward (elsewhere
        the custom op's own registration of those does the same job, with less overhead).
        PyTorch's generated Function for a custom op defines no ``setup_context``, so
        ``torch.func.grad``, ``vjp`` and ``jacrev`` refuse it (pytorch/pytorch#170834); this one
        does, and its vmap rule is generated."""
        return type(
            f"{self.name}_function",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(_with_signature(lambda *values: ops.forward(*values))),
                "setup_context": staticmethod(self._setup_context),
                "backward": staticmethod(functools.partial(self._backward, ops)),
                "generate_vmap_rule": True,
            },
        )

    def _double_backward_refused(self, backward_op: Any) -> type:
        """The Function around the backward op: a backward run with ``create_graph=True`` (as
        ``torch.func.grad`` does) works, and a second derivative through it is a clear error
        instead of a silent zero."""

        def refuse(ctx: Any, *grads: Any) -> None:
            raise NotImplementedError(
                f"{self.name}: second derivatives (backward of the backward) are not supported"
            )

        return type(
            f"{self.name}_backward_function",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(_with_signature(lambda *values: backward_op(*values))),
                "setup_context": staticmethod(lambda ctx, inputs, output: None),
                "backward": staticmethod(refuse),
                "generate_vmap_rule": True,
            },
        )


def _filled(grads: tuple[torch.Tensor | None, ...], plan: _Plan) -> tuple[torch.Tensor, ...]:
    """The upstream gradients of an op with a final state, where None (no gradient reached
    that output) becomes zeros of the output's shape, dtype and device, or for the final state
    the kernel contract's "no gradient", an empty tensor whose terms the kernel skips (the
    plan's, made once: a decode step's backward gets it for every call)."""
    grad, grad_second = grads
    if grad is None:
        shape, dtype, device = plan.out
        grad = torch.zeros(shape, dtype=dtype, device=device)
    if grad_second is None:
        grad_second = plan.no_gradient
        if grad_second is None:
            _, dtype, device = plan.second
            grad_second = plan.no_gradient = torch.empty(0, dtype=dtype, device=device)
    return grad, grad_second


class _LeanFunction(torch.autograd.Function):
    """An eager call that autograd records, in a plain context (``OpSpec._lean``): the chosen
    backend's forward and backward kernels called directly, without the custom op's dispatch
    and its second round of checks, which cost a small call more than its kernels. It saves
    exactly the tensor inputs, as the custom op does (autograd's version counters refuse a
    backward after one of them changed in place, so the forward's checks still hold); a
    backward that could itself be differentiated goes through the backward op, which refuses
    second derivatives."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, spec: OpSpec, plan: _Plan, choice: _Choice, *values: Any
    ) -> Any:
        out = spec._lean_forward(plan, choice, values)
        ctx.save_for_backward(*[values[i] for i in plan.tensors_at])
        ctx.params = plan.params
        # (ctx.backend: the name, as the custom op's context keeps it for OpSpec._backward)
        ctx.spec, ctx.plan, ctx.kernels = spec, plan, choice[1]
        ctx.backend = choice[1].name
        if spec.second is not None:
            # an output no gradient reached arrives as None (autograd's zeros: a state-sized
            # tensor a decode step's backward then reads for nothing); _filled makes it
            ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx: Any, *grads_out: torch.Tensor | None) -> Any:  # type: ignore[override]
        spec: OpSpec = ctx.spec
        if spec.second is not None:
            grads_out = _filled(grads_out, ctx.plan)
        if _may_differentiate_backward():  # the custom op's backward, through the backward op
            return (None, None, None, *spec._backward(spec._full, ctx, *grads_out))
        return (None, None, None, *spec._lean_backward(ctx, grads_out))


try:  # _LeanFunction.apply, the C part (autograd.Function.apply's own, after its Python)
    _lean_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _LeanFunction)
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
except (AttributeError, KeyError):  # (a PyTorch without them: the whole apply)
    _lean_apply = _unwrap_if_dead = None


def _recorded(spec: OpSpec, plan: _Plan, choice: _Choice, values: tuple[Any, ...]) -> Any:
    """``_LeanFunction.apply(spec, plan, choice, *values)`` less ``autograd.Function.apply``'s
    Python, which a call in a plain context does not need (a check for a ``setup_context`` the
    Function does not define, a check for functorch transforms the caller made) but for its
    unwrapping of dead functorch wrappers, done here (a measurable share of a small call)."""
    if _lean_apply is None or _unwrap_if_dead is None:
        return _LeanFunction.apply(spec, plan, choice, *values)
    unwrapped = list(values)
    for i in plan.tensors_at:
        unwrapped[i] = _unwrap_if_dead(unwrapped[i])
    return _lean_apply(spec, plan, choice, *unwrapped)


def moved_to_helpers(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` forwarding the backend helpers that lived in the op modules
    before :mod:`cakeops.helpers` (with a ``DeprecationWarning`` naming the new place)."""

    def __getattr__(name: str) -> Any:
        from cakeops import helpers

        if name not in helpers.__all__:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to cakeops.helpers.{name}", DeprecationWarning, stacklevel=2
        )
        return getattr(helpers, name)

    return __getattr__
