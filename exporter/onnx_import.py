"""An ONNX export directory (onnx_export.py) -> the torch-dialect module the torch front end gives.

    check each model (opset, custom ops, external data)  -> ONNX shape inference
    -> torch-mlir's ONNX importer (IREE's copy): prefill and decode as two functions of one module;
       each external-data initializer becomes ``util.global`` ``#flow.parameter.named<"model"::"<name>">``
       at its stored dtype, shared by both functions, so the bundle reads the checkpoint at run time
    -> to_k3_ops: k3-domain nodes -> ``torch.operator "torch.k3.*"``
    -> convert-torch-onnx-to-torch: the remaining ONNX nodes -> torch ops

From there Pipeline() lowers the k3 ops exactly as for the torch front end.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from iree.compiler import ir, passmanager
from iree.compiler.extras import onnx_importer
from iree.compiler.tools.import_onnx.importer_externalization_overrides import ELEM_TYPE_TO_SIGNLESS_IR_TYPE

from ..errors import K3Error
from ..utils.files import inside, sha256_file
from .entry_points import REQUIRED
from .onnx_export import MANIFEST
from .onnx_ops import DOMAIN, DOMAIN_VERSION, ONNX_TO_K3, OPSET
from .operators import custom_ops
from .parameters import declare_parameter, load_parameter



@dataclass
class ImportedModule:
    module: ir.Module
    manifest: dict        # the export directory's k3c-onnx.json


def load_checked(path: Path) -> onnx.ModelProto:
    """Load one ONNX model (external data left on disk) after checking what k3c can compile: the
    default opset k3c exports, only the k3 custom ops, every external-data file present; then
    ``onnx.checker`` with full_check. Each problem is a one-line K3Error naming it."""
    if not path.is_file():
        raise K3Error(f"onnx: {path} does not exist")
    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, ValueError) as e:
        raise K3Error(f"onnx: {path} is not an ONNX model ({e})") from None
    for opset in model.opset_import:
        domain = opset.domain or "ai.onnx"
        supported = {"ai.onnx": OPSET, DOMAIN: DOMAIN_VERSION}.get(domain)
        if opset.version != supported:
            want = f"k3c reads {domain} version {supported}" if supported else "k3c knows only ai.onnx and k3"
            raise K3Error(f"onnx: {path.name} imports opset {domain} version {opset.version}, which k3c does not support ({want})")
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") and (node.domain != DOMAIN or node.op_type not in ONNX_TO_K3):
            raise K3Error(f"onnx: {path.name}: node {node.name!r} is the unknown custom op {node.domain}.{node.op_type} "
                          f"(k3c knows {', '.join(f'{DOMAIN}.{op}' for op in ONNX_TO_K3)})")
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next(e.value for e in tensor.external_data if e.key == "location")
            if Path(location).is_absolute() or not inside(path.parent / location, path.parent):
                raise K3Error(f"onnx: {path.name}: external data file {location} of initializer "
                              f"{tensor.name!r} is outside {path.parent}")
            if not (path.parent / location).is_file():
                raise K3Error(f"onnx: {path.name}: external data file {location} of initializer "
                              f"{tensor.name!r} is missing from {path.parent}")
    try:
        onnx.checker.check_model(path, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise K3Error(f"onnx: {path.name} fails onnx.checker: {str(e).strip().splitlines()[0]}") from None
    return model


def matvec_as_matmul(model: onnx.ModelProto) -> None:
    """Rewrite each MatMul of an N-D (N >= 3) tensor by a vector as Squeeze(MatMul(A, Unsqueeze(b)), -1),
    the same product: IREE 3.13 cannot lower that form of torch.aten.matmul (the torch front end
    never meets it: torch's decompositions turn it into mm)."""
    graph = model.graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*graph.value_info, *graph.input, *graph.output)}
    ranks.update({t.name: len(t.dims) for t in graph.initializer})
    nodes = []
    for node in graph.node:
        a, b = node.input[:2] if node.op_type == "MatMul" else ("", "")
        if node.op_type != "MatMul" or ranks.get(b) != 1 or ranks.get(a, 0) < 3:
            nodes.append(node)
            continue
        axes, column, product = (f"{node.name}/{x}" for x in ("axes", "column", "product"))
        nodes += [onnx.helper.make_node("Constant", [], [axes], value=onnx.numpy_helper.from_array(np.array([-1]))),
                  onnx.helper.make_node("Unsqueeze", [b, axes], [column]),
                  onnx.helper.make_node("MatMul", [a, column], [product], name=node.name),
                  onnx.helper.make_node("Squeeze", [product, axes], [node.output[0]])]
    del graph.node[:]
    graph.node.extend(nodes)


