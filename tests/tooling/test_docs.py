"""The docs' generated parts (docs/hooks.py): the home page's op table comes from the specs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from cakeops.ops import SPECS

ROOT = Path(__file__).resolve().parents[2]


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


def test_benchmarks_page_shows_every_op_figure_by_figure():
    """Every op has a saved CPU record and its figures, one per case at the page's text width
    (7.5 in at 110 dpi) and one case high; the page's section lists exactly those."""
    page = (ROOT / "docs" / "content" / "benchmarks.md").read_text()
    assert "<!-- cakeops:plots -->" in page
    section = _hooks().plots_section()
    assert [line[5:-1] for line in section.splitlines() if line.startswith("### ")] == [
        f"{op}" for op in SPECS
    ]
    links = re.findall(r"\]\((bench/cpu/[^)]+\.png)\)", section)
    assert links and len(links) == 2 * len(set(links))  # each image links to itself
    for link in set(links):
        png = (ROOT / "docs" / "content" / link).read_bytes()
        width, height = (int.from_bytes(png[i : i + 4], "big") for i in (16, 20))
        assert width == 825 and height <= 700, (link, width, height)
