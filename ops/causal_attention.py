"""``k3::causal_attention``, the MLA prefill attention (docs/model.md §2): T new tokens attend to
the L >= T keys of the sequence so far (the cache's L - T rows, then their own), query t at
position L - T + t seeing keys s <= L - T + t; the op, its eager reference and its lowering. A
prefill from an empty cache is L = T; a prompt's later pieces (``extend``) have L > T.

The lowering is a loop over static query blocks: for a dynamic T, IREE 3.13's llvm-cpu softmax over
rows of dynamic length recomputes the row maximum inside its exp-sum loop, ~110 ns per score at
T = 2048, and the whole [H, T, L] score matrix is materialised.

    q [B, T, H, Dq], k, v [B, L, H, D]  --pad T and L by the same P rows (T + P = Tp = ceil(T / Bq) Bq),
                                          transpose once-->  [B H, Tp | L + P, D]
    for off in 0, Bq, ..., Tp - Bq:                       (scf.for, templates/causal_attention_blocks.mlir)
        o[:, off:off + Bq] = block(q[:, off:off + Bq], k[:, :L - T + off + Bq], v[:, :L - T + off + Bq])
    o [B H, Tp, Dv] --slice T, transpose back--> [B, T, H, Dv]

``block`` is traced from PyTorch with ``torch.bmm`` (``@`` traces to broadcast generics that ran
2.4x slower): its scores [B H, Bq, n] have a static row count, and keys past the block's last row
are never read, so the upper triangle costs nothing. Its rows are the last Bq of the n keys'
positions: row i sees keys j <= i + n - Bq. Padded rows (past T) attend to padded keys and are
sliced off; real rows never see a padded key (those lie past position L - 1). The one-time
transposes are kept out of the loop by ``util.optimization_barrier``, with the padded lengths
re-tied to the result (``flow.tensor.tie_shape``: a barrier on a dynamic tensor alone does not
compile).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import NAMESPACE, CustomOp, Lowering, TensorType, check_one_float, require
from .mlir import render
from .trace import trace_to_linalg

BLOCK = 128  # query rows per iteration: within 5-10% of the best block at 512-8192 tokens (notes)


@torch.library.custom_op(f"{NAMESPACE}::causal_attention", mutates_args=())
def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [B, T, H, Dq], k [B, L, H, Dq], v [B, L, H, Dv] (L >= T) -> o [B, T, H, Dv],
    o_t = sum_{s <= L - T + t} softmax_s(q_t.k_s scale) v_s, in q's dtype (fp32, float64 in the
    double-precision reference). Reference: PyTorch's scaled_dot_product_attention."""
    T, L = q.shape[1], k.shape[1]
    mask = None if T == L else torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, is_causal=mask is None, scale=scale)
    return o.transpose(1, 2).contiguous()


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale):
    return q.new_empty((*q.shape[:3], v.shape[-1]))


def check(ins: list[TensorType]) -> None:
    op = "causal_attention"
    require(len(ins) == 3, op, f"takes 3 tensors (q, k, v), got {len(ins)}")
    check_one_float(op, ["q", "k", "v"], ins)
    q, k, v = (t.shape for t in ins)
    require(len(q) == len(k) == len(v) == 4 and (k[0], *k[2:]) == (q[0], *q[2:]) and v[:3] == k[:3]
            and None not in (q[0], *q[2:], v[3]), op,
            "wants q [B, T, H, Dq], k [B, L, H, Dq] and v [B, L, H, Dv] (only T and L dynamic); got "
            + ", ".join(f"{n} {t.describe()}" for n, t in zip("qkv", ins)))


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


def blocks(sym: str, ins: list[TensorType], consts: list, block: int = BLOCK) -> list[str]:
    """``func @sym(q [B, T, H, Dq], k [B, L, H, Dq], v [B, L, H, Dv]) -> [B, T, H, Dv]`` (T and L
    dynamic, or static and cast to dynamic inside)."""
    check(ins)
    q_in, k_in, v_in = ins
    q, k, v = (t.with_dim(1, None) for t in ins)
    (scale,) = consts
    B, _, H, Dq = q.shape
    Dv = v.shape[3]
    N, dtype = B * H, q.dtype
    qb, kd, vd = TensorType((N, block, Dq), dtype), TensorType((N, "L", Dq), dtype), TensorType((N, "L", Dv), dtype)
    body = trace_to_linalg(_block(scale), [qb, kd, vd], sym + "_block")
    wrapper = render("causal_attention_blocks.mlir", sym=sym, q_in=q_in, k_in=k_in, v_in=v_in, q=q, k=k, v=v,
                     qb=qb, kd=kd, vd=vd, ob=TensorType((N, block, Dv), dtype), od=vd,
                     out=TensorType((B, None, H, Dv), dtype), out_in=TensorType((B, q_in.shape[1], H, Dv), dtype),
                     block=block, B=B, H=H, N=N, Dq=Dq, Dv=Dv, element=q.element)
    return [body, wrapper]


CAUSAL_ATTENTION = CustomOp("causal_attention", {
    "default": Lowering(blocks, f"MLA prefill attention: a loop over {BLOCK}-row query blocks, keys up to the block's end"),
})
