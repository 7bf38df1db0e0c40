"""The dense MLP, the sigmoid router and Stable LatentMoE (docs/model.md §4); the SiTU-GLU activation is
ops/numerics.py's; the routed experts are the k3::mxfp4_moe op (ops/mxfp4_moe.py) where they are
MXFP4, else the k3::float_moe op (ops/float_moe.py): both run only the picked experts.

K3: z = down(x) into the latent; y = RMSNorm(sum_i w_i e_i(z)); out = up(y) + shared(x).
Kimi Linear (no latent): out = sum_i w_i e_i(x) + shared(x), SiLU-GLU experts.
Routed experts are one stacked tensor per matrix and layer (``experts.w1/w2/w3`` [E, ...]), as
MXFP4 (``weight_packed`` + ``weight_scale``) or a float ``weight``; checkpoints store them one per
expert (``experts.{e}.w1``), mapped by model/stacking.py.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.float_moe import float_moe
from ..ops.mxfp4_moe import mxfp4_moe
from ..ops.numerics import glu_act, upcast
from .config import K3Config
from .linear import Linear, project
from .norms import RMSNorm


def glu(cfg: K3Config, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return glu_act(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta, g, u)


class GatedMLP(nn.Module):
    """down(act(gate x, up x)): the dense first layer and the (fused) shared experts."""

    def __init__(self, cfg: K3Config, dim: int, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.cfg, self.gate_proj(x), self.up_proj(x)).to(x.dtype))


class StackedLinear(nn.Module):
    """One matrix [out, in] for each of E experts, stacked as one tensor (gpt-fast's layout): MXFP4
    (``weight_packed`` u8 [E, out, in/2] + ``weight_scale`` u8 [E, out, in/32]) or float ``weight``
    [E, out, in]. The checkpoint stores one tensor per expert; model/stacking.py maps the names."""

    def __init__(self, experts: int, out_dim: int, in_dim: int, mxfp4: bool):
        super().__init__()
        if mxfp4:
            self.register_buffer("weight_packed", torch.zeros(experts, out_dim, in_dim // 2, dtype=torch.uint8))
            self.register_buffer("weight_scale", torch.full((experts, out_dim, in_dim // 32), 127, dtype=torch.uint8))
        else:
            self.weight = nn.Parameter(torch.zeros(experts, out_dim, in_dim))


class Experts(nn.Module):
    """The routed experts of one MoE layer: w1 (gate), w3 (up) [E, hidden, dim], w2 (down) [E, dim, hidden]."""

    def __init__(self, experts: int, dim: int, hidden: int, mxfp4: bool):
        super().__init__()
        self.w1 = StackedLinear(experts, hidden, dim, mxfp4)
        self.w3 = StackedLinear(experts, hidden, dim, mxfp4)
        self.w2 = StackedLinear(experts, dim, hidden, mxfp4)


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, largest first: k rounds of a max, then the
    first index holding it (a NaN counts as the largest, as in torch.argmax). Same result as
    torch.topk for distinct scores. Written without topk or argmax: IREE 3.13's llvm-cpu backend
    miscompiles every topk after the first in a function (one per MoE layer here), and its CUDA
    backend fails to distribute an argmax over K3's 896 experts ("failed to distribute"); a float max
    and an int32 min are plain reductions on every target."""
    E = scores.shape[-1]
    experts = torch.arange(E, dtype=torch.int32, device=scores.device)
    picked = []
    for _ in range(k):
        top = scores.amax(dim=-1, keepdim=True)
        hit = (scores == top) | scores.isnan()
        i = torch.where(hit, experts, E).amin(dim=-1, keepdim=True)
        picked.append(i)
        scores = scores.masked_fill(experts == i, float("-inf"))
    return torch.cat(picked, dim=-1).long()


def route(cfg: K3Config, x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor):
    """s = sigmoid(x W_g^T) in fp32; top-k by s + bias (bias picks, never weighs);
    w = s_idx / (sum s_idx + 1e-20) * routed_scaling_factor. Returns (idx [N, k], w [N, k] fp32)."""
    s = torch.sigmoid(project(upcast(x), gate_weight))
    idx = top_k_indices(s + upcast(bias), cfg.num_experts_per_token)
    w = s.gather(-1, idx)
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


class MoE(nn.Module):
    """Sigmoid-routed MoE with shared experts; latent (K3) when routed_expert_hidden_size is set."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        D, L = cfg.hidden_size, cfg.expert_input_size
        self.gate = Linear(D, cfg.num_experts)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        if cfg.is_latent_moe:
            self.routed_expert_down_proj = Linear(D, L)
            self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps)
            self.routed_expert_up_proj = Linear(L, D)
        self.experts = Experts(cfg.num_experts, L, cfg.moe_intermediate_size, cfg.experts_mxfp4)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, D, cfg.moe_intermediate_size * cfg.num_shared_experts)

    def routed(self, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sum_i w_i e_{idx_i}(z), fp32, z [N, L]."""
        cfg, ex = self.cfg, self.experts
        if cfg.experts_mxfp4:
            p = [t for n in ("w1", "w3", "w2") for t in (getattr(ex, n).weight_packed, getattr(ex, n).weight_scale)]
            return mxfp4_moe(upcast(z), idx, w, *p, cfg.hidden_act,
                             cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        return float_moe(upcast(z), idx, w, ex.w1.weight, ex.w3.weight, ex.w2.weight, cfg.hidden_act,
                         cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = route(self.cfg, x, self.gate.weight, self.gate.e_score_correction_bias)
        if self.cfg.is_latent_moe:
            y = self.routed(self.routed_expert_down_proj(x), idx, w)
            out = self.routed_expert_up_proj(self.routed_expert_norm(y).to(x.dtype))
        else:
            out = self.routed(x, idx, w).to(x.dtype)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out.view(shape)
