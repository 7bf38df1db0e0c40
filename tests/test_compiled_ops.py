"""Each k3 custom op compiled alone (export -> passes/ -> iree-compile for the CPU -> IREE runtime)
against an independent reference: fla's naive recurrent KDA, and MXFP4 or float experts (dequantised)
multiplied token by token in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.export import Dim, export

import k3c.ops  # noqa: F401  (registers torch.ops.k3.*)
from conftest import CPU_TARGETS, cpu_target  # tests/ is on sys.path
from k3c.ops import mxfp4
from k3c.ops.numerics import glu_act

H, K, V = 2, 16, 24            # V != K so a transposed state cannot pass
E, I, L, TOP_K = 8, 32, 64, 2  # experts, expert hidden, latent width, experts per token
BETA1, BETA2 = 4.0, 25.0


def compile_op(fn, example: tuple, dynamic_shapes=None, target: str = "cpu"):
    """Export ``fn`` (a function of tensors calling torch.ops.k3.*), lower its custom ops with
    passes/ as the model is for ``target`` (a CPU target), compile and load it; returns a function
    of numpy arrays -> numpy arrays."""
    import iree.runtime as rt
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporter

    from k3c.passes.pipeline import Pipeline
    from k3c.compiler.targets import compile_mlir, parse_target

    class Op(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    program = export(Op(), example, dynamic_shapes=(dynamic_shapes,) if dynamic_shapes else None)
    context = ir.Context()
    importer = FxImporter(context=context)
    with context:
        importer.import_program(program, func_name="main")
    Pipeline.for_target(parse_target(target)).run(importer.module, log=lambda _: None)
    vmfb = compile_mlir(str(importer.module), parse_target(target), log=lambda _: None)
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    main = context.modules.module.main

    def run(*arrays):
        out = main(*(np.ascontiguousarray(a) for a in arrays))
        return tuple(o.to_host() for o in out) if isinstance(out, (tuple, list)) else out.to_host()

    return run


def kda_inputs(T: int, seed: int):
    """Unit q (unscaled) and k, v, log-decay g in (-5, 0), beta in (0, 1), nonzero initial state."""
    gen = torch.Generator().manual_seed(seed)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q = unit(torch.randn(1, T, H, K, generator=gen))
    k = unit(torch.randn(1, T, H, K, generator=gen))
    v = torch.randn(1, T, H, V, generator=gen)
    g = -5 * torch.rand(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    S0 = torch.randn(1, H, K, V, generator=gen) * 0.5
    return q, k, v, g, beta, S0


def fla_recurrent(fla_naive, q, k, v, g, beta, S0):
    """fla's naive recurrent KDA in float64 (it scales q itself)."""
    f64 = [t.double() for t in (q, k, v, g, beta, S0)]
    o, S = fla_naive.naive_recurrent_kda(*f64[:5], scale=K ** -0.5, initial_state=f64[5], output_final_state=True)
    return o.numpy(), S.numpy()


@pytest.fixture(scope="module")
def compiled_kda_chunk():
    """One module, T dynamic in [1, 512]."""
    T = Dim("T", min=1, max=512)
    return compile_op(torch.ops.k3.kda_chunk, kda_inputs(3, seed=0), ({1: T},) * 5 + (None,))


@pytest.mark.parametrize("T", [100, 7, 200])
def test_kda_chunk_matches_fla_recurrent(compiled_kda_chunk, fla_naive, T):
    """T = 7 (one padded chunk), 100 (a full and a padded chunk), 200 (four chunks) from one module:
    the chunk loop runs at run time, not unrolled at compile time."""
    q, k, v, g, beta, S0 = kda_inputs(T, seed=T)
    o, S = compiled_kda_chunk(*(t.numpy() for t in (q * K ** -0.5, k, v, g, beta, S0)))
    o_ref, S_ref = fla_recurrent(fla_naive, q, k, v, g, beta, S0)
    assert o.shape == (1, T, H, V) and S.shape == (1, H, K, V)
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(S, S_ref, rtol=0, atol=2e-5)


