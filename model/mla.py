"""Gated Multi-head Latent Attention with no positional encoding (docs/model.md §2).

The cache holds only the latent [c_n | k_pe] (kv_lora_rank + qk_rope_head_dim numbers per token);
its length is the number of tokens seen, so decode cost grows with the context actually used.
Prefill expands keys and values from the latent (naive form); decode attends in the latent space
(absorbed form). With NoPE there are no positions: the 64-dim "rope" part is kept unrotated.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.causal_attention import causal_attention
from ..ops.numerics import upcast
from .config import K3Config
from .linear import Linear
from .norms import RMSNorm

LORA_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm


class GatedMLA(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.nope, self.rope, self.dv = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(D, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * (self.nope + self.rope))
        else:
            self.q_proj = Linear(D, H * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = Linear(D, self.rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_EPS)
        self.kv_b_proj = Linear(self.rank, H * (self.nope + self.dv))
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(D, H * self.dv)
        self.o_proj = Linear(H * self.dv, D)

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q = q_b_proj(RMSNorm(q_a_proj x)) -> q_nope [B, T, H, nope], q_pe [B, T, H, rope]."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        return q.view(B, T, self.H, -1).split((self.nope, self.rope), dim=-1)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The cache row of each token: [c_n | k_pe], [B, T, rank + rope]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), dim=-1)
        return torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1)

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, dv] -> gate by sigmoid(g_proj x) (x = the layer input), then o_proj."""
        o = o.reshape(*o.shape[:2], -1)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None, decode: bool = False,
                valid: torch.Tensor | None = None):
        """x [B, T, D]; cache [B, L, rank + rope] of the L tokens before, or None at the start of a
        sequence. Returns (out, latent [B, T, rank + rope]): the cache rows of these T tokens, which
        the caller appends to the cache (the cache itself is only read here). In decode ``valid``
        [B, L] (nonzero where a cache row is one of that sequence's tokens) lets sequences of
        different lengths share a batch: each attends to its own rows and its new token only."""
        first = cache is None
        latent = self.latent(x)
        q_nope, q_pe = self.queries(x)
        if decode:
            before = latent[:, :0] if first else cache.to(x.dtype)
            o = self.attend_absorbed(q_nope, q_pe, before, latent, valid)
        else:
            o = self.attend_naive(q_nope, q_pe, latent if first else torch.cat((cache.to(x.dtype), latent), dim=1))
        return self.finish(x, o.to(x.dtype)), latent

    def attend_naive(self, q_nope, q_pe, cache):
        """Expand per-head keys/values from the latent rows ``cache`` (the L - T before these T
        tokens, then theirs); causal softmax over them, query t at position L - T + t seeing keys up
        to it: the k3 causal_attention op (its own lowering per target)."""
        B, L = cache.shape[:2]
        H = self.H
        c_n, k_pe = cache.split((self.rank, self.rope), dim=-1)
        k_nope, v = self.kv_b_proj(c_n).view(B, L, H, -1).split((self.nope, self.dv), dim=-1)
        key = torch.cat((k_nope, k_pe.unsqueeze(2).expand(B, L, H, self.rope)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        return causal_attention(upcast(query), upcast(key), upcast(v), self.scale)

    def attend_absorbed(self, q_nope, q_pe, before, latent, valid=None):
        """MQA over the latent: q_lat,h = W_UK,h^T q_nope,h; score = (q_lat.c + q_pe.k_pe) * scale;
        o_h = W_UV,h sum_t p_t c_t, over the L cache rows ``before`` these T tokens and their own
        ``latent`` rows. Causal as in attend_naive; with ``valid`` [B, L - T] only the cache rows
        it marks (nonzero) are seen."""
        B, T, H, _ = q_nope.shape
        L = before.shape[1] + T
        W = self.kv_b_proj.weight.view(H, self.nope + self.dv, self.rank)
        W_UK, W_UV = W[:, :self.nope], W[:, self.nope:]
        q_lat = torch.einsum("bthn,hnr->bthr", upcast(q_nope), upcast(W_UK))
        query = torch.cat((q_lat, upcast(q_pe)), dim=-1).flatten(1, 2)     # [B, T*H, rank + rope]
        parts = [upcast(before), upcast(latent)]
        # The cache is only ever read where it lies, in its stored layout, [L, r] rows: as the left
        # operand of the scores and whole (rope columns included) in the context, whose rope part
        # is dropped after; the new rows are a part of their own. Concatenated, transposed or
        # sliced, a compiler copies all L rows per layer and token (IREE: 3x slower decode at 16k
        # tokens for a transpose, 1.4x for a concatenation).
        scores = torch.cat([c @ query.transpose(1, 2) for c in parts], dim=1)          # [B, L, T*H]
        scores = scores.transpose(1, 2).unflatten(1, (T, H)).transpose(1, 2) * self.scale
        mask = torch.ones(T, L, dtype=torch.bool, device=latent.device).tril(L - T)
        if valid is not None:                                               # [B, 1, T, L]
            seen = torch.cat((valid != 0, valid.new_ones(B, T, dtype=torch.bool)), dim=1)
            mask = (mask & seen.unsqueeze(1)).unsqueeze(1)
        p = scores.masked_fill(~mask, -torch.inf).softmax(dim=-1)           # [B, H, T, L]
        p = p.transpose(1, 2).flatten(1, 2)                                 # [B, T*H, L]
        ctx = (p[..., :L - T] @ parts[0] + p[..., L - T:] @ parts[1])[..., :self.rank].unflatten(1, (T, H))
        return torch.einsum("bthr,hvr->bthv", ctx, upcast(W_UV))
