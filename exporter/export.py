"""K3Model -> torch.export -> torch-dialect MLIR with three entry points (and one per layer group) and external parameters.

    prefill(tokens [B, T])          -> (logits [B, T, vocab], hidden [layers, B, T, D], *state)
    extend(tokens [B, T], *state)   -> (logits [B, T, vocab], *state)
    decode(token [B, 1], *state)    -> (logits [B, 1, vocab], *state)

    layer_<group>(E, at, *layer state) -> (p, *layer state)   one layer of a group (docs/bundle.md §7)

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

import time
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim, export
from torch.export.graph_signature import InputKind

from iree.compiler import ir
from iree.compiler.dialects import func as func_d
from iree.compiler.extras.fx_importer import FxImporter, FxImporterHooks
from torch_mlir.extras.fx_decomp_util import get_decomposition_table

from ..errors import K3Error
from ..model import K3Model
from ..model.attnres import attn_res
from ..model.linear import Linear
from ..model.norms import upcast
from ..model.stacking import LayerRun, layer_groups, layer_runs, place, program_dtypes
from ..ops.base import TensorType
from ..utils.quiet import leafspec_deprecation_silenced
from .devices import shard_experts
from .entry_points import ENTRY_POINTS, MOVE, PUT, Pool, pooled_decode
from .layers import LayerBody, RunBody, running
from .parameters import declare_parameter, load_parameter

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
    """One entry point over the whole model: the embedding, the layers as runs (model/stacking.py
    ``layer_runs``: a run that repeats is one ``k3x.layer_loop`` over its ``RunBody``, a single layer
    is its RunBody called once), the output AttnRes, norm and lm_head. ``mode``: "prefill" starts a
    sequence, "extend" continues one by a prompt piece, "decode" feeds one token, "pooled" feeds one
    token to each of ``batch`` sequences of different lengths (``PooledDecode``). Only the tensors
    outside the layers are its own (named as in the checkpoint). Over several ``devices`` every layer
    is a run of its own (no loop: IREE 3.13's iree-stream-elide-timepoints fails on a loop whose body
    moves tensors between devices)."""

    def __init__(self, model: K3Model, mode: str, devices: int = 1, bodies: dict[str, "LayerBody"] | None = None,
                 batch: int = 1):
        super().__init__()
        self.bodies = bodies or {}   # body key -> LayerBody (``layer_bodies``): what the placeholders run eagerly
        cfg = self.cfg = model.cfg
        self.mode, self.slots, self.places, self.devices = mode, model.slots, place(cfg), devices
        self.batch = batch
        self.name = pooled_decode(batch) if mode == "pooled" else mode   # the entry point's name
        self.model = nn.Module()
        for name in ("embed_tokens", "norm", "output_attn_res_proj", "output_attn_res_norm"):
            if hasattr(model.model, name):
                setattr(self.model, name, getattr(model.model, name))
        self.lm_head = model.lm_head
        self.kinds = [k for k in ("kda", "mla") if k in cfg.layer_kinds]
        self.state_names = [s for k in self.kinds for s in STATE_OF[k]]
        self.given_names = self.state_names + (["valid"] if mode == "pooled" else [])
        self.slots_of = {k: cfg.layer_kinds.count(k) for k in self.kinds}
        self.rows = sum(map(cfg.closes_block, range(cfg.num_hidden_layers))) + 1
        self.runs = {}
        runs = layer_runs(cfg) if devices == 1 else [LayerRun(i, 1, 1) for i in range(cfg.num_hidden_layers)]
        for i, run in enumerate(runs):
            key = f"{self.name}.{i}"
            self.runs[key] = RunBody(self, run, key)

    def body(self, group: str, kind: str) -> str:
        """Each entry point calls bodies of its own (``BODY_FORMS``; a pooled decode step of B
        sequences, ``pooled_form(B)``)."""
        if self.mode == "pooled":
            return f"{group}.{pooled_form(self.batch)}"
        return f"{group}.start" if self.mode == "prefill" and kind == "mla" else f"{group}.{self.mode}"

    def new_state(self, p: torch.Tensor, given: list[torch.Tensor]) -> list[torch.Tensor]:
        """Zero stacks for the state after this call (filled layer by layer); for MLA the cache rows
        of the T tokens (``forward`` appends them to the caches given)."""
        cfg, (B, T, _) = self.cfg, p.shape
        H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.conv_size
        shapes = {"kda_conv": ((cfg.layer_kinds.count("kda"), B, 3, H * K, W - 1), p.dtype),
                  "kda_S": ((cfg.layer_kinds.count("kda"), B, H, K, K), upcast(p).dtype),
                  "mla_cache": ((cfg.layer_kinds.count("mla"), B, T, cfg.mla_cache_width), p.dtype)}
        return [p.new_zeros(*shapes[s][0], dtype=shapes[s][1]) for s in self.state_names]

    def forward(self, tokens, *given):
        with running({**self.bodies, **self.runs}):
            return self._forward(tokens, *given)

    def _forward(self, tokens, *given):
        cfg, m = self.cfg, self.model
        p = m.embed_tokens(tokens)
        B, T, D = p.shape
        carry = [p.new_zeros(self.rows, B, T, D), p, *self.new_state(p, list(given))]
        if self.mode == "prefill":
            carry.append(p.new_zeros(cfg.num_hidden_layers, B, T, D))
        for key, body in self.runs.items():
            if body.run.count == 1:
                carry = list(body(torch.zeros(1, dtype=torch.long, device=p.device), *carry, *given))
            else:
                carry = list(torch.ops.k3x.layer_loop(carry, list(given), body.run.count, key))
        E, p, *out = carry
        if given and "mla" in self.kinds and self.mode != "pooled":
            # one copy of each cache, at the end: the layers only read the caches given (model/mla.py)
            i = self.state_names.index("mla_cache")
            out[i] = torch.cat((given[i], out[i]), dim=2)
        if cfg.uses_attn_res:
            p = attn_res(list(E[:self.rows - 1].unbind(0)), p, m.output_attn_res_proj.weight,
                         m.output_attn_res_norm.weight)
        logits = self.lm_head(m.norm(p))
        if self.mode == "prefill":
            return logits, out[-1], *out[:-1]
        return logits, *out


STATE_OF = {"kda": ("kda_conv", "kda_S"), "mla": ("mla_cache",)}


class PooledDecode(Program):
    """``decode_b<B>`` (entry_points.Pool): one decode step of the B sequences in slots 0 to B - 1 of
    the pool. The pool's tensors are the last arguments, stacked per state name as the entry points
    take a state, with a slot axis after the layer axis ([n_kda, slots, ...], MLA caches [n_mla,
    slots, context, W]); they are updated in place (export makes them module globals:
    ``pool_globals``). The step reads the first B slots' state where it lies (a contiguous slice:
    the first L rows of each MLA cache, ``valid`` marking those each sequence has), and writes the
    new KDA windows and S back over it and each token's MLA cache row at its sequence's position
    (the number of rows ``valid`` marks). A gather and scatter of the slots by index instead runs
    at a fifth of copy speed in IREE 3.13 (docs/pipeline.md §8)."""

    def __init__(self, model: K3Model, batch: int, bodies: dict[str, "LayerBody"] | None = None):
        super().__init__(model, "pooled", bodies=bodies, batch=batch)

    def forward(self, tokens, valid, *pool):
        B, L = valid.shape
        positions = (valid != 0).sum(-1)
        given = [t[:, :B, :L] if s == "mla_cache" else t[:, :B] for s, t in zip(self.state_names, pool)]
        logits, *new = super().forward(tokens, *given, valid)
        for s, t, n in zip(self.state_names, pool, new):
            if s == "mla_cache":
                layers = torch.arange(t.shape[0], device=t.device).unsqueeze(1)
                rows = torch.arange(B, device=t.device).unsqueeze(0)
                t.index_put_((layers, rows, positions.unsqueeze(0)), n[:, :, 0])
            else:
                t[:, :B] = n
        return logits


class PutSequence(nn.Module):
    """``put_sequence(slot [1], *state)``: one sequence's state, as prefill and extend return it
    (stacked per name, batch 1, MLA caches of its L tokens), written into its slot of the pool (the
    last arguments, as ``PooledDecode`` takes them), in place."""

    def __init__(self, state_names: list[str]):
        super().__init__()
        self.state_names = state_names

    def forward(self, slot, *tensors):
        n = len(self.state_names)
        for s, state, t in zip(self.state_names, tensors[:n], tensors[n:]):
            layers = torch.arange(t.shape[0], device=t.device).view(-1, 1)
            if s == "mla_cache":
                rows = torch.arange(state.shape[2], device=t.device).view(1, -1)
                t.index_put_((layers, slot.view(1, 1), rows), state[:, 0])
            else:
                t.index_put_((layers, slot.view(1, 1)), state)


class MoveSequence(nn.Module):
    """``move_sequence(src [1], dst [1])``: the state in slot src of the pool (the last arguments)
    copied into slot dst, in place: how the serving engine keeps its sequences in the first slots
    when one of them finishes."""

    def forward(self, src, dst, *pool):
        for t in pool:
            layers = torch.arange(t.shape[0], device=t.device).view(-1, 1)
            t.index_put_((layers, dst.view(1, 1)), t[layers, src.view(1, 1)])


def stacked_state(state) -> list[torch.Tensor]:
    """A K3State as the entry points take it: per layer kind present, the layers' tensors stacked."""
    return [torch.stack(getattr(state, s)) for s in ("kda_conv", "kda_S", "mla_cache") if getattr(state, s)]


