"""The docs' generated parts (docs/hooks.py): the home page's op table comes from the specs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cakeops.ops import SPECS

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_home_page_lists_every_op_from_the_specs():
    page = (ROOT / "docs" / "content" / "index.md").read_text()
    assert "<!-- cakeops:ops -->" in page
    table = _hooks().on_page_markdown("<!-- cakeops:ops -->")
    rows = [r for r in table.splitlines() if r.startswith("| [`")]
    assert [r.split("`")[1] for r in rows] == list(SPECS)
    for op, row in zip(SPECS, rows, strict=True):
        assert f"(ops/{op}.md)" in row and (ROOT / "docs" / "content" / "ops" / f"{op}.md").exists()
        assert "`torch`" in row and "`reference`" in row
        assert all(f"`{name}`" in row for name in SPECS[op].differentiable)
