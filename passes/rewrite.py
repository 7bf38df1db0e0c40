"""Replace each ``torch.operator "torch.k3.<op>"`` by a call to its implementation.

    %r = torch.operator "torch.k3.op"(%a, ...)      becomes
    %a' = torch_c.to_builtin_tensor %a;  %r' = func.call @k3_op_<hash>(%a', ...);
    %r = torch_c.from_builtin_tensor %r'

One implementation per (op, operand types, constant arguments), defined as a private function
in the same module; iree-compile inlines and fuses it like any other code.
"""
from __future__ import annotations

import hashlib

from iree.compiler import ir
from iree.compiler.dialects import func as func_d

from ..exporter.operators import custom_ops
from .trace import TensorType


def _constant(value: ir.Value):
    """The Python value of a torch.constant.* operand (op attributes are baked into the impl)."""
    op = value.owner
    kind = op.name.removeprefix("torch.constant.")
    attr = op.attributes["value"] if "value" in op.attributes else None
    if kind == "float":
        return ir.FloatAttr(attr).value
    if kind == "int":
        return ir.IntegerAttr(attr).value
    if kind == "bool":
        return ir.BoolAttr(attr).value
    if kind == "str":
        return ir.StringAttr(attr).value
    if kind == "none":
        return None
    raise ValueError(f"custom op operand from {op.name} is not a constant")


def merge_functions(module: ir.Module, text: str) -> None:
    """Parse ``text`` in the module's context and move its function definitions in, private."""
    source = ir.Module.parse(text, context=module.context)
    for f in list(source.body.operations):
        if len(f.regions[0].blocks) == 0:  # a declaration of a function defined in another text
            continue
        f.attributes["sym_visibility"] = ir.StringAttr.get("private")
        f.detach_from_parent()
        module.body.append(f)


def lower_custom_op(module: ir.Module, op_name: str, generator) -> int:
    """Rewrite every ``op_name`` operator in ``module`` with implementations from ``generator``
    (sym, operand types, constants) -> MLIR texts. Returns how many operators were replaced."""
    impls: dict[tuple, str] = {}
    count = 0
    with module.context, ir.Location.unknown():
        for name, op in custom_ops(module):
            if name != op_name:
                continue
            tensors, types, consts = [], [], []
            for v in op.operands:
                if str(v.type).startswith("!torch.vtensor"):
                    tensors.append(v)
                    types.append(TensorType.from_vtensor(str(v.type)))
                else:
                    consts.append(_constant(v))
            out_types = [TensorType.from_vtensor(str(r.type)) for r in op.results]
            key = (name, tuple(map(str, types)), tuple(consts))
            if key not in impls:
                sym = name.removeprefix("torch.").replace(".", "_") + "_" + hashlib.sha1(repr(key).encode()).hexdigest()[:10]
                for text in generator(sym, types, consts):
                    merge_functions(module, text)
                impls[key] = sym
            with ir.InsertionPoint(op), op.location:
                args = [ir.Operation.create("torch_c.to_builtin_tensor", results=[ir.Type.parse(str(t))],
                                            operands=[v]).result for v, t in zip(tensors, types)]
                call = func_d.CallOp([ir.Type.parse(str(t)) for t in out_types], ir.FlatSymbolRefAttr.get(impls[key]), args)
                for old, new in zip(op.results, call.results):
                    back = ir.Operation.create("torch_c.from_builtin_tensor", results=[old.type], operands=[new])
                    old.replace_all_uses_with(back.result)
            op.erase()
            count += 1
    return count
