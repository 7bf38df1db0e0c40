"""K3Model -> an ONNX export directory: one model per entry point, weights as external data.

    OUT/prefill.onnx      tokens [B, T] -> logits, hidden, present.* (T dynamic)
    OUT/decode.onnx       token [B, 1], past.* -> logits, present.* (MLA cache length L dynamic)
    OUT/checkpoint/       config.json + model.safetensors: the weights, in k3c names and stored dtypes
    OUT/k3c-onnx.json     where it came from (preset and seed, or checkpoint and hash), config, opsets,
                          entry points, max_prompt, sha256 of the files

State names follow K3State: ``kda_conv.i``, ``kda_S.i``, ``mla_cache.i`` (past.* in, present.* out).
Both models start from the same torch.export programs as the MLIR front end (export.py) and go
through torch.onnx.export; the k3 custom ops become single nodes of the domain ``k3``
(onnx_ops.py). Weights are ONNX external data that point into the checkpoint's safetensors files
(a safetensors file is a JSON header and then each tensor's raw little-endian bytes, which is what
ONNX external data reads), so the ONNX models, the IREE parameters and the PyTorch reference all read
one copy of the weights. Stored bf16 weights are widened by a Cast node, as the torch front end does.
"""
from __future__ import annotations

import json
import struct
import time
from importlib import metadata
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common
import onnxscript
import torch
from onnxscript import optimizer

from ..utils.files import atomic_dir, hash_dir, sha256_file
from ..model import K3Config, K3Model
from ..model.checkpoint import INDEX_FILE, SINGLE_FILE, load_checkpoint
from ..model.convert import save_checkpoint
from ..model.init import init_weights
from ..utils.quiet import leafspec_deprecation_silenced
from .export import trace_entry_points
from .onnx_ops import DOMAIN, DOMAIN_VERSION, OPSET

MANIFEST = "k3c-onnx.json"
FORMAT = 1
CHECKPOINT = "checkpoint"
STATE_FIELDS = ("kda_conv", "kda_S", "mla_cache")
_SAFETENSORS_DTYPES = {"F32": ir.DataType.FLOAT, "BF16": ir.DataType.BFLOAT16, "F16": ir.DataType.FLOAT16,
                       "U8": ir.DataType.UINT8}

op = onnxscript.values.Opset("", OPSET)
_k3 = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)


def _kda_chunk(q, k, v, g, beta, S):
    return _k3.KdaChunk(q, k, v, g, beta, S)


def _kda_step(q, k, v, g, beta, S):
    return _k3.KdaStep(q, k, v, g, beta, S)


def _mxfp4_moe(z, idx, w, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, act, beta1, beta2):
    return _k3.Mxfp4ExpertFfn(z, idx, w, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                              act=act, beta1=beta1, beta2=beta2)


def _float_moe(z, idx, w, w1, w3, w2, act, beta1, beta2):
    return _k3.FloatExpertFfn(z, idx, w, w1, w3, w2, act=act, beta1=beta1, beta2=beta2)


def _causal_attention(q, k, v, scale):
    """torch.ops.k3.causal_attention (q [B, T, H, D], k, v [B, L, H, D]) in plain ONNX ops, the mask
    s <= L - T + t built from the two lengths, k^T by a Transpose (torch.onnx's own attention
    transposes k through a Reshape to [-1, L, E] whose leading size ONNX shape inference leaves
    unknown, and IREE 3.13 lowers that Reshape to a failing assertion, "mismatching contracting
    dimension", at run time)."""
    qh, kh, vh = (op.Transpose(t, perm=[0, 2, 1, 3]) for t in (q, k, v))
    scores = op.Mul(op.MatMul(qh, op.Transpose(kh, perm=[0, 1, 3, 2])), op.CastLike(scale, q))
    T, L = (op.Squeeze(op.Shape(t, start=1, end=2)) for t in (q, k))
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    rows = op.Add(op.Range(zero, T, one), op.Sub(L, T))
    cols = op.Range(zero, L, one)
    mask = op.LessOrEqual(op.Unsqueeze(cols, op.Constant(value_ints=[0])), op.Unsqueeze(rows, op.Constant(value_ints=[1])))
    scores = op.Where(mask, scores, op.CastLike(float("-inf"), q))
    return op.Transpose(op.MatMul(op.Softmax(scores, axis=-1), vh), perm=[0, 2, 1, 3])


