"""``k3::linear``, y = x W^T with W at the dtype it is stored in (bf16): the projections of the trunk
(docs/pipeline.md §6), the op and its lowerings. The model's ``Linear`` layers call it, so a compiled
program reads each weight as stored and widens it where it is multiplied.

    default   traced from PyTorch: W widened to x's dtype, then a matmul (IREE fuses the widening
              into the matmul's dispatch)
    llvm-cpu  up to MAX_ROWS rows of x (a decode step of as many sequences) against bf16 W: the
              streamed matvec (templates/bf16_matvec.mlir), W read once where it lies as i32 words of
              two bf16, 16 partial sums per row and output with the vector lanes on a parallel dim,
              ROWS_PER_TILE rows to a vector tile (IREE's default matvec reads W at a fraction of
              copy bandwidth: docs/pipeline.md §6). Every other shape: the default.
    cpu:x86-64-v3, cpu:x86-64-v4
              besides the streamed matvec, f32 rows of a dynamic count (prefill) as one
              ``linalg.mmt4d`` on T x T x 1 tiles (templates/linear_tiled.mlir), W widened into its
              tiles once per call. IREE lowers the mmt4d to its microkernel, which has a fast f32
              tile function for 16x16x1 with AVX-512 and for 8x8x1 with AVX2 + FMA; the tile is the
              level's (``TILE``). Where the microkernel has no tile function for the target's
              features its fallback is wrong in IREE 3.13 (docs/pipeline.md, "mmt4d tiles"), so
              no other level takes this lowering.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import NAMESPACE, CustomOp, Lowering, TensorType, require
from .mlir import render
from .trace import trace_to_linalg

LANES = 16   # partial sums per row: words (bf16 pairs) of a 32-element block
# the mmt4d tile (M0 = N0, K0 = 1) of each CPU level that has a microkernel tile function for it
TILE = {"x86-64-v3": 8, "x86-64-v4": 16}


def reference(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out] in x's dtype; the weight in any float dtype."""
    return F.linear(x, weight.to(x.dtype))


@torch.library.custom_op(f"{NAMESPACE}::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor) -> Tensor:
    """The op: ``reference``."""
    return reference(x, weight)


@linear.register_fake
def _linear_fake(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def check(ins: list[TensorType]) -> None:
    op = "linear"
    require(len(ins) == 2, op, f"takes x and weight, got {len(ins)} tensors")
    x, w = ins
    require(x.dtype.is_floating_point and w.dtype.is_floating_point and len(w.shape) == 2 and len(x.shape) >= 1
            and None not in w.shape and x.shape[-1] == w.shape[1], op,
            f"wants x [..., in] and a float weight [out, in] (static); got x {x.describe()}, weight {w.describe()}")


def traced(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    """The PyTorch reference traced: any shape, dtypes and dynamic sizes."""
    check(ins)
    x, w = ins
    x = TensorType(tuple(f"d{i}" if d is None else d for i, d in enumerate(x.shape)), x.dtype)
    return [trace_to_linalg(reference, [x, w], sym)]


MAX_ROWS = 32   # most rows of x the streamed matvec takes (a decode step of that many sequences)
# rows of x per vector tile of the streamed matvec: each row's x for all of IN is read once per
# output, so more rows to a tile outgrow the L1 cache at k3-small's widths (docs/pipeline.md §6)
ROWS_PER_TILE = 2


def streams(ins: list[TensorType]) -> bool:
    """Whether the streamed matvec takes these operands: f32 x of static leading dims holding
    1 to MAX_ROWS rows, bf16 W [O, in], in a multiple of 32."""
    x, w = ins
    return (None not in x.shape and len(x.shape) >= 2 and 1 <= math.prod(x.shape[:-1]) <= MAX_ROWS
            and x.dtype == torch.float32 and w.dtype == torch.bfloat16 and w.shape[1] % (2 * LANES) == 0)


def streamed(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    """For llvm-cpu: the streamed matvec where it applies (``streams``), else ``traced``."""
    check(ins)
    if not streams(ins):
        return traced(sym, ins, consts)
    x, w = ins
    (O, IN), lead = w.shape, [str(d) for d in x.shape[:-1]]
    M = math.prod(x.shape[:-1])
    return [render("bf16_matvec.mlir", name=sym, O=O, IN=IN, B=IN // (2 * LANES), LANES=LANES, lead=lead, M=M,
                   MV=math.gcd(M, ROWS_PER_TILE))]


def tiles(ins: list[TensorType], tile: int) -> bool:
    """Whether the tiled product takes these operands: f32 x whose leading dims hold exactly one
    dynamic size (the row count), a weight of a whole number of ``tile`` rows."""
    x, w = ins
    return (x.dtype == torch.float32 and len(x.shape) >= 2 and x.shape[:-1].count(None) == 1
            and w.dtype in (torch.float32, torch.bfloat16) and w.shape[0] % tile == 0)


def tiled(level: str) -> Lowering:
    """For a CPU level of ``TILE``: a dynamic row count as a tile x tile x 1 mmt4d where it applies
    (``tiles``), else ``streamed``."""
    tile = TILE[level]

    def generate(sym: str, ins: list[TensorType], consts: list) -> list[str]:
        check(ins)
        if not tiles(ins, tile):
            return streamed(sym, ins, consts)
        x, w = ins
        lead = ["?" if d is None else str(d) for d in x.shape[:-1]]
        return [render("linear_tiled.mlir", name=sym, O=w.shape[0], IN=w.shape[1], lead=lead, dyn=lead.index("?"),
                       wtype="f32" if w.dtype == torch.float32 else "bf16", M0=tile, N0=tile)]
    return Lowering(generate, f"rows of a dynamic count: one {tile}x{tile}x1 mmt4d, W widened into its tiles per "
                              "call; up to 32 rows against bf16 W: streamed; else widened, then a matmul")


LINEAR = CustomOp("linear", {
    "default": Lowering(traced, "x W^T: W widened to x's dtype, then a matmul"),
    "llvm-cpu": Lowering(streamed, "up to 32 rows against bf16 W: W streamed once as words of two bf16, 16 "
                                   "partial sums per row; else widened, then a matmul"),
    **{f"cpu:{level}": tiled(level) for level in TILE},
})
