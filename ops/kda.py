"""The KDA core, ``k3::kda_step`` and ``k3::kda_chunk`` (docs/model.md §1.2-1.3): the recurrence (the
definition, and decode) and the chunkwise form (prefill), their ops and their lowerings.

Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state S [B, H, K, V]. q is already
L2-normalised and scaled, k L2-normalised, g the log-decay; all fp32 (float64 in the
double-precision reference). Both ops return (o [B, T, H, V], S) in fp32.

Lowerings:
- ``kda_step``: the recurrence traced as is; for SPIR-V the same recurrence on the transposed state
  (``kda_step_v_major``).
- ``kda_chunk``: ``kda_chunk_blocks``, a block of tokens (the chunkwise form: one 64-token chunk by
  default; on the CPU 256 tokens in chunks of 16, whose [16, 16, K] decays stay in L2) traced with
  static shapes, inside the ``scf.for`` of templates/kda_chunk_blocks.mlir over the dynamic number
  of blocks; ``kda_token_scan`` (the bench's baseline) calls the traced one-token recurrence in a
  loop over the tokens.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import NAMESPACE, CustomOp, Lowering, TensorType, check_one_float, require
from .mlir import render
from .numerics import upcast
from .trace import trace_to_linalg

CHUNK = 64


# ---- the recurrence, token by token (decode, and the definition) --------------------------------
def kda_recurrent(q, k, v, g, beta, S):
    """S <- Diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t.

    q is already L2-normalised and scaled; k is L2-normalised. Returns (o [B, T, H, V], S)."""
    q, k, v, g, beta = (upcast(t) for t in (q, k, v, g, beta))
    S = upcast(S)
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - pred)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1), S


# ---- the chunkwise form (prefill) ------------------------------------------------------------
def unit_lower_inverse(M: torch.Tensor) -> torch.Tensor:
    """(I + M)^-1 for strictly lower-triangular M [..., C, C], exact after log2(C) doublings:
    (I - M)(I + M^2)(I + M^4)...(I + M^(C/2)), since M^C = 0."""
    C = M.shape[-1]
    eye = torch.eye(C, dtype=M.dtype, device=M.device)
    P, Mp = eye - M, M
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        Mp = Mp @ Mp
        P = P @ (eye + Mp)
    return P


def kda_chunk_step(q, k, v, g, beta, S):
    """One chunk of n tokens entering with state S; tensors laid out [B, H, n, .].

    G = inclusive cumsum of g;  M_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd) (j < i);
    T = (I + M)^-1 diag(beta);  W = T (k * exp G);  U = T v;  A_ij = sum_d q_id k_jd exp(G_id - G_jd) (j <= i);
    V' = U - W S;  O = (q * exp G) S + A V';  S <- exp(G_n) S + (k * exp(G_n - G))^T V'.
    exp(G_i - G_j) is taken only where j <= i, so every exponent is <= 0 (no overflow)."""
    n = q.shape[-2]
    G = g.cumsum(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal[..., None], -torch.inf)
    decay = diff.exp()                                                 # [B, H, n, n, K]
    kk = torch.einsum("bhid,bhjd,bhijd->bhij", k, k, decay)
    M = (beta.unsqueeze(-1) * kk).tril(-1)
    T = unit_lower_inverse(M) * beta.unsqueeze(-2)
    W = T @ (k * G.exp())
    U = T @ v
    A = torch.einsum("bhid,bhjd,bhijd->bhij", q, k, decay)           # lower incl. diagonal
    V_new = U - W @ S
    O = (q * G.exp()) @ S + A @ V_new
    G_n = G[..., -1:, :]
    S = G_n.transpose(-1, -2).exp() * S + (k * (G_n - G).exp()).transpose(-1, -2) @ V_new
    return O, S


def kda_chunked(q, k, v, g, beta, S, chunk: int = CHUNK):
    """Chunkwise prefill over any T: pad to a multiple of the chunk with tokens that change nothing
    (g = 0, beta = 0, k = v = 0), run the chunks in order carrying S. Returns (o [B, T, H, V], S)."""
    B, T, H, K = q.shape
    pad = (-T) % chunk
    to_bhtd = lambda x: F.pad(upcast(x), (0, 0, 0, 0, 0, pad)).transpose(1, 2)  # noqa: E731
    q, k, v, g = (to_bhtd(x) for x in (q, k, v, g))
    beta = F.pad(upcast(beta), (0, 0, 0, pad)).transpose(1, 2)
    S = upcast(S)
    outs = []
    for c in range(0, T + pad, chunk):
        sl = slice(c, c + chunk)
        o, S = kda_chunk_step(q[..., sl, :], k[..., sl, :], v[..., sl, :], g[..., sl, :], beta[..., sl], S)
        outs.append(o)
    return torch.cat(outs, dim=-2)[..., :T, :].transpose(1, 2), S


# ---- the ops -------------------------------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::kda_chunk", mutates_args=())
def kda_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """Prefill: the chunkwise form over T tokens. Returns (o [B, T, H, V] fp32, S fp32)."""
    o, S_out = kda_chunked(q, k, v, g, beta, S)
    return o, S_out.clone()


@torch.library.custom_op(f"{NAMESPACE}::kda_step", mutates_args=())
def kda_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """Decode: the recurrent form, token by token (T = 1 at decode). Shapes as kda_chunk."""
    o, S_out = kda_recurrent(q, k, v, g, beta, S)
    return o, S_out.clone()


@kda_chunk.register_fake
@kda_step.register_fake
def _kda_fake(q, k, v, g, beta, S):
    return upcast(v.new_empty(v.shape)), upcast(S.new_empty(S.shape))


NAMES = ("q", "k", "v", "g", "beta", "S")


def check(op: str, ins: list[TensorType]) -> None:
    """The operands both KDA ops take: six of one float dtype, shaped as the module docstring says."""
    require(len(ins) == 6, op, f"takes 6 tensors (q, k, v, g, beta, S), got {len(ins)}")
    check_one_float(op, list(NAMES), ins)
    q, k, v, g, beta, S = (t.shape for t in ins)
    ok = (len(q) == 4 and k == q == g and len(v) == 4 and v[:3] == q[:3] and beta == q[:3]
          and S == (q[0], q[2], q[3], v[3]) and None not in (*q[:1], *q[2:], v[3]))
    require(ok, op, "wants q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], S [B, H, K, V] "
            "(only T dynamic); got " + ", ".join(f"{n} {t.describe()}" for n, t in zip(NAMES, ins)))


# ---- the lowerings -------------------------------------------------------------------------------
def kda_step_traced(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    check("kda_step", ins)
    return [trace_to_linalg(kda_recurrent, _named_t(ins), sym)]


def recurrent_one(q, k, v, g, beta, S):
    """kda_recurrent for one token, in the order that reads the state twice and writes it once:
    with d = exp(g) and S1 = Diag(d) S, both products with S1 are one [2, K] x [K, V] product of
    S itself, (k d; q d) S = (S1^T k; S1^T q); then u = beta (v - S1^T k), the new state S1 + k u^T
    in one pass, and o = S^T q from it as S1^T q + (q . k) u, which does not read it again. (The
    recurrence as written reads the state four times and writes it twice per token.)"""
    q, k, v, g, beta = (upcast(t[:, 0]) for t in (q, k, v, g, beta))
    S = upcast(S)
    d = g.exp()                                                     # [B, H, K]
    products = (torch.stack((k, q), dim=2) * d.unsqueeze(2)) @ S    # [B, H, 2, V]
    u = beta.unsqueeze(-1) * (v - products[:, :, 0])
    S = S * d.unsqueeze(-1) + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = products[:, :, 1] + (q * k).sum(-1, keepdim=True) * u
    return o.unsqueeze(1), S


def kda_step_one(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    """``recurrent_one`` traced for a step of one token, else the recurrence as written."""
    check("kda_step", ins)
    if ins[0].shape[1] != 1:
        return kda_step_traced(sym, ins, consts)
    return [trace_to_linalg(recurrent_one, ins, sym)]


def recurrent_v_major(q, k, v, g, beta, S):
    """kda_recurrent with the state held transposed, [B, H, V, K], so that S^T k and S^T q reduce
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
    check("kda_step", ins)
    return [trace_to_linalg(recurrent_v_major, _named_t(ins), sym)]