def _linear(x, weight):
    """torch.ops.k3.linear: x W^T with W widened to x's type."""
    return op.MatMul(x, op.Transpose(op.CastLike(weight, x), perm=[1, 0]))


TRANSLATIONS = {torch.ops.k3.linear.default: _linear, torch.ops.k3.kda_chunk.default: _kda_chunk, torch.ops.k3.kda_step.default: _kda_step,
                torch.ops.k3.mxfp4_moe.default: _mxfp4_moe, torch.ops.k3.float_moe.default: _float_moe,
                torch.ops.k3.causal_attention.default: _causal_attention}


def checkpoint_tensors(directory: Path, base: Path) -> dict[str, ir.ExternalTensor]:
    """Every tensor of a safetensors checkpoint as ONNX external data (location relative to ``base``)."""
    index = directory / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [SINGLE_FILE]
    tensors = {}
    for file in files:
        path = directory / file
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, t in header.items():
            start, end = t["data_offsets"]
            tensors[name] = ir.ExternalTensor(path.relative_to(base).as_posix(), 8 + n + start, end - start,
                                              _SAFETENSORS_DTYPES[t["dtype"]], shape=ir.Shape(t["shape"]),
                                              name=name, base_dir=base)
    return tensors


def _weights_external(graph: ir.Graph, weights: dict[str, ir.ExternalTensor], prefix: str) -> set[ir.Value]:
    """Point each weight initializer (``prefix`` + checkpoint name) at its checkpoint bytes, named by
    the checkpoint name; a weight stored narrower than it is computed in is widened by a Cast.
    Returns the weight initializers."""
    stored = set()
    for name, value in list(graph.initializers.items()):
        tensor = weights.get(name.removeprefix(prefix))
        if tensor is None:
            continue
        if tensor.dtype == value.dtype:
            value.name, value.const_value = tensor.name, tensor
            stored.add(value)
            continue
        graph.initializers.pop(name)
        narrow = ir.Value(name=tensor.name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
        graph.register_initializer(narrow)
        cast = ir.node("Cast", [narrow], attributes={"to": value.dtype}, name=f"widen {tensor.name}")
        wide = cast.outputs[0]
        wide.name, wide.type, wide.shape = f"{tensor.name}.{value.dtype.name.lower()}", value.type, value.shape
        ir.convenience.replace_all_uses_with(value, wide)
        graph.insert_before(graph.node(0), cast)
        stored.add(narrow)
    return stored


def to_onnx(program: torch.export.ExportedProgram, name: str, inputs: list[str], outputs: list[str],
            weights: dict[str, ir.ExternalTensor]) -> ir.Model:
    """One entry point as an ONNX model: the graph named ``name``, inputs and outputs renamed, weight
    initializers pointing into the checkpoint, constants folded (never through a weight) and lifted
    to initializers."""
    with leafspec_deprecation_silenced():  # torch.onnx runs the decompositions too
        onnx_program = torch.onnx.export(program, dynamo=True, custom_translation_table=TRANSLATIONS,
                                         opset_version=OPSET, optimize=False, verbose=False)
    model = onnx_program.model
    graph = model.graph
    graph.name = name
    for value, new in zip([*graph.inputs, *graph.outputs], [*inputs, *outputs], strict=True):
        value.name = new
    stored = _weights_external(graph, weights, prefix="net.")
    optimizer.fold_constants(model, should_fold=lambda node: False if stored & set(node.inputs) else None)
    optimizer.remove_unused_nodes(model)
    ir.passes.common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    for node in graph:  # keep the module path of each node, drop the exporter's stack traces
        for key in [k for k in node.metadata_props if k != "namespace"]:
            del node.metadata_props[key]
    model.producer_name, model.producer_version = "k3c", metadata.version("k3c")
    return model


def state_names(model: K3Model) -> list[str]:
    """The flattened K3State tensors after a prefill, in order: kda_conv.i, kda_S.i, mla_cache.i."""
    kinds = model.cfg.layer_kinds
    counts = {"kda_conv": kinds.count("kda"), "kda_S": kinds.count("kda"), "mla_cache": kinds.count("mla")}
    return [f"{field}.{i}" for field in STATE_FIELDS for i in range(counts[field])]


def export_onnx(out: Path, *, preset: str | None = None, checkpoint: Path | None = None, seed: int = 0,
                max_prompt: int = 64, log=print) -> dict:
    """Write the export directory (module docstring) for a preset's seeded random weights or a
    checkpoint (re-saved in k3c names and stored dtypes). Returns its manifest."""
    out = Path(out)
    t_start = time.perf_counter()
    with atomic_dir(out) as tmp:
        if preset is not None:
            save_checkpoint(init_weights(K3Model(K3Config.preset(preset)), seed), tmp / CHECKPOINT,
                            module_layout=True)
            source = {"preset": preset, "seed": seed}
        else:
            save_checkpoint(load_checkpoint(checkpoint), tmp / CHECKPOINT, module_layout=True)
            source = {"checkpoint": str(Path(checkpoint).resolve()), "checkpoint_hash": hash_dir(Path(checkpoint))}
        model = load_checkpoint(tmp / CHECKPOINT)  # what the ONNX weights hold (bf16 values, widened)
        prefill, decode, _, timings = trace_entry_points(model, max_prompt=max_prompt, log=log)
        weights = checkpoint_tensors(tmp / CHECKPOINT, tmp)
        names = state_names(model)
        present, past = [f"present.{n}" for n in names], [f"past.{n}" for n in names]
        for name, program, inputs, outputs in (("prefill", prefill, ["tokens"], ["logits", "hidden", *present]),
                                               ("decode", decode, ["token", *past], ["logits", *present])):
            t0 = time.perf_counter()
            onnx_model = to_onnx(program, name, inputs, outputs, weights)
            ir.save(onnx_model, tmp / f"{name}.onnx")
            onnx.checker.check_model(tmp / f"{name}.onnx", full_check=True)
            timings[f"onnx_{name}_s"] = time.perf_counter() - t0
            log(f"wrote {name}.onnx ({len(onnx_model.graph)} nodes) in {timings[f'onnx_{name}_s']:.1f}s")
        cfg = model.cfg
        manifest = {
            "format": FORMAT, "source": source, "config": cfg.to_dict(), "config_hash": cfg.hash,
            "checkpoint": CHECKPOINT, "checkpoint_hash": hash_dir(tmp / CHECKPOINT),
            "opset_imports": {"": OPSET, DOMAIN: DOMAIN_VERSION}, "batch": 1, "max_prompt": max_prompt,
            "entry_points": {
                "prefill": f"tokens [1, T <= {max_prompt}] int64 -> logits [1, T, {cfg.vocab_size}], "
                           f"hidden [{cfg.num_hidden_layers}, 1, T, {cfg.hidden_size}], present.*",
                "decode": f"token [1, 1] int64, past.* -> logits [1, 1, {cfg.vocab_size}], present.*",
                "state": ", ".join(names)},
            "files": {f: sha256_file(tmp / f) for f in ("prefill.onnx", "decode.onnx")},
            "packages": {p: metadata.version(p) for p in ("k3c", "torch", "onnx", "onnxscript")},
            "timings": timings,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    log(f"ONNX export written to {out} in {time.perf_counter() - t_start:.1f}s")
    return manifest
