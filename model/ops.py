"""The four k3 custom ops (namespace ``k3``): the only parts of the graph that are not plain aten.

Each eager implementation is the readable reference in kda.py / moe.py / mxfp4.py; the fake
implementation gives shapes for torch.export, so the ops reach torch-mlir as
``torch.operator "torch.k3.<name>"`` and passes/ lowers them per target.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import kda, mxfp4
from .moe import glu_act
from .norms import upcast


@torch.library.custom_op("k3::kda_chunk", mutates_args=())
def kda_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """Prefill: the chunkwise KDA form over T tokens. q, k, g [B, T, H, K]; v [B, T, H, V];
    beta [B, T, H]; S [B, H, K, V]. Returns (o [B, T, H, V] fp32, S fp32)."""
    o, S_out = kda.kda_chunked(q, k, v, g, beta, S)
    return o, S_out.clone()


@torch.library.custom_op("k3::kda_step", mutates_args=())
def kda_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """Decode: the recurrent KDA form, token by token (T = 1 at decode). Shapes as kda_chunk."""
    o, S_out = kda.kda_recurrent(q, k, v, g, beta, S)
    return o, S_out.clone()


@kda_chunk.register_fake
@kda_step.register_fake
def _kda_fake(q, k, v, g, beta, S):
    return upcast(v.new_empty(v.shape)), upcast(S.new_empty(S.shape))


@torch.library.custom_op("k3::mxfp4_moe", mutates_args=())
def mxfp4_moe(z: Tensor, idx: Tensor, w: Tensor,
              w1_packed: Tensor, w1_scale: Tensor, w3_packed: Tensor, w3_scale: Tensor,
              w2_packed: Tensor, w2_scale: Tensor, act: str, beta1: float, beta2: float) -> Tensor:
    """y = sum_i w_i W2_e act(W1_e z, W3_e z), e = idx_i, with MXFP4 expert weights stacked [E, out, in/2]
    (+ scales [E, out, in/32]). z [N, L] fp32 (float64 in the double-precision reference), idx [N, k]
    int64, w [N, k] -> y [N, L] in z's dtype.
    Reference: for each expert that was picked, dequantise it and run its tokens."""
    y = z.new_zeros(z.shape[0], w2_packed.shape[1])
    for e in idx.unique().tolist():
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


@torch.library.custom_op("k3::causal_attention", mutates_args=())
def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal softmax attention of T tokens over themselves (an MLA prefill from an empty cache):
    q, k [B, T, H, Dq], v [B, T, H, Dv] -> o [B, T, H, Dv], o_t = sum_{s <= t} softmax_s(q_t.k_s
    scale) v_s, in q's dtype (fp32, float64 in the double-precision reference).
    Reference: PyTorch's scaled_dot_product_attention. Lowered by passes/causal_attention.py."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale)
    return o.transpose(1, 2).contiguous()


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale):
    return q.new_empty((*q.shape[:3], v.shape[-1]))
