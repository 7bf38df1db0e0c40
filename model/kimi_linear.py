"""Kimi Linear checkpoints (``model_type: kimi_linear``) in K3Model (docs/model.md §7).

Kimi Linear is the K3 architecture with the softplus decay gate, a low-rank KDA output gate
(``g_a_proj``/``g_b_proj``), plain residuals, a plain MoE with SwiGLU experts on the full width, and
MLA without an output gate. transformers' ``KimiLinearForCausalLM`` is the oracle for its semantics.

Config: ``k3_config_fields`` turns a Kimi Linear ``config.json`` (checkpoint or transformers spelling)
into K3Config fields; what transformers computes whatever the config says is pinned, and a config
that says otherwise is refused (never silently run as something else).

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

import json
import math
import re
from typing import Any, Callable

import torch

from ..errors import K3Error
from .config import ALIASES, ConfigError, K3Config

# top-level transformers fields -> linear_attn_config keys (the sub-dict wins, as in transformers)
KDA_FIELDS = {"linear_num_heads": "num_heads", "linear_head_dim": "head_dim",
              "linear_conv_kernel_dim": "short_conv_kernel_size"}
# what transformers computes whatever the config says
PINNED = {"hidden_act": "silu", "tie_word_embeddings": False, "mla_use_output_gate": False,
          "routed_expert_hidden_size": None, "attn_res_block_size": None}
PINNED_KDA = {"gate_lower_bound": None, "use_full_rank_gate": False}

LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


def _layer_plan(raw: dict[str, Any], lac: dict[str, Any], n: int) -> dict[str, list[int]]:
    """``full_attn_layers`` and ``kda_layers`` (1-indexed). transformers' precedence: ``layer_types``
    (0-indexed), then both ``linear_attn_config`` lists, then full attention at 0-indexed 4, 8, ..."""
    types = raw.get("layer_types")
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        return {"full_attn_layers": lac["full_attn_layers"], "kda_layers": lac["kda_layers"]}
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
        raise ConfigError(f"config field 'layer_types': need {n} entries of "
                          f"'full_attention' / 'linear_attention', got {types!r}")
    return {"full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"]}


def _first_dense(raw: dict[str, Any], n: int) -> int:
    """K3's dense-then-MoE split from ``mlp_layer_types``, else ``first_k_dense_replace`` (default 1)."""
    types = raw.get("mlp_layer_types")
    if types is None:
        freq = raw.get("moe_layer_freq", 1)
        if freq not in (None, 1):
            raise ConfigError(f"config field 'moe_layer_freq': only 1 is supported, got {freq!r}")
        return raw.get("first_k_dense_replace", 1)
    k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if len(types) != n or any(t != "sparse" for t in types[k:]):
        raise ConfigError(f"config field 'mlp_layer_types': need {n} entries, 'dense' layers first "
                          f"then 'sparse', got {types!r}")
    return k


def k3_config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A Kimi Linear ``config.json`` -> the same dict in K3Config's terms (docs/model.md §7). A field k3c
    pins to what transformers computes must not say otherwise (PINNED: refused, never ignored)."""
    out = dict(raw)
    for alias, field in ALIASES.items():
        if alias in out:
            out.setdefault(field, out.pop(alias))
    n = out.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"config field 'num_hidden_layers': must be a positive integer, got {n!r}")
    lac = raw.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"config field 'linear_attn_config': expected an object, got {json.dumps(lac)}")
    lac = {**{k: raw[f] for f, k in KDA_FIELDS.items() if f in raw}, **lac}
    for name, pinned in (*PINNED.items(), *((f"linear_attn_config.{k}", v) for k, v in PINNED_KDA.items())):
        where = lac if name.startswith("linear_attn_config.") else raw
        key = name.removeprefix("linear_attn_config.")
        if where.get(key, pinned) != pinned:
            raise ConfigError(f"config field '{name}': Kimi Linear has {json.dumps(pinned)}, "
                              f"got {json.dumps(where[key])}")
    lac.update(PINNED_KDA, **_layer_plan(raw, lac, n))
    out.update(PINNED, linear_attn_config=lac, first_k_dense_replace=_first_dense(raw, n))
    out.setdefault("quantization_config", None)
    for key in ("layer_types", "mlp_layer_types", *KDA_FIELDS):
        out.pop(key, None)
    return out


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
