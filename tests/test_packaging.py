"""Each distribution builds a wheel that carries what the architecture promises."""

import ast
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [
    ("spec", "cakeops", "cakeops"),
    ("packages/torch", "cakeops-torch", "cakeops_torch"),
    ("packages/triton", "cakeops-triton", "cakeops_triton"),
    ("packages/numba", "cakeops-numba", "cakeops_numba"),
]


@pytest.mark.parametrize("path, dist, package", DISTRIBUTIONS)
def test_wheel_contents_and_metadata(tmp_path, path, dist, package):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT / path),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
        entry_points = zf.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert meta["Name"] == dist
    assert meta["Requires-Python"] == ">=3.10"
    assert any(r.replace(" ", "").startswith("torch>=2.4") for r in meta.get_all("Requires-Dist"))
    assert f"{package}/py.typed" in names
    assert f"{package}/__init__.py" in names
    assert not any(n.startswith(("tests/", "src/")) for n in names)
    assert "[cakeops.backends]" in entry_points or dist == "cakeops"


def test_installed_entry_points():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts["cakeops"] == "cakeops.cli:main"
    plugins = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
    assert plugins["cakeops"] == "cakeops.testing.plugin"
    backends = {ep.name: ep.dist.name for ep in metadata.entry_points(group="cakeops.backends")}
    assert backends["torch"] == "cakeops-torch"


def test_spec_imports_no_backend():
    for path in (ROOT / "spec" / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("cakeops_") for n in names), f"{path} imports {names}"


def test_no_backend_imports_another():
    for pkg_dir in (ROOT / "packages").iterdir():
        own = next((pkg_dir / "src").iterdir()).name
        for path in (pkg_dir / "src").rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    mod = node.module.split(".")[0]
                    assert not (mod.startswith("cakeops_") and mod != own), f"{path}: {mod}"
