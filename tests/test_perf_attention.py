"""``torch.k3.causal_attention`` (the MLA prefill attention) compiled as the model is, a loop over
128-row query blocks (ops/causal_attention.py), against causal softmax attention written out in
float64; and its module compiled for the GPU targets."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.export import Dim, export

from test_compiled_ops import compile_op

import k3c.model  # noqa: F401  (registers torch.ops.k3.*)

B, H, DQ, DV = 1, 3, 40, 24   # DV != DQ, so values and keys cannot be swapped
SCALE = DQ ** -0.5


def attention(q, k, v):
    return torch.ops.k3.causal_attention(q, k, v, SCALE)


def inputs(T: int, seed: int) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    return [gen.standard_normal((B, T, H, d), dtype=np.float32) for d in (DQ, DQ, DV)]


def reference(q, k, v) -> np.ndarray:
    """o[t] = sum_{s <= t} softmax_s(q_t . k_s * scale) v_s per head, in float64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    T = q.shape[1]
    scores = np.einsum("bthd,bshd->bhts", q, k) * SCALE
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


@pytest.fixture(scope="module")
def compiled():
    T = Dim("T", min=1, max=4096)
    return compile_op(attention, tuple(torch.from_numpy(a) for a in inputs(5, 0)), ({1: T},) * 3)


@pytest.mark.parametrize("T", [1, 255, 257, 600])
def test_blocked_causal_attention_matches_float64(compiled, T):
    """T = 1 (one padded block), 255 / 257 (either side of two blocks), 600 (a partial fifth)."""
    q, k, v = inputs(T, seed=T)
    np.testing.assert_allclose(compiled(q, k, v), reference(q, k, v), rtol=0, atol=2e-6)


def test_eager_op_matches_float64():
    q, k, v = inputs(70, seed=1)
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
