"""``torch.k3.causal_attention`` (model/ops.py; the MLA prefill, docs/model.md §2) as a loop over static
query blocks: for a dynamic T, IREE 3.13's llvm-cpu softmax over rows of dynamic length recomputes
the row maximum inside its exp-sum loop, ~110 ns per score at T = 2048, and the whole [H, T, T]
score matrix is materialised (../shared/notes/attention-cpu.md: 0.14x eager at 2048 tokens).

    q, k, v [B, T, H, D]  --pad T to Tp = ceil(T / Bq) Bq, transpose once-->  [B H, Tp, D]
    for off in 0, Bq, ..., Tp - Bq:                                 (scf.for, hand-written)
        o[:, off:off + Bq] = block(q[:, off:off + Bq], k[:, :off + Bq], v[:, :off + Bq])
    o [B H, Tp, Dv] --slice T, transpose back--> [B, T, H, Dv]

``block`` is traced from PyTorch with ``torch.bmm`` (``@`` traces to broadcast generics that ran
2.4x slower): its scores [B H, Bq, off + Bq] have a static row count, and keys past the block's
last row are never read, so the upper triangle costs nothing. Its rows are the last Bq of the
keys' positions: row i sees keys j <= i + L - Bq. Padded rows (past T) attend to zero keys and are
sliced off; real rows never see a padded key. The one-time transposes are kept out of the loop by
``util.optimization_barrier``, with the padded length re-tied to the result
(``flow.tensor.tie_shape``: a barrier on a dynamic tensor alone does not compile).
"""
from __future__ import annotations

import torch

from ..errors import K3Error
from .trace import TensorType, trace_to_linalg

BLOCK = 128  # query rows per iteration: within 5-10% of the best block at 512-8192 tokens (notes)


def _block(scale: float):
    def block(q, k, v):
        """softmax(q k^T scale, causal for the last Bq of L positions) v; q [N, Bq, Dq], k [N, L, Dq]."""
        nq, L = q.shape[1], k.shape[1]
        s = torch.bmm(q, k.transpose(1, 2)) * scale
        rows = torch.arange(nq).unsqueeze(1) + (L - nq)
        cols = torch.arange(L).unsqueeze(0)
        s = torch.where(cols <= rows, s, -torch.inf)
        return torch.bmm(torch.softmax(s, -1), v)
    return block


def _to_heads(x: str, t: TensorType, N: int) -> str:
    """%x [B, ?, H, D] padded by %pad rows -> %{x}h0 [B H, Tp, D]."""
    B, _, H, D = t.shape
    zeros = ", ".join("0" for _ in range(4))
    return f"""
    %{x}p = tensor.pad %{x} low[{zeros}] high[0, %pad, 0, 0] {{
    ^bb0(%{x}0: index, %{x}1: index, %{x}2: index, %{x}3: index):
      tensor.yield %zero : f32
    }} : {t} to {t}
    %{x}e = tensor.empty(%Tp) : tensor<{B}x{H}x?x{D}xf32>
    %{x}t = linalg.transpose ins(%{x}p : {t}) outs(%{x}e : tensor<{B}x{H}x?x{D}xf32>) permutation = [0, 2, 1, 3]
    %{x}h0 = tensor.collapse_shape %{x}t [[0, 1], [2], [3]] : tensor<{B}x{H}x?x{D}xf32> into tensor<{N}x?x{D}xf32>"""


def causal_attention(sym: str, ins: list[TensorType], consts: list, block: int = BLOCK) -> list[str]:
    """``func @sym(q [B, T, H, Dq], k [B, T, H, Dq], v [B, T, H, Dv]) -> [B, T, H, Dv]`` (f32; T
    dynamic, or static and cast to dynamic inside)."""
    if any(t.element != "f32" for t in ins):
        raise K3Error(f"passes: causal_attention takes f32 operands, got {', '.join(map(str, ins))}")
    q_in, k_in, v_in = ins
    q, k, v = (t.with_dim(1, None) for t in ins)
    (scale,) = consts
    B, _, H, Dq = q.shape
    Dv = v.shape[3]
    N = B * H
    qb, kd, vd = (TensorType((N, block, Dq), "f32"), TensorType((N, None, Dq), "f32"), TensorType((N, None, Dv), "f32"))
    ob, od = TensorType((N, block, Dv), "f32"), TensorType((N, None, Dv), "f32")
    body = trace_to_linalg(_block(scale), [qb, kd, vd], sym + "_block")
    out, out_in = TensorType((B, None, H, Dv), "f32"), TensorType((B, q_in.shape[1], H, Dv), "f32")
    wrapper = f"""
module {{
  func.func private @{sym}_block({qb}, {kd}, {vd}) -> {ob}
  func.func @{sym}(%q_in: {q_in}, %k_in: {k_in}, %v_in: {v_in}) -> {out_in} {{
    %q = tensor.cast %q_in : {q_in} to {q}
    %k = tensor.cast %k_in : {k_in} to {k}
    %v = tensor.cast %v_in : {v_in} to {v}
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %cB = arith.constant {block} : index
    %cB1 = arith.constant {block - 1} : index
    %zero = arith.constant 0.0 : f32
    %T = tensor.dim %q, %c1 : {q}
    %T1 = arith.addi %T, %cB1 : index
    %nb = arith.divui %T1, %cB : index
    %Tp = arith.muli %nb, %cB : index
    %pad = arith.subi %Tp, %T : index{_to_heads("q", q, N)}{_to_heads("k", k, N)}{_to_heads("v", v, N)}
    %qb0, %kb0, %vb0 = util.optimization_barrier %qh0, %kh0, %vh0 : {kd}, {kd}, {vd}
    %qh = flow.tensor.tie_shape %qb0 : {kd}{{%Tp}}
    %kh = flow.tensor.tie_shape %kb0 : {kd}{{%Tp}}
    %vh = flow.tensor.tie_shape %vb0 : {vd}{{%Tp}}
    %init = tensor.empty(%Tp) : {od}
    %res = scf.for %off = %c0 to %Tp step %cB iter_args(%acc = %init) -> ({od}) {{
      %L = arith.addi %off, %cB : index
      %qs = tensor.extract_slice %qh[0, %off, 0] [{N}, {block}, {Dq}] [1, 1, 1] : {kd} to {qb}
      %ks = tensor.extract_slice %kh[0, 0, 0] [{N}, %L, {Dq}] [1, 1, 1] : {kd} to {kd}
      %vs = tensor.extract_slice %vh[0, 0, 0] [{N}, %L, {Dv}] [1, 1, 1] : {vd} to {vd}
      %ob = func.call @{sym}_block(%qs, %ks, %vs) : ({qb}, {kd}, {vd}) -> {ob}
      %acc2 = tensor.insert_slice %ob into %acc[0, %off, 0] [{N}, {block}, {Dv}] [1, 1, 1] : {ob} into {od}
      scf.yield %acc2 : {od}
    }}
    %rs = tensor.extract_slice %res[0, 0, 0] [{N}, %T, {Dv}] [1, 1, 1] : {od} to {od}
    %re = tensor.expand_shape %rs [[0, 1], [2], [3]] output_shape [{B}, {H}, %T, {Dv}] : {od} into tensor<{B}x{H}x?x{Dv}xf32>
    %oe = tensor.empty(%T) : {out}
    %o = linalg.transpose ins(%re : tensor<{B}x{H}x?x{Dv}xf32>) outs(%oe : {out}) permutation = [0, 2, 1, 3]
    %o_out = tensor.cast %o : {out} to {out_in}
    return %o_out : {out_in}
  }}
}}"""
    return [body, wrapper]
