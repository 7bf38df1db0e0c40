"""Op-level benchmark modules: one k3 custom op exported alone, lowered and compiled as the model is.

- KDA prefill (docs/model.md §1): ``torch.k3.kda_chunk`` with a dynamic token count, compiled twice from the
  same export: with the pipeline's chunkwise lowering, and with a token-by-token baseline, an
  ``scf.for`` over tokens calling the traced one-token recurrence (ops/kda.py ``kda_token_scan``).
- MoE experts (docs/model.md §4-5): ``torch.k3.mxfp4_moe`` for one token, which the pipeline lowers to its
  decode form (a loop over the picked experts), and ``torch.k3.float_moe`` over the same experts stored in bf16.
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
from ..utils.files import atomic_dir, cache_lock, seal_entry, verified_entry
from ..ops import float_moe, kda, mxfp4, mxfp4_moe
from ..model.kda import l2norm
from ..exporter.export import decompose
from ..passes.pipeline import Pipeline, Rewrite
from ..compiler.targets import Target, compile_mlir

TOKEN_SCAN = Pipeline([Rewrite.of(kda.KDA_CHUNK, kda.TOKEN_SCAN)])


class KdaPrefill(nn.Module):
    def forward(self, q, k, v, g, beta, S):
        return kda.kda_chunk(q, k, v, g, beta, S)


class FloatExperts(nn.Module):
    """The routed experts of one MoE layer for decode tokens, float (bf16) weights as inputs."""

    def __init__(self, act: str, beta1: float, beta2: float):
        super().__init__()
        self.act, self.beta1, self.beta2 = act, beta1, beta2

    def forward(self, z, idx, w, w1, w3, w2):
        return float_moe.float_moe(z, idx, w, w1, w3, w2, self.act, self.beta1, self.beta2)


class Mxfp4Experts(nn.Module):
    """The routed experts of one MoE layer for decode tokens, MXFP4 weights as inputs."""

    def __init__(self, act: str, beta1: float, beta2: float):
        super().__init__()
        self.act, self.beta1, self.beta2 = act, beta1, beta2

    def forward(self, z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s):
        return mxfp4_moe.mxfp4_moe(z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s, self.act, self.beta1, self.beta2)


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
    with cache_lock(entry, log):
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
    q, k = l2norm(r(1, T, H, K)) * K ** -0.5, l2norm(r(1, T, H, K))
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
    lowering of torch.k3.mxfp4_moe (weights: packed/scale arrays); "bf16" its lowering of
    torch.k3.float_moe, the experts stored in bf16 (weights: bf16 tensors)."""
    E, I, L = weights[0].shape[0], weights[0].shape[1], token[0].shape[1]

    def make():
        experts = Mxfp4Experts(*act) if form == "mxfp4" else FloatExperts(*act)
        args = [torch.from_numpy(a) for a in token] + [torch.from_numpy(a) if form == "mxfp4" else a for a in weights]
        return lower(experts, tuple(args), Pipeline.for_target(target))
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
