"""``k3::mxfp4_moe``, the routed experts of an MoE layer with MXFP4 weights (docs/model.md §4-5): the op,
its eager reference and its lowerings.

    y = sum_i w_i W2_e act(W1_e z, W3_e z), e = idx_i

z [N, L] fp32, idx [N, k] int64, w [N, k] fp32; the experts stacked, w1, w3 [E, I, L] and w2
[E, L, I], each as ``weight_packed`` u8 [E, out, in/2] and ``weight_scale`` u8 [E, out, in/32]
(mxfp4.py). The lowerings keep the experts 4-bit in memory and slice each expert in place:

    by_slot    decode (a static handful of tokens): a loop over the (token, slot) pairs, each
               adding w * FFN_e(z) for its picked expert e to the token's output.
    by_expert  prefill (a dynamic token count N): the (token, slot) pairs ordered by expert by
               counting (no sort: IREE's CPU sort of a dynamic length needs an unbounded stack
               buffer), then each expert on its own rows, written out ``UNROLL`` at a time (IREE
               3.13 copies a loop-carried tensor whole on every trip); the work of the top-k only
               (every expert on every token would cost E/k times more).
Inside the FFN the MXFP4 matrices are dequantised by ``dequantize``: one elementwise op per matrix,
which IREE compiles to one dispatch (mxfp4.dequantize's interleaving of the two nibbles becomes a
strided copy; with it the gather form that came before was ~3x slower per weight). On llvm-cpu the
decode form instead multiplies the packed weights as they are (``decode_streamed``, mxfp4_gemv.py): a
decode step reads each picked matrix once, 0.53 bytes per weight. ``tiled_expert``
(``prefill_tiled``) is a faster prefill FFN for the CPU levels x86-64-v3 and -v4: each matrix
dequantised once per expert by integer ops into the layout of a ``linalg.mmt4d`` on the level's
tiles (templates/mxfp4_expert_tiled.mlir). Only programs over several devices take it: in a
one-device model under IREE 3.13's local-task driver it gives wrong results in ``extend``,
depending on what ran before (docs/pipeline.md §6, tests/test_e2e.py
``test_extend_pieces_of_every_length_match_eager``); there the CPU levels prefill with
``prefill_dequantized``.

A pair (token, slot) whose expert lies outside [0, E) adds nothing: on a program over several
devices each device holds a contiguous range of the experts and gets the pairs with their expert
ids shifted by the range's start (exporter/devices.py). The ``ranged`` lowerings (``SHARDED``)
skip those pairs, so a device does no expert work for a token routed elsewhere; the one-device
lowerings take every id in range (the router's picks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import mxfp4, mxfp4_gemv
from .base import NAMESPACE, CustomOp, Lowering, TensorType, require
from .linear import TILE
from .mlir import render
from .numerics import ACTIVATIONS, glu_act
from .trace import trace_to_linalg


@torch.library.custom_op(f"{NAMESPACE}::mxfp4_moe", mutates_args=())
def mxfp4_moe(z: Tensor, idx: Tensor, w: Tensor,
              w1_packed: Tensor, w1_scale: Tensor, w3_packed: Tensor, w3_scale: Tensor,
              w2_packed: Tensor, w2_scale: Tensor, act: str, beta1: float, beta2: float) -> Tensor:
    """y [N, L] in z's dtype (float64 in the double-precision reference). Reference: for each
    expert that was picked, dequantise it and run its tokens."""
    y = z.new_zeros(z.shape[0], w2_packed.shape[1])
    for e in [e for e in idx.unique().tolist() if 0 <= e < w1_packed.shape[0]]:
        token, slot = (idx == e).nonzero(as_tuple=True)
        W1 = mxfp4.dequantize(w1_packed[e], w1_scale[e], z.dtype)
        W3 = mxfp4.dequantize(w3_packed[e], w3_scale[e], z.dtype)
        W2 = mxfp4.dequantize(w2_packed[e], w2_scale[e], z.dtype)
        h = glu_act(act, beta1, beta2, z[token] @ W1.t(), z[token] @ W3.t())
        y.index_add_(0, token, (h @ W2.t()) * w[token, slot].unsqueeze(-1))
    return y


@mxfp4_moe.register_fake
def _mxfp4_moe_fake(z, idx, w, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, act, beta1, beta2):
    return z.new_empty((z.shape[0], w2_packed.shape[1]))


NAMES = ("z", "idx", "w", "w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")


def check(ins: list[TensorType], consts: list, form: str) -> None:
    """The operands the lowerings take: fp32 z and w, int64 idx, u8 MXFP4 experts of the module
    docstring's shapes (static), N static for the decode forms and dynamic for by_expert."""
    op = "mxfp4_moe"
    got = ", ".join(f"{n} {t.describe()}" for n, t in zip(NAMES, ins))
    require(len(ins) == 9 and len(consts) == 3, op, f"takes 9 tensors and (act, beta1, beta2), got {got}, {consts}")
    require(consts[0] in ACTIVATIONS, op, f"act must be one of {', '.join(ACTIVATIONS)}, got {consts[0]!r}")
    z, idx, w, *weights = ins
    require((z.dtype, idx.dtype, w.dtype) == (torch.float32, torch.int64, torch.float32)
            and all(t.dtype == torch.uint8 for t in weights), op,
            f"takes z, w float32, idx int64 and the experts uint8; got {got}")
    wanted = ("wants z [N, L], idx and w [N, k], w1, w3 [E, I, L] and w2 [E, L, I] as packed [E, out, in/2] "
              f"and scales [E, out, in/32], L and I multiples of 32, only N dynamic; got {got}")
    require(len(z.shape) == len(idx.shape) == 2 and w.shape == idx.shape and z.shape[0] == idx.shape[0]
            and all(len(t.shape) == 3 for t in weights), op, wanted)
    E, I, L, k = weights[0].shape[0], weights[0].shape[1], z.shape[1], idx.shape[1]
    require(all(isinstance(d, int) for d in (E, I, L, k)) and L % 32 == 0 and I % 32 == 0, op, wanted)
    shapes = [(E, I, L // 2), (E, I, L // 32)] * 2 + [(E, L, I // 2), (E, L, I // 32)]
    require([t.shape for t in weights] == shapes, op, wanted)
    dynamic = z.shape[0] is None
    require(dynamic == (form == "by_expert"), op,
            f"the {form} form takes a {'dynamic' if form == 'by_expert' else 'static'} token count; got {got}")


SCALES = torch.exp2(torch.arange(256, dtype=torch.float32) - mxfp4.SCALE_BIAS)  # E8M0 byte -> 2^(X - 127)


def dequantize(packed, scale):
    """mxfp4.dequantize of one matrix, [out, in/2] and [out, in/32] u8 -> [out, in] f32, as one
    elementwise op: the nibble pair of a byte spread over a trailing dim of 2 (low nibble first; on
    int32, so shifts are logical), the E2M1 values and the scales by table lookup."""
    p = packed.to(torch.int32).unflatten(-1, (-1, 16)).unsqueeze(-1)          # [out, in/32, 16, 1]
    low = p & 15
    code = low + ((p >> 4) - low) * torch.tensor([0, 1], dtype=torch.int32)  # [out, in/32, 16, 2]
    return (mxfp4.e2m1_table()[code.long()] * SCALES[scale.long()][..., None, None]).flatten(-3)


def _ffn(act: str, beta1: float, beta2: float):
    def ffn(rows, w1p, w1s, w3p, w3s, w2p, w2s):
        """rows [n, L] through one expert, whose matrices come as [1, out, in/2] and [1, out, in/32]."""
        W1, W3, W2 = (dequantize(p[0], s[0]) for p, s in ((w1p, w1s), (w3p, w3s), (w2p, w2s)))
        return glu_act(act, beta1, beta2, rows @ W1.t(), rows @ W3.t()) @ W2.t()
    return ffn


def _weights(weights: list[TensorType]) -> list[dict]:
    """The stacked weights as the templates walk them: name, type [E, ...] and one expert [1, ...]."""
    return [{"name": f"m{i}", "type": t, "one": t.with_dim(0, 1)} for i, t in enumerate(weights)]


def traced_slot(ffn):
    """The slot function traced from PyTorch: ``a + ws * ffn(rows, *weight slices)``."""
    def slot(name: str, types: list[TensorType]) -> list[str]:
        return [trace_to_linalg(lambda a, r, ws, *m: a + ws * ffn(r, *m), types, name)]
    return slot


def by_slot(sym: str, ins: list[TensorType], slot, ranged: bool = False, stacked: bool = False) -> list[str]:
    """Decode form of ``func @sym(z [N, L], idx [N, k], w [N, k], *weights [E, ...]) -> [N, L]``
    (templates/mxfp4_moe_by_slot.mlir); ``slot(name, types)`` gives the texts defining ``func
    @name(a [1, L], rows [1, L], ws [1, 1], *weight slices [1, ...]) -> a + ws * FFN(rows)`` (e.g.
    ``traced_slot(ffn)``), or where ``stacked`` ``func @name(a, rows, ws, idx [N * k], pair: index,
    *weights [E, ...])`` for expert idx[pair], which the slot reads on the device. The weights may be
    of any kind the slot takes (the bench passes bf16).
    ``ranged``: pairs whose expert is outside [0, E) are skipped (module docstring)."""
    z, idx, w, *weights = ins
    N, k, L = z.shape[0], idx.shape[1], z.shape[1]  # experts map L -> L
    row, wt = TensorType((1, L), z.dtype), TensorType((1, 1), w.dtype)
    walked = _weights(weights)
    one = [m["one"] for m in walked]
    wrapper = render("mxfp4_moe_by_slot.mlir", sym=sym, z=z, idx=idx, w=w, weights=walked, one=one,
                     row=row, wt=wt, out=TensorType((N, L), z.dtype), N=N, k=k, L=L, ranged=ranged, stacked=stacked)
    flat = TensorType((N * k,), idx.dtype)
    return [*slot(sym + "_slot", [row, row, wt, *([flat, *weights] if stacked else one)]), wrapper]


UNROLL = 32  # most experts in one straight-line run of the prefill form (k3-small's 32: no loop)


def unrolled(n_experts: int) -> int:
    """Experts per trip of the prefill form's loop: the largest divisor of E up to ``UNROLL`` (all
    of them, no loop, for E <= UNROLL; K3's 896: 32, 28 trips, so 28 copies of the loop-carried
    results where a loop over single experts made 896). Run time and compile memory at each
    choice: docs/pipeline.md §6."""
    return max(d for d in range(1, min(n_experts, UNROLL) + 1) if n_experts % d == 0)


def _group(n_experts: int, ranged: bool = False):
    def group(z, idx):
        """zs [N, k, L]: the token rows of the (token, slot) pairs in expert order; dest [N, k]: where
        each pair went; counts and starts [E] of each expert's rows. ``ranged``: the pairs of an
        expert outside [0, E) go last, in a bucket E of their own that no expert reads."""
        N, k = idx.shape
        flat = idx.flatten()
        if ranged:
            flat = torch.where((flat >= 0) & (flat < n_experts), flat, n_experts)
        buckets = n_experts + int(ranged)
        seen = (flat.unsqueeze(-1) == torch.arange(buckets)).to(torch.int32).cumsum(0)  # [N*k, E]
        counts = seen[-1].long()
        starts = counts.cumsum(0) - counts
        dest = starts[flat] + seen.gather(1, flat.unsqueeze(-1)).squeeze(-1) - 1
        # the token of each pair scattered, not its flat position divided by k: traced, the
        # division is a float64 floor per gathered element. dest is a permutation of the N*k
        # positions, so every element of the target is written and the target can be any [N*k]
        # tensor: ``flat``, not ``zeros_like(flat)``. A zero tensor of dynamic size reads no tensor,
        # so IREE 3.13 makes it a dispatch of no operands that CSE shares between every MoE layer
        # of an entry point, loop bodies included, and its stream partitioning can then leave that
        # dispatch outside any execution region ("streamable op expected to be in an execution
        # region": the 8- and 9-layer K3 plans at k3-tiny widths).
        token = torch.arange(N).unsqueeze(-1).expand(N, k).flatten()
        src = flat.scatter(0, dest, token)
        return z[src].view(N, k, -1), dest.view(N, k), counts[:n_experts], starts[:n_experts]
    return group


def _combine(ys, dest, w):
    """y[n] = sum_i w[n, i] ys[dest[n, i]]; ys [N, k, D] in expert order. A sum of k row gathers,
    which IREE fuses into one elementwise op (gathering [N, k, D] first, then reducing over k, wrote
    and read back k rows per token)."""
    rows = ys.flatten(0, 1)
    y = rows[dest[:, 0]] * w[:, :1]
    for i in range(1, dest.shape[1]):
        y = y + rows[dest[:, i]] * w[:, i:i + 1]
    return y


def traced_expert(ffn):
    """The expert function traced from PyTorch: ``ffn(rows [R, L], *weight slices [1, ...]) -> [R, L]``."""
    def expert(name: str, types: list[TensorType]) -> list[str]:
        return [trace_to_linalg(ffn, types, name)]
    return expert


def tiled_expert(tile: int, act: str, beta1: float, beta2: float):
    """The expert function as three ``linalg.mmt4d`` on tile x tile x 1 tiles (the CPU level's,
    linear.TILE) on matrices dequantised once per call by integer ops into the mmt4d layout
    (templates/mxfp4_expert_tiled.mlir); the activation, which also transposes the tiles, traced
    from PyTorch."""
    def expert(name: str, types: list[TensorType]) -> list[str]:
        rows, w1p = types[0], types[1]
        L, I = rows.shape[1], w1p.shape[1]
        tiles = TensorType(("R", I // tile, tile, tile), rows.dtype)
        act_fn = trace_to_linalg(lambda g, u: glu_act(act, beta1, beta2, g, u).transpose(-1, -2), [tiles, tiles],
                                 name + "_act")
        return [act_fn, render("mxfp4_expert_tiled.mlir", name=name, act=name + "_act", L=L, I=I, T=tile)]
    return expert


def by_expert(sym: str, ins: list[TensorType], expert, ranged: bool = False) -> list[str]:
    """Prefill form of ``func @sym(z [N, L], idx [N, k], w [N, k], *weights [E, ...]) -> [N, L]``, N
    dynamic (templates/mxfp4_moe_by_expert.mlir); ``expert(name, types)`` gives the texts defining
    ``func @name(rows [R, L], *weight slices [1, ...]) -> [R, L]`` (e.g. ``traced_expert(ffn)``).
    ``ranged``: pairs whose expert is outside [0, E) are skipped."""
    z, idx, w, *weights = ins
    E, k, L = weights[0].shape[0], idx.shape[1], z.shape[1]  # experts map L -> L
    z, idx, w = (t.with_dim(0, "N") for t in (z, idx, w))
    walked = _weights(weights)
    rows, zs3 = TensorType(("R", L), z.dtype), TensorType(("N", k, L), z.dtype)
    group = trace_to_linalg(_group(E, ranged), [z, idx], sym + "_group", int_high=E)
    experts = expert(sym + "_expert", [rows, *(m["one"] for m in walked)])
    combine = trace_to_linalg(_combine, [zs3, idx, w], sym + "_combine", int_high=1)
    wrapper = render("mxfp4_moe_by_expert.mlir", sym=sym, z=z, idx=idx, w=w, weights=walked, rows=rows,
                     zs3=zs3, vec=TensorType((E,), torch.int64), k=k, E=E, L=L, ranged=ranged,
                     unroll=unrolled(E))
    return [group, *experts, combine, wrapper]


def _streamed_slot(nibbles: str, act: str, beta1: float, beta2: float):
    """The slot as mxfp4_gemv's matvecs on the packed weights, stacked and whole (the matvecs read
    expert idx[pair]'s rows in place), with the activation and the weighted add traced from PyTorch."""
    def slot(name: str, types: list[TensorType]) -> list[str]:
        row, _, wt, flat, w1p, *_ = types
        E, L, I = w1p.shape[0], row.shape[1], w1p.shape[1]
        hid = TensorType((1, I), row.dtype)
        act_fn = trace_to_linalg(lambda g, u: glu_act(act, beta1, beta2, g, u), [hid, hid], name + "_act")
        axpy = trace_to_linalg(lambda a, ws, y: a + ws * y, [row, wt, row], name + "_axpy")
        return [act_fn, axpy, *mxfp4_gemv.expert_slot(name, name + "_act", name + "_axpy", E, L, I, nibbles,
                                                      flat.shape[0])]
    return slot


# The four forms: a decode step (static N) or a prefill (dynamic N), each on dequantised matrices
# (every target) or on the CPU's own layout of the packed weights.

def decode_dequantized(sym: str, ins: list[TensorType], consts: list, ranged: bool = False) -> list[str]:
    """by_slot; each picked matrix dequantised, then multiplied."""
    check(ins, consts, "by_slot")
    return by_slot(sym, ins, traced_slot(_ffn(*consts)), ranged)


def decode_streamed(sym: str, ins: list[TensorType], consts: list, nibbles: str, ranged: bool = False) -> list[str]:
    """by_slot on the packed weights through mxfp4_gemv (nibble decode "int", "f16" or
    "native:<level>"): a step reads each picked matrix once, 0.53 bytes per weight (llvm-cpu)."""
    check(ins, consts, "streamed by_slot")
    return by_slot(sym, ins, _streamed_slot(nibbles, *consts), ranged, stacked=True)


def prefill_dequantized(sym: str, ins: list[TensorType], consts: list, ranged: bool = False) -> list[str]:
    """by_expert; each expert's matrices dequantised once, then multiplied over its rows."""
    check(ins, consts, "by_expert")
    return by_expert(sym, ins, traced_expert(_ffn(*consts)), ranged)


def prefill_tiled(sym: str, ins: list[TensorType], consts: list, tile: int, ranged: bool = False) -> list[str]:
    """by_expert with ``tiled_expert``: three mmt4d on the CPU level's tile x tile x 1 tiles."""
    check(ins, consts, "by_expert")
    return by_expert(sym, ins, tiled_expert(tile, *consts), ranged)


@dataclass(frozen=True)
class MoeLowering:
    """The lowering of one target: each call takes one of the four forms above, by its token count
    and the target's choices. ``nibbles``: decode streams the packed weights with this nibble decode
    (None: dequantised); ``tile``: prefill on mmt4d tiles of this size (None: dequantised);
    ``ranged``: one device's range of the experts (module docstring)."""
    nibbles: str | None = None
    tile: int | None = None
    ranged: bool = False

    def __call__(self, sym: str, ins: list[TensorType], consts: list) -> list[str]:
        """The form of this call: prefill when the token count is dynamic, else decode."""
        if ins[0].shape[0] is None and self.tile:
            return prefill_tiled(sym, ins, consts, self.tile, self.ranged)
        if ins[0].shape[0] is None:
            return prefill_dequantized(sym, ins, consts, self.ranged)
        if self.nibbles:
            return decode_streamed(sym, ins, consts, self.nibbles, self.ranged)
        return decode_dequantized(sym, ins, consts, self.ranged)


def _native(level: str) -> str:
    return (f"MXFP4 decode streams the packed weights through the native kernel for {level} (f16 nibble decode, "
            f"16 lanes per row, where it does not build)")


# lowering key -> (decode's nibble decode, prefill's tile, what it is)
FORMS = {
    "default": (None, None, "MXFP4 experts one at a time, sliced in place: loop over picked slots / over experts"),
    "llvm-cpu": ("int", None, "MXFP4 decode streams the packed weights, 16 lanes per row, i16 nibble decode (no F16C)"),
    **{f"cpu:{level}": (f"native:{level}", TILE[level], _native(level)) for level in TILE},
}


def _prefill(tile: int | None) -> str:
    return f"; prefill on {tile}x{tile} mmt4d tiles" if tile else "; prefill dequantises each expert once"


# One device never takes the tiled prefill (module docstring). A program over several devices keeps
# it: with the dequantised prefill, k3-tiny over 2 devices at x86-64-v4 is wrong from its prefill
# (docs/pipeline.md §6).
MXFP4_MOE = CustomOp(
    "mxfp4_moe",
    {key: Lowering(MoeLowering(nibbles, None), doc + _prefill(None)) for key, (nibbles, tile, doc) in FORMS.items()},
    sharded={key: Lowering(MoeLowering(nibbles, tile, ranged=True),
                           f"one device's range of the experts, pairs of other devices' experts skipped; {doc}{_prefill(tile)}")
             for key, (nibbles, tile, doc) in FORMS.items()})
