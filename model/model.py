"""K3Model: the eager PyTorch reference (docs/model.md §1-4), with explicit prefill / decode state.

Forward, per decoder layer l (docs/model.md §3), with p the running partial sum and B the bank of blocks:
    x = AttnRes(B, p) if B else p;  if l % block == 0: B.append(p), p = None
    p = p + attn(input_layernorm(x));  x = AttnRes(B, p);  p = p + mlp(post_attention_layernorm(x))
Kimi Linear has plain residuals instead: h = h + attn(norm(h)); h = h + mlp(norm(h)).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import nn

from .attnres import attn_res
from .config import K3Config
from .linear import Linear
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .moe import MoE, GatedMLP
from .norms import RMSNorm


@dataclass
class K3State:
    """Decode state. Per KDA layer: ``kda_conv`` [B, 3, H*K, W-1] (last W-1 pre-conv inputs of q, k, v)
    and ``kda_S`` [B, H, K, V] fp32. Per MLA layer: ``mla_cache`` [B, L, kv_lora_rank + rope], the
    latent of the L tokens seen so far (L is the position of the next token), None before any."""
    kda_conv: list[torch.Tensor] = field(default_factory=list)
    kda_S: list[torch.Tensor] = field(default_factory=list)
    mla_cache: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Tokens seen so far (from the MLA cache length; -1 for a model without MLA layers)."""
        if not self.mla_cache:
            return -1
        return 0 if self.mla_cache[0] is None else self.mla_cache[0].shape[1]


pytree.register_dataclass(K3State)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer: int):
        super().__init__()
        D = cfg.hidden_size
        self.kind = cfg.layer_kinds[layer]
        self.self_attn = GatedMLA(cfg) if self.kind == "mla" else KimiDeltaAttention(cfg)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        if cfg.is_moe(layer):
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = GatedMLP(cfg, D, cfg.intermediate_size)
        if cfg.uses_attn_res:
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(D)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D)

    def attention(self, x, state: K3State, slot: int, decode: bool):
        """Run self_attn on x and write this layer's new state into ``state`` at ``slot``."""
        h = self.input_layernorm(x)
        if self.kind == "mla":
            cache = state.mla_cache[slot]
            out, latent = self.self_attn(h, cache, decode)
            state.mla_cache[slot] = latent if cache is None else torch.cat((cache.to(latent.dtype), latent), dim=1)
        else:
            conv = state.kda_conv[slot].unbind(1)
            out, conv, state.kda_S[slot] = self.self_attn(h, conv, state.kda_S[slot], decode)
            state.kda_conv[slot] = torch.stack(conv, dim=1)
        return out

    def ffn(self, x):
        h = self.post_attention_layernorm(x)
        return self.block_sparse_moe(h) if hasattr(self, "block_sparse_moe") else self.mlp(h)


def decoder_step(cfg: K3Config, layer: DecoderLayer, i: int, bank: list[torch.Tensor], p: torch.Tensor,
                 state: K3State, slot: int, decode: bool) -> torch.Tensor:
    """Decoder layer ``i`` (module docstring) on the partial sum ``p``: the new p. ``bank`` (the closed
    blocks) gains the old p when layer i closes a block; the layer's state is updated at ``slot``."""
    if not cfg.uses_attn_res:
        p = p + layer.attention(p, state, slot, decode)
        return p + layer.ffn(p)
    x = attn_res(bank, p, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight) \
        if bank else p
    a = layer.attention(x, state, slot, decode)
    if cfg.closes_block(i):
        bank.append(p)
        p = a
    else:
        p = p + a
    x = attn_res(bank, p, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight)
    return p + layer.ffn(x)


class K3Model(nn.Module):
    """``model.*`` tensors and ``lm_head``; names match the checkpoint (docs/model.md §1-4)."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.uses_attn_res:
            self.model.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.model.output_attn_res_norm = RMSNorm(cfg.hidden_size)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        # slot of each layer within its kind's state list
        kinds = cfg.layer_kinds
        self.slots = [kinds[:i].count(k) for i, k in enumerate(kinds)]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def init_state(self, batch: int = 1) -> K3State:
        cfg, dev = self.cfg, self.model.embed_tokens.weight.device
        HK, W = cfg.kda_heads * cfg.kda_head_dim, cfg.conv_size
        n_kda = cfg.layer_kinds.count("kda")
        n_mla = cfg.layer_kinds.count("mla")
        return K3State(
            kda_conv=[torch.zeros(batch, 3, HK, W - 1, dtype=self.dtype, device=dev) for _ in range(n_kda)],
            kda_S=[torch.zeros(batch, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim, device=dev,
                               dtype=torch.promote_types(self.dtype, torch.float32))
                   for _ in range(n_kda)],
            mla_cache=[None] * n_mla)

    def layers_forward(self, tokens: torch.Tensor, state: K3State, decode: bool,
                       hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Embedding through final norm and lm_head. If ``hidden`` is a list, the residual stream
        after each layer (the partial sum p under AttnRes) is appended to it."""
        state = K3State(list(state.kda_conv), list(state.kda_S), list(state.mla_cache))
        cfg, m = self.cfg, self.model
        p = m.embed_tokens(tokens)
        bank: list[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            p = decoder_step(cfg, layer, i, bank, p, state, self.slots[i], decode)
            if hidden is not None:
                hidden.append(p)
        if cfg.uses_attn_res:
            p = attn_res(bank, p, m.output_attn_res_proj.weight, m.output_attn_res_norm.weight)
        return self.lm_head(m.norm(p)), state

    def prefill(self, tokens: torch.Tensor, state: K3State | None = None):
        """tokens [B, T] -> (logits [B, T, vocab], state after the T tokens)."""
        state = state if state is not None else self.init_state(tokens.shape[0])
        return self.layers_forward(tokens, state, decode=False)

    def decode(self, token: torch.Tensor, state: K3State):
        """token [B, 1] at position state.position -> (logits [B, 1, vocab], state)."""
        return self.layers_forward(token, state, decode=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.prefill(tokens)[0]