def test_kda_step_matches_fla_recurrent(fla_naive):
    """Ten decode steps through the compiled one-token op, the state carried between calls."""
    steps = 10
    q, k, v, g, beta, S0 = kda_inputs(steps, seed=1)
    qs = q * K ** -0.5
    step = compile_op(torch.ops.k3.kda_step, tuple(t[:, :1] for t in (qs, k, v, g, beta)) + (S0,))
    S, outs = S0.numpy(), []
    for t in range(steps):
        o, S = step(*(x[:, t:t + 1].numpy() for x in (qs, k, v, g, beta)), S)
        outs.append(o)
    o_ref, S_ref = fla_recurrent(fla_naive, q, k, v, g, beta, S0)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), o_ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(S, S_ref, rtol=0, atol=2e-5)


def expert_weights(seed: int) -> list[torch.Tensor]:
    """MXFP4 w1, w3 [E, I, L] and w2 [E, L, I], each as (packed, scale)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((E, I, L), (E, I, L), (E, L, I)):
        out += mxfp4.quantize(torch.randn(shape, generator=gen) * shape[-1] ** -0.5)
    return out


def routed_tokens(N: int, seed: int):
    """z [N, L], k distinct experts per token, positive routing weights."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(N)])
    return z, idx, torch.rand(N, TOP_K, generator=gen) + 0.1


def moe_reference(z, idx, w, weights) -> np.ndarray:
    """Dequantise every expert, then y_n = sum_i w_ni W2_e act(W1_e z_n, W3_e z_n), e = idx_ni, in float64."""
    return experts_reference(z, idx, w, *(mxfp4.dequantize(p, s, torch.float64)
                                          for p, s in zip(weights[::2], weights[1::2])))


def experts_reference(z, idx, w, W1, W3, W2) -> np.ndarray:
    """y_n = sum_i w_ni W2_e act(W1_e z_n, W3_e z_n), e = idx_ni, token by token; W* float64."""
    z = z.double()
    y = torch.zeros(z.shape[0], L, dtype=torch.float64)
    for n in range(z.shape[0]):
        for e, wt in zip(idx[n].tolist(), w[n].double()):
            y[n] += wt * (W2[e] @ glu_act("situ", BETA1, BETA2, W1[e] @ z[n], W3[e] @ z[n]))
    return y.numpy()


def moe(z, idx, w, *weights):
    return torch.ops.k3.mxfp4_moe(z, idx, w, *weights, "situ", BETA1, BETA2)


def test_mxfp4_moe_by_slot_form_matches_dequantised():
    """Static token count (decode): a loop over the (token, slot) pairs, each expert sliced in place."""
    weights = expert_weights(0)
    z, idx, w = routed_tokens(3, seed=1)
    y = compile_op(moe, (z, idx, w, *weights))(z.numpy(), idx.numpy(), w.numpy(), *(t.numpy() for t in weights))
    np.testing.assert_allclose(y, moe_reference(z, idx, w, weights), rtol=0, atol=1e-5)


@pytest.mark.parametrize("unroll", [None, 3])
def test_mxfp4_moe_by_expert_form_matches_dequantised(unroll, monkeypatch):
    """Dynamic token count (prefill): the pairs grouped by expert, then the experts in straight-line
    code (all 8) or, with at most 3 per run, a loop of 4 trips over 2 each; three token counts from
    one module (one token leaves most experts with no rows)."""
    from k3c.ops import mxfp4_moe
    if unroll:
        monkeypatch.setattr(mxfp4_moe, "UNROLL", unroll)
        assert mxfp4_moe.unrolled(E) == 2
    weights = expert_weights(2)
    N = Dim("N", min=1, max=512)
    run = compile_op(moe, (*routed_tokens(4, seed=3), *weights), ({0: N},) * 3 + (None,) * 6)
    for n_tokens in (1, 5, 37):
        z, idx, w = routed_tokens(n_tokens, seed=n_tokens)
        y = run(z.numpy(), idx.numpy(), w.numpy(), *(t.numpy() for t in weights))
        np.testing.assert_allclose(y, moe_reference(z, idx, w, weights), rtol=0, atol=1e-5)