def read_manifest(directory: Path) -> dict:
    """The export directory's manifest, its fields typed, its checkpoint and files inside the directory."""
    path = directory / MANIFEST
    if not path.is_file():
        raise K3Error(f"onnx: {directory} has no {MANIFEST} (not a k3c ONNX export)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise K3Error(f"onnx: {path} is not valid JSON ({e})") from None
    types = {"checkpoint": str, "checkpoint_hash": str, "config_hash": str, "max_prompt": int, "files": dict,
             "entry_points": dict, "opset_imports": dict}
    for key, want in types.items():
        if not isinstance(manifest, dict) or not isinstance(manifest.get(key), want):
            raise K3Error(f"onnx: {path}: field {key!r} is missing or not a JSON {want.__name__}")
    for rel in (manifest["checkpoint"], *manifest["files"]):
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not inside(directory / rel, directory):
            raise K3Error(f"onnx: {path} names {rel}, which is outside {directory}")
    return manifest


def check_files(directory: Path, manifest: dict) -> None:
    """Each file the manifest lists matches its sha256 (after the models' own checks, whose
    messages name a problem more precisely than a changed hash does)."""
    for rel, digest in manifest["files"].items():
        if not (directory / rel).is_file() or sha256_file(directory / rel) != digest:
            raise K3Error(f"onnx: {rel} in {directory} is missing or does not match its sha256 in {MANIFEST}")


def _import_function(model: onnx.ModelProto, module_op, cc, mc, parameters: dict[str, str]) -> None:
    """Import the model's graph as a function of ``module_op``; external-data initializers become
    loads of named parameters (``parameters``: name -> global, created once per module), the other
    initializers constants. The importer sees the external ones as graph inputs (its public path:
    no weight is read); each such argument of the imported function is then replaced by the load
    of its parameter and dropped from the signature."""
    graph = model.graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    kept = [t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    onnx_importer.NodeImporter.define_function(onnx_importer.ModelInfo(model).main_graph, module_op,
                                               context_cache=cc, module_cache=mc).import_all()
    func = next(op for op in module_op.regions[0].blocks[0].operations
                if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == graph.name)
    block = func.regions[0].blocks[0]
    first = len(block.arguments) - len(external)
    for i, tensor in reversed(list(enumerate(external, first))):
        stored = ir.RankedTensorType.get(list(tensor.dims), ELEM_TYPE_TO_SIGNLESS_IR_TYPE[tensor.data_type]())
        if tensor.name not in parameters:
            parameters[tensor.name] = declare_parameter(module_op, tensor.name, stored)
        argument = block.arguments[i]
        with ir.InsertionPoint.at_block_begin(block), ir.Location.name(tensor.name):
            argument.replace_all_uses_with(load_parameter(parameters[tensor.name], stored, argument.type))
        block.erase_argument(i)
    signature = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    func.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in block.arguments], signature.results))


def import_onnx(directory: Path, log=print) -> ImportedModule:
    """prefill.onnx and decode.onnx of an export directory -> one torch-dialect module whose k3
    custom ops are ``torch.k3.*`` operators, ready for Pipeline()."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    t0 = time.perf_counter()
    models = {}
    for name in REQUIRED:
        model = load_checked(directory / f"{name}.onnx")
        if model.graph.name != name:
            raise K3Error(f"onnx: {name}.onnx in {directory} holds graph {model.graph.name!r}, expected {name!r}")
        matvec_as_matmul(model)
        models[name] = onnx.shape_inference.infer_shapes(model, data_prop=True)
    check_files(directory, manifest)
    context = ir.Context()
    module = ir.Module.create(ir.Location.unknown(context))
    cc = onnx_importer.ContextCache(context)
    mc = onnx_importer.ModuleCache(module.operation, cc)
    parameters: dict[str, str] = {}
    with context, ir.Location.unknown():
        for model in models.values():
            _import_function(model, module.operation, cc, mc, parameters)
        n_custom = to_k3_ops(module)
        passmanager.PassManager.parse("builtin.module(func.func(convert-torch-onnx-to-torch))").run(module.operation)
    module.operation.verify()
    log(f"checked and imported {directory} to torch-dialect MLIR in {time.perf_counter() - t0:.1f}s "
        f"({len(parameters)} parameters, {n_custom} k3 custom ops)")
    return ImportedModule(module, manifest)


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
