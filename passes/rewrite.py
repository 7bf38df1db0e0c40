"""Replace each ``torch.operator "torch.k3.<op>"`` by a call to its implementation.

    %r = torch.operator "torch.k3.op"(%a, ...)      becomes
    %a' = torch_c.to_builtin_tensor %a;  %r' = func.call @k3_op_<hash>(%a', ...);
    %r = torch_c.from_builtin_tensor %r'

One implementation per (op, operand types, constant arguments), from the op's lowering (ops/),
defined as a private function in the same module; iree-compile inlines and fuses it like any other
code.
"""
from __future__ import annotations

import hashlib
import math

from iree.compiler import ir
from iree.compiler.dialects import func as func_d

from ..exporter.operators import custom_ops
from ..ops.base import Generator, TensorType
from ..ops.mlir import merge_functions


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


def _is_tensor(value: ir.Value) -> bool:
    return str(value.type).startswith("!torch.vtensor")


# ops that only reshape or slice a tensor: through them, a slice that keeps every element is the same data
_VIEWS = {"torch.aten.slice.Tensor", "torch.aten.narrow", "torch.aten.select.int", "torch.prims.squeeze",
          "torch.aten.squeeze.dim", "torch.aten.unsqueeze", "torch.aten.view", "torch.aten.reshape"}


def _elements(vtensor: ir.Type) -> int | None:
    """Elements of a ``!torch.vtensor<[d, ...], t>`` of static shape, else None."""
    dims = str(vtensor).split("[", 1)[1].split("]", 1)[0]
    if "?" in dims:
        return None
    return math.prod(int(d) for d in dims.split(",") if d)


def _whole_parameter(value: ir.Value):
    """The ``torch_c.from_builtin_tensor`` of a ``util.global.load`` (a parameter, exporter/parameters.py)
    that ``value`` reads whole, maybe reshaped or sliced to every element (a layer group of one
    layer: its layer's slice is the whole stacked parameter); None if it reads anything else."""
    while True:
        op = value.owner
        if not isinstance(op, ir.OpView):
            return None
        name = op.operation.name
        if name == "torch_c.from_builtin_tensor":
            source = op.operands[0].owner
            return op if isinstance(source, ir.OpView) and source.operation.name == "util.global.load" else None
        if name not in _VIEWS or _elements(value.type) is None or _elements(value.type) != _elements(op.operands[0].type):
            return None
        value = op.operands[0]


def _bar(read) -> None:
    """Route a parameter read (``_whole_parameter``) through ``util.optimization_barrier``."""
    loaded = read.operands[0]
    with ir.InsertionPoint(read):
        read.operands[0] = ir.Operation.create("util.optimization_barrier", results=[loaded.type],
                                               operands=[loaded]).result


def lower_custom_op(module: ir.Module, op_name: str, generator: Generator) -> int:
    """Rewrite every ``op_name`` operator in ``module`` with implementations from ``generator``
    (sym, operand types, constants) -> MLIR texts. Returns how many operators were replaced."""
    impls: dict[tuple, str] = {}
    count = 0
    with module.context, ir.Location.unknown():
        for name, op in custom_ops(module):
            if name != op_name:
                continue
            tensors = [v for v in op.operands if _is_tensor(v)]
            # a parameter read whole (the LM head, the layers of a one-layer group) is a constant to
            # IREE, and whatever an implementation does to it (a bitcast, a relayout) a constant
            # expression that it would hoist into a copy made at load time: a barrier where it is
            # loaded keeps it a runtime value (never inside a layer loop: no such read is in one)
            for read in filter(None, map(_whole_parameter, tensors)):
                _bar(read)
            consts = [_constant(v) for v in op.operands if not _is_tensor(v)]
            types = TensorType.of([v.type for v in tensors])
            out_types = [t.builtin for t in TensorType.of([r.type for r in op.results])]
            key = (name, tuple(map(str, types)), tuple(consts))
            if key not in impls:
                sym = name.removeprefix("torch.").replace(".", "_") + "_" + hashlib.sha1(repr(key).encode()).hexdigest()[:10]
                for text in generator(sym, types, consts):
                    merge_functions(module, text, f"{name} ({sym})")
                impls[key] = sym
            with ir.InsertionPoint(op), op.location:
                args = [ir.Operation.create("torch_c.to_builtin_tensor", results=[t.builtin], operands=[v]).result
                        for v, t in zip(tensors, types)]
                call = func_d.CallOp(out_types, ir.FlatSymbolRefAttr.get(impls[key]), args)
                for old, new in zip(op.results, call.results):
                    back = ir.Operation.create("torch_c.from_builtin_tensor", results=[old.type], operands=[new])
                    old.replace_all_uses_with(back.result)
            op.erase()
            count += 1
    return count