def decompose(program: torch.export.ExportedProgram, table) -> torch.export.ExportedProgram:
    """``program.run_decompositions(table)`` without torch's LeafSpec deprecation warnings."""
    with leafspec_deprecation_silenced():
        return program.run_decompositions(table)


class _ParameterHooks(FxImporterHooks):
    """Lifted parameters and buffers -> one shared ``util.global`` per program parameter, loaded at
    its stored dtype and widened to the traced dtype with ``torch.prims.convert_element_type``.
    ``names`` maps the exported program's buffer and parameter names to parameter names; set it
    before importing each program."""

    def __init__(self, stored: dict[str, torch.dtype]):
        self.stored = stored
        self.names: dict[str, str] = {}
        self.globals: dict[str, str] = {}   # parameter name -> its global's symbol
        self.module_op = None

    def prepare_module(self, module_op):
        self.module_op = module_op

    def resolve_input(self, gni, value, info):
        if info.input_spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            return None
        name = self.names[info.input_spec.target]
        traced = value.dtype
        stored = TensorType(tuple(value.shape), self.stored.get(name, traced))
        if name not in self.globals:
            self.globals[name] = declare_parameter(self.module_op, name, stored.builtin)
        if stored.dtype == traced:
            return load_parameter(self.globals[name], stored.builtin, info.ir_type)
        as_torch = load_parameter(self.globals[name], stored.builtin, stored.vtensor)
        code = ir.Operation.create("torch.constant.int", results=[ir.Type.parse("!torch.int")],
                                   attributes={"value": ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                           _TORCH_DTYPE_CODE[traced])}).result
        return ir.Operation.create("torch.prims.convert_element_type", results=[info.ir_type],
                                   operands=[as_torch, code]).result


