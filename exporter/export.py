"""K3Model -> torch.export -> torch-dialect MLIR with three entry points and external parameters.

    prefill(tokens [B, T])          -> (logits [B, T, vocab], hidden [layers, B, T, D], *state)
    extend(tokens [B, T], *state)   -> (logits [B, T, vocab], *state)
    decode(token [B, 1], *state)    -> (logits [B, 1, vocab], *state)

``extend`` continues a sequence by T tokens (chunked prefill: a prompt longer than max_prompt, or a
new chat turn). T is dynamic in [1, max_prompt]; the MLA caches in the state have a dynamic length L
(the position of the next token), so decode costs grow with the context used. The state is one
tensor per kind and layer kind present, stacked over the layers: ``kda_conv`` [n_kda, B, 3, HK, W-1],
``kda_S`` [n_kda, B, H, K, V], ``mla_cache`` [n_mla, B, L, rank + rope].

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
from ..model.attnres import attn_res
from ..model.norms import upcast
from ..model.stacking import layer_groups, place, program_dtypes
from .layers import BODIES, LayerBody

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


class Program(nn.Module):
    """One entry point over the whole model: the embedding, one placeholder call per layer
    (exporter/layers.py), the output AttnRes, norm and lm_head. ``mode``: "prefill" starts a
    sequence, "extend" continues one by a prompt piece, "decode" feeds one token. Only the tensors
    outside the layers are its own (named as in the checkpoint)."""

    def __init__(self, model: K3Model, mode: str):
        super().__init__()
        cfg = self.cfg = model.cfg
        self.mode, self.slots, self.places = mode, model.slots, place(cfg)
        self.model = nn.Module()
        for name in ("embed_tokens", "norm", "output_attn_res_proj", "output_attn_res_norm"):
            if hasattr(model.model, name):
                setattr(self.model, name, getattr(model.model, name))
        self.lm_head = model.lm_head
        self.kinds = [k for k in ("kda", "mla") if k in cfg.layer_kinds]
        self.rows = sum(map(cfg.closes_block, range(cfg.num_hidden_layers))) + 1

    def body(self, group: str, kind: str) -> str:
        """Each entry point calls bodies of its own (``BODY_FORMS``): IREE 3.13 needs every call of
        an out-of-line function to pass arguments of one lifetime, and prefill's zero KDA state is a
        temporary where extend's comes from the caller."""
        return f"{group}.start" if self.mode == "prefill" and kind == "mla" else f"{group}.{self.mode}"

    def forward(self, tokens, *state):
        cfg, m = self.cfg, self.model
        p = m.embed_tokens(tokens)
        B, T, D = p.shape
        H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.conv_size
        given = dict(zip([s for k in self.kinds for s in STATE_OF[k]], state))
        convs, Ss, caches, hidden = [], [], [], []
        E, n = p.new_zeros(self.rows, B, T, D), 0
        for i, (group, j) in enumerate(self.places):
            E = E.slice_scatter(p.unsqueeze(0), 0, n, n + 1)
            args = (E, torch.tensor([n, int(cfg.closes_block(i)), j], dtype=torch.int32))
            kind, slot, body = cfg.layer_kinds[i], self.slots[i], self.body(group, cfg.layer_kinds[i])
            if kind == "kda":
                conv = given["kda_conv"][slot] if given else p.new_zeros(B, 3, H * K, W - 1)
                S = given["kda_S"][slot] if given else upcast(p).new_zeros(B, H, K, K)
                p, conv, S = torch.ops.k3x.kda_layer(*args, conv, S, body)
                convs.append(conv)
                Ss.append(S)
            else:
                if given:
                    p, cache = torch.ops.k3x.mla_layer(*args, given["mla_cache"][slot], body)
                else:
                    p, cache = torch.ops.k3x.mla_layer_start(*args, cfg.mla_cache_width, body).split(
                        (D, cfg.mla_cache_width), dim=-1)
                caches.append(cache)
            n += int(cfg.closes_block(i))
            hidden.append(p)
        if cfg.uses_attn_res:
            p = attn_res(list(E[:n].unbind(0)), p, m.output_attn_res_proj.weight, m.output_attn_res_norm.weight)
        logits = self.lm_head(m.norm(p))
        new_state = {"kda_conv": convs, "kda_S": Ss, "mla_cache": caches}
        out = [torch.stack(new_state[s]) for k in self.kinds for s in STATE_OF[k]]
        return (logits, torch.stack(hidden), *out) if self.mode == "prefill" else (logits, *out)


STATE_OF = {"kda": ("kda_conv", "kda_S"), "mla": ("mla_cache",)}


def stacked_state(state) -> list[torch.Tensor]:
    """A K3State as the entry points take it: per layer kind present, the layers' tensors stacked."""
    return [torch.stack(getattr(state, s)) for s in ("kda_conv", "kda_S", "mla_cache") if getattr(state, s)]


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


