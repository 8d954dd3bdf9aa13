"""The configuration reference page (``docs/reference/config.md``), generated from the schema.

Every field's dotted name, type, default and one-line help come from ``config/schema.py`` through
:func:`~megarl.config.loader.field_help`, so the page cannot drift from the code:
``megarl config --fields --markdown`` prints it, and ``tests/test_docs.py`` fails when the
committed page differs from what this prints."""
from __future__ import annotations

import json
from typing import Any

from megarl.config.loader import field_help

HEADER = """# Configuration reference

Every field of a run's configuration, by section: its type, its default and what it does. A recipe
(`recipes/*.yaml`) sets some of them; `a.b=value` on the command line overrides any. Generated from
the schema by `megarl config --fields --markdown > docs/reference/config.md` -- do not edit by hand
(the tests compare this page with the schema).
"""


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table: one line, pipes escaped, ``<`` not read as HTML."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def _default(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict, tuple)):
        return f"`{json.dumps(value)}`"
    if isinstance(value, str):
        return f"`{value}`" if value else "`\"\"`"
    return f"`{value}`"


def fields_markdown() -> str:
    """The whole page: one table per top-level section (top-level scalars under "run")."""
    sections: dict[str, list[tuple[str, str, str, Any]]] = {}
    for name, type_name, help_text, default in field_help():
        section = name.split(".", 1)[0] if "." in name else "run"
        sections.setdefault(section, []).append((name, type_name, help_text, default))
    out = [HEADER]
    for section, rows in sections.items():
        out.append(f"## {section}\n")
        out.append("| field | type | default | meaning |")
        out.append("|---|---|---|---|")
        for name, type_name, help_text, default in rows:
            out.append(f"| `{name}` | {_cell(type_name)} | {_cell(_default(default))} | {_cell(help_text)} |")
        out.append("")
    return "\n".join(out)
