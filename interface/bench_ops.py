"""Op-level benchmark modules: one k3 custom op exported alone, lowered and compiled as the model is.

- KDA prefill (docs/model.md §1): ``torch.k3.kda_chunk`` with a dynamic token count, compiled twice from the
  same export: with the pipeline's chunkwise lowering, and with a token-by-token baseline, an
  ``scf.for`` over tokens calling the traced one-token recurrence (``kda.kda_recurrent``).
- MXFP4 MoE (docs/model.md §4-5): ``torch.k3.mxfp4_moe`` for one token, which the pipeline lowers to its
  decode form (a loop over the picked experts), and the same loop over the experts stored in bf16.
- Layer parts at prefill: the KDA or MLA attention or the MoE block of one decoder layer over a
  dynamic token count, the weights as constants.
Compiled modules are cached (verified entries, utils/files.py) by what decides them: shapes, k3c sources,
target and package versions.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.export import Dim, export

from iree.compiler import ir
from iree.compiler.extras.fx_importer import FxImporter
from torch_mlir.extras.fx_decomp_util import get_decomposition_table

from .build import cache_dir, cache_key, source_hash
from ..artifacts.bundle import package_versions
from ..utils.files import atomic_dir, seal_entry, verified_entry
from ..model import kda, mxfp4, ops  # noqa: F401  (ops registers torch.ops.k3.*)
from ..exporter.export import decompose
from ..model.moe import glu_act
from ..passes import expert_loops
from ..passes.pipeline import Pipeline, Rewrite
from ..passes.rewrite import merge_functions
from ..passes.trace import TensorType, trace_to_linalg
from ..compiler.targets import Target, compile_mlir


def kda_token_scan(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    """Baseline lowering of ``torch.k3.kda_chunk``: one traced token step inside an scf.for over T."""
    q, k, v, g, beta, S = ins
    one = [t.with_dim(1, 1) for t in ins[:5]] + [S]
    body = trace_to_linalg(kda.kda_recurrent, one, sym + "_token")
    slices = []
    for name, t, t1 in zip(("q", "k", "v", "g", "beta"), ins[:5], one):
        offsets = ", ".join("%i" if d == 1 else "0" for d in range(len(t.shape)))
        sizes = ", ".join(str(n) for n in t1.shape)
        strides = ", ".join("1" for _ in t.shape)
        slices.append(f"%{name}_t = tensor.extract_slice %{name}[{offsets}] [{sizes}] [{strides}] : {t} to {t1}")
    B, _, H, V = v.shape
    o1 = one[2]
    args = ", ".join(str(t) for t in one)
    wrapper = f"""
module {{
  func.func private @{sym}_token({args}) -> ({o1}, {S})
  func.func @{sym}(%q: {q}, %k: {k}, %v: {v}, %g: {g}, %beta: {beta}, %S0: {S}) -> ({v}, {S}) {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %T = tensor.dim %q, %c1 : {q}
    %init = tensor.empty(%T) : {v}
    %r:2 = scf.for %i = %c0 to %T step %c1 iter_args(%out = %init, %S = %S0) -> ({v}, {S}) {{
      {chr(10).join("      " + s for s in slices).strip()}
      %o:2 = func.call @{sym}_token(%q_t, %k_t, %v_t, %g_t, %beta_t, %S) : ({args}) -> ({o1}, {S})
      %o2 = tensor.insert_slice %o#0 into %out[0, %i, 0, 0] [{B}, 1, {H}, {V}] [1, 1, 1, 1] : {o1} into {v}
      scf.yield %o2, %o#1 : {v}, {S}
    }}
    return %r#0, %r#1 : {v}, {S}
  }}
}}"""
    return [body, wrapper]


TOKEN_SCAN = Pipeline([Rewrite("torch.k3.kda_chunk", kda_token_scan, "token-by-token KDA baseline")])


class KdaPrefill(nn.Module):
    def forward(self, q, k, v, g, beta, S):
        return torch.ops.k3.kda_chunk(q, k, v, g, beta, S)


class Mxfp4Experts(nn.Module):
    """The routed experts of one MoE layer for decode tokens, MXFP4 weights as inputs."""

    def __init__(self, act: str, beta1: float, beta2: float):
        super().__init__()
        self.act, self.beta1, self.beta2 = act, beta1, beta2

    def forward(self, z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s):
        return torch.ops.k3.mxfp4_moe(z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s, self.act, self.beta1, self.beta2)


def bf16_ffn(act: str, beta1: float, beta2: float):
    """expert_loops' FFN over one expert stored in bf16: matrices [1, out, in]."""
    def ffn(rows, W1, W3, W2):
        W1, W3, W2 = (W[0].float() for W in (W1, W3, W2))
        return glu_act(act, beta1, beta2, rows @ W1.t(), rows @ W3.t()) @ W2.t()
    return ffn


