"""The implementation of each k3 custom op, per target, as MLIR built from PyTorch bodies.

- ``torch.k3.kda_chunk``: the chunkwise KDA form. A block of tokens (model.kda.kda_chunked, the
  function the reference runs: 64 tokens in one chunk as the reference; on CPU 256 in chunks of 16,
  whose [16, 16, K] decays stay in L2) is traced with static shapes; a short hand-written ``scf.for``
  walks the dynamic number of blocks carrying the state. The tail block is padded with tokens that
  change nothing (g = 0, beta = 0, k = v = 0).
- ``torch.k3.kda_step``: the recurrent form for the decode token(s), traced as is; for SPIR-V the
  same recurrence on the transposed state (``kda_step_v_major``).
- ``torch.k3.mxfp4_moe``: experts stay 4-bit in memory and are dequantised one at a time, sliced
  in place: decode loops over the picked (token, slot) pairs, prefill groups the tokens by expert
  and loops over the experts (expert_loops.py); on llvm-cpu decode multiplies the packed weights
  directly (mxfp4_gemv.py).
- ``torch.k3.causal_attention``: a loop over static query blocks (causal_attention.py).
Each generator returns MLIR texts defining ``func @<sym>`` with the operator's builtin types.
"""
from __future__ import annotations

import torch

from ..model import kda
from ..model.norms import upcast
from .expert_loops import mxfp4_moe
from .trace import TensorType, trace_to_linalg


def kda_step(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    return [trace_to_linalg(kda.kda_recurrent, ins, sym)]


def _recurrent_v_major(q, k, v, g, beta, S):
    """kda.kda_recurrent with the state held transposed, [B, H, V, K], so that S^T k and S^T q reduce
    over the innermost dim. IREE 3.13's SPIR-V code for the K-major form (S^T k fused with the
    rank-1 update S + beta k (v - S^T k)^T, whose innermost dim is V) is wrong on llvmpipe."""
    q, k, v, g, beta = (upcast(t) for t in (q, k, v, g, beta))
    St = upcast(S).transpose(-1, -2)
    outs = []
    for t in range(q.shape[1]):
        St = St * g[:, t].exp().unsqueeze(-2)
        pred = (St * k[:, t].unsqueeze(-2)).sum(-1)
        St = St + (v[:, t] - pred).unsqueeze(-1) * (beta[:, t, :, None] * k[:, t]).unsqueeze(-2)
        outs.append((St * q[:, t].unsqueeze(-2)).sum(-1))
    return torch.stack(outs, dim=1), St.transpose(-1, -2)


def kda_step_v_major(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    return [trace_to_linalg(_recurrent_v_major, ins, sym)]


def _head_major_chunk(chunk: int):
    """kda.kda_chunked with the output head-major, [B, H, C, V], the layout of the state's rows."""
    def body(q, k, v, g, beta, S):
        o, S = kda.kda_chunked(q, k, v, g, beta, S, chunk=chunk)
        return o.transpose(1, 2), S
    return body


def kda_chunk(sym: str, ins: list[TensorType], consts: list, block: int = kda.CHUNK,
              chunk: int = kda.CHUNK) -> list[str]:
    """Each loop iteration takes ``block`` tokens, in chunks of ``chunk``. The loop carries one buffer
    [B, H, K + T, V]: the state's K rows, then the outputs, head-major; they are transposed to
    [B, T, H, V] after it. (Carrying the output beside the state, IREE copied all of it on every
    iteration, which made prefill quadratic in T.)"""
    q, k, v, g, beta, S = ins
    C = block
    B, _, H, V = v.shape
    K = S.shape[2]
    static = [t.with_dim(1, C) for t in ins[:5]] + [S]
    o_chunk = TensorType((B, H, C, V), S.element)
    buf = TensorType((B, H, None, V), S.element)
    body = trace_to_linalg(_head_major_chunk(chunk), static, sym + "_chunk")
    o_t = v  # same layout as v: [B, ?, H, V]
    decl_args = ", ".join(str(t) for t in static)
    names = ["q", "k", "v", "g", "beta"]
    slices, padded = [], []
    for name, t, ts in zip(names, ins[:5], static):
        rank = len(t.shape)
        offs = ", ".join("%i" if d == 1 else "0" for d in range(rank))
        sizes = ", ".join("%n" if d == 1 else str(t.shape[d]) for d in range(rank))
        ones = ", ".join("1" for _ in range(rank))
        low = ", ".join("0" for _ in range(rank))
        high = ", ".join("%npad" if d == 1 else "0" for d in range(rank))
        idx = ", ".join(f"%a{d}: index" for d in range(rank))
        slices.append(f"""
      %{name}_s = tensor.extract_slice %{name}[{offs}] [{sizes}] [{ones}] : {t} to {t}
      %{name}_p = tensor.pad %{name}_s low[{low}] high[{high}] {{
      ^bb0({idx}):
        tensor.yield %zero : f32
      }} : {t} to {t}
      %{name}_c = tensor.cast %{name}_p : {t} to {ts}""")
        padded.append(f"%{name}_c")
    state = f"[0, 0, 0, 0] [{B}, {H}, {K}, {V}] [1, 1, 1, 1]"
    wrapper = f"""
module {{
  func.func private @{sym}_chunk({decl_args}) -> ({o_chunk}, {S})
  func.func @{sym}(%q: {q}, %k: {k}, %v: {v}, %g: {g}, %beta: {beta}, %S0: {S}) -> ({o_t}, {S}) {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %cC = arith.constant {C} : index
    %cK = arith.constant {K} : index
    %zero = arith.constant 0.0 : f32
    %T = tensor.dim %q, %c1 : {q}
    %TK = arith.addi %T, %cK : index
    %empty = tensor.empty(%TK) : {buf}
    %init = tensor.insert_slice %S0 into %empty{state} : {S} into {buf}
    %r = scf.for %i = %c0 to %T step %cC iter_args(%b = %init) -> ({buf}) {{
      %rem = arith.subi %T, %i : index
      %n = arith.minsi %rem, %cC : index
      %npad = arith.subi %cC, %n : index{"".join(slices)}
      %S = tensor.extract_slice %b{state} : {buf} to {S}
      %co:2 = func.call @{sym}_chunk({", ".join(padded)}, %S) : ({decl_args}) -> ({o_chunk}, {S})
      %os = tensor.extract_slice %co#0[0, 0, 0, 0] [{B}, {H}, %n, {V}] [1, 1, 1, 1] : {o_chunk} to {buf}
      %at = arith.addi %i, %cK : index
      %b2 = tensor.insert_slice %os into %b[0, 0, %at, 0] [{B}, {H}, %n, {V}] [1, 1, 1, 1] : {buf} into {buf}
      %b3 = tensor.insert_slice %co#1 into %b2{state} : {S} into {buf}
      scf.yield %b3 : {buf}
    }}
    %oh = tensor.extract_slice %r[0, 0, {K}, 0] [{B}, {H}, %T, {V}] [1, 1, 1, 1] : {buf} to {buf}
    %o_e = tensor.empty(%T) : {o_t}
    %o = linalg.transpose ins(%oh : {buf}) outs(%o_e : {o_t}) permutation = [0, 2, 1, 3]
    %Sr = tensor.extract_slice %r{state} : {buf} to {S}
    %S_e = tensor.empty() : {S}
    %S1 = linalg.copy ins(%Sr : {S}) outs(%S_e : {S}) -> {S}
    return %o, %S1 : {o_t}, {S}
  }}
}}"""
    return [body, wrapper]