def _element_type(dtype: torch.dtype) -> ir.Type:
    return {torch.float32: ir.F32Type.get(), torch.float16: ir.F16Type.get(), torch.bfloat16: ir.BF16Type.get(),
            torch.float64: ir.F64Type.get(), torch.uint8: ir.IntegerType.get_signless(8),
            torch.int64: ir.IntegerType.get_signless(64)}[dtype]


class _ParameterHooks(FxImporterHooks):
    """Lifted parameters and buffers -> one shared ``util.global`` per program parameter, loaded at
    its stored dtype and widened to the traced dtype with ``torch.prims.convert_element_type``.
    ``names`` maps the exported program's buffer and parameter names to parameter names; set it
    before importing each program."""

    def __init__(self, stored: dict[str, torch.dtype]):
        self.stored = stored
        self.names: dict[str, str] = {}
        self.globals: dict[str, str] = {}
        self.module_op = None

    def prepare_module(self, module_op):
        self.module_op = module_op

    def resolve_input(self, gni, value, info):
        if info.input_spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            return None
        name = self.names[info.input_spec.target]
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


ENTRY_POINTS = ("prefill", "extend", "decode")
# body form -> (decode step?, attention kinds it exists for): MLA starts a sequence without a cache
BODY_FORMS = {"start": (False, ("mla",)), "prefill": (False, ("kda",)), "extend": (False, ("kda", "mla")),
              "decode": (True, ("kda", "mla"))}


def example_state(model: K3Model, batch: int, length: int) -> list[torch.Tensor]:
    """Zero state tensors as the entry points take them (stacked per kind), MLA caches ``length`` long."""
    cfg, dtype = model.cfg, model.dtype
    H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.conv_size
    n_kda, n_mla = cfg.layer_kinds.count("kda"), cfg.layer_kinds.count("mla")
    state = []
    if n_kda:
        state += [torch.zeros(n_kda, batch, 3, H * K, W - 1, dtype=dtype),
                  torch.zeros(n_kda, batch, H, K, K, dtype=torch.promote_types(dtype, torch.float32))]
    if n_mla:
        state.append(torch.zeros(n_mla, batch, length, cfg.mla_cache_width, dtype=dtype))
    return state


def register_bodies(model: K3Model, stored: dict[str, torch.dtype] | None = None,
                    weights: bool = False) -> dict[str, LayerBody]:
    """One LayerBody per layer group and form (``BODY_FORMS``), registered in exporter.layers.BODIES
    under its key "<group>.<form>" for the placeholders to run (with ``weights``, eagerly)."""
    made = {}
    for group in layer_groups(model.cfg).values():
        for form, (decode, kinds) in BODY_FORMS.items():
            if group.attention in kinds:
                body = LayerBody(model, group, decode, stored, weights)
                made[f"{group.name}.{form}"] = BODIES[f"{group.name}.{form}"] = body
    return made


def _export(module: nn.Module, args: tuple, dynamic: tuple, what: str, timings: dict, log) -> torch.export.ExportedProgram:
    t0 = time.perf_counter()
    program = export(module, args, dynamic_shapes=dynamic)
    timings[f"export_{what}_s"] = time.perf_counter() - t0
    log(f"exported {what} in {timings[f'export_{what}_s']:.1f}s")
    return program


def trace_programs(model: K3Model, stored: dict[str, torch.dtype] | None = None, *, batch: int = 1,
                   max_prompt: int = 128, log=print):
    """torch.export of the entry points (``Program``: prefill T in [1, max_prompt], extend T and the
    MLA cache length L dynamic, decode L dynamic) and of one body per layer group and form
    (exporter/layers.py). Returns ({entry: program}, {body key: (program, LayerBody)}, timings).
    The model may live on the meta device: nothing here reads a weight."""
    cfg = model.cfg
    if max_prompt < 2 or max_prompt >= cfg.max_position_embeddings:
        raise K3Error(f"export: max_prompt {max_prompt} must lie in [2, {cfg.max_position_embeddings})")
    with torch.device("meta"):   # export reads no weight: a model of the same config on meta serves
        model = K3Model(cfg).to(model.dtype).eval()
    timings: dict[str, float] = {}
    T = Dim("T", min=1, max=max_prompt)
    L = Dim("L", min=1, max=cfg.max_position_embeddings - 1)
    tokens = torch.zeros(batch, 2, dtype=torch.long, device="meta")
    state = [t.to("meta") for t in example_state(model, batch, 2)]
    kinds = [k for k in ("kda", "mla") if k in cfg.layer_kinds]
    state_dims = tuple({} if s != "mla_cache" else {2: L} for k in kinds for s in STATE_OF[k])
    programs, bodies = {}, {}
    with torch.no_grad():
        # bodies first: the entry points' placeholders run them when traced
        rows = Program(model, "prefill").rows
        for key, body in register_bodies(model, stored).items():
            decode = BODY_FORMS[key.rsplit(".", 1)[1]][0]
            E = torch.zeros(rows, batch, 1 if decode else 2, cfg.hidden_size, dtype=model.dtype, device="meta")
            at = torch.zeros(3, dtype=torch.int32, device="meta")
            if body.group.attention == "kda":
                st, dims = [state[0][0], state[1][0]], ({}, {})
            elif key.endswith(".start"):
                st, dims = [], ()
            else:
                st, dims = [state[-1][0]], ({1: L},)
            dyn = ({} if decode else {2: T}, None) + ((dims,) if dims else ())
            bodies[key] = (_export(body, (E, at, *st), dyn, f"body {key}", timings, log), body)
        programs["prefill"] = _export(Program(model, "prefill"), (tokens,), ({1: T},), "prefill", timings, log)
        programs["extend"] = _export(Program(model, "extend"), (tokens, *state), ({1: T}, state_dims),
                                     "extend", timings, log)
        programs["decode"] = _export(Program(model, "decode"), (tokens[:, :1], *state), (None, state_dims),
                                     "decode", timings, log)
    return programs, bodies, timings



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


