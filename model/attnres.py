"""Block Attention Residuals (docs/model.md §3): each sublayer reads a softmax mix over depth.

Rows V = [b_0, ..., b_{m-1}, p]: the closed blocks of the bank and the running partial sum.
s_j = (w * gamma) . V_j / sqrt(mean(V_j^2) + eps), alpha = softmax(s) in fp32, h = sum_j alpha_j V_j.
The values are not normalised; only the scores see the RMS norm. w is ``*_res_proj.weight`` [1, D],
gamma is ``*_res_norm.weight`` [D].
"""
from __future__ import annotations

import torch

from ..ops.numerics import upcast
from .norms import rms_norm

EPS = 1e-5


def score(v: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """s = w . RMSNorm_gamma(v) for rows v [..., D] -> [...]."""
    return rms_norm(upcast(v), gamma, EPS) @ upcast(w).squeeze(0)


def attn_res(bank: list[torch.Tensor], p: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """The definition: one softmax over all m + 1 rows, accumulated in fp32."""
    V = upcast(torch.stack([*bank, p], dim=0))                           # [m+1, B, T, D]
    alpha = score(V, w, gamma).softmax(dim=0)
    return (alpha.unsqueeze(-1) * V).sum(0).to(p.dtype)


def bank_summary(bank: list[torch.Tensor], w: torch.Tensor, gamma: torch.Tensor):
    """Online-softmax state over the closed blocks: (m1, l1, o1) = (max score, sum of exp, weighted sum).
    The pseudo-query does not depend on the input, so one block's rows serve every layer after it."""
    V = upcast(torch.stack(bank, dim=0))
    s = score(V, w, gamma)
    m1 = s.amax(dim=0)
    e = (s - m1).exp()
    return m1, e.sum(0), (e.unsqueeze(-1) * V).sum(0)


def attn_res_online(summary, p: torch.Tensor, w: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Merge the partial sum into a bank summary: m = max(m1, s2);
    h = (e^{m1-m} o1 + e^{s2-m} p) / (e^{m1-m} l1 + e^{s2-m})."""
    m1, l1, o1 = summary
    s2 = score(upcast(p), w, gamma)
    m = torch.maximum(m1, s2)
    a, b = (m1 - m).exp(), (s2 - m).exp()
    return ((a.unsqueeze(-1) * o1 + b.unsqueeze(-1) * upcast(p)) / (a * l1 + b).unsqueeze(-1)).to(p.dtype)
