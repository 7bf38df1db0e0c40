"""K3Config: every hyperparameter of a K3 / Kimi Linear text model (spec §0).

Field names follow the published ``config.json``. The layer plan (which layers are KDA or MLA,
dense or MoE, where AttnRes blocks close) is derived from a few fields, never hand-listed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import K3Error


class ConfigError(K3Error, ValueError):
    """An invalid or unreadable model configuration; the message names the field."""


MODEL_TYPES = ("kimi_k3", "kimi_linear")
ACTIVATIONS = ("situ", "silu")


def every_fourth_and_last(num_layers: int) -> list[int]:
    """The published plan: full attention at 1-indexed layers 4, 8, ... and the last one."""
    plan = [i for i in range(4, num_layers + 1, 4)]
    if num_layers not in plan:
        plan.append(num_layers)
    return plan


@dataclass
class K3Config:
    model_type: str = "kimi_k3"
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    vocab_size: int = 163840
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1_048_576
    initializer_range: float = 0.02
    # Kimi Delta Attention (`linear_attn_config` in config.json); layer lists are 1-indexed.
    linear_attn_config: dict[str, Any] = field(default_factory=lambda: {
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0, "use_full_rank_gate": True,
        "full_attn_layers": every_fourth_and_last(93),
        "kda_layers": [i for i in range(1, 94) if i not in every_fourth_and_last(93)],
    })
    # Gated MLA with no positional encoding
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # MoE (Stable LatentMoE for K3; plain MoE when routed_expert_hidden_size is None)
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    # activation
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # Block Attention Residuals; None means plain residuals (Kimi Linear)
    attn_res_block_size: int | None = 12
    quantization_config: dict[str, Any] | None = field(default_factory=lambda: {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "group_size": 32,
        "targets": ["routed_experts"],
    })

    def __post_init__(self) -> None:
        self.validate()

    # ---- derived layer plan -------------------------------------------------------------
    @property
    def kda(self) -> dict[str, Any]:
        return self.linear_attn_config

    @property
    def kda_heads(self) -> int:
        return int(self.kda["num_heads"])

    @property
    def kda_head_dim(self) -> int:
        return int(self.kda["head_dim"])

    @property
    def conv_size(self) -> int:
        return int(self.kda["short_conv_kernel_size"])

    @property
    def gate_lower_bound(self) -> float | None:
        """K3's decay floor; None selects Kimi Linear's softplus gate."""
        lb = self.kda.get("gate_lower_bound")
        return None if lb is None else float(lb)

    @property
    def layer_kinds(self) -> list[str]:
        """'mla' or 'kda' for each 0-indexed layer (config lists are 1-indexed)."""
        full = set(self.kda["full_attn_layers"])
        return ["mla" if i + 1 in full else "kda" for i in range(self.num_hidden_layers)]

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    def closes_block(self, layer: int) -> bool:
        """AttnRes: layer l appends the running partial sum to the bank when l % B == 0 (spec §3)."""
        return self.uses_attn_res and layer % self.attn_res_block_size == 0

    @property
    def mla_cache_width(self) -> int:
        """Numbers per token per MLA layer in the latent cache: [c_n | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_input_size(self) -> int:
        return self.routed_expert_hidden_size if self.is_latent_moe else self.hidden_size

    @property
    def experts_mxfp4(self) -> bool:
        q = self.quantization_config or {}
        return "mxfp4" in str(q.get("format", "")) or q.get("quant_method") == "mxfp4"

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"config field '{name}': {why}")

        need(self.model_type in MODEL_TYPES, "model_type",
             f"unknown model_type {self.model_type!r} (supported: {', '.join(MODEL_TYPES)})")
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts",
                     "num_experts_per_token", "moe_intermediate_size", "intermediate_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, name, f"must be a positive integer, got {v!r}")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
        need(self.hidden_act in ACTIVATIONS, "hidden_act",
             f"unknown activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        need(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
             f"top-k {self.num_experts_per_token} exceeds num_experts {self.num_experts}")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             "must lie in [0, num_hidden_layers]")
        need(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func",
             f"only 'sigmoid' routing is supported, got {self.moe_router_activation_func!r}")
        need(self.num_expert_group == 1 and self.topk_group == 1, "num_expert_group",
             "only one expert group is supported")
        need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
        need(isinstance(self.linear_attn_config, dict), "linear_attn_config", "must be an object")
        for key in ("num_heads", "head_dim", "short_conv_kernel_size", "full_attn_layers"):
            need(key in self.kda, f"linear_attn_config.{key}", "missing")
        need(self.kda_heads > 0 and self.kda_head_dim > 0, "linear_attn_config.head_dim",
             "heads and head_dim must be positive")
        need(self.conv_size >= 1, "linear_attn_config.short_conv_kernel_size", "must be >= 1")
        full = list(self.kda["full_attn_layers"])
        need(all(isinstance(i, int) and 1 <= i <= self.num_hidden_layers for i in full),
             "linear_attn_config.full_attn_layers",
             f"entries must be 1-indexed layers in [1, {self.num_hidden_layers}]")
        if "kda_layers" in self.kda:
            kda = set(self.kda["kda_layers"])
            need(kda.isdisjoint(full) and kda | set(full) == set(range(1, self.num_hidden_layers + 1)),
                 "linear_attn_config.kda_layers",
                 "kda_layers and full_attn_layers must partition layers 1..num_hidden_layers")
        if self.gate_lower_bound is not None:
            need(self.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound", "must be negative")
        if self.is_latent_moe:
            need(self.routed_expert_hidden_size > 0, "routed_expert_hidden_size", "must be positive")
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size > 0, "attn_res_block_size", "must be positive")
        if self.experts_mxfp4:
            expert_input = "routed_expert_hidden_size" if self.is_latent_moe else "hidden_size"
            for name, v in (("moe_intermediate_size", self.moe_intermediate_size),
                            (expert_input, self.expert_input_size)):
                need(v % 32 == 0, name, f"{v} is not a multiple of the MXFP4 group size 32")

    # ---- I/O ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @property
    def hash(self) -> str:
        """Content hash of the configuration: a compiled module is valid for exactly this."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "K3Config":
        if "text_config" in raw:  # multimodal wrapper: the text model's config lies inside
            raw = raw["text_config"]
        model_type = raw.get("model_type", "kimi_k3")
        if model_type == "kimi_linear":
            from .kimi_linear import k3_config_fields  # kimi_linear imports this module
            raw = k3_config_fields(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        kwargs["model_type"] = model_type
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"config: {e}") from None

    @classmethod
    def from_hf(cls, path: str | Path) -> "K3Config":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"config: no config.json at {p}")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"config: {p} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config: {p} does not hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def preset(cls, name: str) -> "K3Config":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        return PRESETS[name]()


def _small_plan(num_layers: int) -> dict[str, Any]:
    full = every_fourth_and_last(num_layers)
    return {"full_attn_layers": full,
            "kda_layers": [i for i in range(1, num_layers + 1) if i not in full]}


def _k3_tiny() -> K3Config:
    """CI size: dense layer 0, MLA at layers 4 and 6 (1-indexed), 2 AttnRes blocks, 8 experts top-2."""
    return K3Config(
        hidden_size=64, num_hidden_layers=6, vocab_size=512, max_position_embeddings=256,
        linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                            "gate_lower_bound": -5.0, "use_full_rank_gate": True, **_small_plan(6)},
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        routed_expert_hidden_size=32, intermediate_size=128, attn_res_block_size=3,
    )


def _k3_small() -> K3Config:
    """Benchmark size (~0.3B): every layer kind, 2 AttnRes blocks, K3's head dims."""
    return K3Config(
        hidden_size=1024, num_hidden_layers=12, vocab_size=32768, max_position_embeddings=16384,
        linear_attn_config={"num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4,
                            "gate_lower_bound": -5.0, "use_full_rank_gate": True, **_small_plan(12)},
        num_attention_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        num_experts=32, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=256,
        routed_expert_hidden_size=512, intermediate_size=4096, attn_res_block_size=6,
    )


PRESETS = {"k3": K3Config, "k3-small": _k3_small, "k3-tiny": _k3_tiny}
