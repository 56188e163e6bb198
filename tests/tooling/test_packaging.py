"""Each distribution builds a wheel that carries what the architecture promises."""

import ast
import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = [
    ("spec", "cakeops", "cakeops"),
    ("packages/torch", "cakeops-torch", "cakeops_torch"),
    ("packages/triton", "cakeops-triton", "cakeops_triton"),
    ("packages/numba", "cakeops-numba", "cakeops_numba"),
]


HOME = "https://github.com/cakeops/cakeops"


def _build(path: str, out: Path) -> tuple[Path, Path]:
    """The sdist of ``path``, and the wheel built from that sdist alone (as an index's users
    and tools build it: nothing outside the distribution's folder is reachable)."""
    subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(out)],
                   cwd=ROOT / path, check=True, capture_output=True)  # fmt: skip
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as tf:
        tf.extractall(out / "unpacked", filter="data")
    (unpacked,) = (out / "unpacked").iterdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
         str(out), str(unpacked)],
        check=True,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


@pytest.mark.parametrize("path, dist, package", DISTRIBUTIONS)
def test_wheel_contents_and_metadata(tmp_path, path, dist, package):
    """Each distribution's sdist and the wheel built from it: the licence text, the one version,
    classifiers, authors, project URLs, its README as the description, ``twine check``."""
    sdist, wheel = _build(path, tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
        entry_points = zf.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
        licence = zf.read(meta_name.replace("METADATA", "licenses/LICENSE")).decode()
    with tarfile.open(sdist) as tf:
        sdist_names = [n.split("/", 1)[1] for n in tf.getnames() if "/" in n]
    assert meta["Name"] == dist
    assert meta["Version"] == (ROOT / "VERSION").read_text().strip()
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["License-Expression"] == "Apache-2.0"
    assert licence == (ROOT / "LICENSE").read_text() and "Apache License" in licence
    assert "LICENSE" in sdist_names and "README.md" in sdist_names
    assert "Development Status :: 3 - Alpha" in meta.get_all("Classifier")
    assert meta["Author"] == "The cakeops developers"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Repository", "Issues", "Changelog"} <= set(urls)
    assert all(u.startswith(HOME) for u in urls.values())
    assert meta.get_payload() == (ROOT / path / "README.md").read_text()
    assert any(r.replace(" ", "").startswith("torch>=2.11,<2.14") or r.startswith("torch<2.14")
               for r in meta.get_all("Requires-Dist"))  # fmt: skip
    assert f"{package}/py.typed" in names
    assert f"{package}/__init__.py" in names
    assert not any(n.startswith(("tests/", "src/")) for n in names)
    assert "[cakeops.backends]" in entry_points or dist == "cakeops"
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(sdist),
                            str(wheel)], capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("path", [d[0] for d in DISTRIBUTIONS])
def test_readme_stands_alone(path):
    """A distribution's README becomes its page on the index: no links into the repository's
    tree (they break once published), and a line that says how to install it."""
    text = (ROOT / path / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert all(link.startswith(("https://", "http://", "#")) for link in links), links
    assert "pip install" in text
    assert (ROOT / path / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()


def test_declared_ranges_hold_the_tested_pins():
    """Every dependency pinned by ``.ci/constraints.txt`` (what CI tests) lies inside the range
    each distribution declares; numba-cuda only in ``cakeops-numba[cuda]``."""
    pins = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version.split("+")[0])
    seen = set()
    for path, _, _ in DISTRIBUTIONS:
        project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
        extras = project.get("optional-dependencies", {})
        requirements = [(None, r) for r in project["dependencies"]]
        requirements += [(e, r) for e, rs in extras.items() for r in rs]
        for extra, text in requirements:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name == "numba-cuda":
                assert extra == "cuda", f"{path}: numba-cuda outside the cuda extra"
            if name in pins:
                seen.add(name)
                assert pins[name] in req.specifier, (
                    f"{path}: {text} excludes the tested {pins[name]}"
                )
                assert any(s.operator == "<" for s in req.specifier), f"{path}: {text}: no bound"
    assert {"torch", "triton", "numba", "numba-cuda", "transformers"} <= seen


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
