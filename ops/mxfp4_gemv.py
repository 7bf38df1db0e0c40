"""The streamed MXFP4 kernel: matrix-vector products on the CPU that stream the packed weights (docs/model.md §5), for the decode
form of ``torch.k3.mxfp4_moe`` on llvm-cpu (mxfp4_moe.py): the checkpoint layout as it is, no repack, no dequantised copy,
expert e's matrix read in place from the stacked weights [E, O, ...].

    y[o] = sum_b 2^(S[o, b] - 127) * sum_j (E2M1[P[o, b, j] & 15] x[32b + 2j] + E2M1[P[o, b, j] >> 4] x[32b + 2j + 1])

P [O, in/32, 16] u8 is ``weight_packed`` seen block by block, S [O, in/32] u8 ``weight_scale``.
Three forms, by ``decode``:

- ``native:<level>`` (the CPU levels x86-64-v3 and x86-64-v4, where kernels/mxfp4_rows.c builds
  for the level: a C compiler here, every input width a multiple of 128; else ``f16``): one
  dispatch calling the C kernel, linked in as an object (native.py, templates/mxfp4_native_gemv.mlir).
  Its variants decode with a table lookup, the instruction IREE 3.13 cannot emit from one (a
  ``tensor.extract`` from a constant table is scalarised): AVX-512 a ``vpermps`` from the 16 E2M1
  values in one register, 16 weights per lookup; AVX2 (whose ``vpermps`` holds 8 values and
  runs on one port of Zen 3) two ``vpshufb`` giving the upper two bytes of each weight's f32, 32
  weights per lookup (docs/pipeline.md §6 has the measurements). The activation is permuted once per
  call into the order the variant multiplies it (``NATIVE_ORDER``, templates/mxfp4_native_split.mlir).
- ``f16`` and ``int``: one ``linalg.generic`` keeps 16 partial sums per row, one per byte position
  j of a block, and reduces over the blocks b; a second sums the 16. The vector lanes sit on j, a
  parallel dim, so the loop over b needs no horizontal sum per step (with the lanes on the
  reduction, each step ends in one). The activation is split once into its even
  and odd elements, ``xe[b, j] = x[32b + 2j]`` and ``xo[b, j] = x[32b + 2j + 1]``, in its own small op.

Decoding a nibble c in the linalg forms (no table: a gather does not vectorise there):

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

import math

from . import native
from .mlir import render, standalone

LANES = 16                       # bytes of a 32-element block = partial sums per row
FOLDS = {"f16": 16384.0, "int": 1.0}   # per nibble decode, the factor the activation carries (f16: 2^14)
NATIVE_ROWS = 64                 # rows per workgroup of the native kernel
# Per level, the order in which its variant of kernels/mxfp4_rows.c multiplies a chunk's 128
# activations: the radices of the digits of a weight's index in its chunk (most significant first),
# then those digits in the order of the weight's position in xt's [8, 16] (most significant first).
#   x86-64-v4: weight 8l + n (dword l, nibble n) at xt position 16n + l
#   x86-64-v3: weight 64h + 32b + 16q + 4d + 2r1 + r0 at 64h + 32r0 + 16q + 8r1 + 4b + d
NATIVE_ORDER = {"x86-64-v4": ((16, 8), (1, 0)),
                "x86-64-v3": ((2, 2, 2, 4, 2, 2), (0, 5, 2, 4, 1, 3))}


def native_object(in_dims: tuple[int, ...], level: str) -> str | None:
    """The object of the native kernel (ops/native.py) for CPU ``level`` where every input width is
    a whole number of its 128-weight chunks and it builds here, else None."""
    if any(d % 128 for d in in_dims):
        return None
    built = native.object_file("mxfp4_rows", level)
    return None if built is None else str(built)


def form(decode: str, in_dims: tuple[int, ...]) -> str:
    """The decode a matvec over ``in_dims`` gets: "native:<level>" falls back to "f16" where
    ``native_object`` is None."""
    kind, _, level = decode.partition(":")
    return "f16" if kind == "native" and native_object(in_dims, level) is None else decode


def gemv(name: str, experts: int, out_dim: int, in_dim: int, decode: str, pairs: int = 1) -> str:
    """``func @name(P [E, O, in/2] i8, S [E, O, in/32] i8, idx [pairs] i64, pair: index, *activation)
    -> [1, O]``: expert e = idx[pair]'s matrix of the stacked weights, read in place, times the activation
    as ``split`` gives it: ``xe, xo [in/32, 16]`` for "f16" and "int" (templates/mxfp4_gemv.mlir,
    the lanes pinned by a ``compilation_info``), ``xt [in/128, 8, 16]`` for "native"
    (templates/mxfp4_native_gemv.mlir)."""
    if decode.startswith("native:"):
        return render("mxfp4_native_gemv.mlir", name=name, E=experts, O=out_dim, IN=in_dim, PAIRS=pairs,
                      object=native_object((in_dim,), decode.partition(":")[2]),
                      ROWS=NATIVE_ROWS, GROUPS=-(-out_dim // NATIVE_ROWS))
    return render("mxfp4_gemv.mlir", name=name, E=experts, O=out_dim, IN=in_dim, B=in_dim // 32, LANES=LANES,
                  decode=decode, PAIRS=pairs)


def split(name: str, width: int, decode: str) -> str:
    """``func @name(x [1, width]) -> activation`` (templates/mxfp4_split.mlir, mxfp4_native_split.mlir)."""
    if decode.startswith("native:"):
        radices, order = NATIVE_ORDER[decode.partition(":")[2]]
        dims = [width // 128, *radices]
        perm = [0, *(1 + i for i in order)]
        rows = next(n for n in range(1, len(order) + 1) if math.prod(radices[i] for i in order[:n]) == 8)
        groups = (f"[[0], [{', '.join(map(str, range(1, rows + 1)))}], "
                  f"[{', '.join(map(str, range(rows + 1, len(perm))))}]]")
        return render("mxfp4_native_split.mlir", name=name, width=width, dims=dims, perm=perm,
                      permuted=[dims[p] for p in perm], groups=groups)
    return render("mxfp4_split.mlir", name=name, width=width, B=width // 32, LANES=LANES, fold=FOLDS[decode])


def activation(width: int, decode: str) -> list[str]:
    """The types of the activation ``split`` gives a matvec over ``width`` inputs."""
    if decode.startswith("native:"):
        return [f"tensor<{width // 128}x8x16xf32>"]
    return [f"tensor<{width // 32}x{LANES}xf32>"] * 2


def expert_slot(name: str, act_name: str, axpy_name: str, E: int, L: int, I: int, decode: str,
                pairs: int) -> list[str]:
    """``func @name(a [1, L], z [1, L], ws [1, 1], idx [pairs] i64, pair: index, w1p, w1s, w3p, w3s,
    w2p, w2s) -> a + ws * FFN_e(z)`` for expert e = idx[pair] of the stacked weights [E, out, ...]
    (templates/mxfp4_expert_slot.mlir); ``act_name(g, u)`` and ``axpy_name(a, ws, y)`` are defined
    elsewhere (traced from PyTorch)."""
    decode = form(decode, (L, I))
    wrapper = render("mxfp4_expert_slot.mlir", name=name, act=act_name, axpy=axpy_name, E=E, L=L, I=I,
                     xl=activation(L, decode), xi=activation(I, decode), PAIRS=pairs)
    return [split(f"{name}_split_in", L, decode), split(f"{name}_split_hid", I, decode),
            gemv(f"{name}_up", E, I, L, decode, pairs), gemv(f"{name}_down", E, L, I, decode, pairs), wrapper]


def matvec_module(out_dim: int, in_dim: int, decode: str) -> str:
    """A module whose public ``main(P [1, O, in/2] i8, S [1, O, in/32] i8, x [1, in]) -> [1, O]`` is
    one matvec as the expert FFN runs it (split, then gemv): for tests and the bench."""
    decode = form(decode, (in_dim,))
    main = render("mxfp4_matvec.mlir", O=out_dim, IN=in_dim, xt=activation(in_dim, decode))
    return standalone([split("split", in_dim, decode), gemv("gemv", 1, out_dim, in_dim, decode), main], "main",
                      "the streamed MXFP4 matvec")