# body form -> (decode step?, attention kinds it exists for): MLA starts a sequence without a cache
BODY_FORMS = {"start": (False, ("mla",)), "prefill": (False, ("kda",)), "extend": (False, ("kda", "mla")),
              "decode": (True, ("kda", "mla"))}


def pooled_form(batch: int) -> str:
    """The body form of a pooled decode step of ``batch`` sequences (MLA bodies take ``valid``)."""
    return f"b{batch}"


def body_forms(batches=()) -> dict[str, tuple[bool, tuple[str, ...]]]:
    """BODY_FORMS and the pooled decode forms of ``batches``."""
    return {**BODY_FORMS, **{pooled_form(b): (True, ("kda", "mla")) for b in batches}}


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


# the form of each attention kind's body that its public layer entry point runs: a prompt piece
LAYER_FORM = {"kda": "prefill", "mla": "start"}


def layer_function(group: str) -> str:
    """The public entry point running one layer of ``group`` (``k3c validate --layers``, docs/bundle.md §7)."""
    return f"layer_{group}"


def add_layer_functions(module: ir.Module, groups) -> None:
    """Each group's public entry point ``layer_<group>(E, at [3], *state)``: at = [n, close, j]; one
    call of the group's body in LAYER_FORM with at[:2] and the integer at[2] (the body is imported
    once, as every entry point calls it)."""
    bodies = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
              if op.operation.name == "func.func"}
    with module.context, ir.Location.unknown():
        torch_int = ir.Type.parse("!torch.int")

        def op(name, result, *operands, **attributes):
            return ir.Operation.create(name, results=[result], operands=list(operands), attributes=attributes).result

        def const(v):
            return op("torch.constant.int", torch_int, value=ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v))

        for group in groups:
            callee = body_function(f"{group.name}.{LAYER_FORM[group.attention]}")
            body = ir.FunctionType(ir.TypeAttr(bodies[callee].attributes["function_type"]).value)
            E, head, _, *state = body.inputs
            at = ir.Type.parse("!torch.vtensor<[3],si32>")
            with ir.InsertionPoint(module.body):
                f = func_d.FuncOp(layer_function(group.name), ([E, at, *state], list(body.results)))
            f.attributes["torch.assume_strict_symbolic_shapes"] = ir.UnitAttr.get()
            with ir.InsertionPoint(f.add_entry_block()):
                E_arg, at_arg, *state_args = f.arguments
                zero, one, two = const(0), const(1), const(2)
                first = op("torch.aten.slice.Tensor", head, at_arg, zero, zero, two, one)
                j = op("torch.aten.item", torch_int,
                       op("torch.aten.select.int", ir.Type.parse("!torch.vtensor<[],si32>"), at_arg, zero, two))
                call = func_d.CallOp(list(body.results), ir.FlatSymbolRefAttr.get(callee), [E_arg, first, j, *state_args])
                func_d.ReturnOp(call.results)