def _named_t(ins: list[TensorType]) -> list[TensorType]:
    """The operands with a dynamic token count named "T" (one size for all five)."""
    return [t.with_dim(1, "T") if t.shape[1:2] == (None,) and i < 5 else t for i, t in enumerate(ins)]


def _head_major_chunk(chunk: int):
    """kda_chunked with the output head-major, [B, H, C, V], the layout of the state's rows."""
    def body(q, k, v, g, beta, S):
        o, S = kda_chunked(q, k, v, g, beta, S, chunk=chunk)
        return o.transpose(1, 2), S
    return body


def _tokens(ins: list[TensorType], **per_operand) -> list[dict]:
    """q, k, v, g, beta as the templates walk them: name, type and per-operand extras."""
    return [{"name": n, "type": t, **{key: v[i] for key, v in per_operand.items()}}
            for i, (n, t) in enumerate(zip(NAMES[:5], ins[:5]))]


def kda_chunk_blocks(sym: str, ins: list[TensorType], consts: list, block: int = CHUNK,
                     chunk: int = CHUNK) -> list[str]:
    """Each loop iteration takes ``block`` tokens, in chunks of ``chunk``. The loop carries one buffer
    [B, H, K + T, V]: the state's K rows, then the outputs, head-major; they are transposed to
    [B, T, H, V] after it. (Carrying the output beside the state, IREE copied all of it on every
    iteration, which made prefill quadratic in T.)"""
    check("kda_chunk", ins)
    q, k, v, g, beta, S = ins
    B, _, H, V = v.shape
    K = S.shape[2]
    static = [t.with_dim(1, block) for t in ins[:5]] + [S]
    body = trace_to_linalg(_head_major_chunk(chunk), static, sym + "_chunk")
    wrapper = render("kda_chunk_blocks.mlir", sym=sym, q=q, k=k, v=v, g=g, beta=beta, S=S, o=v,
                     static=static, o_chunk=TensorType((B, H, block, V), S.dtype),
                     buf=TensorType((B, H, None, V), S.dtype), tokens=_tokens(ins, static=static),
                     block=block, B=B, H=H, K=K, V=V, element=S.element)
    return [body, wrapper]


