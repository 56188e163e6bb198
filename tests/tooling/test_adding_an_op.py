"""The architecture page's "Adding an op", followed to the letter: a toy op added to copies of
the spec package and of the torch backend, in the page's files and nowhere else, is then an
op everywhere the page promises."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import cakeops
import cakeops_torch

ROOT = Path(__file__).resolve().parents[2]
OP = "toy_scale"

#: The page's files, by the path its list gives (the backend package is the torch backend's).
FILES = {
    f"spec/src/cakeops/ops/{OP}.py": '''
        """Spec of ``toy_scale``: ``y = scale * x`` (the architecture test's toy op)."""

        from __future__ import annotations

        import dataclasses
        from collections.abc import Callable

        import torch
        from torch import Tensor

        from cakeops import _spec, opspec
        from cakeops.opspec import OpInputs, OpSpec

        OP = "toy_scale"


        @dataclasses.dataclass(frozen=True, eq=False)
        class Inputs(OpInputs):
            op = OP
            x: torch.Tensor
            scale: float = 2.0


        Kernels = opspec.Kernels[
            Callable[[Tensor, float], Tensor],
            Callable[[Tensor, Tensor, float], tuple[Tensor, ...]],
        ]


        def check(a: Inputs) -> Inputs:
            _spec.check_float_dtype(OP, "x", a.x)
            return a


        def example(device="cpu", dtype=torch.float32) -> Inputs:
            return Inputs(torch.randn(4, 8, device=device, dtype=dtype))


        SPEC = OpSpec(inputs=Inputs, check=check, example=example)


        def toy_scale(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
            """Scale a tensor: ``scale * x``."""
            return SPEC.call(x, scale)
    ''',
    f"spec/src/cakeops/reference/{OP}.py": '''
        """Float64 reference math of ``toy_scale``."""


        def forward(x, scale):
            return (x.double() * scale).to(x.dtype)


        def backward(g, x, scale):
            return ((g.double() * scale).to(x.dtype),)
    ''',
    f"packages/torch/src/cakeops_torch/{OP}.py": '''
        """``toy_scale`` in PyTorch."""


        def forward(x, scale):
            return x * scale


        def backward(g, x, scale):
            return (g * scale,)
    ''',
    f"docs/content/ops/{OP}.md": "# toy_scale\n\n`scale * x`.\n",
}

CHECKS = textwrap.dedent(
    f"""
    import importlib.util, sys
    import torch
    import cakeops
    from cakeops.cli import OP_NAMES
    from cakeops.ops import SPECS

    assert cakeops.__file__.startswith(sys.argv[1]), cakeops.__file__
    assert "{OP}" in SPECS and "{OP}" in OP_NAMES
    from cakeops.ops.{OP} import {OP}

    x = torch.randn(3, 5, requires_grad=True)
    y = {OP}(x, 3.0)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert torch.allclose(y, 3 * x) and torch.allclose(dx, torch.full_like(x, 3.0))
    assert cakeops.explain("{OP}", x).backend == "torch"
    with cakeops.use_backend("reference", op="{OP}"):
        assert torch.allclose({OP}(x), 2 * x)
    assert "{OP}" in str(cakeops.cli.gather_info())
    spec = importlib.util.spec_from_file_location("hooks", sys.argv[2])
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    config = hooks.on_config({{"docs_dir": sys.argv[3], "nav": [{{"Ops": []}}]}})
    assert {{"{OP}": "ops/{OP}.md"}} in config["nav"][0]["Ops"]
    assert "`{OP}`" in hooks.on_page_markdown("<!-- cakeops:ops -->")
    print("ok")
    """
)


def test_a_new_op_is_the_pages_four_files_and_nothing_else(tmp_path):
    """The page's list names four files; the toy op written in exactly those (copies of the
    installed spec package and torch backend, the docs' ops folder) is a custom op with
    autograd, in ``cakeops.ops.SPECS``, the CLI's op names and ``cakeops info``, chosen by
    ``explain``, run by ``use_backend``, listed by the docs' navigation and home-page table,
    and passes the generic conformance suite on the torch backend."""
    page = (ROOT / "docs" / "content" / "architecture.md").read_text()
    section = page[page.index("## Adding an op") :].split("\n## ")[0]
    listed = re.findall(r"^\d\. `([^`]+)`", section, re.M)
    assert listed == [
        "spec/src/cakeops/ops/<op>.py",
        "spec/src/cakeops/reference/<op>.py",
        "<backend package>/<op>.py",
        "docs/content/ops/<op>.md",
    ]
    assert "Four files, no edit anywhere else" in section
    site = tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(cakeops.__file__).parent, site / "cakeops", ignore=ignore)
    shutil.copytree(Path(cakeops_torch.__file__).parent, site / "cakeops_torch", ignore=ignore)
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs" / "content" / "ops", docs / "ops")
    shutil.copy(ROOT / "docs" / "hooks.py", tmp_path / "hooks.py")
    where = {
        "spec/src/cakeops/": site / "cakeops",
        "packages/torch/src/cakeops_torch/": site / "cakeops_torch",
        "docs/content/": docs,
    }
    for path, text in FILES.items():
        prefix = next(p for p in where if path.startswith(p))
        target = where[prefix] / path[len(prefix) :]
        target.write_text(textwrap.dedent(text).lstrip())
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("CAKEOPS_BACKEND", None)
    run = {"env": env, "capture_output": True, "text": True, "timeout": 600, "cwd": tmp_path}
    done = subprocess.run(
        [sys.executable, "-c", CHECKS, str(site), str(tmp_path / "hooks.py"), str(docs)], **run
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    suite = [sys.executable, "-m", "pytest", "--pyargs", "cakeops.testing", "-q", "-p",
             "no:cacheprovider", "--cakeops-backend=torch", "-k", OP]  # fmt: skip
    done = subprocess.run(suite, **run)
    passed = re.search(r"(\d+) passed", done.stdout)
    assert done.returncode == 0 and passed and int(passed.group(1)) >= 10, done.stdout[-3000:]