def layer_entry_points(cfg, batch: int, max_prompt: int, rows: int) -> dict[str, str]:
    """Manifest signature text of each group's layer entry point (its LayerBody in LAYER_FORM)."""
    D, H, K, W = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.conv_size
    E = f"E [{rows}, {batch}, T<= {max_prompt}, {D}], at [3] int32 (bank row n, closes, index in group)"
    state = {"kda": (f", conv [{batch}, 3, {H * K}, {W - 1}], S [{batch}, {H}, {K}, {K}]",
                     f"(p [{batch}, T, {D}], conv, S)"),
             "mla": ("", f"(p | cache [{batch}, T, {D} + {cfg.mla_cache_width}])")}
    return {layer_function(g.name): f"({E}{state[g.attention][0]}) -> {state[g.attention][1]}"
            for g in layer_groups(cfg).values()}


def layer_bodies(model: K3Model, stored: dict[str, torch.dtype] | None = None,
                 weights: bool = False, batches=()) -> dict[str, LayerBody]:
    """One LayerBody per layer group and form (``body_forms(batches)``) under its key
    "<group>.<form>", for a Program's placeholders to call (with ``weights``, eagerly)."""
    made = {}
    for group in layer_groups(model.cfg).values():
        for form, (decode, kinds) in body_forms(batches).items():
            if group.attention in kinds:
                body = LayerBody(model, group, decode, stored, weights)
                made[f"{group.name}.{form}"] = body
    return made


