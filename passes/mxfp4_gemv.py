"""MXFP4 matrix-vector products on the CPU that stream the packed weights (docs/model.md §5), for the decode
form of ``torch.k3.mxfp4_moe``: the checkpoint layout as it is, no repack, no dequantised copy.

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

from .trace import TensorType

LANES = 16                       # bytes of a 32-element block = partial sums per row
F16_FOLD = 16384.0               # 2^14, the f16 decode's offset, carried by the activation

# lanes on the 16 byte positions, 16 rows per distributed tile, the block loop tiled by 1
_LANES_CONFIG = ("attrs = {compilation_info = #iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
                "distribution = [16, 16, 0], vector_common_parallel = [1, 16, 0], vector_reduction = [0, 0, 1]>, "
                "translation_info = #iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>}")

# the f32 2^(S - 127) from its bits, no compare or select (they halved the throughput): S << 23,
# or-ed with 0x400000 (NaN) when S = 255, where (S + 1) >> 8 is 1. S = 0 gives +0: 2^-127 is an
# f32 subnormal, which IREE's CPU workers read as 0 anyway.
_SCALE = """
    %c23 = arith.constant 23 : i32
    %c22 = arith.constant 22 : i32
    %c8_s = arith.constant 8 : i32
    %c1_s = arith.constant 1 : i32
    %s32 = arith.extui %s : i8 to i32
    %sb = arith.shli %s32, %c23 : i32
    %sp = arith.addi %s32, %c1_s : i32
    %st = arith.shrui %sp, %c8_s : i32
    %sq = arith.shli %st, %c22 : i32
    %sr = arith.ori %sb, %sq : i32
    %scale = arith.bitcast %sr : i32 to f32"""

_F16_DECODE = """
    %c12 = arith.constant 12 : i16
    %c8 = arith.constant 8 : i16
    %c3 = arith.constant 3 : i16
    %mask = arith.constant -29184 : i16
    %w = arith.extui %p : i8 to i16
    %la = arith.shli %w, %c12 : i16
    %lb = arith.shrsi %la, %c3 : i16
    %lc = arith.andi %lb, %mask : i16
    %lh = arith.bitcast %lc : i16 to f16
    %lo = arith.extf %lh : f16 to f32
    %ha = arith.shli %w, %c8 : i16
    %hb = arith.shrsi %ha, %c3 : i16
    %hc = arith.andi %hb, %mask : i16
    %hh = arith.bitcast %hc : i16 to f16
    %hi = arith.extf %hh : f16 to f32"""


def _int_nibble(name: str, code: str) -> str:
    """f32 E2M1 value of the nibble %``code`` (i16, 0..15) with i16 ops only (8 lanes per SSE2
    register) and normal floats only: the bf16 pattern (m << 6) + 0x3F00 of m = code & 7 is E2M1[m]
    for m >= 2; m = 0 and 1 are masked to 0 and 0x3F00 (0.5) by (m > 1 ? 0xFFFF : m * 0x3F00);
    the sign bit is or-ed in and the pattern widened to f32 (bf16 is the top half of an f32)."""
    return f"""
    %{name}_m = arith.andi %{code}, %c7 : i16
    %{name}_sg = arith.andi %{code}, %c8 : i16
    %{name}_sb = arith.shli %{name}_sg, %c12 : i16
    %{name}_b = arith.shli %{name}_m, %c6 : i16
    %{name}_e = arith.addi %{name}_b, %half : i16
    %{name}_big = arith.cmpi ugt, %{name}_m, %c1 : i16
    %{name}_bm = arith.extsi %{name}_big : i1 to i16
    %{name}_sm = arith.muli %{name}_m, %half : i16
    %{name}_mask = arith.ori %{name}_bm, %{name}_sm : i16
    %{name}_abs = arith.andi %{name}_e, %{name}_mask : i16
    %{name}_v = arith.ori %{name}_abs, %{name}_sb : i16
    %{name}_w = arith.extui %{name}_v : i16 to i32
    %{name}_f = arith.shli %{name}_w, %c16 : i32
    %{name} = arith.bitcast %{name}_f : i32 to f32"""


_INT_DECODE = """
    %c1 = arith.constant 1 : i16
    %c4 = arith.constant 4 : i16
    %c6 = arith.constant 6 : i16
    %c7 = arith.constant 7 : i16
    %c8 = arith.constant 8 : i16
    %c12 = arith.constant 12 : i16
    %c15 = arith.constant 15 : i16
    %c16 = arith.constant 16 : i32
    %half = arith.constant 16128 : i16
    %w = arith.extui %p : i8 to i16
    %lo_c = arith.andi %w, %c15 : i16
    %hi_c = arith.shrui %w, %c4 : i16""" + _int_nibble("lo", "lo_c") + _int_nibble("hi", "hi_c")

DECODES = {"f16": _F16_DECODE, "int": _INT_DECODE}
FOLDS = {"f16": F16_FOLD, "int": 1.0}


def gemv(name: str, out_dim: int, in_dim: int, decode: str) -> str:
    """``func @name(P [1, O, in/2] i8, S [1, O, in/32] i8, xe [in/32, 16], xo [in/32, 16]) -> [1, O]``,
    the lanes pinned by a ``compilation_info`` (llvm-cpu)."""
    O, B = out_dim, in_dim // 32
    pk, sc = f"tensor<1x{O}x{in_dim // 2}xi8>", f"tensor<1x{O}x{B}xi8>"
    xt, part, y = f"tensor<{B}x{LANES}xf32>", f"tensor<{O}x{LANES}xf32>", f"tensor<{O}xf32>"
    return f"""