def trace_entry_points(model: K3Model, *, batch: int = 1, max_prompt: int = 128, log=print):
    """torch.export of prefill (T dynamic in [1, max_prompt]) and decode (MLA cache length L dynamic)
    with every layer unrolled in one graph, for the ONNX front end (onnx_export.py): (prefill, decode,
    example state flattened, timings)."""
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



def export_model(model: K3Model, stored_dtypes: dict[str, torch.dtype], *, batch: int = 1,
                 max_prompt: int = 128, log=print) -> ExportedModule:
    """Export the entry points and layer bodies of ``model`` (its compute dtype; weights real or on
    the meta device) into one torch-dialect module whose parameters are the program's (model/stacking.py),
    read at their stored dtypes (``stored_dtypes``: checkpoint tensor name -> dtype on disk)."""
    cfg = model.cfg
    stored = program_dtypes(cfg, stored_dtypes)
    programs, bodies, timings = trace_programs(model, stored, batch=batch, max_prompt=max_prompt, log=log)
    with torch.no_grad():
        t0 = time.perf_counter()
        table = get_decomposition_table()
        programs = {k: decompose(v, table) for k, v in programs.items()}
        bodies = {k: (decompose(v, table), body) for k, (v, body) in bodies.items()}
        timings["decompose_s"] = time.perf_counter() - t0

    hooks = _ParameterHooks(stored)
    context = ir.Context()
    importer = FxImporter(context=context, hooks=hooks)
    t0 = time.perf_counter()
    with context:
        for key, (program, body) in bodies.items():
            hooks.names = body.parameter_names()
            importer.import_program(program, func_name=body_function(key), func_visibility="private")
        for name, program in programs.items():
            hooks.names = {n: n for n, _ in Program(model, name).named_parameters()}
            importer.import_program(program, func_name=name)
    meta_devices_to_cpu(importer.module)
    importer.module.operation.verify()
    timings["import_s"] = time.perf_counter() - t0
    log(f"imported to torch-dialect MLIR in {timings['import_s']:.1f}s ({len(hooks.globals)} parameters)")
    shapes = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
                       for t in example_state(model, batch, 1))
    V, D = cfg.vocab_size, cfg.hidden_size
    entry_points = {
        "prefill": f"(tokens [{batch}, T<= {max_prompt}] int64) -> (logits [{batch}, T, {V}] f32, "
                   f"hidden [{cfg.num_hidden_layers}, {batch}, T, {D}], state...)",
        "extend": f"(tokens [{batch}, T<= {max_prompt}] int64, state...) -> (logits [{batch}, T, {V}] f32, state...)",
        "decode": f"(token [{batch}, 1] int64, state...) -> (logits [{batch}, 1, {V}] f32, state...)",
        "state": shapes,
    }
    return ExportedModule(importer.module, entry_points, max_prompt, batch)


def meta_devices_to_cpu(module: ir.Module) -> None:
    """The programs are traced on the meta device, which the graph keeps as ``torch.constant.device
    "meta"`` on the tensors it creates; torch-mlir lowers only host devices, and the device means
    nothing to iree-compile, so each becomes "cpu"."""
    with module.context:
        cpu = ir.StringAttr.get("cpu")

        def visit(op):
            if op.name == "torch.constant.device" and ir.StringAttr(op.attributes["value"]).value == "meta":
                op.attributes["value"] = cpu
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)


def body_function(key: str) -> str:
    """The private function a layer body is imported as (passes/layer_calls.py calls it)."""
    return "body_" + key.replace(".", "_")
