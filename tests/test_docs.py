"""The front door holds: the README is short and its links resolve, the documentation site builds
with ``mkdocs build --strict`` (broken links, pages missing from the nav and missing snippet files
fail it), the configuration reference is the schema's, and every error class megarl raises is on
the troubleshooting page."""
from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import megarl
from megarl.config.reference import fields_markdown
from megarl.errors import MISSING, OOM_NAMES, PATH_ERRORS

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_short_and_every_link_resolves():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    targets = [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]
    assert targets, "the README links to the docs"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, missing


def test_docs_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pages = {p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")}
    built = {p.parent.relative_to(tmp_path / "site") for p in (tmp_path / "site").rglob("index.html")}
    assert {Path(str(p).removesuffix("/index")) for p in pages if p.name != "index"} <= built
    # the snippets are in: the architecture page carries ARCHITECTURE.md, the results page RESULTS.md
    arch = (tmp_path / "site" / "architecture" / "index.html").read_text()
    assert "Contracts with SGLang" in arch and "--8&lt;--" not in arch


def test_config_reference_page_is_the_schema():
    committed = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert committed == fields_markdown(), ("docs/reference/config.md is stale: "
                                            "megarl config --fields --markdown > docs/reference/config.md")


def _megarl_exceptions() -> set[str]:
    for module in pkgutil.walk_packages(megarl.__path__, "megarl."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found: set[str] = set()

    def walk(cls: type) -> None:
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("megarl.") and sub.__module__ != "megarl.errors":
                found.add(sub.__name__)
            walk(sub)
    walk(BaseException)
    return found


def test_every_error_class_is_on_the_troubleshooting_page():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    names = _megarl_exceptions() | {c.__name__ for c in (*MISSING, *PATH_ERRORS)} | set(OOM_NAMES)
    assert len(names) > 20
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", page))
    assert not missing, f"docs/troubleshooting.md does not mention {missing}"