module {{
  func.func @{name}(%P: {pk}, %S: {sc}, %xe: {xt}, %xo: {xt}) -> tensor<1x{O}xf32> {{
    %zero = arith.constant 0.0 : f32
    %P2 = tensor.collapse_shape %P [[0, 1], [2]] : {pk} into tensor<{O}x{in_dim // 2}xi8>
    %P3 = tensor.expand_shape %P2 [[0], [1, 2]] output_shape [{O}, {B}, {LANES}] : tensor<{O}x{in_dim // 2}xi8> into tensor<{O}x{B}x{LANES}xi8>
    %S2 = tensor.collapse_shape %S [[0, 1], [2]] : {sc} into tensor<{O}x{B}xi8>
    %e = tensor.empty() : {part}
    %f = linalg.fill ins(%zero : f32) outs(%e : {part}) -> {part}
    %part = linalg.generic {{indexing_maps = [affine_map<(o, j, b) -> (o, b, j)>, affine_map<(o, j, b) -> (o, b)>,
                                             affine_map<(o, j, b) -> (b, j)>, affine_map<(o, j, b) -> (b, j)>,
                                             affine_map<(o, j, b) -> (o, j)>],
                            iterator_types = ["parallel", "parallel", "reduction"]}}
        ins(%P3, %S2, %xe, %xo : tensor<{O}x{B}x{LANES}xi8>, tensor<{O}x{B}xi8>, {xt}, {xt})
        outs(%f : {part}) {_LANES_CONFIG} {{
    ^bb0(%p: i8, %s: i8, %a: f32, %b: f32, %acc: f32):{DECODES[decode]}{_SCALE}
      %t0 = arith.mulf %lo, %a : f32
      %t1 = arith.mulf %hi, %b : f32
      %t2 = arith.addf %t0, %t1 : f32
      %t3 = arith.mulf %t2, %scale : f32
      %r = arith.addf %acc, %t3 : f32
      linalg.yield %r : f32
    }} -> {part}
    %e2 = tensor.empty() : {y}
    %f2 = linalg.fill ins(%zero : f32) outs(%e2 : {y}) -> {y}
    %sum = linalg.generic {{indexing_maps = [affine_map<(o, j) -> (o, j)>, affine_map<(o, j) -> (o)>],
                           iterator_types = ["parallel", "reduction"]}}
        ins(%part : {part}) outs(%f2 : {y}) {{
    ^bb0(%v: f32, %acc: f32):
      %r = arith.addf %acc, %v : f32
      linalg.yield %r : f32
    }} -> {y}
    %y = tensor.expand_shape %sum [[0, 1]] output_shape [1, {O}] : {y} into tensor<1x{O}xf32>
    return %y : tensor<1x{O}xf32>
  }}
}}"""


def split(name: str, width: int, decode: str) -> str:
    """``func @name(x [1, width]) -> (xe, xo [width/32, 16])``: the even and odd elements of each
    32-element block, times the decode's fold (2^14 for ``f16``); one small op of its own."""
    B = width // 32
    x3, xt, half = f"tensor<{B}x{LANES}x2xf32>", f"tensor<2x{B}x{LANES}xf32>", f"tensor<{B}x{LANES}xf32>"
    return f"""
module {{
  func.func @{name}(%x: tensor<1x{width}xf32>) -> ({half}, {half}) {{
    %fold = arith.constant {FOLDS[decode]:e} : f32
    %x1 = tensor.collapse_shape %x [[0, 1]] : tensor<1x{width}xf32> into tensor<{width}xf32>
    %x3 = tensor.expand_shape %x1 [[0, 1, 2]] output_shape [{B}, {LANES}, 2] : tensor<{width}xf32> into {x3}
    %e = tensor.empty() : {xt}
    %t = linalg.generic {{indexing_maps = [affine_map<(k, b, j) -> (b, j, k)>, affine_map<(k, b, j) -> (k, b, j)>],
                         iterator_types = ["parallel", "parallel", "parallel"]}}
        ins(%x3 : {x3}) outs(%e : {xt}) {{
    ^bb0(%v: f32, %o: f32):
      %r = arith.mulf %v, %fold : f32
      linalg.yield %r : f32
    }} -> {xt}
    %xe = tensor.extract_slice %t[0, 0, 0] [1, {B}, {LANES}] [1, 1, 1] : {xt} to {half}
    %xo = tensor.extract_slice %t[1, 0, 0] [1, {B}, {LANES}] [1, 1, 1] : {xt} to {half}
    return %xe, %xo : {half}, {half}
  }}
}}"""


def expert_slot(name: str, act_name: str, axpy_name: str, L: int, I: int, decode: str) -> list[str]:
    """``func @name(a [1, L], z [1, L], ws [1, 1], w1p, w1s, w3p, w3s, w2p, w2s) -> a + ws * FFN(z)``
    for one expert sliced [1, out, ...] from the stacked weights; ``act_name(g, u)`` and
    ``axpy_name(a, ws, y)`` are defined elsewhere (traced from PyTorch)."""
    row, hid, wt = TensorType((1, L), "f32"), TensorType((1, I), "f32"), TensorType((1, 1), "f32")
    w13 = [TensorType((1, I, L // 2), "i8"), TensorType((1, I, L // 32), "i8")]
    w2 = [TensorType((1, L, I // 2), "i8"), TensorType((1, L, I // 32), "i8")]
    xl, xi = f"tensor<{L // 32}x{LANES}xf32>", f"tensor<{I // 32}x{LANES}xf32>"
    a13 = f"{w13[0]}, {w13[1]}, {xl}, {xl}"
    a2 = f"{w2[0]}, {w2[1]}, {xi}, {xi}"
    wrapper = f"""
module {{
  func.func private @{name}_split_in({row}) -> ({xl}, {xl})
  func.func private @{name}_split_hid({hid}) -> ({xi}, {xi})
  func.func private @{name}_up({a13}) -> {hid}
  func.func private @{name}_down({a2}) -> {row}
  func.func private @{act_name}({hid}, {hid}) -> {hid}
  func.func private @{axpy_name}({row}, {wt}, {row}) -> {row}
  func.func @{name}(%a: {row}, %z: {row}, %ws: {wt}, %w1p: {w13[0]}, %w1s: {w13[1]}, %w3p: {w13[0]}, %w3s: {w13[1]},
                    %w2p: {w2[0]}, %w2s: {w2[1]}) -> {row} {{
    %x:2 = func.call @{name}_split_in(%z) : ({row}) -> ({xl}, {xl})
    %g = func.call @{name}_up(%w1p, %w1s, %x#0, %x#1) : ({a13}) -> {hid}
    %u = func.call @{name}_up(%w3p, %w3s, %x#0, %x#1) : ({a13}) -> {hid}
    %h = func.call @{act_name}(%g, %u) : ({hid}, {hid}) -> {hid}
    %hx:2 = func.call @{name}_split_hid(%h) : ({hid}) -> ({xi}, {xi})
    %y = func.call @{name}_down(%w2p, %w2s, %hx#0, %hx#1) : ({a2}) -> {row}
    %r = func.call @{axpy_name}(%a, %ws, %y) : ({row}, {wt}, {row}) -> {row}
    return %r : {row}
  }}
}}"""
    return [split(f"{name}_split_in", L, decode), split(f"{name}_split_hid", I, decode),
            gemv(f"{name}_up", I, L, decode), gemv(f"{name}_down", L, I, decode), wrapper]


def matvec_module(out_dim: int, in_dim: int, decode: str) -> str:
    """A module whose public ``main(P [1, O, in/2] i8, S [1, O, in/32] i8, x [1, in]) -> [1, O]`` is
    one matvec as the expert FFN runs it (split, then gemv): for tests and the bench."""
    from iree.compiler import ir

    from .rewrite import merge_functions

    O, B = out_dim, in_dim // 32
    pk, sc = f"tensor<1x{O}x{in_dim // 2}xi8>", f"tensor<1x{O}x{B}xi8>"
    xt, x, y = f"tensor<{B}x{LANES}xf32>", f"tensor<1x{in_dim}xf32>", f"tensor<1x{O}xf32>"
    main = f"""
module {{
  func.func private @split({x}) -> ({xt}, {xt})
  func.func private @gemv({pk}, {sc}, {xt}, {xt}) -> {y}
  func.func @main(%P: {pk}, %S: {sc}, %x: {x}) -> {y} {{
    %h:2 = func.call @split(%x) : ({x}) -> ({xt}, {xt})
    %y = func.call @gemv(%P, %S, %h#0, %h#1) : ({pk}, {sc}, {xt}, {xt}) -> {y}
    return %y : {y}
  }}
}}"""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        for text in (split("split", in_dim, decode), gemv("gemv", O, in_dim, decode), main):
            merge_functions(module, text)
        for f in module.body.operations:
            if ir.StringAttr(f.attributes["sym_name"]).value == "main":
                f.attributes["sym_visibility"] = ir.StringAttr.get("public")
        return str(module)
