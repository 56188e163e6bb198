"""The backend registry and the per-call backend selection.

Backends are discovered through the entry-point group ``cakeops.backends``; each entry point names
a :class:`Backend` object (or a zero-argument callable returning one). Selection, per call:

1. the innermost :func:`use_backend` context (a ``contextvars`` value: thread- and task-safe),
2. ``CAKEOPS_BACKEND_<OP>`` then ``CAKEOPS_BACKEND`` (a name or a comma-separated preference list),
   read at call time,
3. otherwise the highest-priority available backend with no reasons against the inputs.

An explicit choice (1 or 2) that cannot run raises :class:`BackendError` listing every reason; it
never falls back to a backend the user did not name.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from cakeops._spec import dtype_name

if TYPE_CHECKING:
    from cakeops.opspec import OpInputs

ENTRY_POINT_GROUP = "cakeops.backends"


def op_names() -> tuple[str, ...]:
    """Every op's name (the modules of :mod:`cakeops.ops`)."""
    from cakeops.ops import SPECS

    return tuple(SPECS)


def __getattr__(name: str) -> Any:
    if name == "OPS":  # the tuple this module used to define
        return op_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: pip distributions of the first-party backends, named in errors when one is not installed.
KNOWN_DISTRIBUTIONS = {
    "torch": "cakeops-torch",
    "triton": "cakeops-triton",
    "numba": "cakeops-numba",
}


#: a first-party backend's optional part: name -> (its extra, what the extra adds)
KNOWN_EXTRAS = {"numba": ("cuda", "its CUDA kernels")}


#: a first-party backend whose kernels need a GPU -> what it runs on
KNOWN_GPU_ONLY = {"triton": "NVIDIA and AMD GPUs (on a CPU only under TRITON_INTERPRET=1, slowly)"}


def install_hint(name: str) -> str:
    """How to install the first-party backend ``name``: from a checkout of the repository
    (``packages/<name>``: the distributions are not on the package index yet), its extra if it
    has one, and what it runs on when that is a GPU only."""
    dist = KNOWN_DISTRIBUTIONS[name]
    hint = (f"`pip install ./packages/{name}` from a checkout of cakeops (`{dist}` is not on "
            "PyPI yet)")  # fmt: skip
    if name in KNOWN_EXTRAS:
        extra, adds = KNOWN_EXTRAS[name]
        hint += f"; {adds} with `pip install './packages/{name}[{extra}]'`"
    if name in KNOWN_GPU_ONLY:
        hint += f"; its kernels run on {KNOWN_GPU_ONLY[name]}"
    return hint


def did_you_mean(name: str) -> str:
    """``"; did you mean 'triton'?"`` for a near miss of a known backend name, else ``""``."""
    known = sorted({*KNOWN_DISTRIBUTIONS, *backends()})
    by_case = [k for k in known if k.lower() == name.lower()]  # names are case-sensitive
    close = by_case or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def missing_reason(name: str) -> str:
    """Why ``name`` names no installed backend: the install line of a first-party one, else a
    "did you mean" for a near miss."""
    if name in KNOWN_DISTRIBUTIONS:
        return f"not installed; install it with {install_hint(name)}"
    return f"no backend of that name is installed{did_you_mean(name)}"


class BackendError(RuntimeError):
    """An explicitly chosen backend cannot run these inputs (or no backend can)."""


