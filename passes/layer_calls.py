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
from iree.compiler.dialects import arith, scf, tensor
from iree.compiler.dialects import func as func_d

from ..errors import K3Error
from ..exporter.export import body_function, run_function
from ..exporter.operators import custom_ops
from ..ops.base import TensorType

PREFIX = "torch.k3x."
LOOP = "torch.k3x.layer_loop"
LOOP_MARK = "k3c.layer_loop"        # unit attribute on the scf.for of a layer run


TORCH_INT = "!torch.int"


def _builtin(torch_type: ir.Type) -> ir.Type:
    """The builtin type of a torch value: a tensor's, or i64 for ``!torch.int``."""
    if str(torch_type) == TORCH_INT:
        return ir.IntegerType.get_signless(64)
    return TensorType.of([torch_type])[0].builtin


def _cast(value: ir.Value, to: ir.Type, op: str) -> ir.Value:
    return ir.Operation.create(op, results=[to], operands=[value]).result


def _to_builtin(value: ir.Value) -> ir.Value:
    op = "torch_c.to_i64" if str(value.type) == TORCH_INT else "torch_c.to_builtin_tensor"
    return _cast(value, _builtin(value.type), op)


def _from_builtin(value: ir.Value, to: ir.Type) -> ir.Value:
    return _cast(value, to, "torch_c.from_i64" if str(to) == TORCH_INT else "torch_c.from_builtin_tensor")


def _wrapper(module: ir.Module, callee: str, args: list[ir.Type], results: list[ir.Type]) -> str:
    """Define ``@call_<callee>`` on builtin tensors around the torch-typed ``@callee``."""
    name = f"call_{callee}"
    with ir.InsertionPoint(module.body):
        f = func_d.FuncOp(name, ([_builtin(t) for t in args], [_builtin(t) for t in results]), visibility="private")
    block = f.add_entry_block()
    with ir.InsertionPoint(block):
        torch_args = [_from_builtin(a, t) for a, t in zip(block.arguments, args)]
        call = func_d.CallOp(results, ir.FlatSymbolRefAttr.get(callee), torch_args)
        func_d.ReturnOp([_to_builtin(r) for r in call.results])
    return name


def _constant(value: ir.Value):
    attr = value.owner.attributes["value"]
    return ir.StringAttr(attr).value if str(value.type) == "!torch.str" else ir.IntegerAttr(attr).value


def loop_layer_runs(module: ir.Module) -> int:
    """Rewrite every ``torch.k3x.layer_loop`` into an scf.for over its iterations k whose body calls
    the run's function (exporter/export.py ``run_function``) on (k, *carry, *given); returns how many
    loops were made. The loop carries the builtin-tensor forms of the carry."""
    count = 0
    with module.context, ir.Location.unknown():
        for _, op in custom_ops(module, prefix=LOOP):
            carry_list, given_list, trips, key = op.operands
            carry, given = list(carry_list.owner.operands), list(given_list.owner.operands)
            unpack = [u.owner for u in op.results[0].uses]
            if len(unpack) != 1 or unpack[0].name != "torch.prim.ListUnpack":
                raise K3Error("passes: a layer_loop's results must be unpacked once")
            callee = run_function(_constant(key))
            k_type = ir.Type.parse("!torch.vtensor<[1],si64>")
            wrapper = _wrapper(module, callee, [k_type] + [v.type for v in carry + given], [v.type for v in carry])
            with ir.InsertionPoint(op), op.location:
                index = ir.IndexType.get()
                bounds = [arith.ConstantOp(index, n).result for n in (0, _constant(trips), 1)]
                init = [_to_builtin(v) for v in carry]
                fixed = [_to_builtin(v) for v in given]
                loop = scf.ForOp(*bounds, init)
                loop.operation.attributes[LOOP_MARK] = ir.UnitAttr.get()
                with ir.InsertionPoint(loop.body):
                    k = arith.IndexCastOp(ir.IntegerType.get_signless(64), loop.induction_variable).result
                    k = tensor.FromElementsOp(ir.RankedTensorType.get([1], k.type), [k]).result
                    call = func_d.CallOp([v.type for v in init], ir.FlatSymbolRefAttr.get(wrapper),
                                         [k, *loop.inner_iter_args, *fixed])
                    scf.YieldOp(call.results)
                for old, new, v in zip(unpack[0].results, loop.results, carry):
                    old.replace_all_uses_with(_from_builtin(new, old.type))
            unpack[0].erase()
            op.erase()
            for lst in (carry_list, given_list):
                if not list(lst.uses):
                    lst.owner.erase()
            count += 1
    return count


