"""MLIR text in and out of the ops' lowerings: templates rendered by jinja2, texts parsed into a module.

The hand-written parts of a lowering (the ``scf.for`` wrappers, the streamed MXFP4 kernel) are the
files in ``templates/``, one per wrapper or kernel, filled with the operand types and sizes. A text
that does not parse is a bug in a lowering: ``parse`` raises a one-line K3Error naming the lowering
and the first diagnostic, and prints the text with line numbers to stderr, so the line can be read.
"""
from __future__ import annotations

import re
import sys

import jinja2

try:
    from iree.compiler import ir
except ImportError:  # iree-base-runtime alone runs a bundle; only lowering needs the compiler
    ir = None

from ..errors import K3Error

_LINE_COLUMN = re.compile(r":(\d+):(\d+)\)$")   # the end of a diagnostic's loc("-":3:12)
_TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("k3c.ops", "templates"),
                                undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                                keep_trailing_newline=True)


def render(template: str, **values) -> str:
    """``templates/<template>`` filled with ``values`` (types print as MLIR types)."""
    return _TEMPLATES.get_template(template).render(**values)


def numbered(text: str) -> str:
    lines = text.splitlines()
    width = len(str(len(lines)))
    return "\n".join(f"{n:>{width}} | {line}" for n, line in enumerate(lines, 1))


def parse(text: str, what: str, context: ir.Context | None = None) -> ir.Module:
    """``text`` parsed in ``context`` (default: the current one). On failure: the text, numbered,
    on stderr, and K3Error "passes: <what>: generated MLIR does not parse: line L, column C (the
    line): <first diagnostic>"."""
    try:
        return ir.Module.parse(text, context=context)
    except ir.MLIRError as e:
        first = e.error_diagnostics[0] if e.error_diagnostics else None
        message = " ".join((first.message if first is not None else str(e)).split())
        where = _LINE_COLUMN.search(str(first.location)) if first is not None else None
        lines = text.splitlines()
        if where and 0 < int(where[1]) <= len(lines):
            message = f"line {where[1]}, column {where[2]} ({lines[int(where[1]) - 1].strip()}): {message}"
        print(f"---- generated MLIR of {what}, which does not parse ----\n{numbered(text)}\n---- end of {what} ----",
              file=sys.stderr)
        raise K3Error(f"passes: {what}: generated MLIR does not parse: {message} (text printed above, numbered)") from None


def merge_functions(module: ir.Module, text: str, what: str) -> None:
    """Parse ``text`` in the module's context and move its function definitions in, private
    (declarations of functions another text defines are dropped)."""
    source = parse(text, what, module.context)  # held: its operations live as long as it does
    for f in list(source.body.operations):
        if len(f.regions[0].blocks) == 0:
            continue
        f.attributes["sym_visibility"] = ir.StringAttr.get("private", context=module.context)
        f.detach_from_parent()
        module.body.append(f)


def standalone(texts: list[str], public: str, what: str) -> str:
    """One module of the functions ``texts`` define, ``public`` the one entry point (tests, the bench)."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        for text in texts:
            merge_functions(module, text, what)
        for f in module.body.operations:
            if ir.StringAttr(f.attributes["sym_name"]).value == public:
                f.attributes["sym_visibility"] = ir.StringAttr.get("public")
        return str(module)