@dataclass(frozen=True)
class OpKernels:
    """Where a backend's kernels for one op live and what they serve.

    ``module`` is imported on first use and must define ``forward`` and ``backward`` with the op's
    kernel signature (see the op's spec module). ``devices`` maps a device type (``"cpu"``,
    ``"cuda"``, ... or ``"*"`` for any) to the priority of implicit selection there; ``None``
    serves the device only when the backend is chosen explicitly. ``dtypes`` lists the input
    dtypes the kernels support (the dtype of the op's first tensor argument); ``device_dtypes``
    narrows them on a device type where fewer are supported there.
    """

    module: str
    devices: Mapping[str, int | None]
    dtypes: tuple[torch.dtype, ...]
    device_dtypes: Mapping[str, tuple[torch.dtype, ...]] = field(default_factory=dict)

    def dtypes_on(self, device_type: str) -> tuple[torch.dtype, ...]:
        """The input dtypes supported on ``device_type``."""
        return tuple(self.device_dtypes.get(device_type, self.dtypes))

    def priority(self, device_type: str) -> int | None:
        return self.devices.get(device_type, self.devices.get("*"))

    def serves(self, device_type: str) -> bool:
        return device_type in self.devices or "*" in self.devices


@dataclass
class Backend:
    """A named set of op kernels. Subclass to refine availability or per-call support."""

    name: str
    distribution: str
    ops: Mapping[str, OpKernels]
    description: str = ""
    _modules: dict[str, ModuleType] = field(default_factory=dict, init=False, repr=False)

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all here (``None`` when it can)."""
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def not_supported_reasons(self, op: str, inputs: OpInputs) -> list[str]:
        """Every reason this backend cannot run ``op`` on ``inputs`` (empty when it can): the
        op's validated ``Inputs`` (read them by attribute, or by name like a mapping). The
        answer depends on the inputs' signature (types, shapes, strides, dtypes, devices, the
        options' values), never on tensor values: a call without autograd reuses it for a
        signature it has seen while :func:`selection_token` is unchanged. By default: what the
        op's :class:`OpKernels` declares (:meth:`served_reasons`), then its kernel module's
        own rule (:meth:`declared_reasons`)."""
        reasons = self.served_reasons(op, inputs)
        return reasons or self.declared_reasons(op, "not_supported_reasons", inputs)

    def not_preferred_reasons(self, op: str, inputs: OpInputs) -> list[str]:
        """Every reason implicit selection passes this backend over for ``inputs`` it supports
        (empty when it does not): kernels that beat the next backend's on some signatures
        only, such as a decode step's. Named explicitly, the backend still runs them. Like
        :meth:`not_supported_reasons`, the answer depends on the signature only. By default:
        the kernel module's own rule (:meth:`declared_reasons`)."""
        return self.declared_reasons(op, "not_preferred_reasons", inputs)

    def served_reasons(self, op: str, inputs: OpInputs) -> list[str]:
        """Why the op's :class:`OpKernels` does not serve ``inputs``: not implemented, another
        device, another dtype."""
        kernels = self.ops.get(op)
        if kernels is None:
            return [f"does not implement {op}"]
        reasons = []
        device_type, first = _device_type(inputs), _first_tensor(inputs)
        if not kernels.serves(device_type):
            served = ", ".join(sorted(kernels.devices))
            reasons.append(f"serves devices {served} for {op}, got {device_type}")
        dtypes = kernels.dtypes_on(device_type)
        if first is not None and first.dtype not in dtypes:
            supported = ", ".join(dtype_name(d) for d in dtypes)
            where = f" on {device_type}" if device_type in kernels.device_dtypes else ""
            reasons.append(
                f"supports dtypes {supported} for {op}{where}, got {dtype_name(first.dtype)}"
            )
        return reasons

    def declared_reasons(self, op: str, rule: str, inputs: OpInputs) -> list[str]:
        """What ``rule(inputs)`` returns where the op's kernel module defines that function
        (``not_supported_reasons`` or ``not_preferred_reasons``): an op's rules said beside its
        kernels. The module is imported then; an error importing it propagates (the registry
        then passes the backend over with it as the reason); a module that is not there
        declares nothing (the registry reports it before asking)."""
        if op not in self.ops or _kernels_missing(self, op) is not None:
            return []
        declared = getattr(self.kernels(op), rule, None)
        return list(declared(inputs)) if callable(declared) else []

    def kernels(self, op: str) -> ModuleType:
        """The imported kernel module for ``op`` (imported once, on first use); one without a
        callable ``forward`` and ``backward`` is refused with a clear error."""
        module = self._modules.get(op)
        if module is None:
            module = importlib.import_module(self.ops[op].module)
            missing = [f for f in ("forward", "backward") if not callable(getattr(module, f, None))]
            if missing:
                raise BackendError(
                    f"{op}: backend {self.name!r}: kernel module {module.__name__!r} defines no "
                    f"{' or '.join(missing)} (see the op's Kernels protocol in cakeops.ops.{op})"
                )
            self._modules[op] = module
        return module


