"""The conformance suite (shipped in ``cakeops.testing``) on every in-tree backend: every test
class of every ``cakeops.testing.test_*`` module, so an op's new module needs no wiring here.

A third-party backend runs the same classes with ``pytest --pyargs cakeops.testing``.
"""

import importlib
import pkgutil

import cakeops.testing

for _info in pkgutil.iter_modules(cakeops.testing.__path__):
    if _info.name.startswith("test_"):
        _module = importlib.import_module(f"cakeops.testing.{_info.name}")
        globals().update(
            {k: v for k, v in vars(_module).items() if k.startswith("Test") and isinstance(v, type)}
        )


def test_certifying_from_the_example_backends_folder_needs_no_workspace_plugin():
    """The documented certification command, run from ``tests/example_backend`` in an
    environment without pytest-timeout (a backend author's): no "Unknown config option" from
    the workspace's settings (the folder has its own)."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "example_backend"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "cakeops.testing", "--cakeops-backend=torch",
         "-p", "no:timeout", "-p", "no:cacheprovider", "--collect-only", "-q"],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Unknown config option" not in done.stdout + done.stderr