def inline_loop_bodies(module: ir.Module) -> int:
    """Inline, transitively, every function called from inside a layer loop (the run's wrapper, the
    run, the layer bodies, the custom ops' implementations); returns how many calls were inlined.

    iree-compile's own inliner runs after the torch lowering, which writes the dynamic sizes of the
    layers' tensors as ``affine.apply`` over ``tensor.dim`` values; inside an ``scf.for`` those are
    not valid affine symbols, so MLIR refuses to inline such a function into the loop and the call
    is left for iree-compile's function conversion, which does not convert calls nested in regions
    ("does not reference a valid function"). Inlined here, at the torch level, the layer's ops are
    lowered in place inside the loop."""
    functions = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                 if op.operation.name == "func.func"}
    count = 0
    with module.context, ir.Location.unknown():
        pending = [c for loop in _layer_loops(module) for c in _calls(loop)]
        while pending:
            call = pending.pop()
            callee = functions[ir.FlatSymbolRefAttr(call.attributes["callee"]).value]
            pending += _inline(call, callee)
            count += 1
    return count


def _layer_loops(module: ir.Module) -> list[ir.Operation]:
    loops = []

    def visit(op):
        if op.name == "scf.for" and LOOP_MARK in op.attributes:
            loops.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return loops


def _calls(op: ir.Operation) -> list[ir.Operation]:
    found = []

    def visit(o):
        if o.name == "func.call":
            found.append(o)
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return found


def _inline(call: ir.Operation, callee) -> list[ir.Operation]:
    """Replace ``call`` by a copy of ``callee``'s body; returns the calls in the copy."""
    block = callee.regions[0].blocks[0]
    mapping = {arg: value for arg, value in zip(block.arguments, call.operands)}
    new_calls = []
    with ir.InsertionPoint(call):
        for op in block.operations:
            if op.operation.name == "func.return":
                results = [mapping.get(v, v) for v in op.operands]
                break
            copy = op.operation.clone()
            copy.walk(lambda o: _remap(o, mapping))
            new_calls += _calls(copy)
            for old, new in zip(op.results, copy.results):
                mapping[old] = new
    for old, new in zip(call.results, results):
        old.replace_all_uses_with(new)
    call.erase()
    return new_calls


def _remap(op: ir.Operation, mapping: dict) -> ir.WalkResult:
    for i, v in enumerate(op.operands):
        if v in mapping:
            op.operands[i] = mapping[v]
    return ir.WalkResult.ADVANCE




def call_layer_bodies(module: ir.Module) -> int:
    """Rewrite every ``torch.k3x.*`` layer placeholder into a call of its body's wrapper; returns
    how many were rewritten.

    A placeholder's operands are (E, at, j, *state tensors[, width], body key) (exporter/layers.py);
    the body takes (E, at, j, *state). Outside a layer loop each call's positions ``at`` and ``j``
    pass through ``util.optimization_barrier``, so that iree-compile folds no layer's positions into
    its body: a layer written out then reads its weights at a run-time offset into the stacked
    parameters as a layer in a loop does (there ``j`` is computed from the loop's counter), and
    every layer of a body form compiles to one set of dispatches, however many layers are written
    out; nor are constant-offset slices of the weights hoisted into copies made at load time
    (docs/pipeline.md §5). (Inside a loop a barrier breaks IREE 3.13's stream scheduling, "failed to
    solve for timepoint coverage", and is not needed.)"""
    wrappers: dict[str, str] = {}
    count = 0
    with module.context, ir.Location.unknown():
        for _, op in custom_ops(module, prefix=PREFIX):
            E, at, j, *rest = op.operands
            operands = [E, at, j] + [v for v in rest if str(v.type).startswith("!torch.vtensor")]
            key = next(ir.StringAttr(v.owner.attributes["value"]).value for v in op.operands
                       if str(v.type) == "!torch.str")
            callee = body_function(key)
            results = [r.type for r in op.results]
            if callee not in wrappers:
                wrappers[callee] = _wrapper(module, callee, [v.type for v in operands], results)
            with ir.InsertionPoint(op), op.location:
                args = [_to_builtin(v) for v in operands]
                if not _enclosing_function(op).startswith(run_function("")):   # not in a run's iteration
                    args[1:3] = [_cast(v, v.type, "util.optimization_barrier") for v in args[1:3]]
                call = func_d.CallOp([_builtin(t) for t in results], ir.FlatSymbolRefAttr.get(wrappers[callee]), args)
                for old, new in zip(op.results, call.results):
                    old.replace_all_uses_with(_from_builtin(new, old.type))
            op.erase()
            count += 1
    return count


def _enclosing_function(op) -> str:
    parent = op.operation.parent
    while parent.name != "func.func":
        parent = parent.parent
    return ir.StringAttr(parent.attributes["sym_name"]).value
