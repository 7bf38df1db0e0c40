"""ONNX front end -> the k3 custom ops, so both front ends meet at the same lowerings (Pipeline).

torch-mlir's ONNX importer turns a node of the custom domain ``k3`` into
``torch.operator "onnx.<OpType>"`` with its ONNX attributes as ``torch.onnx.<name>``. ``to_k3_ops``
renames it ``torch.operator "torch.k3.<op>"`` and passes the attributes as ``torch.constant.*``
operands after the tensors, in the order of the op's torch schema (model/ops.py): exactly the form
the torch front end gives.

    torch.operator "onnx.Mxfp4ExpertFfn"(%z, ...) {torch.onnx.act = "situ", torch.onnx.beta1 = 4.0, ...}
    -> %act = torch.constant.str "situ" ...;  torch.operator "torch.k3.mxfp4_moe"(%z, ..., %act, %b1, %b2)
"""
from __future__ import annotations

import torch
from iree.compiler import ir

from ..model import ops  # noqa: F401  (registers torch.ops.k3.*)
from .rewrite import custom_ops

# ONNX op type in domain k3 -> torch.ops.k3.<name>
ONNX_TO_K3 = {"KdaChunk": "kda_chunk", "KdaStep": "kda_step", "Mxfp4ExpertFfn": "mxfp4_moe"}


def _torch_constant(attr: ir.Attribute) -> ir.Value:
    if isinstance(attr, ir.StringAttr):
        kind, value = "str", ir.StringAttr(attr)
    elif isinstance(attr, ir.FloatAttr):
        kind, value = "float", ir.FloatAttr.get(ir.F64Type.get(), ir.FloatAttr(attr).value)
    elif isinstance(attr, ir.IntegerAttr):
        kind, value = "int", ir.IntegerAttr.get(ir.IntegerType.get_signless(64), ir.IntegerAttr(attr).value)
    else:
        raise ValueError(f"no torch constant for ONNX attribute {attr}")
    return ir.Operation.create(f"torch.constant.{kind}", results=[ir.Type.parse(f"!torch.{kind}")],
                               attributes={"value": value}).result


def to_k3_ops(module: ir.Module) -> int:
    """Rewrite every imported k3-domain node as its ``torch.k3.*`` operator; returns how many."""
    count = 0
    with module.context, ir.Location.unknown():
        for name, op in custom_ops(module, prefix="onnx."):
            k3_name = ONNX_TO_K3.get(name.removeprefix("onnx."))
            if k3_name is None:
                continue
            schema = getattr(torch.ops.k3, k3_name).default._schema
            attributes = [a.name for a in schema.arguments if not isinstance(a.type, torch.TensorType)]
            with ir.InsertionPoint(op), op.location:
                consts = [_torch_constant(op.attributes[f"torch.onnx.{a}"]) for a in attributes]
                new = ir.Operation.create("torch.operator", results=[r.type for r in op.results],
                                          operands=[*op.operands, *consts],
                                          attributes={"name": ir.StringAttr.get(f"torch.k3.{k3_name}")})
            for old, result in zip(op.results, new.results):
                old.replace_all_uses_with(result)
            op.erase()
            count += 1
    return count