def _export(module: nn.Module, args: tuple, dynamic: tuple, what: str, timings: dict, log) -> torch.export.ExportedProgram:
    t0 = time.perf_counter()
    program = export(module, args, dynamic_shapes=dynamic)
    timings[f"export_{what}_s"] = time.perf_counter() - t0
    log(f"exported {what} in {timings[f'export_{what}_s']:.1f}s")
    return program


def _body_example(model: K3Model, key: str, body: LayerBody, batch: int, rows: int, T: Dim, L: Dim):
    """Example arguments (E, at, j, *state) of a layer body and their dynamic dims: a prompt piece
    of T tokens or one decode token per sequence, at ``batch`` sequences (a pooled form's own)."""
    form = key.rsplit(".", 1)[1]
    decode = BODY_FORMS[form][0] if form in BODY_FORMS else True
    batch = batch if form in BODY_FORMS else int(form.removeprefix("b"))
    cfg = model.cfg
    state = [t.to("meta") for t in example_state(model, batch, 2)]
    E = torch.zeros(rows, batch, 1 if decode else 2, cfg.hidden_size, dtype=model.dtype, device="meta")
    at = torch.zeros(2, dtype=torch.int32, device="meta")
    if body.group.attention == "kda":
        st, dims = [state[0][0], state[1][0]], ({}, {})
    elif form == "start":
        st, dims = [], ()
    elif form in BODY_FORMS:
        st, dims = [state[-1][0]], ({1: L},)
    else:   # pooled: the longest sequence's cache rows, and which of them each sequence has
        st, dims = [state[-1][0], torch.ones(batch, 2, dtype=torch.long, device="meta")], ({1: L}, {1: L})
    return (E, at, 0, *st), ({} if decode else {2: T}, None, Dim.DYNAMIC) + ((dims,) if dims else ())


def pool_example(model: K3Model, pool: Pool) -> list[torch.Tensor]:
    """The pool's tensors (``PooledDecode``) on the meta device: the state of its slots' sequences."""
    return [t.to("meta") for t in example_state(model, pool.max_batch, pool.context)]


