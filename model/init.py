"""Seeded random weights that keep activations O(1) through every layer (random checkpoints).

Matrices are N(0, 1/fan_in) so a projection preserves scale; the projections that write into the
residual stream (``o_proj``, ``down_proj``, ``routed_expert_up_proj``, ``w2``) are further scaled by
1/sqrt(2 * layers) so the sum over depth stays O(1). Norm weights are 1, AttnRes pseudo-queries
small, decay parameters in the ranges the released models use. Routed experts are drawn in float
and quantised to MXFP4 when the config stores them so.
"""
from __future__ import annotations

import math

import torch

from ..ops import mxfp4
from .checkpoint import progress
from .model import K3Model

RESIDUAL_WRITERS = ("o_proj", "down_proj", "routed_expert_up_proj", ".w2")


@torch.no_grad()
def init_weights(model: K3Model, seed: int = 0) -> K3Model:
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)

    def normal(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name in progress(sorted(tensors), "initialising"):
        t = tensors[name]
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("weight_scale"):
            continue  # written together with weight_packed
        if name.endswith("weight_packed"):  # stacked experts [E, out, in/2], one expert at a time
            out_dim, in_dim = t.shape[1], t.shape[2] * 2
            std = in_dim ** -0.5 * (depth_scale if ".w2." in name else 1.0)
            for e in range(t.shape[0]):
                packed, scale = mxfp4.quantize(normal((out_dim, in_dim), std))
                t[e].copy_(packed)
                tensors[name.replace("weight_packed", "weight_scale")][e].copy_(scale)
        elif name.endswith("embed_tokens.weight"):
            t.copy_(normal(t.shape, 1.0))
        elif name.endswith("_res_proj.weight"):
            t.copy_(normal(t.shape, 0.1))
        elif leaf == "A_log":
            H = cfg.kda_heads
            t.zero_()
            t[:H] = torch.log(torch.empty(H).uniform_(1.0, 16.0, generator=gen))
        elif leaf == "dt_bias":
            t.copy_(normal(t.shape, 0.5))
        elif leaf == "e_score_correction_bias":
            t.copy_(normal(t.shape, 0.01))
        elif "norm" in name.rsplit(".", 2)[-2]:
            t.fill_(1.0)
        elif name.endswith("conv1d.weight"):
            t.copy_(normal(t.shape, t.shape[-1] ** -0.5))
        elif t.dim() >= 2:
            std = t.shape[-1] ** -0.5
            if any(w in name for w in RESIDUAL_WRITERS):
                std *= depth_scale
            t.copy_(normal(t.shape, std))
        else:
            raise ValueError(f"init: no rule for tensor {name} {tuple(t.shape)}")
    return model
