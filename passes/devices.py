"""Placement of a program over N devices (README "Past one device"; the exporter side is
exporter/devices.py).

- Each ``torch.operator "torch.k3dev.transfer"(%x, %k)`` becomes ``flow.tensor.transfer %x to
  #hal.device.promise<@__device_k>`` (between ``torch_c`` casts).
- Each parameter global gets ``stream.affinity = #hal.device.promise<@__device_k>``: k for a
  device's range of the experts (``...experts.d<k>...``), 0 for the rest. An unpinned global used
  on two devices would silently move to one and be copied every call (IREE 3.13).
- The entry points' arguments and results live on device 0 (``iree.abi.affinity``).

IREE then places each computation on the device of its operands; tests/test_devices.py reads the
placement back from the stream IR.
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith, flow, tensor

from ..exporter.devices import device_of
from ..exporter.entry_points import ENTRY_POINTS
from ..exporter.operators import custom_ops
from ..ops.base import TensorType
from .rewrite import _constant



def promise(device: int) -> ir.Attribute:
    return ir.Attribute.parse(f"#hal.device.promise<@__device_{device}>")


def place_on_devices(module: ir.Module) -> dict[str, int]:
    """Rewrite the transfers, pin the parameters and the entry points (module docstring); returns the
    counts of each."""
    counts = {"transfers": 0, "pinned parameters": 0}
    with module.context, ir.Location.unknown():
        for _, op in custom_ops(module, "torch.k3dev."):
            x, device = op.operands
            ttype = TensorType.of([x.type])[0].builtin
            with ir.InsertionPoint(op), op.location:
                b = ir.Operation.create("torch_c.to_builtin_tensor", results=[ttype], operands=[x]).result
                sizes = [tensor.DimOp(b, arith.ConstantOp(ir.IndexType.get(), i).result).result
                         for i in range(ttype.rank) if ttype.is_dynamic_dim(i)]
                moved = flow.TensorTransferOp(b, sizes, promise(_constant(device))).result
                back = ir.Operation.create("torch_c.from_builtin_tensor", results=[op.results[0].type],
                                           operands=[moved])
            op.results[0].replace_all_uses_with(back.result)
            op.erase()
            counts["transfers"] += 1
        for op in module.body.operations:
            if op.operation.name == "util.global" and "initial_value" in op.attributes:
                init = str(op.attributes["initial_value"])
                if init.startswith("#flow.parameter.named"):
                    name = init.split('::"', 1)[1].split('"', 1)[0]
                    op.attributes["stream.affinity"] = promise(device_of(name))
                    counts["pinned parameters"] += 1
            elif op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value in ENTRY_POINTS:
                ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                on0 = ir.DictAttr.get({"iree.abi.affinity": promise(0)})
                op.attributes["arg_attrs"] = ir.ArrayAttr.get([on0] * len(ftype.inputs))
                op.attributes["res_attrs"] = ir.ArrayAttr.get([on0] * len(ftype.results))
    return counts
