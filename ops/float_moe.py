"""``k3::float_moe``, the routed experts of an MoE layer stored as floats (bf16, f16 or f32, as Kimi
Linear ships them; docs/model.md §4): the op, its eager reference and its lowerings.

    y = sum_i w_i W2_e act(W1_e z, W3_e z), e = idx_i

z [N, L] fp32, idx [N, k] int64, w [N, k] fp32; the experts stacked, w1, w3 [E, I, L] and w2
[E, L, I], in their stored dtype. The lowerings are mxfp4_moe's two loops with a float FFN: decode
(a static handful of tokens) runs ``by_slot``, each picked expert's matrices sliced in place and
widened inside the matvec, so a step reads the k picked experts once at their stored width; prefill
(a dynamic token count) runs ``by_expert``, each expert on its own rows. Only the picked experts are
touched: the dense form (every expert on every token, the top-k weights zero elsewhere) costs E/k
times the reads and the FLOPs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import NAMESPACE, CustomOp, Lowering, TensorType, require
from .mxfp4_moe import by_expert, by_slot, traced_expert, traced_slot
from .numerics import ACTIVATIONS, glu_act

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::float_moe", mutates_args=())
def float_moe(z: Tensor, idx: Tensor, w: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
              act: str, beta1: float, beta2: float) -> Tensor:
    """y [N, L] in z's dtype (float64 in the double-precision reference). Reference: for each expert
    that was picked, its matrices widened to z's dtype, its tokens run."""
    y = z.new_zeros(z.shape[0], w2.shape[1])
    for e in [e for e in idx.unique().tolist() if 0 <= e < w1.shape[0]]:
        token, slot = (idx == e).nonzero(as_tuple=True)
        W1, W3, W2 = (W[e].to(z.dtype) for W in (w1, w3, w2))
        h = glu_act(act, beta1, beta2, z[token] @ W1.t(), z[token] @ W3.t())
        y.index_add_(0, token, (h @ W2.t()) * w[token, slot].unsqueeze(-1))
    return y


@float_moe.register_fake
def _float_moe_fake(z, idx, w, w1, w3, w2, act, beta1, beta2):
    return z.new_empty((z.shape[0], w2.shape[1]))


NAMES = ("z", "idx", "w", "w1", "w3", "w2")


def check(ins: list[TensorType], consts: list) -> None:
    """The operands the lowerings take: fp32 z and w, int64 idx, experts of one float dtype of the
    module docstring's shapes (static); N static (decode) or dynamic (prefill)."""
    op = "float_moe"
    got = ", ".join(f"{n} {t.describe()}" for n, t in zip(NAMES, ins))
    require(len(ins) == 6 and len(consts) == 3, op, f"takes 6 tensors and (act, beta1, beta2), got {got}, {consts}")
    require(consts[0] in ACTIVATIONS, op, f"act must be one of {', '.join(ACTIVATIONS)}, got {consts[0]!r}")
    z, idx, w, w1, w3, w2 = ins
    dtypes = " or ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
    require((z.dtype, idx.dtype, w.dtype) == (torch.float32, torch.int64, torch.float32)
            and w1.dtype in WEIGHT_DTYPES and w1.dtype == w3.dtype == w2.dtype, op,
            f"takes z, w float32, idx int64 and the experts in one of {dtypes}; got {got}")
    wanted = f"wants z [N, L], idx and w [N, k], w1, w3 [E, I, L] and w2 [E, L, I], only N dynamic; got {got}"
    require(len(z.shape) == len(idx.shape) == 2 and w.shape == idx.shape and z.shape[0] == idx.shape[0]
            and all(len(t.shape) == 3 for t in (w1, w3, w2)), op, wanted)
    E, I, L = w1.shape[0], w1.shape[1], z.shape[1]
    require(all(isinstance(d, int) for d in (E, I, L, idx.shape[1]))
            and w1.shape == w3.shape == (E, I, L) and w2.shape == (E, L, I), op, wanted)


def expert_ffn(act: str, beta1: float, beta2: float):
    """The FFN over one expert, matrices [1, out, in] in their stored dtype, widened to the rows'."""
    def ffn(rows, W1, W3, W2):
        W1, W3, W2 = (W[0].to(rows.dtype) for W in (W1, W3, W2))
        return glu_act(act, beta1, beta2, rows @ W1.t(), rows @ W3.t()) @ W2.t()
    return ffn


def lower(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    """Prefill (dynamic N): by_expert; decode (static N): by_slot."""
    check(ins, consts)
    ffn = expert_ffn(*consts)
    if ins[0].shape[0] is None:
        return by_expert(sym, ins, traced_expert(ffn))
    return by_slot(sym, ins, traced_slot(ffn))


FLOAT_MOE = CustomOp("float_moe", {"default": Lowering(
    lower, "float experts one at a time, sliced in place and widened in the matmul: loop over picked slots "
           "(decode) / over experts (prefill)")})
