"""The two forms of ``torch.k3.mxfp4_moe`` (docs/model.md §4-5): a short hand-written ``scf.for`` whose
iterations call one traced expert FFN on slices of the stacked expert weights, sliced in place.

    by_slot    decode (a static handful of tokens): a loop over the (token, slot) pairs, each
               adding w * FFN_e(z) for its picked expert e to the token's output.
    by_expert  prefill (a dynamic token count N): the (token, slot) pairs ordered by expert by
               counting (no sort: IREE's CPU sort of a dynamic length needs an unbounded stack
               buffer), then a loop over the experts, each on its own rows; the work of the top-k
               only (every expert on every token would cost E/k times more).
Inside the FFN the MXFP4 matrices are dequantised by ``dequantize``: one elementwise op per matrix,
which IREE compiles to one dispatch (model.mxfp4.dequantize's interleaving of the two nibbles becomes
a strided copy; with it the gather form that came before was ~3x slower per weight). On llvm-cpu the
decode form instead multiplies the packed weights as they are (``mxfp4_moe_streamed``,
mxfp4_gemv.py): a decode step reads each picked matrix once, 0.53 bytes per weight.
"""
from __future__ import annotations

import torch

from ..model import mxfp4
from ..model.moe import glu_act
from . import mxfp4_gemv
from .trace import TensorType, trace_to_linalg


SCALES = torch.exp2(torch.arange(256, dtype=torch.float32) - mxfp4.SCALE_BIAS)  # E8M0 byte -> 2^(X - 127)


def dequantize(packed, scale):
    """model.mxfp4.dequantize of one matrix, [out, in/2] and [out, in/32] u8 -> [out, in] f32, as one
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


def _slices(names: list[str], types: list[TensorType], index: str, indent: str) -> str:
    """extract_slice of expert ``index`` from each stacked weight: [E, ...] -> [1, ...]."""
    lines = []
    for n, t in zip(names, types):
        one = t.with_dim(0, 1)
        zeros = ", ".join("0" for _ in t.shape[1:])
        lines.append(f"{indent}%{n}_e = tensor.extract_slice %{n}[{index}, {zeros}] [{', '.join(map(str, one.shape))}] "
                     f"[{', '.join('1' for _ in t.shape)}] : {t} to {one}")
    return "\n".join(lines)


def traced_slot(ffn):
    """The slot function traced from PyTorch: ``a + ws * ffn(rows, *weight slices)``."""
    def slot(name: str, types: list[TensorType]) -> list[str]:
        return [trace_to_linalg(lambda a, r, ws, *m: a + ws * ffn(r, *m), types, name)]
    return slot


def by_slot(sym: str, ins: list[TensorType], slot) -> list[str]:
    """Decode form of ``func @sym(z [N, L], idx [N, k], w [N, k], *weights [E, ...]) -> [N, L]``;
    ``slot(name, types)`` gives the texts defining ``func @name(a [1, L], rows [1, L], ws [1, 1],
    *weight slices [1, ...]) -> a + ws * FFN(rows)`` (e.g. ``traced_slot(ffn)``)."""
    z, idx, w, *weights = ins
    N, k, L = z.shape[0], idx.shape[1], z.shape[1]  # experts map L -> L
    one = [t.with_dim(0, 1) for t in weights]
    row, out, wt = TensorType((1, L), "f32"), TensorType((N, L), "f32"), TensorType((1, 1), "f32")
    slot_texts = slot(sym + "_slot", [row, row, wt, *one])
    names = [f"m{i}" for i in range(len(weights))]
    params = ", ".join(f"%{n}: {t}" for n, t in zip(names, weights))
    call_types = ", ".join(map(str, [row, row, wt, *one]))
    wrapper = f"""
