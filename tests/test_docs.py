"""docs/: every "docs/X.md §N" the code cites names a file and a section that exist, every link
between the docs lands on an anchor, and no code cites the spec that is not in the repository."""
from __future__ import annotations

import re
from pathlib import Path


import k3c

ROOT = Path(k3c.__file__).resolve().parent
DOCS = ROOT / "docs"
CITATION = re.compile(r"docs/([\w-]+\.md)(?: §(\d+(?:\.\d+)?)(?:\s*[-–]\s*(\d+))?)?")
SPEC = re.compile(r"spec §", re.IGNORECASE)
HEADING = re.compile(r"^#+ §(\d+(?:\.\d+)?)\.? ", re.MULTILINE)
LINK = re.compile(r"\]\(((?:docs/)?[\w-]+\.md)(?:#([\w.-]+))?\)")
ANCHOR = re.compile(r'<a id="([\w.-]+)"></a>')


def python_files() -> list[Path]:
    """The package's modules, its tests and scripts: every .py under the repository but virtual
    environments, caches, other hidden folders and this file (whose examples are wrong on purpose)."""
    return [p for p in sorted(ROOT.rglob("*.py"))
            if p != Path(__file__).resolve() and not any(part.startswith(".") or part in ("__pycache__", "build", "venv")
                                                          for part in p.relative_to(ROOT).parts[:-1])]


def sections(doc: str) -> set[str]:
    return set(HEADING.findall((DOCS / doc).read_text()))


def bad_citations(text: str) -> list[str]:
    """Each "docs/X.md §N" (or §N-M) in ``text`` whose file or section does not exist."""
    bad = []
    for m in CITATION.finditer(text):
        doc, first, last = m.groups()
        if not (DOCS / doc).is_file():
            bad.append(f"{m.group(0)}: no {doc} in docs/")
            continue
        wanted = [first] if first else []
        if first and last:
            wanted = [str(n) for n in range(int(float(first)), int(last) + 1)]
        bad += [f"{m.group(0)}: no §{n} in {doc}" for n in wanted if n not in sections(doc)]
    return bad


def test_the_checker_catches_a_missing_file_or_section():
    assert bad_citations("see docs/model.md §1 and docs/model.md §1.3, docs/bundle.md §4") == []
    assert bad_citations("docs/model.md §0-8 and docs/pipeline.md") == []
    assert bad_citations("docs/model.md §9, docs/spec.md §1, docs/model.md §7-9") == [
        "docs/model.md §9: no §9 in model.md", "docs/spec.md §1: no spec.md in docs/",
        "docs/model.md §7-9: no §9 in model.md"]


def test_model_md_numbers_its_sections_as_the_code_cites_them():
    assert {str(n) for n in range(9)} <= sections("model.md")


def test_every_docs_citation_in_the_code_exists():
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in python_files() for b in bad_citations(p.read_text())]
    assert bad == []


def test_no_code_cites_the_spec():
    cites = [f"{p.relative_to(ROOT)}:{n}" for p in python_files()
             for n, line in enumerate(p.read_text().splitlines(), 1) if SPEC.search(line)]
    assert cites == []


def test_links_between_docs_land_on_anchors():
    bad = []
    for source in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        for doc, anchor in LINK.findall(source.read_text()):
            target = source.parent / doc
            if not target.is_file():
                bad.append(f"{source.name}: ({doc}) does not exist")
            elif anchor and anchor not in ANCHOR.findall(target.read_text()):
                bad.append(f"{source.name}: ({doc}#{anchor}) has no such anchor")
    assert bad == []