def trace_programs(model: K3Model, stored: dict[str, torch.dtype] | None = None, *, batch: int = 1,
                   max_prompt: int = 128, devices: int = 1, pool: Pool | None = None, log=print):
    """torch.export of the entry points (``Program``: prefill T in [1, max_prompt], extend T and the
    MLA cache length L dynamic, decode L dynamic; with a ``pool``, ``PutSequence`` and a
    ``PooledDecode`` per batch size, L dynamic) and of one body per layer group and form
    (exporter/layers.py), and of one iteration of each repeating layer run (``RunBody``).
    Returns ({entry: program}, {body key: (program, LayerBody)}, {run key: program}, timings).
    The model may live on the meta device: nothing here reads a weight. Over several ``devices`` the
    routed experts are split (exporter/devices.py)."""
    cfg = model.cfg
    if max_prompt < 2 or max_prompt >= cfg.max_position_embeddings:
        raise K3Error(f"export: max_prompt {max_prompt} must lie in [2, {cfg.max_position_embeddings})")
    with torch.device("meta"):   # export reads no weight: a model of the same config on meta serves
        model = K3Model(cfg).to(model.dtype).eval()
    for name, module in model.named_modules():   # Linear weights outside the layers (lm_head): as stored
        if isinstance(module, Linear) and not name.startswith("model.layers."):
            module.to((stored or {}).get(f"{name}.weight", model.dtype))
    if devices > 1:
        shard_experts(model, devices)
    timings: dict[str, float] = {}
    T = Dim("T", min=1, max=max_prompt)
    L = Dim("L", min=1, max=cfg.max_position_embeddings - 1)
    tokens = torch.zeros(batch, 2, dtype=torch.long, device="meta")
    state = [t.to("meta") for t in example_state(model, batch, 2)]
    kinds = [k for k in ("kda", "mla") if k in cfg.layer_kinds]
    state_dims = tuple({} if s != "mla_cache" else {2: L} for k in kinds for s in STATE_OF[k])
    batches = pool.batches if pool else ()
    programs, bodies, runs = {}, {}, {}
    with torch.no_grad():
        # bodies first: the entry points' placeholders run them when traced
        rows = Program(model, "prefill", devices).rows
        made = layer_bodies(model, stored, batches=batches)
        for key, body in made.items():
            args, dyn = _body_example(model, key, body, batch, rows, T, L)
            bodies[key] = (_export(body, args, dyn, f"body {key}", timings, log), body)
        inputs = {"prefill": (tokens,), "extend": (tokens, *state), "decode": (tokens[:, :1], *state)}
        dims = {"prefill": ({1: T},), "extend": ({1: T}, state_dims), "decode": (None, state_dims)}
        made_programs = [(Program(model, mode, devices, made), inputs[mode], dims[mode]) for mode in ENTRY_POINTS]
        if pool:
            cached = pool_example(model, pool)
            Lp = Dim("L", min=1, max=pool.context - 1)
            for b in batches:
                valid = torch.ones(b, 2, dtype=torch.long, device="meta")
                step = torch.zeros(b, 1, dtype=torch.long, device="meta")
                made_programs.append((PooledDecode(model, b, made), (step, valid, *cached),
                                      (None, {1: Lp}, (None,) * len(cached))))
        for program, args, dyn in made_programs:
            programs[program.name] = _export(program, args, dyn, program.name, timings, log)
            if program.mode == "pooled":
                b = program.batch
                args = (args[0], *example_state(model, b, 2), torch.ones(b, 2, dtype=torch.long))
                args = tuple(t.to("meta") for t in args)
            for key, run in program.runs.items():
                if run.run.count > 1:
                    with running({**made, **program.runs}):
                        runs[key] = _export(run, *_run_example(program, args, T, L), f"run {key}", timings, log)
        if pool:
            put = PutSequence(Program(model, "decode").state_names)
            Lc = Dim("L", min=1, max=pool.context)
            slot = torch.zeros(1, dtype=torch.long, device="meta")
            programs[PUT] = _export(put, (slot, *state, *cached),
                                    (None, (*({2: Lc} if s == "mla_cache" else None for s in put.state_names),
                                            *(None,) * len(cached))), PUT, timings, log)
            # two tensors: given one twice, torch.export makes src and dst one argument
            ends = (torch.zeros(1, dtype=torch.long, device="meta"), torch.ones(1, dtype=torch.long, device="meta"))
            programs[MOVE] = _export(MoveSequence(), (*ends, *cached), None, MOVE, timings, log)
    return programs, bodies, runs, timings