module {{
  func.func private @{sym}_slot({call_types}) -> {row}
  func.func @{sym}(%z: {z}, %idx: {idx}, %w: {w}, {params}) -> {out} {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %cN = arith.constant {N} : index
    %ck = arith.constant {k} : index
    %zero = arith.constant 0.0 : f32
    %empty = tensor.empty() : {out}
    %init = linalg.fill ins(%zero : f32) outs(%empty : {out}) -> {out}
    %y = scf.for %n = %c0 to %cN step %c1 iter_args(%all = %init) -> ({out}) {{
      %zn = tensor.extract_slice %z[%n, 0] [1, {L}] [1, 1] : {z} to {row}
      %yn0 = tensor.extract_slice %all[%n, 0] [1, {L}] [1, 1] : {out} to {row}
      %yn = scf.for %s = %c0 to %ck step %c1 iter_args(%a = %yn0) -> ({row}) {{
        %e64 = tensor.extract %idx[%n, %s] : {idx}
        %e = arith.index_cast %e64 : i64 to index
        %ws = tensor.extract_slice %w[%n, %s] [1, 1] [1, 1] : {w} to {wt}
{_slices(names, weights, "%e", "        ")}
        %a2 = func.call @{sym}_slot(%a, %zn, %ws, {", ".join(f"%{n}_e" for n in names)}) : ({call_types}) -> {row}
        scf.yield %a2 : {row}
      }}
      %put = tensor.insert_slice %yn into %all[%n, 0] [1, {L}] [1, 1] : {row} into {out}
      scf.yield %put : {out}
    }}
    return %y : {out}
  }}
}}"""
    return [*slot_texts, wrapper]


def _group(n_experts: int):
    def group(z, idx):
        """zs [N, k, L]: the token rows of the (token, slot) pairs in expert order; dest [N, k]: where
        each pair went; counts and starts [E] of each expert's rows."""
        N, k = idx.shape
        flat = idx.flatten()
        seen = (flat.unsqueeze(-1) == torch.arange(n_experts)).to(torch.int32).cumsum(0)  # [N*k, E]
        counts = seen[-1].long()
        starts = counts.cumsum(0) - counts
        dest = starts[flat] + seen.gather(1, flat.unsqueeze(-1)).squeeze(-1) - 1
        src = torch.zeros_like(flat).scatter(0, dest, torch.arange(N * k))
        return z[src // k].view(N, k, -1), dest.view(N, k), counts, starts
    return group


def _combine(ys, dest, w):
    """y[n] = sum_i w[n, i] ys[dest[n, i]]; ys [N, k, D] in expert order."""
    N, k, D = ys.shape
    picked = ys.flatten(0, 1)[dest.flatten()].view(N, k, D)
    return (picked * w.unsqueeze(-1)).sum(1)


def by_expert(sym: str, ins: list[TensorType], ffn) -> list[str]:
    """Prefill form of ``func @sym(z [?, L], idx [?, k], w [?, k], *weights [E, ...]) -> [?, L]``;
    ``ffn(rows [?, L], *weight slices [1, ...]) -> [?, L]`` is traced once."""
    z, idx, w, *weights = ins
    E, k, L = weights[0].shape[0], idx.shape[1], z.shape[1]  # experts map L -> L
    one = [t.with_dim(0, 1) for t in weights]
    rows, ys3 = TensorType((None, L), "f32"), TensorType((None, k, L), "f32")
    zs3 = TensorType((None, k, L), "f32")
    group = trace_to_linalg(_group(E), [z, idx], sym + "_group", int_high=E)
    expert = trace_to_linalg(ffn, [rows, *one], sym + "_expert")
    combine = trace_to_linalg(_combine, [ys3, idx, w], sym + "_combine", int_high=1)
    vec = f"tensor<{E}xi64>"
    names = [f"m{i}" for i in range(len(weights))]
    params = ", ".join(f"%{n}: {t}" for n, t in zip(names, weights))
    wrapper = f"""
module {{
  func.func private @{sym}_group({z}, {idx}) -> ({zs3}, {idx}, {vec}, {vec})
  func.func private @{sym}_expert({rows}, {", ".join(map(str, one))}) -> {rows}
  func.func private @{sym}_combine({ys3}, {idx}, {w}) -> {rows}
  func.func @{sym}(%z: {z}, %idx: {idx}, %w: {w}, {params}) -> {rows} {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %ck = arith.constant {k} : index
    %cE = arith.constant {E} : index
    %g:4 = func.call @{sym}_group(%z, %idx) : ({z}, {idx}) -> ({zs3}, {idx}, {vec}, {vec})
    %N = tensor.dim %z, %c0 : {z}
    %Nk = arith.muli %N, %ck : index
    %zs = tensor.collapse_shape %g#0 [[0, 1], [2]] : {zs3} into {rows}
    %init = tensor.empty(%Nk) : {rows}
    %out = scf.for %e = %c0 to %cE step %c1 iter_args(%acc = %init) -> ({rows}) {{
      %n64 = tensor.extract %g#2[%e] : {vec}
      %s64 = tensor.extract %g#3[%e] : {vec}
      %n = arith.index_cast %n64 : i64 to index
      %s = arith.index_cast %s64 : i64 to index
      %rows = tensor.extract_slice %zs[%s, 0] [%n, {L}] [1, 1] : {rows} to {rows}
{_slices(names, weights, "%e", "      ")}
      %ye = func.call @{sym}_expert(%rows, {", ".join(f"%{n}_e" for n in names)})
          : ({rows}, {", ".join(map(str, one))}) -> {rows}
      %put = tensor.insert_slice %ye into %acc[%s, 0] [%n, {L}] [1, 1] : {rows} into {rows}
      scf.yield %put : {rows}
    }}
    %out3 = tensor.expand_shape %out [[0, 1], [2]] output_shape [%N, {k}, {L}] : {rows} into {ys3}
    %y = func.call @{sym}_combine(%out3, %g#1, %w) : ({ys3}, {idx}, {w}) -> {rows}
    return %y : {rows}
  }}
}}"""
    return [group, expert, combine, wrapper]


def mxfp4_moe(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    """``torch.k3.mxfp4_moe``: by_expert for a dynamic token count, by_slot for a static one; the
    FFN dequantises each matrix, then multiplies (every target)."""
    if ins[0].shape[0] is None:
        return by_expert(sym, ins, _ffn(*consts))
    return by_slot(sym, ins, traced_slot(_ffn(*consts)))


def _streamed_slot(decode: str, act: str, beta1: float, beta2: float):
    """The slot as mxfp4_gemv's matvecs on the packed weights, with the activation and the
    weighted add traced from PyTorch."""
    def slot(name: str, types: list[TensorType]) -> list[str]:
        row, _, wt, w1p, *_ = types
        L, I = row.shape[1], w1p.shape[1]
        hid = TensorType((1, I), "f32")
        act_fn = trace_to_linalg(lambda g, u: glu_act(act, beta1, beta2, g, u), [hid, hid], name + "_act")
        axpy = trace_to_linalg(lambda a, ws, y: a + ws * y, [row, wt, row], name + "_axpy")
        return [act_fn, axpy, *mxfp4_gemv.expert_slot(name, name + "_act", name + "_axpy", L, I, decode)]
    return slot


def mxfp4_moe_streamed(decode: str):
    """``torch.k3.mxfp4_moe`` for llvm-cpu: decode (by_slot) streams the packed weights through
    mxfp4_gemv (nibble ``decode`` "f16" or "int"); prefill as mxfp4_moe (its matmuls over many
    rows pay for a dequantised copy)."""
    def generator(sym: str, ins: list[TensorType], consts: list) -> list[str]:
        if ins[0].shape[0] is None:
            return by_expert(sym, ins, _ffn(*consts))
        return by_slot(sym, ins, _streamed_slot(decode, *consts))
    return generator