def package_kernels(
    package: str,
    devices: Mapping[str, int | None],
    dtypes: tuple[torch.dtype, ...],
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, OpKernels]:
    """The :class:`OpKernels` of every op ``package`` has a module for, named after the op
    (``<package>.<op>``), found without importing them: each serves ``devices`` and ``dtypes``
    unless ``overrides[op]`` replaces some of those fields (``device_dtypes`` too). A backend
    built this way serves a new op as soon as it has the module, with no name to mistype."""
    found = {}
    for op in op_names():
        module = f"{package}.{op}"
        if importlib.util.find_spec(module) is not None:
            fields = {"devices": devices, "dtypes": dtypes, **(overrides or {}).get(op, {})}
            found[op] = OpKernels(module=module, **fields)
    return found


def _first_tensor(inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """The op's first tensor argument: its device and dtype drive the selection."""
    return next((t for t in inputs.values() if isinstance(t, torch.Tensor)), None)


def _device_type(inputs: Mapping[str, Any]) -> str:
    first = _first_tensor(inputs)
    return first.device.type if first is not None else "cpu"


# --------------------------------------------------------------------------------------------
# Discovery


_lock = threading.Lock()
_backends: dict[str, Backend] | None = None
_load_errors: dict[str, str] = {}
_implicit_order: dict[tuple[str, str], tuple[Backend, ...]] = {}
#: bumped whenever the installed backends change (what :func:`selection_token` reads)
_generation = 0
_unavailable: dict[str, str | None] = {}
_missing: dict[tuple[str, str], str | None] = {}


def why_unavailable(backend: Backend) -> str | None:
    """``backend.unavailable_reason()``, asked once per backend (availability does not change);
    a method that raises makes the backend unavailable, with the error as the reason."""
    if backend.name not in _unavailable:
        try:
            reason = backend.unavailable_reason()
        except Exception as exc:  # a broken backend must not break the others
            reason = f"unavailable_reason() raised {type(exc).__name__}: {exc}"
        _unavailable[backend.name] = reason
    return _unavailable[backend.name]


def _kernels_missing(backend: Backend, op: str) -> str | None:
    """Why ``backend``'s kernel module for ``op`` cannot be imported (``None`` when it is
    there), looked up once: such a backend is never chosen for the op implicitly."""
    key = (backend.name, op)
    if key not in _missing:
        module = backend.ops[op].module
        try:
            found = module in sys.modules or importlib.util.find_spec(module) is not None
        except Exception:  # a parent package that fails to import
            found = False
        _missing[key] = None if found else f"kernel module {module!r} of {op} not found"
    return _missing[key]


def _distribution(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "an unknown distribution"


def _discover() -> dict[str, Backend]:
    """Every backend an entry point names. Nothing a backend package does here can break the
    others: an entry point that fails to load (any exception, ``SystemExit`` included) or gives
    no ``Backend`` is reported in :func:`load_errors` under its name and package; a backend name
    of the in-tree packages is reserved for them; a name taken twice keeps the first."""
    from cakeops.reference import backend as reference

    found: dict[str, Backend] = {reference.name: reference}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = _distribution(ep)
        try:
            obj = ep.load()
            backend = obj() if callable(obj) and not isinstance(obj, Backend) else obj
            if not isinstance(backend, Backend):
                raise TypeError(f"entry point gave {type(backend).__name__}, not a Backend")
        except (Exception, SystemExit) as exc:
            _load_errors[ep.name] = (
                f"failed to load entry point {ep.value!r} of {dist}: {type(exc).__name__}: {exc}"
            )
            continue
        owner = KNOWN_DISTRIBUTIONS.get(
            backend.name, "cakeops" if backend.name == "reference" else None
        )
        if owner is not None and dist.replace("_", "-").lower() != owner:
            _load_errors[f"{backend.name} (from {dist})"] = (
                f"{dist} registers a backend named {backend.name!r}, a name reserved for "
                f"{owner}: ignored"
            )
            continue
        if backend.name in found:
            _load_errors[f"{backend.name} (from {dist})"] = (
                f"{dist} registers a backend named {backend.name!r}, already registered by "
                f"{found[backend.name].distribution}: ignored"
            )
            continue
        found[backend.name] = backend
    return found


def backends() -> dict[str, Backend]:
    """All installed backends by name (discovered once, then cached)."""
    global _backends
    if _backends is None:
        with _lock:
            if _backends is None:
                _backends = _discover()
    return _backends


def rediscover() -> dict[str, Backend]:
    """Forget every backend and discover them again (after installing one at run time)."""
    global _backends, _generation
    with _lock:
        _backends = None
        _generation += 1
        _load_errors.clear()
        _implicit_order.clear()
        _unavailable.clear()
        _missing.clear()
    return backends()


def _after_fork_in_child() -> None:
    """In a forked child: every remembered choice is made again, since a backend can say it
    cannot run in a fork (numba's CPU kernels, whose OpenMP threads do not survive one); and
    the discovery's lock is a new one (another thread of the parent may have held it)."""
    global _generation, _lock
    _generation += 1
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # (not on Windows, which does not fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend without an entry point (tests, notebooks)."""
    found = backends()
    if backend.name in found and not replace:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    global _generation
    found[backend.name] = backend
    _generation += 1
    _implicit_order.clear()
    _unavailable.pop(backend.name, None)
    _missing.clear()


def unregister_backend(name: str) -> None:
    global _generation
    backends().pop(name, None)
    _generation += 1
    _implicit_order.clear()
    _unavailable.pop(name, None)
    _missing.clear()


def load_errors() -> dict[str, str]:
    """Entry points that failed to load, with the error."""
    backends()
    return dict(_load_errors)


# --------------------------------------------------------------------------------------------
# Selection

# op name (None: every op) -> preference list; a fresh dict is set on every change.
_forced: contextvars.ContextVar[Mapping[str | None, tuple[str, ...]] | None] = (
    contextvars.ContextVar("cakeops_forced_backend", default=None)
)


def _parse_names(names: str | Sequence[str], source: str) -> tuple[str, ...]:
    """Backend names from a name, a comma-separated list or a sequence; ``source`` (where they
    came from: ``use_backend()`` or an environment variable) names the culprit in the error."""
    given = names
    if isinstance(names, str):
        names = names.split(",")
    elif not isinstance(names, (list, tuple)):
        raise TypeError(
            f"{source}: expected a backend name, a comma-separated string of names or a list "
            f"or tuple of names, got {type(names).__name__} {names!r}"
        )
    parsed = tuple(n.strip() for n in names if isinstance(n, str) and n.strip())
    if not parsed or len(parsed) != len(names):
        raise ValueError(
            f"{source}: expected a backend name or a comma-separated list of backend names, "
            f"got {given!r}"
        )
    return parsed


@torch.compiler.assume_constant_result
def _refuse_inside_compile() -> None:
    """Raised while Dynamo traces: a function it runs at trace time (assumed constant) raises
    with this message first, where one it traces would be reported as Dynamo's own
    "Observed exception" with this message in its debug context."""
    raise RuntimeError(
        "use_backend() cannot be entered inside a torch.compile'd function: enter it around "
        "the call of the compiled function (the ops choose their backend when the compiled "
        "code runs), or set CAKEOPS_BACKEND"
    )


@contextlib.contextmanager
def use_backend(names: str | Sequence[str], *, op: str | None = None) -> Iterator[None]:
    """Force a backend (or a preference list) inside the block, for one op or all of them.

    The choice lives in a ``contextvars`` value, so it is private to this thread or task.
    """
    if torch.compiler.is_compiling():
        _refuse_inside_compile()
    if op is not None and op not in op_names():
        raise ValueError(f"use_backend: op must be one of {', '.join(op_names())}, got {op!r}")
    with forcing(_parse_names(names, "use_backend()"), op):
        yield


@contextlib.contextmanager
def forcing(names: str | tuple[str, ...], op: str | None) -> Iterator[None]:
    """:func:`use_backend` without its argument checks (names already parsed, or one name)."""
    current = dict(_forced.get() or {})
    current[op] = (names,) if isinstance(names, str) else names
    token = _forced.set(current)
    try:
        yield
    finally:
        _forced.reset(token)


@functools.cache
def _variables(op: str) -> tuple[str, str]:
    return f"CAKEOPS_BACKEND_{op.upper()}", "CAKEOPS_BACKEND"


@functools.cache
def _encoded_variables(op: str) -> tuple[Any, ...]:
    return tuple(os.environ.encodekey(v) for v in _variables(op))  # type: ignore[attr-defined]


#: The process's ``os.environ`` and its own store, when it has one (CPython's: a dict of
#: encoded keys and values that ``putenv``/``unsetenv`` keep up to date)
_ENVIRON = os.environ
_ENVIRON_DATA = getattr(os.environ, "_data", None)
if not (isinstance(_ENVIRON_DATA, dict) and hasattr(os.environ, "encodekey")):
    _ENVIRON_DATA = None


def selection_token(op: str) -> tuple[Any, ...]:
    """What :func:`select` depends on besides the inputs' signature: the installed backends,
    ``use_backend()`` and the environment variables. Equal tokens, the same signature: the same
    backend (``not_supported_reasons`` answers from the signature, not from tensor values)."""
    # os.environ's own store, read with its encoded keys (what os.environ.get does, less the
    # encoding and decoding of every lookup, and the lookups of the store: with caches cold, a
    # small call's share); a replaced os.environ, or none such, through os.environ.get
    if os.environ is _ENVIRON and _ENVIRON_DATA is not None:
        per_op, default = _encoded_variables(op)
        return (_generation, _forced.get(), _ENVIRON_DATA.get(per_op), _ENVIRON_DATA.get(default))
    return (_generation, _forced.get(), *(os.environ.get(v) for v in _variables(op)))


def forced_choice(op: str) -> tuple[tuple[str, ...], str] | None:
    """The explicit preference for ``op`` and where it came from, or ``None`` for automatic."""
    forced = _forced.get() or {}
    for key in (op, None):
        if key in forced:
            return forced[key], "use_backend()"
    for var in _variables(op):
        value = os.environ.get(var, "").strip()
        if value:
            return _parse_names(value, var), var
    return None


def _implicit_candidates(op: str, device_type: str) -> tuple[Backend, ...]:
    key = (op, device_type)
    order = _implicit_order.get(key)
    if order is None:
        ranked = []
        for backend in backends().values():
            kernels = backend.ops.get(op)
            prio = kernels.priority(device_type) if kernels else None
            if (
                prio is not None
                and why_unavailable(backend) is None
                and _kernels_missing(backend, op) is None
            ):
                ranked.append((-prio, backend.name, backend))
        order = tuple(b for _, _, b in sorted(ranked, key=lambda r: r[:2]))
        _implicit_order[key] = order
    return order


def _reasons(backend: Backend | None, name: str, op: str, inputs: Mapping[str, Any]) -> list[str]:
    if backend is None:
        if name in _load_errors:
            return [_load_errors[name]]
        return [missing_reason(name)]
    unavailable = why_unavailable(backend)
    if unavailable is not None:
        return [f"unavailable: {unavailable}"]
    missing = _kernels_missing(backend, op) if op in backend.ops else None
    if missing is not None:
        return [missing]
    return asked(backend, "not_supported_reasons", op, inputs)


def asked(backend: Backend, method: str, op: str, inputs: Mapping[str, Any]) -> list[str]:
    """``backend.<method>(op, inputs)`` (``not_supported_reasons`` or ``not_preferred_reasons``);
    a method that raises gives its error as the one reason: a broken backend is passed over,
    and named, refused with the cause, instead of failing every call."""
    try:
        return getattr(backend, method)(op, inputs)
    except Exception as exc:
        return [f"{method}() raised {type(exc).__name__}: {exc}"]


@dataclass(frozen=True)
class Explanation:
    """Which backend would run an op on given inputs, and why each other one would not."""

    op: str
    backend: str | None
    source: str
    reasons: Mapping[str, list[str]]

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.backend or 'no backend'} (chosen by {self.source})"]
        for name, why in self.reasons.items():
            if name != self.backend:
                lines.append(f"  {name}: {'; '.join(why) or 'lower priority'}")
        return "\n".join(lines)


def explain_inputs(op: str, inputs: Mapping[str, Any]) -> Explanation:
    """Selection for ``op`` on validated ``inputs`` (a mapping of argument name to value)."""
    device_type = _device_type(inputs)
    installed = backends()
    forced = forced_choice(op)
    reasons: dict[str, list[str]] = {}
    chosen = None
    if forced is not None:
        names, source = forced
        for name in names:
            reasons[name] = _reasons(installed.get(name), name, op, inputs)
            if not reasons[name]:
                chosen = name
                break
    else:
        source = "priority"
        for backend in _implicit_candidates(op, device_type):
            why = asked(backend, "not_supported_reasons", op, inputs)
            reasons[backend.name] = why or asked(backend, "not_preferred_reasons", op, inputs)
            if not reasons[backend.name]:
                chosen = backend.name
                break
    for name, backend in installed.items():
        if name not in reasons:
            why = _reasons(backend, name, op, inputs)
            if forced is not None:
                why = [*why, f"not named in {source}"]
            elif backend.ops.get(op) is not None and backend.ops[op].priority(device_type) is None:
                why = [*why, f"never chosen implicitly on {device_type}"]
            reasons[name] = why
    return Explanation(op=op, backend=chosen, source=source, reasons=reasons)


def select(op: str, inputs: Mapping[str, Any]) -> Backend:
    """The backend that runs ``op`` on ``inputs``; raises :class:`BackendError` if none can."""
    forced = forced_choice(op)
    if forced is None:
        # Fast path: the first implicit candidate usually accepts the inputs.
        for backend in _implicit_candidates(op, _device_type(inputs)):
            if not (
                asked(backend, "not_supported_reasons", op, inputs)
                or asked(backend, "not_preferred_reasons", op, inputs)
            ):
                return backend
    else:
        installed = backends()
        for name in forced[0]:
            backend = installed.get(name)
            if backend is not None and not _reasons(backend, name, op, inputs):
                return backend
    explanation = explain_inputs(op, inputs)
    detail = "\n".join(
        f"  {name}: {'; '.join(why) or 'ok'}" for name, why in explanation.reasons.items()
    )
    if forced is not None:
        wanted = ",".join(forced[0])
        msg = f"{op}: backend {wanted!r} (from {forced[1]}) cannot run these inputs"
    else:
        msg = f"{op}: no installed backend can run these inputs"
    raise BackendError(f"{msg}:\n{detail}")
