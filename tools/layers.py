"""``python -m k3c.tools.layers [PACKAGE_DIR]``: every import inside k3c checked against the layers.

The package is a stack of layers (LAYERS, bottom first; docs/pipeline.md §1 draws it). A module may
import from its own layer and the layers below it, never from one above: the graph of folders is
one-way. Every import is read with ``ast``, at module level and inside functions alike, absolute
(``k3c.x``) and relative (``..x``). Prints one line per import against the flow, and per module in a
folder the table does not name, and exits 1 if there is any; exits 0 silently otherwise.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "k3c"

# The layout, bottom to top: the one place it is written. A name is a top-level module or folder of
# the package; names in one tuple share a layer. "__init__" is the package's own __init__.py.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__init__", "errors", "utils"),   # the one exception type, shared helpers (atomic writes, hashing)
    ("ops",),                          # the k3 custom ops: schema, eager reference, lowerings; MXFP4, numerics
    ("model",),                        # reference model, config, checkpoint I/O
    ("exporter",),                     # torch.export -> torch-mlir, ONNX export and import
    ("passes",),                       # MLIR rewrites of the k3 custom ops
    ("compiler",),                     # the target table and iree-compile, the devices of this host
    ("artifacts",),                    # the bundle format: manifest, seal, open and verify
    ("runtimes",),                     # a session on an IREE device
    ("interface",),                    # orchestration the CLI delegates to: build, validate, bench
    ("cli",),                          # argument parsing
    ("tools",),                        # developer tools: may import anything
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def layer_of(module: str) -> str:
    """``k3c.passes.trace`` -> ``passes``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root`` (folders with an __init__.py;
    tests/, scripts/ and docs/ are not packages and are not read)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not all((root / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
            continue
        parts = [PACKAGE, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import of a module of the package, anywhere in ``tree``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != PACKAGE:
                continue
            if base == PACKAGE:  # from k3c import errors / from . import cli: the names are the modules
                found += [(node.lineno, f"{PACKAGE}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, base))
    return found


def check(root: Path) -> list[Finding]:
    """Every import against the flow, and every module outside the layout, in the package at ``root``."""
    findings = []
    for module, path in modules(root).items():
        layer = layer_of(module)
        if layer not in RANK:
            findings.append(Finding(path, 1, f"{module}: '{layer}' is not a layer of k3c.tools.layers.LAYERS"))
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in imported(tree, module, path.name == "__init__.py"):
            to = layer_of(target)
            if to in RANK and RANK[to] > RANK[layer]:
                findings.append(Finding(path, line, f"{module} ({layer}) imports {target} ({to}): against the flow"))
    return findings


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    findings = check(root)
    for f in findings:
        print(f)
    if findings:
        print(f"{len(findings)} import(s) against the layers, bottom first: "
              + " < ".join("/".join(names) for names in LAYERS), file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
