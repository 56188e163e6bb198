"""pytest plugin of the conformance suite (loaded through the ``pytest11`` entry point).

Options:

``--cakeops-backend NAME[,NAME...]``  backends under test (repeatable; default: every installed,
                                      available backend)
``--cakeops-device DEVICE``           device to run on (default ``cpu``)

Suite classes set ``op = "<op name>"``; a test taking ``backend`` runs once per backend under test
that implements the op on the device, a test taking ``backend`` and ``dtype`` once per backend and
each dtype it declares (narrowed with ``@pytest.mark.cakeops_dtypes(torch.float64, ...)``). The
``backend`` fixture forces that backend for the whole test with ``cakeops.use_backend``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cakeops", "cakeops conformance suite")
    group.addoption(
        "--cakeops-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="backend(s) to certify, comma-separated or repeated (default: all installed)",
    )
    group.addoption(
        "--cakeops-device", default="cpu", metavar="DEVICE", help="device to test on (cpu)"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cakeops_dtypes(*dtypes): run a conformance test only for these dtypes"
    )
    config.addinivalue_line(
        "markers",
        "cakeops_not_for(*backends, reason): a check that does not apply to these backends "
        "(only the float64 reference, whose plain math is its point, may be named here)",
    )


def device_missing(name: str) -> str | None:
    """Why the device ``name`` (``cpu``, ``cuda``, ``cuda:1``, ...) cannot run tests here, or
    ``None`` when it can."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        return f"{name!r} is not a device torch knows ({exc})"
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if available is None or not available():
        return f"{name}: no {device.type} device on this machine"
    count = getattr(module, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        return f"{name}: this machine has {count} {device.type} device(s)"
    return None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Asked for a device that is not there, the suite stops at once with one line (not a
    failure per test)."""
    if not hasattr(session.config, "workerinput"):  # once, in the controller of an xdist run
        missing = device_missing(session.config.getoption("cakeops_device"))
        if missing:
            pytest.exit(f"cakeops conformance suite: --cakeops-device={missing}", returncode=4)


def _requested(config: pytest.Config) -> list[str]:
    return [
        n.strip()
        for opt in config.getoption("cakeops_backend")
        for n in opt.split(",")
        if n.strip()
    ]


def backends_under_test(config: pytest.Config) -> list[str]:
    """Named backends, or every installed backend that is available here."""
    requested = _requested(config)
    if requested:
        return requested
    from cakeops import registry

    return [name for name, b in registry.backends().items() if registry.why_unavailable(b) is None]


def pytest_report_header(config: pytest.Config) -> list[str]:
    from cakeops import registry

    lines = [f"cakeops backends under test: {', '.join(backends_under_test(config))}"]
    if not _requested(config):
        for name, backend in registry.backends().items():
            if registry.why_unavailable(backend) is not None:
                lines.append(f"  left out {name}: {registry.why_unavailable(backend)}")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cakeops_backend" not in metafunc.fixturenames:
        return
    op = getattr(metafunc.cls, "op", None)
    if op is None:
        return
    from cakeops import registry

    device_type = metafunc.config.getoption("cakeops_device").split(":")[0]
    installed = registry.backends()
    not_for = metafunc.definition.get_closest_marker("cakeops_not_for")
    excluded = set(not_for.args) if not_for else set()
    names = []
    for name in backends_under_test(metafunc.config):
        if name in excluded:
            continue
        backend = installed.get(name)
        # A named backend that is missing still gets its tests: the fixture then fails loudly.
        if backend is None or (op in backend.ops and backend.ops[op].serves(device_type)):
            names.append(name)
    if "dtype" not in metafunc.fixturenames:
        metafunc.parametrize("cakeops_backend", names, indirect=True)
        return
    marker = metafunc.definition.get_closest_marker("cakeops_dtypes")
    wanted = marker.args if marker else None
    pairs, ids = [], []
    for name in names:
        declared = installed[name].ops[op].dtypes_on(device_type) if name in installed else ()
        for dtype in declared:
            if wanted is None or dtype in wanted:
                pairs.append((name, dtype))
                ids.append(f"{name}-{str(dtype).removeprefix('torch.')}")
    metafunc.parametrize(("cakeops_backend", "dtype"), pairs, ids=ids, indirect=["cakeops_backend"])


@pytest.fixture
def cakeops_backend(request: pytest.FixtureRequest):
    """The backend under test (its name), forced for the duration of the test. Named for the
    project, as is :func:`cakeops_device`: the plugin loads into every pytest session of an
    environment with cakeops installed, where a project's own ``backend`` or ``device``
    fixture must not meet ours."""
    import cakeops
    from cakeops import registry

    name = request.param
    found = registry.backends().get(name)
    if found is None:
        pytest.fail(f"backend {name!r} is not installed: {registry.load_errors().get(name, '')}")
    if registry.why_unavailable(found) is not None:
        pytest.fail(f"backend {name!r} is unavailable: {registry.why_unavailable(found)}")
    with cakeops.use_backend(name):
        yield name


@pytest.fixture
def cakeops_device(request: pytest.FixtureRequest):
    """The device under test (``--cakeops-device``)."""
    import torch

    return torch.device(request.config.getoption("cakeops_device"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) suite tests that no backend under test applies to, such as the tests of
    an op the backend does not implement or of a dtype it does not declare."""
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        is_suite = getattr(getattr(item, "cls", None), "op", None) is not None
        backend = callspec.params.get("cakeops_backend") if callspec else None
        if (
            is_suite
            and "cakeops_backend" in getattr(item, "fixturenames", ())
            and not isinstance(backend, str)
        ):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
