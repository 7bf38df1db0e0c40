"""Kimi Delta Attention (docs/model.md §1): the gated delta rule with a per-channel decay.

Read top to bottom, this file is docs/model.md §1: the gates, the short convolution, the L2 norm,
then the recurrence (token by token, the definition) and its chunkwise form (what prefill runs),
which are the custom ops of ops/kda.py, and the layer that strings them together with the gated
output norm. Shapes: q, k [B, T, H, K]; v [B, T, H, V];
g [B, T, H, K] (log-decay, fp32); beta [B, T, H]; state S [B, H, K, V] fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.kda import kda_chunk, kda_step
from ..ops.numerics import upcast
from .config import K3Config
from .linear import Linear
from .norms import RMSNorm


# ---- step 4: the log-decay gates ----------------------------------------------------------
def lowerbound_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    lower_bound: float) -> torch.Tensor:
    """K3: g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias)) in (lb, 0). z [..., H, K]."""
    H, K = z.shape[-2:]
    a = upcast(A_log[:H]).exp().unsqueeze(-1)
    return lower_bound * torch.sigmoid(a * (upcast(z) + upcast(dt_bias).view(H, K)))


def softplus_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear: g = -exp(A_log[h]) * softplus(z + dt_bias). z [..., H, K]."""
    H, K = z.shape[-2:]
    a = upcast(A_log[:H]).exp().unsqueeze(-1)
    return -a * F.softplus(upcast(z) + upcast(dt_bias).view(H, K))


# ---- step 2: causal depthwise short convolution ---------------------------------------------
def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t[c] = silu(sum_i w[c, 0, i] * x_{t-W+1+i}[c]); tap W-1 is the current token.

    x [B, T, C]; weight [C, 1, W]; state [B, C, W-1] holds the last W-1 pre-conv inputs
    (zeros at the start of a sequence). Returns y [B, T, C] and the new state."""
    W = weight.shape[-1]
    window = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, W-1+T]
    y = F.conv1d(window, weight.to(x.dtype), groups=weight.shape[0])      # [B, C, T]
    return F.silu(y).transpose(1, 2), window[..., window.shape[-1] - (W - 1):]


# ---- step 6: L2 norm, eps inside the root ---------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = upcast(x)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---- step 8: the recurrence (decode) and its chunkwise form (prefill) ------------------------
# are the KDA core, the k3::kda_step and k3::kda_chunk ops: ops/kda.py (kda_recurrent, kda_chunked)


# ---- the layer -------------------------------------------------------------------------------
class KimiDeltaAttention(nn.Module):
    """Projections, short convs, gates and output of one KDA layer (docs/model.md §1 steps 1-10)."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
        self.H, self.K, self.lower_bound = H, K, cfg.gate_lower_bound
        self.q_proj, self.k_proj, self.v_proj = (Linear(D, H * K) for _ in range(3))
        W = cfg.conv_size
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
                                                       for _ in range(3))
        self.f_a_proj = Linear(D, K)
        self.f_b_proj = Linear(K, H * K)
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.A_log = nn.Parameter(torch.zeros(max(H, K)))  # stored [128] for K3: H values, then zeros
        self.b_proj = Linear(D, H)
        if cfg.kda.get("use_full_rank_gate", True):
            self.g_proj = Linear(D, H * K)
        else:
            self.g_a_proj = Linear(D, K)
            self.g_b_proj = Linear(K, H * K)
        self.o_norm = RMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = Linear(H * K, D)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, conv_state: tuple[torch.Tensor, ...], S: torch.Tensor,
                decode: bool = False):
        """x [B, T, D] (after input_layernorm). Returns (out [B, T, D], conv_state, S)."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        q, cq = short_conv(self.q_proj(x), self.q_conv1d.weight, conv_state[0])
        k, ck = short_conv(self.k_proj(x), self.k_conv1d.weight, conv_state[1])
        v, cv = short_conv(self.v_proj(x), self.v_conv1d.weight, conv_state[2])
        q, k, v = (t.view(B, T, H, K) for t in (q, k, v))
        z = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        if self.lower_bound is not None:
            g = lowerbound_gate(z, self.A_log, self.dt_bias, self.lower_bound)
        else:
            g = softplus_gate(z, self.A_log, self.dt_bias)
        beta = torch.sigmoid(upcast(self.b_proj(x)))
        q = l2norm(q) * K ** -0.5
        k = l2norm(k)
        o, S = (kda_step if decode else kda_chunk)(q, k, upcast(v), g, beta, S)
        gate = torch.sigmoid(upcast(self.output_gate(x).view(B, T, H, K)))
        y = (self.o_norm(o) * gate).to(x.dtype).reshape(B, T, H * K)
        return self.o_proj(y), (cq, ck, cv), S
