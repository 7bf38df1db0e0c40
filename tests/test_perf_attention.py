"""``torch.k3.causal_attention`` (the MLA prefill attention) compiled as the model is, a loop over
128-row query blocks (ops/causal_attention.py), against causal softmax attention written out in
float64, from an empty cache (L = T) and after one (L > T, a prompt's later pieces); and its
module compiled for the GPU targets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.export import Dim, export

from test_compiled_ops import compile_op

import k3c.ops  # noqa: F401  (registers torch.ops.k3.*)

B, H, DQ, DV = 1, 3, 40, 24   # DV != DQ, so values and keys cannot be swapped
SCALE = DQ ** -0.5


def attention(q, k, v):
    return torch.ops.k3.causal_attention(q, k, v, SCALE)


def inputs(T: int, seed: int, L: int | None = None) -> list[np.ndarray]:
    """q [B, T, H, DQ], k [B, L, H, DQ], v [B, L, H, DV] (L = T by default)."""
    gen = np.random.default_rng(seed)
    return [gen.standard_normal((B, n, H, d), dtype=np.float32) for n, d in ((T, DQ), (L or T, DQ), (L or T, DV))]


def reference(q, k, v) -> np.ndarray:
    """o[t] = sum_{s <= L - T + t} softmax_s(q_t . k_s * scale) v_s per head, in float64: query t
    sits at position L - T + t."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    T, L = q.shape[1], k.shape[1]
    scores = np.einsum("bthd,bshd->bhts", q, k) * SCALE
    scores = np.where(np.arange(L)[None, :] <= np.arange(L - T, L)[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


@pytest.fixture(scope="module")
def compiled():
    T, L = Dim("T", min=1, max=4096), Dim("L", min=1, max=8192)
    return compile_op(attention, tuple(torch.from_numpy(a) for a in inputs(5, 0, L=9)), ({1: T}, {1: L}, {1: L}))


@pytest.mark.parametrize("T, L", [(1, 1), (255, 255), (257, 257), (600, 600), (1, 300), (130, 1000), (200, 456)])
def test_blocked_causal_attention_matches_float64(compiled, T, L):
    """From an empty cache: T = 1 (one padded block), 255 / 257 (either side of two blocks), 600 (a
    partial fifth); after a cache: one query (decode-like), two blocks after 870 rows, a partial
    second block after 256 rows (the padded keys then sit inside the last block's key range)."""
    q, k, v = inputs(T, seed=T + L, L=L)
    np.testing.assert_allclose(compiled(q, k, v), reference(q, k, v), rtol=0, atol=2e-6)


@pytest.mark.parametrize("T, L", [(70, 70), (30, 100)])
def test_eager_op_matches_float64(T, L):
    q, k, v = inputs(T, seed=1, L=L)
    np.testing.assert_allclose(attention(*map(torch.from_numpy, (q, k, v))).numpy(), reference(q, k, v),
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize("spec", ["cuda:sm_80", "rocm:gfx942", "vulkan:llvmpipe"])
def test_compiles_for_gpu_targets(spec):
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporter

    from k3c.passes.pipeline import Pipeline
    from k3c.compiler.targets import compile_mlir, parse_target

    class Op(torch.nn.Module):
        def forward(self, q, k, v):
            return attention(q, k, v)

    T = Dim("T", min=1, max=4096)
    program = export(Op(), tuple(torch.from_numpy(a) for a in inputs(5, 0)), dynamic_shapes=({1: T},) * 3)
    context = ir.Context()
    importer = FxImporter(context=context)
    with context:
        importer.import_program(program, func_name="main")
    target = parse_target(spec)
    Pipeline.for_target(target).run(importer.module, log=lambda _: None)
    assert len(compile_mlir(str(importer.module), target, log=lambda _: None)) > 0
