"""Kimi Linear checkpoints (``model_type: kimi_linear``) in K3Model (docs/model.md §7).

Kimi Linear is the K3 architecture with the softplus decay gate, a low-rank KDA output gate
(``g_a_proj``/``g_b_proj``), plain residuals, a plain MoE with SwiGLU experts on the full width, and
MLA without an output gate. transformers' ``KimiLinearForCausalLM`` is the oracle for its semantics.

Config: ``config.kimi_linear_fields`` turns a Kimi Linear ``config.json`` (checkpoint or transformers
spelling) into K3Config fields; what transformers computes whatever the config says is pinned, and
a config that says otherwise is refused (never silently run as something else).

Tensors: three spellings of the same weights exist. The official checkpoint (and transformers'
``save_pretrained``, which writes it back) already uses K3Model's names, with two differences; the
transformers modules (``KimiLinearForCausalLM.state_dict()``) rename and pack more.
``k3_parts`` maps either spelling to K3Model names, tensor by tensor, lazily (the checkpoint reader
slices stored tensors through it); ``to_k3`` applies it to a tensor in memory. Per layer
(``model.layers.N.`` omitted):

| checkpoint / transformers name                          | K3Model name                               | conversion                |
|---------------------------------------------------------|--------------------------------------------|---------------------------|
| ``self_attn.A_log`` / ``self_attn.forget_gate.A_log``   | ``self_attn.A_log``                        | [1, 1, H, 1] -> [H] + zeros to max(H, K) |
| ``self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias}``   | ``self_attn.{f_a_proj,f_b_proj,dt_bias}``  | rename                    |
| ``self_attn.conv1d.weight`` [3HK, 1, W]                 | ``self_attn.{q,k,v}_conv1d.weight``        | split dim 0 as q, k, v    |
| ``mlp.*`` / ``block_sparse_moe.*`` on a dense layer     | ``mlp.*``                                  | rename (save_pretrained writes ``block_sparse_moe.``) |
| ``mlp.*`` / ``block_sparse_moe.*`` on a MoE layer       | ``block_sparse_moe.*``                     | rename                    |
| ``mlp.experts.gate_up_proj`` [E, 2I, D]                 | ``block_sparse_moe.experts.{e}.w1 / w3.weight`` | rows [0, I) gate, [I, 2I) up |
| ``mlp.experts.down_proj`` [E, D, I]                     | ``block_sparse_moe.experts.{e}.w2.weight`` | unstack                   |

Every other name (embeddings, norms, projections, router, shared experts, ``lm_head``) is the same.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch

from ..errors import K3Error
from .config import K3Config

LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


Read = Callable[[Any], torch.Tensor]


def _index(*index: int | slice) -> Read:
    """Reads ``t[index]`` from a tensor or a safetensors slice (both index the same way)."""
    return lambda t: t[index]


def _padded_heads(H: int, width: int) -> Read:
    """Reads [1, 1, H, 1] as [width]: the H per-head values, then zeros (KimiDeltaAttention.A_log)."""
    def read(t):
        a = t[:].reshape(H)
        return torch.cat((a, a.new_zeros(width - H)))
    return read


def _need(ok: bool, name: str, shape: tuple[int, ...], want: str) -> None:
    if not ok:
        raise K3Error(f"tensor '{name}' has shape {list(shape)}, expected {want}")


def k3_parts(name: str, shape: tuple[int, ...], cfg: K3Config) -> list[tuple[str, tuple[int, ...], Read | None]]:
    """The K3Model tensors one stored Kimi Linear tensor holds (module docstring): their names, shapes,
    and how to read each from the stored tensor or its safetensors slice (None: as stored)."""
    m = LAYER.fullmatch(name)
    if m is None:
        return [(name, shape, None)]
    layer, rest = int(m[1]), m[2]
    prefix = f"model.layers.{layer}."
    ffn = "block_sparse_moe." if cfg.is_moe(layer) else "mlp."
    rest = re.sub(r"^(mlp|block_sparse_moe)\.", ffn, rest).replace("self_attn.forget_gate.", "self_attn.")
    if rest == "self_attn.A_log":
        H, K = cfg.kda_heads, cfg.kda_head_dim
        _need(math.prod(shape) == H, name, shape, f"{H} per-head values")
        return [(prefix + rest, (max(H, K),), _padded_heads(H, max(H, K)))]
    if rest == "self_attn.conv1d.weight":
        _need(len(shape) == 3 and shape[0] % 3 == 0, name, shape, "[3*H*K, 1, W] (q, k, v packed)")
        n = shape[0] // 3
        return [(f"{prefix}self_attn.{c}_conv1d.weight", (n, *shape[1:]), _index(slice(i * n, (i + 1) * n)))
                for i, c in enumerate("qkv")]
    experts = f"{prefix}{ffn}experts."
    if rest == ffn + "experts.gate_up_proj":
        _need(len(shape) == 3 and shape[1] % 2 == 0, name, shape, "[E, 2*I, D] (gate rows, then up rows)")
        E, I, D = shape[0], shape[1] // 2, shape[2]
        return [(f"{experts}{e}.{w}.weight", (I, D), _index(e, slice(j * I, (j + 1) * I)))
                for e in range(E) for j, w in enumerate(("w1", "w3"))]
    if rest == ffn + "experts.down_proj":
        _need(len(shape) == 3, name, shape, "[E, D, I]")
        return [(f"{experts}{e}.w2.weight", shape[1:], _index(e)) for e in range(shape[0])]
    return [(prefix + rest, shape, None)]


def to_k3(name: str, tensor: torch.Tensor, cfg: K3Config) -> list[tuple[str, torch.Tensor]]:
    """One Kimi Linear tensor (checkpoint or transformers name) -> its K3Model state_dict entries."""
    return [(k, tensor if read is None else read(tensor)) for k, _, read in k3_parts(name, tuple(tensor.shape), cfg)]
