"""mkdocs hooks: the per-backend dtype tables come from the backend registry, not from prose,
and the "Ops" section of the navigation lists every page in ``ops/`` (a new op's page needs no
edit of ``mkdocs.yml``).

A page line ``<!-- cakeops:dtypes OP -->`` becomes a table of every installed backend that
implements OP: the input dtypes it declares and the devices it serves with their priority
(``explicit only`` where it runs only when chosen). The docs build installs the in-tree backends.

A page line ``<!-- cakeops:ops -->`` becomes the table of every op in the specs: its page, what
it computes (its function's summary line), the tensors it differentiates and the backends that
implement it. A new op appears there with no edit of the page.

A page line ``<!-- cakeops:plots -->`` becomes, per op with a saved CPU record
(``docs/bench/cpu/<op>.json``, which ``nox -s bench`` writes), a heading and that run's figures
(``content/bench/cpu/<op>/``, one per case), linked at full size: a new case or op appears with
no edit of the page, and a figure no record names is reported.
"""

from __future__ import annotations

import re
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16", "float64")
MARKER = re.compile(r"^<!-- cakeops:dtypes (\w+) -->$", re.M)
OPS_MARKER = re.compile(r"^<!-- cakeops:ops -->$", re.M)
PLOTS_MARKER = re.compile(r"^<!-- cakeops:plots -->$", re.M)
DOCS = Path(__file__).parent


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph, one line, in Markdown (``x`` becomes `x`)."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")


def _ops_table() -> str:
    import cakeops
    from cakeops import registry
    from cakeops.ops import SPECS

    lines = ["| op | what | gradients for | backends |", "| --- | --- | --- | --- |"]
    for op, spec in SPECS.items():
        function = getattr(cakeops, op)
        grads = ", ".join(f"`{n}`" for n in spec.differentiable)
        backends = ", ".join(
            f"`{name}`" for name, b in sorted(registry.backends().items()) if op in b.ops
        )
        lines.append(f"| [`{op}`](ops/{op}.md) | {_summary(function.__doc__)} | {grads} | "
                     f"{backends} |")  # fmt: skip
    return "\n".join(lines)


def plots_section() -> str:
    """Every saved CPU record's figures, op by op in the specs' order, as page-relative links;
    a ``ValueError`` for a figure missing or one that no record names."""
    import json

    from cakeops.bench.plots import plot_paths
    from cakeops.ops import SPECS

    folder = DOCS / "content" / "bench" / "cpu"
    named: set[Path] = set()
    parts = []
    for op in SPECS:
        saved = DOCS / "bench" / "cpu" / f"{op}.json"
        if not saved.exists():
            continue
        record = json.loads(saved.read_text())
        parts.append(f"### `{op}`\n")
        for row, path in zip(record["results"][op], plot_paths(record, folder)[op], strict=True):
            if not path.exists():
                raise ValueError(f"{path} is missing: cakeops bench --from-json {saved} --plots "
                                 f"{folder}")  # fmt: skip
            named.add(path)
            link = path.relative_to(DOCS / "content").as_posix()
            parts.append(f"[![{op}, {row['case']}, {row['dtype']}]({link})]({link})\n")
    stray = sorted(set(folder.rglob("*.png")) - named)
    if stray:
        raise ValueError(f"figures no saved record names: {[str(p) for p in stray]}")
    return "\n".join(parts)


def _table(op: str) -> str:
    from cakeops import registry
    from cakeops._spec import dtype_name

    lines = [
        f"| backend | {' | '.join(DTYPES)} | devices (priority of the automatic choice) |",
        "| --- |" + " --- |" * (len(DTYPES) + 1),
    ]
    for name, backend in sorted(registry.backends().items()):
        kernels = backend.ops.get(op)
        if kernels is None:
            continue
        declared = {dtype_name(d) for d in kernels.dtypes}
        marks = ["yes" if d in declared else "no" for d in DTYPES]
        devices = ", ".join(
            f"{'any' if d == '*' else d}: {'explicit only' if p is None else p}"
            + (
                f" ({', '.join(dtype_name(t) for t in kernels.device_dtypes[d])} only)"
                if d in kernels.device_dtypes
                else ""
            )
            for d, p in kernels.devices.items()
        )
        lines.append(f"| `{name}` | {' | '.join(marks)} | {devices} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_kwargs) -> str:
    markdown = OPS_MARKER.sub(lambda m: _ops_table(), markdown)
    markdown = PLOTS_MARKER.sub(lambda m: plots_section(), markdown)
    return MARKER.sub(lambda m: _table(m.group(1)), markdown)


def on_config(config, **_kwargs):
    """Fill the nav's "Ops" section with ``ops/*.md``, sorted."""
    pages = sorted(Path(config["docs_dir"], "ops").glob("*.md"))
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and "Ops" in entry:
            entry["Ops"] = [{p.stem: f"ops/{p.name}"} for p in pages]
    return config