def float_expert_weights(seed: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """Float w1, w3 [E, I, L] and w2 [E, L, I] in ``dtype`` (as Kimi Linear stores them)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(dtype) for shape in ((E, I, L), (E, I, L), (E, L, I))]


def float_moe_reference(z, idx, w, weights) -> np.ndarray:
    """The float experts widened exactly to float64, then ``experts_reference``."""
    return experts_reference(z, idx, w, *(t.double() for t in weights))


def float_moe(z, idx, w, *weights):
    return torch.ops.k3.float_moe(z, idx, w, *weights, "situ", BETA1, BETA2)


def test_float_moe_eager_matches_float64():
    weights = float_expert_weights(0)
    z, idx, w = routed_tokens(5, seed=4)
    np.testing.assert_allclose(float_moe(z, idx, w, *weights).numpy(), float_moe_reference(z, idx, w, weights),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_moe_decode_and_prefill_forms_match_float64(dtype):
    """Static token count (decode: the picked slots, each expert sliced in place) and dynamic
    (prefill: the pairs grouped by expert), the experts stored in ``dtype``."""
    weights = float_expert_weights(1, dtype)
    host = [as_numpy(t) if t.dtype == torch.bfloat16 else t.numpy() for t in weights]
    z, idx, w = routed_tokens(2, seed=5)
    y = compile_op(float_moe, (z, idx, w, *weights))(z.numpy(), idx.numpy(), w.numpy(), *host)
    np.testing.assert_allclose(y, float_moe_reference(z, idx, w, weights), rtol=0, atol=1e-5)
    N = Dim("N", min=1, max=512)
    run = compile_op(float_moe, (*routed_tokens(4, seed=3), *weights), ({0: N},) * 3 + (None,) * 3)
    for n_tokens in (1, 37):
        z, idx, w = routed_tokens(n_tokens, seed=n_tokens)
        y = run(z.numpy(), idx.numpy(), w.numpy(), *host)
        np.testing.assert_allclose(y, float_moe_reference(z, idx, w, weights), rtol=0, atol=1e-5,
                                   err_msg=f"{n_tokens} tokens")


def bf16_linear_inputs(rows: int, O: int, I: int, seed: int):
    """x [1, rows, I] f32 and a bf16 W [O, I] with widely spread magnitudes (|w| from 2^-20 to 2^6)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(O, I, generator=gen) * torch.exp2(torch.randint(-20, 6, (O, I), generator=gen).float())
    return torch.randn(1, rows, I, generator=gen), w.to(torch.bfloat16)


def linear_reference(x, w) -> np.ndarray:
    """x W^T in float64 from the bf16 weights (exact in float64)."""
    return (x.double() @ w.double().T).numpy()


def as_numpy(w: torch.Tensor) -> np.ndarray:
    import ml_dtypes
    return w.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("target, O, I, rows", [cpu_target(t, *case) for t in CPU_TARGETS
                                                 for case in [(48, 96, 1), (40, 64, 3), (16, 32, 8)]])
def test_linear_streamed_matvec_matches_float64(target, O, I, rows):
    """A decode step's rows against bf16 W, as the CPU runs every projection of a step of one or
    of several pooled sequences, on every CPU level: the streamed matvec (3 tiles of 16 outputs x
    3 blocks of 32, one row; an output count that is no multiple of 16, 3 rows: one to a vector
    tile; one of each, 8 rows: four tiles of two)."""
    from k3c.ops.base import TensorType
    from k3c.ops.linear import streams

    x, w = bf16_linear_inputs(rows, O, I, seed=O + I)
    assert streams([TensorType(tuple(x.shape), x.dtype), TensorType(tuple(w.shape), w.dtype)])
    y = compile_op(torch.ops.k3.linear, (x, w), target=target)(x.numpy(), as_numpy(w))
    ref = linear_reference(x, w)
    scale = (x.double().abs() @ w.double().abs().T).numpy()   # sum of |x_i w_i|: the f32 rounding's scale
    np.testing.assert_array_less(np.abs(y - ref), 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("target", [cpu_target(t) for t in CPU_TARGETS])
def test_linear_streamed_rows_do_not_depend_on_each_other(target):
    """A row's result is the same bits with 7 others beside it as alone: a sequence's projections in
    a pooled step of 8 are its projections alone (templates/bf16_matvec.mlir)."""
    x, w = bf16_linear_inputs(8, 48, 96, seed=1)
    eight = compile_op(torch.ops.k3.linear, (x, w), target=target)(x.numpy(), as_numpy(w))
    one = compile_op(torch.ops.k3.linear, (x[:, 2:3], w), target=target)(x[:, 2:3].numpy(), as_numpy(w))
    np.testing.assert_array_equal(eight[:, 2:3], one)


@pytest.mark.parametrize("target, O, rank, f32_weight", [
    cpu_target(t, *case) for t in CPU_TARGETS for case in [(48, 3, False), (32, 2, True), (40, 3, False)]])
def test_linear_rows_dynamic_matches_float64(target, O, rank, f32_weight):
    """A dynamic row count (prefill): at the CPU levels v3 and v4 one mmt4d on the level's tiles
    (O = 48: 3 tiles of 16 or 6 of 8 outputs; x [1, T, I] as the layers pass it, or [T, I] with an
    f32 W as the MoE block does), else (O = 40 at v4, and the baseline) the widen-then-matmul
    lowering; 1, 16 and 37 rows (a padded tile, whole ones, more) from one module."""
    from k3c.compiler.targets import parse_target
    from k3c.ops.base import TensorType
    from k3c.ops.linear import TILE, tiles

    def inputs(rows, seed):
        x, w = bf16_linear_inputs(rows, O, 96, seed=seed)
        return (x[0], w.float()) if f32_weight else (x, w)

    x, w = inputs(5, 7)
    shape = tuple(None if i == rank - 2 else d for i, d in enumerate(x.shape))
    tile = TILE.get(parse_target(target).level)
    assert tile is None or tiles([TensorType(shape, x.dtype), TensorType(tuple(w.shape), w.dtype)], tile) == (O % tile == 0)
    run = compile_op(torch.ops.k3.linear, (x, w), ({rank - 2: Dim("T", min=1, max=512)}, None), target=target)
    for rows in (1, 16, 37):
        x, _ = inputs(rows, rows)
        scale = (x.double().abs() @ w.double().abs().T).numpy()
        y = run(x.numpy(), w.numpy() if f32_weight else as_numpy(w))
        assert y.shape == (*x.shape[:-1], O)
        np.testing.assert_array_less(np.abs(y - linear_reference(x, w)), 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("target", [cpu_target(t) for t in ("cpu", "cpu:x86-64-v3", "cpu:x86-64-v4")])
def test_mmt4d_tile_of_each_level_is_right(target):
    """The reproducer of docs/pipeline.md §4 ("mmt4d tiles") with the tile a level's lowerings take:
    IREE's mmt4d microkernel is wrong for a tile the target's CPU has no tile function for (16x16x1
    below AVX-512) as soon as the reduction has two steps, so IN = 2 and 16 rows, against float64."""
    from k3c.compiler.targets import parse_target
    from k3c.ops.linear import TILE
    from k3c.ops.mlir import render
    from test_perf_mxfp4 import load_main

    t = parse_target(target)
    tile = TILE[t.level]
    run = load_main(render("linear_tiled.mlir", name="main", O=16, IN=2, lead=["?"], dyn=0, wtype="f32",
                           M0=tile, N0=tile), target)
    gen = np.random.default_rng(tile)
    x, w = gen.standard_normal((16, 2), dtype=np.float32), gen.standard_normal((16, 2), dtype=np.float32)
    np.testing.assert_allclose(run(x, w), x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-6, atol=1e-6)
