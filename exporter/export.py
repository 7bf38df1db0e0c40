"""K3Model -> torch.export -> torch-dialect MLIR with three entry points and external parameters.

    prefill(tokens [B, T])          -> (logits [B, T, vocab], hidden [layers, B, T, D], *state)
    decode(token [B, 1], *state)    -> (logits [B, 1, vocab], *state)
    extend(tokens [B, T], *state)   -> (logits [B, T, vocab], *state)

``extend`` continues a sequence by T tokens (chunked prefill: a prompt longer than max_prompt, or a
new chat turn); it is the prefill graph started from a given state. T is dynamic in [1, max_prompt];
the MLA caches in the state have a dynamic length L (the position of the next token), so decode
costs grow with the context used. State tensors are flattened in K3State field order: every
``kda_conv``, every ``kda_S``, every ``mla_cache``.

Weights become ``util.global`` with ``#flow.parameter.named<"model"::"<checkpoint tensor name>">``
at the dtype they are stored in (bf16 trunk, u8 MXFP4 experts), widened to the model's compute dtype
where they are loaded: one module serves every checkpoint of the same config. The k3 custom ops stay
``torch.operator "torch.k3.*"`` for passes/ to lower.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, export
from torch.export.graph_signature import InputKind

from iree.compiler import ir
from iree.compiler.dialects import util
from iree.compiler.extras.fx_importer import FxImporter, FxImporterHooks
from torch_mlir.extras.fx_decomp_util import get_decomposition_table

from ..errors import K3Error
from ..model import K3Model

SCOPE = "model"
_TORCH_DTYPE_CODE = {torch.float32: 6, torch.float64: 7, torch.float16: 5, torch.bfloat16: 15}


@dataclass
class ExportedModule:
    """The torch-dialect module and what its entry points take and return."""
    module: ir.Module
    entry_points: dict[str, str]          # name -> signature text for the manifest
    max_prompt: int
    batch: int

    @property
    def text(self) -> str:
        return str(self.module)


class _Prefill(nn.Module):
    def __init__(self, model: K3Model):
        super().__init__()
        self.net = model

    def forward(self, tokens):
        hidden: list[torch.Tensor] = []
        logits, state = self.net.layers_forward(tokens, self.net.init_state(tokens.shape[0]), False, hidden)
        return logits, torch.stack(hidden), *pytree.tree_leaves(state)


class _Decode(nn.Module):
    def __init__(self, model: K3Model, spec):
        super().__init__()
        self.net, self.spec = model, spec

    def forward(self, token, *flat_state):
        state = pytree.tree_unflatten(list(flat_state), self.spec)
        logits, state = self.net.layers_forward(token, state, True)
        return logits, *pytree.tree_leaves(state)


class _Extend(_Decode):
    """Prefill's graph (naive MLA, chunked KDA) continued from the given state."""

    def forward(self, tokens, *flat_state):
        state = pytree.tree_unflatten(list(flat_state), self.spec)
        logits, state = self.net.layers_forward(tokens, state, False)
        return logits, *pytree.tree_leaves(state)


def _element_type(dtype: torch.dtype) -> ir.Type:
    return {torch.float32: ir.F32Type.get(), torch.float16: ir.F16Type.get(), torch.bfloat16: ir.BF16Type.get(),
            torch.float64: ir.F64Type.get(), torch.uint8: ir.IntegerType.get_signless(8),
            torch.int64: ir.IntegerType.get_signless(64)}[dtype]


class _ParameterHooks(FxImporterHooks):
    """Lifted parameters and buffers -> one shared ``util.global`` per checkpoint tensor, loaded at
    its stored dtype and widened to the traced dtype with ``torch.prims.convert_element_type``."""

    def __init__(self, stored: dict[str, torch.dtype], prefix: str):
        self.stored, self.prefix = stored, prefix
        self.globals: dict[str, str] = {}
        self.module_op = None

    def prepare_module(self, module_op):
        self.module_op = module_op

    def resolve_input(self, gni, value, info):
        if info.input_spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            return None
        name = info.input_spec.target.removeprefix(self.prefix)
        traced = value.dtype
        stored = self.stored.get(name, traced)
        stored_type = ir.RankedTensorType.get(list(value.shape), _element_type(stored))
        sym = "__param_" + name.replace(".", "_")
        if name not in self.globals:
            with ir.InsertionPoint.at_block_begin(self.module_op.regions[0].blocks[0]), ir.Location.unknown():
                init = ir.Attribute.parse(f'#flow.parameter.named<"{SCOPE}"::"{name}"> : {stored_type}')
                util.GlobalOp(sym, ir.TypeAttr.get(stored_type), sym_visibility="private", initial_value=init)
            self.globals[name] = str(stored).removeprefix("torch.")
        loaded = util.GlobalLoadOp(stored_type, ir.FlatSymbolRefAttr.get(sym)).result
        if stored == traced:
            return ir.Operation.create("torch_c.from_builtin_tensor", results=[info.ir_type], operands=[loaded]).result
        vt_stored = ir.Type.parse(str(info.ir_type).replace(_mlir_dtype(traced), _mlir_dtype(stored)))
        as_torch = ir.Operation.create("torch_c.from_builtin_tensor", results=[vt_stored], operands=[loaded]).result
        code = ir.Operation.create("torch.constant.int", results=[ir.Type.parse("!torch.int")],
                                   attributes={"value": ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                           _TORCH_DTYPE_CODE[traced])}).result
        return ir.Operation.create("torch.prims.convert_element_type", results=[info.ir_type],
                                   operands=[as_torch, code]).result


