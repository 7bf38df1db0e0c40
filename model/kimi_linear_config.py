"""Kimi Linear's config.json read in K3Config's terms (docs/model.md §7; its tensors: kimi_linear.py)."""
from __future__ import annotations

import json
from typing import Any

from .config_keys import ALIASES, ConfigError

# top-level transformers fields -> linear_attn_config keys (the sub-dict wins, as in transformers)
KDA_FIELDS = {"linear_num_heads": "num_heads", "linear_head_dim": "head_dim",
              "linear_conv_kernel_dim": "short_conv_kernel_size"}
# what transformers computes whatever the config says
PINNED = {"hidden_act": "silu", "tie_word_embeddings": False, "mla_use_output_gate": False,
          "routed_expert_hidden_size": None, "attn_res_block_size": None}
PINNED_KDA = {"gate_lower_bound": None, "use_full_rank_gate": False}

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


def kimi_linear_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A Kimi Linear ``config.json`` -> the same dict in K3Config's terms (docs/model.md §7). A field k3c
    pins to what transformers computes must not say otherwise (PINNED: refused, never ignored)."""
    out = dict(raw)
    for alias, name in ALIASES.items():
        if alias in out:
            out.setdefault(name, out.pop(alias))
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
