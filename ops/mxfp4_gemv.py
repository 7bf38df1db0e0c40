"""The streamed MXFP4 kernel: matrix-vector products on the CPU that stream the packed weights (docs/model.md §5), for the decode
form of ``torch.k3.mxfp4_moe`` on llvm-cpu (mxfp4_moe.py): the checkpoint layout as it is, no repack, no dequantised copy.

    y[o] = sum_b 2^(S[o, b] - 127) * sum_j (E2M1[P[o, b, j] & 15] x[32b + 2j] + E2M1[P[o, b, j] >> 4] x[32b + 2j + 1])

P [O, in/32, 16] u8 is ``weight_packed`` seen block by block, S [O, in/32] u8 ``weight_scale``.
One ``linalg.generic`` keeps 16 partial sums per row, one per byte position j of a block, and
reduces over the blocks b; a second sums the 16. The vector lanes sit on j, a parallel dim, so
the loop over b needs no horizontal sum per step (../shared/notes/mxfp4-cpu.md: lanes on the
reduction ran at 0.1x a bf16 matvec). The activation is split once into its even and odd elements,
``xe[b, j] = x[32b + 2j]`` and ``xo[b, j] = x[32b + 2j + 1]``, in its own small op.

Decoding a nibble c, two ways (no table: a gather does not vectorise):

- ``f16`` (targets with F16C, ``cpu``): c moved to bits 15:12 of an i16, shifted right
  arithmetically by 3 and masked with 0x8E00 is the f16 pattern of E2M1[c] * 2^-14 (the sign
  bit stays, exponent and mantissa bits land in the f16's low exponent and top mantissa bits;
  0.5 becomes an f16 subnormal), converted exactly to f32 by one instruction. The 2^14 is
  folded into the activation when it is split.
- ``int`` (``cpu:x86-64``, no F16C, where an f16 convert is emulated): the bf16 pattern
  ``(c & 7) << 6 | 126 << 7`` is E2M1[c] for codes 2..7 (exponent and mantissa bits of E2M1 in
  the bf16's low exponent bits and top mantissa bit); codes 0 and 1 are masked to 0 and 0.5; the
  sign bit is or-ed in, and the bf16 widened to f32 by a shift. i16 integer ops, normal floats
  only (IREE flushes subnormals).

Numeric edges (tests/test_perf_mxfp4.py checks them bit for bit against ml_dtypes): the block
scale is the f32 2^(S - 127) built from its bits: S << 23 for S in [1, 254], NaN for S = 255
(the OCP NaN scale, which makes its row NaN), and 0 for S = 0, whose 2^-127 is an f32 subnormal
(see below). Every weight enters exactly as E2M1 * 2^(S - 127), and a block's products are summed before
the scale multiplies them: the result is the float64 dequantise-then-matmul rounded to f32, up to
the order of the f32 additions. Where a dequantised weight would not fit in f32 (S = 254 with
|E2M1| >= 2, S = 253 with |E2M1| >= 4) an f32 dequantisation gives inf, this form the product
when it fits (as float64 does). IREE's CPU workers flush subnormals to zero, inputs and results,
in every op: a scale byte 0 (2^-127) counts as 0 there, as it does in a dequantisation compiled by
IREE, and subnormal results are 0. The ``f16`` form multiplies the activations by 2^14: |x| >= 2^114
overflows there.
"""
from __future__ import annotations

from .mlir import render, standalone

LANES = 16                       # bytes of a 32-element block = partial sums per row
FOLDS = {"f16": 16384.0, "int": 1.0}   # per nibble decode, the factor the activation carries (f16: 2^14)


def gemv(name: str, out_dim: int, in_dim: int, decode: str) -> str:
    """``func @name(P [1, O, in/2] i8, S [1, O, in/32] i8, xe [in/32, 16], xo [in/32, 16]) -> [1, O]``
    (templates/mxfp4_gemv.mlir), the lanes pinned by a ``compilation_info`` (llvm-cpu)."""
    return render("mxfp4_gemv.mlir", name=name, O=out_dim, IN=in_dim, B=in_dim // 32, LANES=LANES, decode=decode)


def split(name: str, width: int, decode: str) -> str:
    """``func @name(x [1, width]) -> (xe, xo [width/32, 16])`` (templates/mxfp4_split.mlir)."""
    return render("mxfp4_split.mlir", name=name, width=width, B=width // 32, LANES=LANES, fold=FOLDS[decode])


def expert_slot(name: str, act_name: str, axpy_name: str, L: int, I: int, decode: str) -> list[str]:
    """``func @name(a [1, L], z [1, L], ws [1, 1], w1p, w1s, w3p, w3s, w2p, w2s) -> a + ws * FFN(z)``
    for one expert sliced [1, out, ...] from the stacked weights (templates/mxfp4_expert_slot.mlir);
    ``act_name(g, u)`` and ``axpy_name(a, ws, y)`` are defined elsewhere (traced from PyTorch)."""
    wrapper = render("mxfp4_expert_slot.mlir", name=name, act=act_name, axpy=axpy_name, L=L, I=I, LANES=LANES)
    return [split(f"{name}_split_in", L, decode), split(f"{name}_split_hid", I, decode),
            gemv(f"{name}_up", I, L, decode), gemv(f"{name}_down", L, I, decode), wrapper]


def matvec_module(out_dim: int, in_dim: int, decode: str) -> str:
    """A module whose public ``main(P [1, O, in/2] i8, S [1, O, in/32] i8, x [1, in]) -> [1, O]`` is
    one matvec as the expert FFN runs it (split, then gemv): for tests and the bench."""
    main = render("mxfp4_matvec.mlir", O=out_dim, IN=in_dim, LANES=LANES)
    return standalone([split("split", in_dim, decode), gemv("gemv", out_dim, in_dim, decode), main], "main",
                      "the streamed MXFP4 matvec")