def _mlir_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}[dtype]


def trace_entry_points(model: K3Model, *, batch: int = 1, max_prompt: int = 128, log=print):
    """torch.export of prefill (T dynamic in [1, max_prompt]) and decode (MLA cache length L dynamic)
    for ``model`` (eval, in its compute dtype): (prefill, decode, example state flattened, timings).
    Both front ends (torch-mlir here, ONNX in onnx_export.py) start from these programs."""
    cfg = model.cfg
    if max_prompt < 2 or max_prompt >= cfg.max_position_embeddings:
        raise K3Error(f"export: max_prompt {max_prompt} must lie in [2, {cfg.max_position_embeddings})")
    model = model.eval()
    timings = {}
    example = torch.zeros(batch, 2, dtype=torch.long)
    with torch.no_grad():
        t0 = time.perf_counter()
        prefill = export(_Prefill(model), (example,),
                         dynamic_shapes={"tokens": {1: Dim("T", min=1, max=max_prompt)}})
        timings["export_prefill_s"] = time.perf_counter() - t0
        log(f"exported prefill in {timings['export_prefill_s']:.1f}s")

        state = model.init_state(batch)
        state = model.prefill(example, state)[1]
        flat, spec = pytree.tree_flatten(state)
        n_mla = len(state.mla_cache)
        L = Dim("L", min=1, max=cfg.max_position_embeddings - 1)
        dyn = tuple([None] * (len(flat) - n_mla) + [{1: L}] * n_mla)
        t0 = time.perf_counter()
        decode = export(_Decode(model, spec), (example[:, :1], *flat), dynamic_shapes=(None, dyn))
        timings["export_decode_s"] = time.perf_counter() - t0
        log(f"exported decode in {timings['export_decode_s']:.1f}s")
    return prefill, decode, flat, timings


# torch 2.13's ExportedProgram.run_decompositions deep-copies the module call graph; copying a pytree
# LeafSpec goes through its deprecated constructor, which warns "`isinstance(treespec, LeafSpec)` is
# deprecated" (a FutureWarning about torch's own code) once per leaf. Every run_decompositions of
# k3c's (here, torch.onnx.export's in onnx_export.py, torch-mlir's in passes/trace.py) runs under
# this filter, which drops only that warning.
@contextlib.contextmanager
def leafspec_deprecation_silenced():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def decompose(program: torch.export.ExportedProgram, table) -> torch.export.ExportedProgram:
    """``program.run_decompositions(table)`` without torch's LeafSpec deprecation warnings."""
    with leafspec_deprecation_silenced():
        return program.run_decompositions(table)


def export_model(model: K3Model, stored_dtypes: dict[str, torch.dtype], *, batch: int = 1,
                 max_prompt: int = 128, log=print) -> ExportedModule:
    """Export prefill, decode and extend of ``model`` (already in its compute dtype) into one module whose
    parameters are read at ``stored_dtypes`` (checkpoint tensor name -> dtype on disk)."""
    cfg = model.cfg
    prefill, decode, flat, _ = trace_entry_points(model, batch=batch, max_prompt=max_prompt, log=log)
    with torch.no_grad():
        table = get_decomposition_table()
        prefill, decode = decompose(prefill, table), decompose(decode, table)

    hooks = _ParameterHooks(stored_dtypes, prefix="net.")
    context = ir.Context()
    importer = FxImporter(context=context, hooks=hooks)
    t0 = time.perf_counter()
    with context:
        importer.import_program(prefill, func_name="prefill")
        importer.import_program(decode, func_name="decode")
        importer.import_program(extend, func_name="extend")
    importer.module.operation.verify()
    log(f"imported to torch-dialect MLIR in {time.perf_counter() - t0:.1f}s ({len(hooks.globals)} parameters)")

    shapes = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in flat)
    entry_points = {
        "prefill": f"(tokens [{batch}, T<= {max_prompt}] int64) -> (logits [{batch}, T, {cfg.vocab_size}] f32, "
                   f"hidden [{cfg.num_hidden_layers}, {batch}, T, {cfg.hidden_size}], state...)",
        "decode": f"(token [{batch}, 1] int64, state...) -> (logits [{batch}, 1, {cfg.vocab_size}] f32, state...)",
        "extend": f"(tokens [{batch}, T<= {max_prompt}] int64, state...) -> (logits [{batch}, T, "
                  f"{cfg.vocab_size}] f32, state...)",
        "state": shapes,
    }
    return ExportedModule(importer.module, entry_points, max_prompt, batch)
