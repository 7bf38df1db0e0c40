"""The MXFP4 expert lowering that streams the packed weights (ops/mxfp4_gemv.py) against
ml_dtypes: one matvec bit for bit on every E2M1 code and the E8M0 edges, and the whole
``torch.k3.mxfp4_moe`` op, decode and prefill, compiled as the model is for each CPU target,
against ml_dtypes dequantisation and a float64 matmul."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.export import Dim

from conftest import CPU_TARGETS, cpu_target
from test_compiled_ops import compile_op

import k3c.ops  # noqa: F401  (registers torch.ops.k3.*)

# (target, nibble decode, O, IN): the forms the lowerings pick per CPU level (each level's native
# kernel variant; "f16" where it does not build), at sizes crossing their tiles: the native kernel's
# 128-weight chunks in fours and a remainder (640 = 5 chunks), its 64-row workgroups and a partial one (80)
FORMS = [cpu_target("cpu:x86-64-v4", "native:x86-64-v4", 80, 640), cpu_target("cpu:x86-64-v3", "native:x86-64-v3", 80, 640),
         cpu_target("cpu:x86-64-v3", "f16", 32, 64), cpu_target("cpu:x86-64", "int", 32, 64)]
# E8M0 bytes: 0 (2^-127, an f32 subnormal), small, 1.0, large, >= 241 (where a +14 fold would
# overflow), 254 (2^127) and 255 (NaN)
SCALE_BYTES = np.array([0, 1, 2, 20, 100, 127, 128, 200, 240, 241, 250, 253, 254, 255], dtype=np.uint8)
# W1/W3 [384, 640], W2 [640, 384]: 24 and 40 tiles of 16 rows, 20 and 12 blocks, 5 and 3 native chunks
E, L, I, TOP_K = 8, 640, 384, 2
BETA1, BETA2 = 4.0, 25.0


def dequantise(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float64 [..., out, in] by ml_dtypes: E2M1 codes (low nibble first) times E8M0 block scales."""
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scales = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return (values.reshape(*scale.shape, 32) * scales[..., None]).reshape(values.shape)


def load_main(text: str, target: str):
    import iree.runtime as rt

    from k3c.compiler.targets import compile_mlir, parse_target

    vmfb = compile_mlir(text, parse_target(target), log=lambda _: None)
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    main = context.modules.module.main
    return lambda *arrays: main(*(np.ascontiguousarray(a) for a in arrays)).to_host()


def native_here(decode: str, in_dims: tuple[int, ...]) -> None:
    """Skip where the native kernel does not build (no C compiler): the level runs "f16" there."""
    from k3c.ops.mxfp4_gemv import form

    if form(decode, in_dims) != decode:
        pytest.skip(f"the native MXFP4 kernel ({decode}) does not build on this machine (no C compiler)")


