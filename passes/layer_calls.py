"""Layer placeholders -> calls of the layer bodies (docs/pipeline.md §5).

    %r:3 = torch.operator "torch.k3x.kda_layer"(%E, %at, %conv, %S, %str "kda_moe.prefill")
becomes
    %r':3 = func.call @call_body_kda_moe_prefill(builtin tensors of %E ... %S)
where ``@call_body_*`` converts to torch tensors and calls the imported body ``@body_*``
(exporter/export.py ``body_function``), which reads its layer's slice of the stacked parameters.

iree-compile inlines these calls. Kept out of line (``no_inline``, ``noinline``, ``iree.abi.stub``,
``stream.affinity`` and the torch-finalizing preprocessing flag, as measured in the depth notes),
IREE 3.13's interprocedural pass (iree-util-ipo) miscompiles the calls of these bodies: it loses the
size of a dynamically shaped result ("operation's operand is unlinked") and, with the sizes routed
around that, mixes up call operands (an 8-byte index buffer read as a 30 KB activation). So each
layer is still inlined, but over ~100 stacked globals instead of one per checkpoint tensor.
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import func as func_d

from ..exporter.export import body_function
from ..exporter.operators import custom_ops
from .trace import TensorType

PREFIX = "torch.k3x."


def _builtin(vtensor: ir.Type) -> ir.Type:
    return ir.Type.parse(str(TensorType.from_vtensor(str(vtensor))))


def _cast(value: ir.Value, to: ir.Type, op: str) -> ir.Value:
    return ir.Operation.create(op, results=[to], operands=[value]).result


def _wrapper(module: ir.Module, callee: str, args: list[ir.Type], results: list[ir.Type]) -> str:
    """Define ``@call_<callee>`` on builtin tensors around the torch-typed ``@callee``."""
    name = f"call_{callee}"
    with ir.InsertionPoint(module.body):
        f = func_d.FuncOp(name, ([_builtin(t) for t in args], [_builtin(t) for t in results]), visibility="private")
    block = f.add_entry_block()
    with ir.InsertionPoint(block):
        torch_args = [_cast(a, t, "torch_c.from_builtin_tensor") for a, t in zip(block.arguments, args)]
        call = func_d.CallOp(results, ir.FlatSymbolRefAttr.get(callee), torch_args)
        func_d.ReturnOp([_cast(r, _builtin(t), "torch_c.to_builtin_tensor") for r, t in zip(call.results, results)])
    return name


def call_layer_bodies(module: ir.Module) -> int:
    """Rewrite every ``torch.k3x.*`` layer placeholder into a call of its body's wrapper; returns
    how many were rewritten."""
    wrappers: dict[str, str] = {}
    count = 0
    with module.context, ir.Location.unknown():
        for _, op in custom_ops(module, prefix=PREFIX):
            tensors = [v for v in op.operands if str(v.type).startswith("!torch.vtensor")]
            key = next(ir.StringAttr(v.owner.attributes["value"]).value for v in op.operands
                       if str(v.type) == "!torch.str")
            callee = body_function(key)
            results = [r.type for r in op.results]
            if callee not in wrappers:
                wrappers[callee] = _wrapper(module, callee, [v.type for v in tensors], results)
            with ir.InsertionPoint(op), op.location:
                args = [_cast(v, _builtin(v.type), "torch_c.to_builtin_tensor") for v in tensors]
                call = func_d.CallOp([_builtin(t) for t in results], ir.FlatSymbolRefAttr.get(wrappers[callee]), args)
                for old, new in zip(op.results, call.results):
                    old.replace_all_uses_with(_cast(new, old.type, "torch_c.from_builtin_tensor"))
            op.erase()
            count += 1
    return count
