"""The program's weights as named parameters, for both front ends (export.py, onnx_import.py): one
private ``util.global`` per parameter, initialised from ``#flow.parameter.named<"model"::"<name>">``
at the type it is stored in, and loaded where a function uses it. The bundle's archive (or an ONNX
bundle's checkpoint) provides the scope ``model`` at run time."""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import util

SCOPE = "model"


def declare_parameter(module_op: ir.Operation, name: str, stored: ir.RankedTensorType) -> str:
    """Define the global of parameter ``name`` at the top of ``module_op``; returns its symbol."""
    sym = "__param_" + name.replace(".", "_")
    with ir.InsertionPoint.at_block_begin(module_op.regions[0].blocks[0]), ir.Location.unknown():
        init = ir.Attribute.parse(f'#flow.parameter.named<"{SCOPE}"::"{name}"> : {stored}')
        util.GlobalOp(sym, ir.TypeAttr.get(stored), sym_visibility="private", initial_value=init)
    return sym


def load_parameter(sym: str, stored: ir.RankedTensorType, torch_type: ir.Type) -> ir.Value:
    """The parameter's value as a torch tensor of ``torch_type`` (same shape and dtype), at the
    current insertion point."""
    loaded = util.GlobalLoadOp(stored, ir.FlatSymbolRefAttr.get(sym)).result
    return ir.Operation.create("torch_c.from_builtin_tensor", results=[torch_type], operands=[loaded]).result
