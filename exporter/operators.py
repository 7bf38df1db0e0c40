"""Finding the custom operators of an imported module (``torch.operator "<prefix><name>"``)."""
from __future__ import annotations

from iree.compiler import ir


def custom_ops(module: ir.Module, prefix: str = "torch.k3.") -> list[tuple[str, ir.Operation]]:
    found = []

    def visit(op):
        if op.name == "torch.operator":
            name = ir.StringAttr(op.attributes["name"]).value
            if name.startswith(prefix):
                found.append((name, op.opview if hasattr(op, "opview") else op))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found
