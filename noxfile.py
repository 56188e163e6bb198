"""Every dev task: ``nox -s tests``, ``lint``, ``demo``, ``bench``, ``docs``.

Each session builds and installs the distributions (wheels, not editable) into its own venv, with
torch pinned by ``.ci/constraints.txt``.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]

CONSTRAINTS = ("-c", ".ci/constraints.txt")
PACKAGES = ("./spec", "./packages/torch", "./packages/triton")
EXAMPLE_BACKEND = "./tests/example_backend"


def install(session: nox.Session, *extra: str) -> None:
    session.install(*CONSTRAINTS, *PACKAGES, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite: conformance on every in-tree backend, dispatch, CLI, packaging."""
    install(session, EXAMPLE_BACKEND, "pytest", "hatchling", "numpy")
    session.run("pytest", *session.posargs)
    # The documented command a third-party backend certifies itself with.
    session.run("pytest", "--pyargs", "cakeops.testing", "--cakeops-backend=example", "-q")
    # The Triton kernels on CPU tensors through Triton's interpreter (no GPU here).
    session.run(
        "pytest", "--pyargs", "cakeops.testing", "--cakeops-backend=triton", "-q",
        env={"TRITON_INTERPRET": "1"},
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: what is installed and chosen here, then a small forward/backward."""
    install(session)
    session.run("cakeops", "info")
    session.run("python", "docs/examples/quickstart.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks: time ratios, peak and saved memory (``-- --quick``: small)."""
    install(session, "numpy")
    # A full run refreshes the figures the docs show; a --quick run only prints.
    record = [] if "--quick" in session.posargs else ["--markdown", "docs/bench/cpu"]
    session.run("cakeops", "bench", "--json", "bench-results/bench.json", *record, *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site; warnings fail the build."""
    session.install("mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml", "-d", "../site")
