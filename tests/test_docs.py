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


# the words of a project's own history (its runs and work items), which the repository never uses
HISTORY = re.compile(r"(first|second|third|[a-z]+th) session|issues? [0-9]+|bench-" + "issue", re.IGNORECASE)


def repository_files() -> list[Path]:
    """Every file of the repository but virtual environments, build outputs, caches and hidden folders."""
    skip = {"__pycache__", "build", "venv", "out", "k3c.egg-info"}
    return [p for p in sorted(ROOT.rglob("*")) if p.is_file()
            and not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts[:-1])]


def test_the_history_check_catches_its_words():
    assert HISTORY.search("as measured in the nin" + "th session") and HISTORY.search("(iss" + "ue 15)")
    assert not HISTORY.search("the session opens N devices; issues are welcome")


def test_no_file_speaks_of_how_the_project_was_made():
    found = [f"{p.relative_to(ROOT)}" for p in repository_files() if HISTORY.search(str(p.relative_to(ROOT)))]
    for p in repository_files():
        if p.is_file() and p.suffix in (".py", ".md", ".mlir", ".c", ".sh", ".toml", ".json", ""):
            found += [f"{p.relative_to(ROOT)}:{n}: {m.group(0)}" for n, line in
                      enumerate(p.read_text(errors="replace").splitlines(), 1) for m in [HISTORY.search(line)] if m]
    assert found == []


def test_readme_is_an_index():
    assert len((ROOT / "README.md").read_bytes()) < 8192


def test_benchmarks_page_is_what_the_bench_writes_from_its_runs():
    """docs/benchmarks.md equals the page `k3c bench --markdown` renders from the runs it names."""
    import shlex

    from k3c.interface.bench_report import page, read_runs
    text = (DOCS / "benchmarks.md").read_text()
    command = re.search(r"^Written by `([^`]+)`", text, re.MULTILINE).group(1)
    args = shlex.split(command)
    assert args[:4] == ["k3c", "bench", "--markdown", "docs/benchmarks.md"]
    assert page(read_runs([ROOT / a for a in args[4:]], DOCS), command, DOCS / "benchmarks.md") == text