def _run_example(program: Program, inputs: tuple, T: Dim, L: Dim) -> tuple[tuple, tuple]:
    """Example arguments (k, *carry, *given) of a RunBody of ``program`` and their dynamic dims."""
    tokens, *given = inputs
    p = torch.zeros(*tokens.shape, program.cfg.hidden_size, dtype=program.model.embed_tokens.weight.dtype, device="meta")
    B, t, D = p.shape
    new = program.new_state(p, given)
    carry = [p.new_zeros(program.rows, B, t, D), p, *new]
    seq = program.mode not in ("decode", "pooled")          # T is dynamic
    carry_dims = [{2: T} if seq else {}, {1: T} if seq else {}]
    carry_dims += [{2: T} if s == "mla_cache" and seq else {} for s in program.state_names]
    if program.mode == "prefill":
        carry.append(p.new_zeros(program.cfg.num_hidden_layers, B, t, D))
        carry_dims.append({2: T})
    given_dims = [{2: L} if s == "mla_cache" else {1: L} if s == "valid" else {} for s in program.given_names]
    k = torch.zeros(1, dtype=torch.long, device="meta")
    return (k, *carry, *given), (None, (*carry_dims, *given_dims[:len(given)]))


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
                 max_prompt: int = 128, devices: int = 1, pool: Pool | None = None, log=print) -> ExportedModule:
    """Export the entry points and layer bodies of ``model`` (its compute dtype; weights real or on
    the meta device) into one torch-dialect module whose parameters are the program's (model/stacking.py),
    read at their stored dtypes (``stored_dtypes``: checkpoint tensor name -> dtype on disk), for a
    program over ``devices`` devices (the routed experts split: exporter/devices.py), with a
    sequence ``pool`` for serving (entry_points.Pool)."""
    cfg = model.cfg
    if pool and devices > 1:
        raise K3Error("export: a sequence pool (--max-batch) is for one device; this program spans "
                      f"{devices}")
    stored = program_dtypes(cfg, stored_dtypes)
    programs, bodies, runs, timings = trace_programs(model, stored, batch=batch, max_prompt=max_prompt,
                                                     devices=devices, pool=pool, log=log)
    with torch.no_grad():
        t0 = time.perf_counter()
        table = get_decomposition_table()
        programs = {k: decompose(v, table) for k, v in programs.items()}
        bodies = {k: (decompose(v, table), body) for k, (v, body) in bodies.items()}
        runs = {k: decompose(v, table) for k, v in runs.items()}
        timings["decompose_s"] = time.perf_counter() - t0

    hooks = _ParameterHooks(stored)
    context = ir.Context()
    importer = FxImporter(context=context, hooks=hooks)
    t0 = time.perf_counter()
    with context:
        for key, (program, body) in bodies.items():
            hooks.names = body.parameter_names()
            importer.import_program(program, func_name=body_function(key), func_visibility="private")
        add_layer_functions(importer.module, [body.group for key, (_, body) in bodies.items()
                                              if key == f"{body.group.name}.{LAYER_FORM[body.group.attention]}"])
        hooks.names = {}
        for key, program in runs.items():
            importer.import_program(program, func_name=run_function(key), func_visibility="private")
        hooks.names = {n: n for n, _ in Program(model, "decode", devices).named_parameters()}
        for name, program in programs.items():
            importer.import_program(program, func_name=name)
        if pool:
            pool_globals(importer.module, Program(model, "decode").state_names)
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
        **layer_entry_points(cfg, batch, max_prompt, Program(model, "prefill").rows),
    }
    if pool:
        pooled = example_state(model, pool.max_batch, pool.context)
        entry_points["pool"] = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in pooled)
        entry_points[PUT] = f"(slot [1] int64, state... of one sequence, L<= {pool.context}) -> ()"
        entry_points[MOVE] = "(src [1] int64, dst [1] int64) -> ()"
        for b in pool.batches:
            entry_points[pooled_decode(b)] = (f"(tokens [{b}, 1] int64, valid [{b}, L< {pool.context}] int64) "
                                              f"-> (logits [{b}, 1, {V}] f32), slots 0 to {b - 1}")
    return ExportedModule(importer.module, entry_points, max_prompt, batch)


POOL_GLOBAL = "k3c_pool_{}"   # the module global holding the pool's stack of one state name