@pytest.mark.parametrize("target,decode,O,IN", FORMS)
def test_matvec_is_exact_on_every_code_and_scale_edge(target, decode, O, IN):
    """x one-hot (0.75 at position i): y[o] must be W[o, i] * 0.75 rounded once to f32, where W is
    dequantised by ml_dtypes in float64: every code in every row, each scale byte in some block,
    6 * 2^127 * 0.75 overflowing to inf, 3 * 2^127 * 0.75 finite (an f32 dequantisation would give
    inf), a NaN scale making its whole row NaN. IREE's CPU workers flush subnormals (inputs and
    results, like any f32 op they run): the scale 2^-127 of byte 0 is one, so its blocks count as
    zero, and a subnormal result is zero."""
    from k3c.ops.mxfp4_gemv import matvec_module

    if decode.startswith("native:"):
        native_here(decode, (IN,))
    run = load_main(matvec_module(O, IN, decode), target)
    codes = (np.arange(IN)[None] + np.arange(O)[:, None]) % 16
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)
    scale = SCALE_BYTES[(np.arange(O)[:, None] + 7 * np.arange(IN // 32)) % len(SCALE_BYTES)]
    W = dequantise(packed, scale)
    assert np.isnan(W).any() and (np.abs(W) > np.finfo(np.float32).max).any() and (W[W != 0] < 2.0 ** -126).any()
    W_daz = np.where(np.repeat(scale == 0, 32, axis=1), 0.0, W)
    ys = []
    for i in range(IN):
        x = np.zeros((1, IN), np.float32)
        x[0, i] = 0.75
        ys.append(run(packed[None].view(np.int8), scale[None].view(np.int8), x)[0].copy())
        with np.errstate(over="ignore"):
            expected = (W_daz @ x[0].astype(np.float64)).astype(np.float32)
        expected[np.abs(expected) < np.finfo(np.float32).tiny] = 0.0
        np.testing.assert_array_equal(ys[-1], expected)
    ys = np.array(ys)
    assert np.isinf(ys).any() and np.isnan(ys).any() and (np.abs(ys[np.isfinite(ys)]) > 2.0 ** 127).any()



@pytest.mark.parametrize("target,tile", [cpu_target("cpu:x86-64-v4", 16), cpu_target("cpu:x86-64-v3", 8)])
def test_prefill_dequantisation_is_exact_on_every_code_and_scale_edge(target, tile):
    """The prefill's dequantisation into the mmt4d layout of a level's tile T
    (templates/mxfp4_expert_tiled.mlir), W4[n1, i, n0, 0] = W[T n1 + n0, i], bit for bit against ml_dtypes in float64 rounded to f32:
    every code in every row, each scale byte in some block (2^127 * 6 overflowing to inf, NaN
    scales giving NaN), IREE's flush of subnormals as in the matvec test above."""
    from iree.compiler import ir

    from k3c.ops.base import TensorType
    from k3c.ops.mlir import standalone
    from k3c.ops.mxfp4_moe import tiled_expert

    O, IN = 32, 64
    p, s = f"tensor<1x{O}x{IN // 2}xi8>", f"tensor<1x{O}x{IN // 32}xi8>"
    w = f"tensor<{O // tile}x{IN}x{tile}x1xf32>"
    main = (f"module {{ func.func private @x_rhs_up({p}, {s}) -> {w}\n"
            f"func.func @main(%P: {p}, %S: {s}) -> {w} {{ %W = func.call @x_rhs_up(%P, %S) : ({p}, {s}) -> {w}\n"
            f"return %W : {w} }} }}")
    types = [TensorType(("R", IN), torch.float32)] + [TensorType(t, torch.uint8) for t in
                                                      [(1, O, IN // 2), (1, O, IN // 32)] * 2 + [(1, IN, O // 2), (1, IN, O // 32)]]
    with ir.Context():
        text = standalone([*tiled_expert(tile, "situ", BETA1, BETA2)("x", types), main], "main", "the tiled dequantisation")
    run = load_main(text, target)
    codes = (np.arange(IN)[None] + np.arange(O)[:, None]) % 16
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)
    scale = SCALE_BYTES[(np.arange(O)[:, None] + 7 * np.arange(IN // 32)) % len(SCALE_BYTES)]
    W = dequantise(packed, scale)
    with np.errstate(over="ignore"):
        expected = np.where(np.repeat(scale == 0, 32, axis=1), 0.0, W).astype(np.float32)
    expected[np.abs(expected) < np.finfo(np.float32).tiny] = 0.0
    got = run(packed[None].view(np.int8), scale[None].view(np.int8))[..., 0]       # [O/T, IN, T]
    np.testing.assert_array_equal(got.transpose(0, 2, 1).reshape(O, IN), expected)
    assert np.isinf(got).any() and np.isnan(got).any()

def experts(seed: int) -> list[np.ndarray]:
    """w1, w3 [E, I, L], w2 [E, L, I] as (packed, scale): random codes, scales of 2^-6 .. 2^-2."""
    gen = np.random.default_rng(seed)
    out = []
    for o, i in ((I, L), (I, L), (L, I)):
        out += [gen.integers(0, 256, (E, o, i // 2), dtype=np.uint8), gen.integers(121, 126, (E, o, i // 32), dtype=np.uint8)]
    return out


def tokens(N: int, seed: int):
    gen = np.random.default_rng(seed)
    idx = np.stack([gen.permutation(E)[:TOP_K] for _ in range(N)]).astype(np.int64)
    return gen.standard_normal((N, L), dtype=np.float32), idx, gen.random((N, TOP_K), dtype=np.float32) + 0.1


def reference(z, idx, w, weights) -> np.ndarray:
    """y_n = sum_i w_ni W2_e situ(W1_e z_n, W3_e z_n), e = idx_ni, in float64 from ml_dtypes' weights."""
    W1, W3, W2 = (dequantise(p, s) for p, s in zip(weights[::2], weights[1::2]))
    y = np.zeros((z.shape[0], L))
    for n in range(z.shape[0]):
        for e, wt in zip(idx[n], w[n].astype(np.float64)):
            g, u = W1[e] @ z[n].astype(np.float64), W3[e] @ z[n].astype(np.float64)
            h = BETA1 * np.tanh(g / BETA1) / (1 + np.exp(-g)) * BETA2 * np.tanh(u / BETA2)
            y[n] += wt * (W2[e] @ h)
    return y


def moe(z, idx, w, *weights):
    return torch.ops.k3.mxfp4_moe(z, idx, w, *weights, "situ", BETA1, BETA2)


def check(y, z, idx, w, weights):
    ref = reference(z, idx, w, weights)
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("target", [cpu_target(t) for t in CPU_TARGETS])
def test_moe_decode_form_matches_ml_dtypes(target):
    """Three tokens (a static count: the loop over the picked slots, each matvec on packed weights;
    on the levels v3 and v4 and on this host the native kernel)."""
    weights = experts(0)
    z, idx, w = tokens(3, seed=1)
    args = (z, idx, w, *weights)
    run = compile_op(moe, tuple(torch.from_numpy(a) for a in args), target=target)
    check(run(*args), z, idx, w, weights)


@pytest.mark.parametrize("target", [cpu_target(t) for t in CPU_TARGETS])
def test_moe_prefill_form_matches_ml_dtypes(target):
    """A dynamic token count from one module: 1 token (most experts without rows) to 300."""
    weights = experts(2)
    N = Dim("N", min=1, max=1024)
    example = tuple(torch.from_numpy(a) for a in (*tokens(4, seed=3), *weights))
    run = compile_op(moe, example, ({0: N},) * 3 + (None,) * 6, target=target)
    for n in (1, 37, 300):
        z, idx, w = tokens(n, seed=n)
        check(run(z, idx, w, *weights), z, idx, w, weights)