def standalone(texts: list[str], sym: str) -> str:
    """One module of the functions the MLIR ``texts`` define, ``sym`` public."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        for text in texts:
            merge_functions(module, text)
        for f in module.body.operations:
            if ir.StringAttr(f.attributes["sym_name"]).value == sym:
                f.attributes["sym_visibility"] = ir.StringAttr.get("public")
        return str(module)


def lower(module: nn.Module, examples: tuple, pipeline: Pipeline, dynamic_shapes=None) -> str:
    """torch.export ``module`` on ``examples``, import to torch-dialect MLIR, run ``pipeline``."""
    with torch.no_grad():
        program = decompose(export(module, examples, dynamic_shapes=dynamic_shapes), get_decomposition_table())
    importer = FxImporter(context=ir.Context())
    importer.import_program(program, func_name="main")
    pipeline.run(importer.module, log=lambda m: None)
    return str(importer.module)


def compile_cached(name: str, spec: dict, make_mlir, target: Target, log=print) -> bytes:
    """The module ``make_mlir()`` compiles to, cached by what decides it: ``name`` and ``spec``
    (shapes), the source of model/, exporter/, passes/ and this file, the target and package versions."""
    key = cache_key(name=name, spec=spec, source=source_hash(),
                    bench_ops=hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
                    target=target.to_dict(), versions=package_versions())
    entry = cache_dir() / "ops" / f"{name}-{key}"
    if verified_entry(entry, ("module.vmfb",), log):
        log(f"{name}: compiled module found in cache")
        return (entry / "module.vmfb").read_bytes()
    vmfb = compile_mlir(make_mlir(), target, log=log)
    with atomic_dir(entry) as tmp:
        (tmp / "module.vmfb").write_bytes(vmfb)
        seal_entry(tmp)
    return vmfb


def kda_inputs(T: int, H: int, K: int, seed: int = 0) -> list[np.ndarray]:
    """Realistic KDA operands: L2-normalised q (scaled) and k, log-decays in (-5, 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = kda.l2norm(r(1, T, H, K)) * K ** -0.5, kda.l2norm(r(1, T, H, K))
    g = -5.0 * torch.sigmoid(r(1, T, H, K))
    return [t.numpy() for t in (q, k, r(1, T, H, K), g, torch.sigmoid(r(1, T, H)), 0.1 * r(1, H, K, K))]


def kda_module(H: int, K: int, max_tokens: int, pipeline: str, target: Target, log=print) -> bytes:
    """``pipeline``: "chunkwise" (the model's lowering for ``target``) or "token_scan" (the baseline)."""
    def make():
        examples = tuple(torch.from_numpy(a) for a in kda_inputs(128, H, K))
        T = Dim("T", min=2, max=max_tokens)
        rewrites = Pipeline.for_target(target) if pipeline == "chunkwise" else TOKEN_SCAN
        return lower(KdaPrefill(), examples, rewrites, ({1: T},) * 5 + (None,))
    return compile_cached(f"kda-{pipeline}", {"H": H, "K": K, "max_tokens": max_tokens}, make, target, log)


def random_mxfp4(E: int, out_dim: int, in_dim: int, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Uniformly random E2M1 codes, scales 2^-6 ... 2^-3 (weights of magnitude ~0.05)."""
    packed = gen.integers(0, 256, (E, out_dim, in_dim // 2), dtype=np.uint8)
    scale = gen.integers(121, 125, (E, out_dim, in_dim // mxfp4.GROUP), dtype=np.uint8)
    return packed, scale


def moe_inputs(E: int, k: int, L: int, I: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(z, idx, w) of one token and the MXFP4 experts w1, w3 [E, I, L], w2 [E, L, I] (packed, scale)."""
    gen = np.random.default_rng(seed)
    z = gen.standard_normal((1, L), dtype=np.float32)
    idx = gen.permutation(E)[:k][None].astype(np.int64)
    w = gen.random((1, k), dtype=np.float32)
    weights = [*random_mxfp4(E, I, L, gen), *random_mxfp4(E, I, L, gen), *random_mxfp4(E, L, I, gen)]
    return [z, idx, w / w.sum()], weights


def as_bf16(packed: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """The same expert matrices in bf16 (E2M1 times a power of two is exact in bf16), one expert at a time."""
    return torch.stack([mxfp4.dequantize(torch.from_numpy(p), torch.from_numpy(s), torch.bfloat16)
                        for p, s in zip(packed, scale)])


def moe_module(form: str, act: tuple[str, float, float], token: list[np.ndarray], weights: list,
               target: Target, log=print) -> bytes:
    """The decode-step routed experts, ``main(z, idx, w, *weights)``: ``form`` "mxfp4" is the model's
    lowering of torch.k3.mxfp4_moe (weights: packed/scale arrays); "bf16" the same loop over the
    picked slots with the experts stored in bf16 (weights: bf16 tensors)."""
    E, I, L = weights[0].shape[0], weights[0].shape[1], token[0].shape[1]

    def make():
        if form == "mxfp4":
            args = [torch.from_numpy(a) for a in token + weights]
            return lower(Mxfp4Experts(*act), tuple(args), Pipeline.for_target(target))
        k = token[1].shape[1]
        types = [TensorType((1, L), "f32"), TensorType((1, k), "i64"), TensorType((1, k), "f32")]
        types += [TensorType(tuple(w.shape), "bf16") for w in weights]
        return standalone(expert_loops.by_slot("main", types, expert_loops.traced_slot(bf16_ffn(*act))), "main")
    spec = {"E": E, "k": token[1].shape[1], "L": L, "I": I, "act": list(act)}
    return compile_cached(f"moe-{form}", spec, make, target, log)


class LayerPrefill(nn.Module):
    """One part of a decoder layer over T tokens from an empty state, x [1, T, D] -> [1, T, D]:
    ``part`` "kda" or "mla" (the attention, fed as after input_layernorm) or "moe" (the MoE block)."""

    def __init__(self, layer: nn.Module, part: str, conv_width: int):
        super().__init__()
        self.layer, self.part, self.conv_width = layer, part, conv_width

    def forward(self, x):
        if self.part == "moe":
            return self.layer.block_sparse_moe(x)
        attn = self.layer.self_attn
        if self.part == "mla":
            return attn(x, None)[0]
        width = attn.H * attn.K
        conv = tuple(x.new_zeros(1, width, self.conv_width - 1) for _ in range(3))
        return attn(x, conv, x.new_zeros(1, attn.H, attn.K, attn.K))[0]


def layer_module(layer: LayerPrefill, cfg_hash: str, index: int, max_tokens: int, target: Target, log=print) -> bytes:
    """``layer`` exported with a dynamic token count up to ``max_tokens``, its weights as constants,
    lowered as the model is for ``target``."""
    def make():
        T = Dim("T", min=2, max=max_tokens)
        return lower(layer, (torch.zeros(1, 64, layer.layer.input_layernorm.weight.shape[0]),),
                     Pipeline.for_target(target), ({1: T},))
    spec = {"config": cfg_hash, "layer": index, "part": layer.part, "max_tokens": max_tokens}
    return compile_cached(f"layer-{layer.part}", spec, make, target, log)