def kda_token_scan(sym: str, ins: list[TensorType], consts: list) -> list[str]:
    """Baseline lowering of ``kda_chunk``: one traced token step inside an scf.for over T."""
    check("kda_chunk", ins)
    one = [t.with_dim(1, 1) for t in ins[:5]] + [ins[5]]
    body = trace_to_linalg(kda_recurrent, one, sym + "_token")
    q, k, v, g, beta, S = ins
    wrapper = render("kda_token_scan.mlir", sym=sym, q=q, k=k, v=v, g=g, beta=beta, S=S,
                     one=one, o1=one[2], tokens=_tokens(ins, one=one))
    return [body, wrapper]


KDA_CHUNK = CustomOp("kda_chunk", {
    "default": Lowering(kda_chunk_blocks, f"chunkwise KDA: traced {CHUNK}-token chunk in an scf.for"),
    "llvm-cpu": Lowering(partial(kda_chunk_blocks, block=256, chunk=16),
                         "chunkwise KDA, 256 tokens per loop iteration in 16-token chunks (k3c bench)"),
})
KDA_STEP = CustomOp("kda_step", {
    "default": Lowering(kda_step_traced, "recurrent KDA step for decode"),
    "llvm-cpu": Lowering(kda_step_one, "recurrent KDA step for decode, one token reading the state twice and "
                                       "writing it once"),
    "vulkan-spirv": Lowering(kda_step_v_major, "recurrent KDA step on the V-major state (SPIR-V: reductions innermost)"),
})
TOKEN_SCAN = Lowering(kda_token_scan, "token-by-token KDA baseline")