def pool_globals(module: ir.Module, state_names: list[str]) -> None:
    """The pool arguments of the entry points (``PooledDecode``, ``PutSequence``: torch-mlir imports
    an argument the program updates in place as a ``!torch.tensor``, read by ``torch.copy.to_vtensor``
    and written by ``torch.overwrite.tensor.contents``) become mutable module globals, zero at load,
    one per state name and shared by every entry point: loaded and stored where the argument was
    read and overwritten. IREE 3.13 updates a global in place; an argument updated in place it
    copies whole, twice, on every call (docs/pipeline.md §8)."""
    with module.context, ir.Location.unknown():
        made = set()
        for f in [op for op in module.body.operations if op.operation.name == "func.func"]:
            block = f.regions[0].blocks[0]
            pooled = [a for a in block.arguments if str(a.type).startswith("!torch.tensor")]
            if not pooled:
                continue
            if len(pooled) != len(state_names):
                raise K3Error(f"export: {len(pooled)} arguments updated in place, expected the pool's "
                              f"{len(state_names)}")
            for arg, name in zip(pooled, state_names):
                vtensor = ir.Type.parse(str(arg.type).replace("!torch.tensor", "!torch.vtensor", 1))
                builtin = TensorType.of([vtensor])[0].builtin
                symbol = POOL_GLOBAL.format(name)
                if symbol not in made:
                    zero = ir.FloatAttr.get(builtin.element_type, 0.0)
                    with ir.InsertionPoint.at_block_begin(module.body):
                        ir.Operation.create("util.global", attributes={
                            "sym_name": ir.StringAttr.get(symbol), "sym_visibility": ir.StringAttr.get("private"),
                            "type": ir.TypeAttr.get(builtin), "is_mutable": ir.UnitAttr.get(),
                            "initial_value": ir.DenseElementsAttr.get_splat(builtin, zero)})
                    made.add(symbol)
                ref = ir.FlatSymbolRefAttr.get(symbol)
                for use in list(arg.uses):
                    op = use.owner
                    with ir.InsertionPoint(op), op.location:
                        if op.name == "torch.copy.to_vtensor":
                            loaded = ir.Operation.create("util.global.load", results=[builtin],
                                                         attributes={"global": ref}).result
                            op.results[0].replace_all_uses_with(ir.Operation.create(
                                "torch_c.from_builtin_tensor", results=[vtensor], operands=[loaded]).result)
                        elif op.name == "torch.overwrite.tensor.contents":
                            value = ir.Operation.create("torch_c.to_builtin_tensor", results=[builtin],
                                                        operands=[op.operands[0]]).result
                            ir.Operation.create("util.global.store", operands=[value], attributes={"global": ref})
                        else:
                            raise K3Error(f"export: the pool argument {name} is used by {op.name}")
                    op.erase()
            ftype = ir.FunctionType(ir.TypeAttr(f.attributes["function_type"]).value)
            keep = [a.arg_number for a in block.arguments if a not in pooled]
            for arg in reversed(pooled):
                block.erase_argument(arg.arg_number)
            results = list(ftype.results)
            if [str(t) for t in results] == ["!torch.none"]:   # put_sequence, move_sequence: nothing
                ret = next(op for op in block.operations if op.operation.name == "func.return")
                with ir.InsertionPoint(ret):
                    func_d.ReturnOp([])
                ret.operation.erase()
                results = []
            f.attributes["function_type"] = ir.TypeAttr.get(
                ir.FunctionType.get([ftype.inputs[i] for i in keep], results))


def meta_devices_to_cpu(module: ir.Module) -> None:
    """The programs are traced on the meta device, which the graph keeps as ``torch.constant.device
    "meta"`` on the tensors it creates and as ``prims.device_put`` where a host constant (a layer
    run's position table) meets the traced tensors; torch-mlir lowers only host devices, and the
    device means nothing to iree-compile, so each device becomes "cpu" and each move goes."""
    with module.context:
        cpu = ir.StringAttr.get("cpu")
        moves = []

        def visit(op):
            if op.name == "torch.constant.device" and ir.StringAttr(op.attributes["value"]).value == "meta":
                op.attributes["value"] = cpu
            elif op.name == "torch.operator" and ir.StringAttr(op.attributes["name"]).value == "torch.prims.device_put":
                moves.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        for op in moves:
            op.results[0].replace_all_uses_with(op.operands[0])
            op.erase()


def run_function(key: str) -> str:
    """The private function one iteration of a layer run is imported as (passes/layer_calls.py loops it)."""
    return "run_" + key.replace(".", "_")


def body_function(key: str) -> str:
    """The private function a layer body is imported as (passes/layer_calls.py calls it)."""
    return "body_" + key.replace(".", "_")
