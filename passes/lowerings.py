"""The implementation of each k3 custom op, per target, as MLIR built from PyTorch bodies.

- ``torch.k3.kda_chunk``: the chunkwise KDA form. One 64-token chunk (model.kda.kda_chunk_step,
  the same function the reference runs) is traced with static shapes; a short hand-written
  ``scf.for`` walks the dynamic number of chunks carrying the state. The tail chunk is padded with
  tokens that change nothing (g = 0, beta = 0, k = v = 0).
- ``torch.k3.kda_step``: the recurrent form for the decode token(s), traced as is; for SPIR-V the
  same recurrence on the transposed state (``kda_step_v_major``).
- ``torch.k3.mxfp4_moe``: experts stay 4-bit in memory; dequantisation happens inside the expert
  matmuls. Decode (a static handful of tokens) gathers the picked experts' packed rows; prefill
  (a dynamic token count) dequantises every expert once and mixes densely with zero weights off
  the top-k, which keeps shapes static.
Each generator returns MLIR texts defining ``func @<sym>`` with the operator's builtin types.
"""
from __future__ import annotations

import torch

from ..model import kda, mxfp4
from ..model.moe import glu_act
from ..model.norms import upcast
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


def _chunk_body(q, k, v, g, beta, S):
    """[B, C, H, .] layout in and out, as the operator has it."""
    bh = lambda x: x.transpose(1, 2)  # noqa: E731
    o, S = kda.kda_chunk_step(bh(q), bh(k), bh(v), bh(g), bh(beta), S)
    return bh(o), S


def kda_chunk(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    q, k, v, g, beta, S = ins
    C = kda.CHUNK
    static = [t.with_dim(1, C) for t in ins[:5]] + [S]
    body = trace_to_linalg(_chunk_body, static, sym + "_chunk")
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
    B, _, H, V = v.shape
    wrapper = f"""
module {{
  func.func private @{sym}_chunk({decl_args}) -> ({static[2]}, {S})
  func.func @{sym}(%q: {q}, %k: {k}, %v: {v}, %g: {g}, %beta: {beta}, %S0: {S}) -> ({o_t}, {S}) {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %cC = arith.constant {C} : index
    %zero = arith.constant 0.0 : f32
    %T = tensor.dim %q, %c1 : {q}
    %init = tensor.empty(%T) : {o_t}
    %r:2 = scf.for %i = %c0 to %T step %cC iter_args(%out = %init, %S = %S0) -> ({o_t}, {S}) {{
      %rem = arith.subi %T, %i : index
      %n = arith.minsi %rem, %cC : index
      %npad = arith.subi %cC, %n : index{"".join(slices)}
      %co:2 = func.call @{sym}_chunk({", ".join(padded)}, %S) : ({decl_args}) -> ({static[2]}, {S})
      %os = tensor.extract_slice %co#0[0, 0, 0, 0] [{B}, %n, {H}, {V}] [1, 1, 1, 1] : {static[2]} to {o_t}
      %o2 = tensor.insert_slice %os into %out[0, %i, 0, 0] [{B}, %n, {H}, {V}] [1, 1, 1, 1] : {o_t} into {o_t}
      scf.yield %o2, %co#1 : {o_t}, {S}
    }}
    return %r#0, %r#1 : {o_t}, {S}
  }}
}}"""
    return [body, wrapper]


def _dequantize(packed, scale):
    """MXFP4 -> f32 inside the traced body; nibbles are split on int32 so shifts are logical."""
    return mxfp4.dequantize(packed.to(torch.int32), scale.to(torch.int32))


def mxfp4_moe(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    act, beta1, beta2 = consts
    n_experts = ins[3].shape[0]

    def gather(z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s):
        W1, W3, W2 = (_dequantize(p[idx], s[idx]) for p, s in ((w1p, w1s), (w3p, w3s), (w2p, w2s)))
        h = glu_act(act, beta1, beta2, torch.einsum("nl,nkil->nki", z, W1), torch.einsum("nl,nkil->nki", z, W3))
        return torch.einsum("nki,nkli->nl", h * w.unsqueeze(-1), W2)

    def dense(z, idx, w, w1p, w1s, w3p, w3s, w2p, w2s):
        W1, W3, W2 = (_dequantize(p, s) for p, s in ((w1p, w1s), (w3p, w3s), (w2p, w2s)))
        # routing weight of every (token, expert), 0 off the top-k; one-hot keeps shapes static
        mix = ((idx.unsqueeze(-1) == torch.arange(n_experts)) * w.unsqueeze(-1)).sum(1)
        h = glu_act(act, beta1, beta2, torch.einsum("nl,eil->nei", z, W1), torch.einsum("nl,eil->nei", z, W3))
        return torch.einsum("nei,eli->nl", h * mix.unsqueeze(-1), W2)

    body = dense if ins[0].shape[0] is None else gather
    return [trace_to_linalg(body, ins, sym, int_high=n_experts)]


GENERATORS = {
    "torch.k3.kda_chunk": kda_chunk,
    "torch.k3.kda_step": kda_step,
    "torch.k3.mxfp4_moe": mxfp4_moe,
}
