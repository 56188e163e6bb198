"""mkdocs hooks: the per-backend dtype tables come from the backend registry, not from prose,
and the "Ops" section of the navigation lists every page in ``ops/`` (a new op's page needs no
edit of ``mkdocs.yml``).

A page line ``<!-- cakeops:dtypes OP -->`` becomes a table of every installed backend that
implements OP: the input dtypes it declares and the devices it serves with their priority
(``explicit only`` where it runs only when chosen). The docs build installs the in-tree backends.
"""

from __future__ import annotations

import re
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16", "float64")
MARKER = re.compile(r"^<!-- cakeops:dtypes (\w+) -->$", re.M)


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
    return MARKER.sub(lambda m: _table(m.group(1)), markdown)


def on_config(config, **_kwargs):
    """Fill the nav's "Ops" section with ``ops/*.md``, sorted."""
    pages = sorted(Path(config["docs_dir"], "ops").glob("*.md"))
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and "Ops" in entry:
            entry["Ops"] = [{p.stem: f"ops/{p.name}"} for p in pages]
    return config
