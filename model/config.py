"""K3Config: every hyperparameter of a K3 / Kimi Linear text model (docs/model.md §0).

Field names follow the published ``config.json``. The layer plan (which layers are KDA or MLA,
dense or MoE, where AttnRes blocks close) is derived from a few fields, never hand-listed.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config_keys import (ACTIVATIONS, ALIASES, IGNORED, QUANT_GROUP_KEYS, QUANT_KEYS, QUANT_WEIGHT_KEYS, WRAPPER_KEYS,
                          ConfigError, is_int, need_type, refuse, unknown_keys)
from .kimi_linear_config import kimi_linear_fields


MODEL_TYPES = ("kimi_k3", "kimi_linear")
LAYOUTS = ("k3c", "k3_release", "kimi_linear")
K3C_ARCHITECTURE = "K3Model"   # ``architectures`` of the config.json k3c writes: K3Model's own tensor names
MXFP4_FORMAT = "mxfp4-pack-quantized"
MXFP4_GROUP = 32               # OCP MX: one E8M0 scale per 32 elements (docs/model.md §5)
# The published quantization block (docs/model.md §8), also k3c's own for MXFP4 experts.
MXFP4_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": MXFP4_FORMAT,
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MXFP4_GROUP,
                    "symmetric": True, "scale_dtype": "torch.uint8", "dynamic": False}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}
# Keys k3c reads but does not keep: the values k3c computes; any other value is refused.
FIXED = {
    "num_nextn_predict_layers": (0, None),   # multi-token-prediction layers: k3c runs none
    "topk_method": ("noaux_tc",),            # sigmoid scores, top-k on score + correction bias
    "moe_layer_freq": (1, None),             # every layer after first_k_dense_replace is MoE
    "num_key_value_heads": None,             # MLA: checked against num_attention_heads
    "attention_bias": (False, None),
    "pretraining_tp": (1, None),
    "use_grouped_topk": None,                # checked with num_expert_group
}
KDA_TYPES = {"num_heads": "int", "head_dim": "int", "short_conv_kernel_size": "int",
             "gate_lower_bound": "float | None", "use_full_rank_gate": "bool",
             "full_attn_layers": "list[int]", "kda_layers": "list[int]"}
KDA_OPTIONAL = ("gate_lower_bound", "use_full_rank_gate", "kda_layers")
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
    quantization_config: dict[str, Any] | None = field(default_factory=lambda: copy.deepcopy(MXFP4_QUANTIZATION))
    # How a checkpoint of this config names and stores its tensors (LAYOUTS): "k3c" (K3Model's names,
    # k3c's dtypes), "k3_release" (the K3 release: K3Model names under ``language_model.``, docs/model.md §8),
    # "kimi_linear" (the Kimi Linear Hub / transformers names, kimi_linear.py). Not part of the model:
    # left out of ``to_dict`` and ``hash``.
    layout: str = field(default="k3c", compare=False)
    # keys of the file k3c has never heard of, outside the math-bearing groups: ignored, and said
    # once by whoever reads the file (cli.py load_config). Not part of the model, like ``layout``.
    ignored_keys: tuple[str, ...] = field(default=(), compare=False)

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
        """AttnRes: layer l appends the running partial sum to the bank when l % B == 0 (docs/model.md §3)."""
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
        """Routed experts stored MXFP4 (``quantization_config`` checked by ``validate``)."""
        return self.quantization_config is not None

    @property
    def quantization_ignore(self) -> list[str]:
        """compressed-tensors ``ignore``: module names, or ``re:`` regexes, that stay unquantised."""
        return list((self.quantization_config or {}).get("ignore", []))

    def quantization_ignores(self, tensor: str) -> bool:
        """Whether ``ignore`` names the module a tensor belongs to (``X.weight_packed`` -> ``X``)."""
        module = tensor.rsplit(".", 1)[0]
        return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module
                   for p in self.quantization_ignore)

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        """Every field checked; all the problems found reported in one ConfigError (types first:
        the value checks need the right types)."""
        problems: list[str] = []

        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                problems.append(f"config field '{name}': {why}")

        for f in dataclasses.fields(self):
            if f.name == "ignored_keys":
                continue
            try:
                need_type(f.name, getattr(self, f.name), f.type)
            except ConfigError as e:
                problems.append(str(e))
        for key, kind in KDA_TYPES.items():
            if isinstance(self.kda, dict) and key in self.kda:
                try:
                    need_type(f"linear_attn_config.{key}", self.kda[key], kind)
                except ConfigError as e:
                    problems.append(str(e))
        refuse(problems)
        need(self.model_type in MODEL_TYPES, "model_type",
             f"unknown model_type {self.model_type!r} (supported: {', '.join(MODEL_TYPES)})")
        need(self.layout in LAYOUTS, "layout", f"unknown layout {self.layout!r}")
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts",
                     "num_experts_per_token", "moe_intermediate_size", "intermediate_size",
                     "max_position_embeddings", "q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
            v = getattr(self, name)
            need(v is None or v > 0, name, f"must be a positive integer, got {v!r}")
        for name in ("rms_norm_eps", "routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta"):
            need(getattr(self, name) > 0, name, f"must be a positive number, got {getattr(self, name)!r}")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
        need(self.hidden_act in ACTIVATIONS, "hidden_act",
             f"unknown activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        need(self.mla_use_nope, "mla_use_nope", "k3c implements MLA without positional encoding only (true)")
        need(self.latent_moe_use_norm, "latent_moe_use_norm",
             "k3c always applies routed_expert_norm after the expert combine (true)")
        need(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
             f"top-k {self.num_experts_per_token} exceeds num_experts {self.num_experts}")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             "must lie in [0, num_hidden_layers]")
        need(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func",
             f"only 'sigmoid' routing is supported, got {self.moe_router_activation_func!r}")
        need(self.num_expert_group == 1 and self.topk_group == 1, "num_expert_group",
             "only one expert group is supported")
        need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
        for key in KDA_TYPES:
            need(key in self.kda or key in KDA_OPTIONAL, f"linear_attn_config.{key}", "missing")
        for key in unknown_keys(self.kda, set(KDA_TYPES), "linear_attn_config."):
            need(False, key, "not a key k3c knows (it could change the model's math)")
        if self.quantization_config is not None:
            problems += self.quantization_problems()
        refuse(problems)   # the checks below read the KDA keys
        need(self.kda_heads > 0 and self.kda_head_dim > 0, "linear_attn_config.head_dim",
             "heads and head_dim must be positive")
        need(self.conv_size >= 1, "linear_attn_config.short_conv_kernel_size", "must be >= 1")
        full = list(self.kda["full_attn_layers"])
        need(all(1 <= i <= self.num_hidden_layers for i in full), "linear_attn_config.full_attn_layers",
             f"entries must be 1-indexed layers in [1, {self.num_hidden_layers}]")
        if "kda_layers" in self.kda:
            kda = set(self.kda["kda_layers"])
            need(kda.isdisjoint(full) and kda | set(full) == set(range(1, self.num_hidden_layers + 1)),
                 "linear_attn_config.kda_layers",
                 "kda_layers and full_attn_layers must partition layers 1..num_hidden_layers")
        if self.gate_lower_bound is not None:
            need(self.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound", "must be negative")
        refuse(problems)

    def quantization_problems(self) -> list[str]:
        """k3c runs one quantisation: compressed-tensors MXFP4 (docs/model.md §5, §8), group size 32,
        weights only; a key it does not know in the block is refused (it could change the decode)."""
        q = self.quantization_config
        problems: list[str] = []

        def need(ok: bool, key: str, why: str) -> None:
            if not ok:
                problems.append(f"config field 'quantization_config.{key}': {why}")

        for key in unknown_keys(q, QUANT_KEYS):
            need(False, key, "not a key k3c knows (it could change how the weights decode)")
        need(q.get("kv_cache_scheme") is None, "kv_cache_scheme", "k3c runs an unquantised cache (null)")

        fmt = q.get("format")
        need(q.get("quant_method") in ("compressed-tensors", "mxfp4"), "quant_method",
             f"k3c reads compressed-tensors MXFP4 only, got {q.get('quant_method')!r}")
        need(fmt in (MXFP4_FORMAT, None) if q.get("quant_method") == "mxfp4" else fmt == MXFP4_FORMAT,
             "format", f"k3c runs {MXFP4_FORMAT!r} only, got {fmt!r}")
        groups = q.get("config_groups", {})
        need(isinstance(groups, dict) and all(isinstance(g, dict) for g in groups.values()), "config_groups",
             "expected an object of groups")
        for name, group in (groups.items() if isinstance(groups, dict) else ()):
            if not isinstance(group, dict):
                continue
            for key in unknown_keys(group, QUANT_GROUP_KEYS, f"config_groups.{name}."):
                need(False, key, "not a key k3c knows (it could change how the weights decode)")
            for part in ("input_activations", "output_activations"):
                need(group.get(part) is None, f"config_groups.{name}.{part}", "k3c quantises weights only (null)")
            weights = group.get("weights") or {}
            need(isinstance(weights, dict), f"config_groups.{name}.weights", "expected an object")
            if not isinstance(weights, dict):
                continue
            for key in unknown_keys(weights, QUANT_WEIGHT_KEYS, f"config_groups.{name}.weights."):
                need(False, key, "not a key k3c knows (it could change how the weights decode)")
            size = weights.get("group_size", MXFP4_GROUP)
            need(is_int(size), f"config_groups.{name}.weights.group_size", f"expected an integer, got {size!r}")
            need(size == MXFP4_GROUP, f"config_groups.{name}.weights.group_size",
                 f"MXFP4 scales groups of {MXFP4_GROUP} elements, got {size}")
            need(weights.get("num_bits", 4) == 4 and weights.get("type", "float") == "float",
                 f"config_groups.{name}.weights", "MXFP4 weights are 4-bit floats")
        if "group_size" in q:
            need(q["group_size"] == MXFP4_GROUP, "group_size",
                 f"MXFP4 scales groups of {MXFP4_GROUP}, got {q['group_size']!r}")
        ignore = q.get("ignore", [])
        need(isinstance(ignore, list) and all(isinstance(p, str) for p in ignore), "ignore",
             "expected a list of strings")
        for p in (ignore if isinstance(ignore, list) else ()):
            if not isinstance(p, str):
                continue
            try:
                re.compile(p[3:]) if p.startswith("re:") else None
            except re.error as e:
                need(False, "ignore", f"{p!r} is not a regular expression ({e})")
        expert_input = "routed_expert_hidden_size" if self.is_latent_moe else "hidden_size"
        for name, v in (("moe_intermediate_size", self.moe_intermediate_size), (expert_input, self.expert_input_size)):
            if v % MXFP4_GROUP:
                problems.append(f"config field '{name}': {v} is not a multiple of the MXFP4 group size {MXFP4_GROUP}")
        return problems

    # ---- I/O ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The model's fields (not ``layout``): what ``hash`` covers and the manifest records."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("layout", "ignored_keys")}

    def to_json(self) -> str:
        """The config.json k3c writes beside K3Model's own tensor names (``architectures`` says so)."""
        return json.dumps({"architectures": [K3C_ARCHITECTURE], **self.to_dict()}, indent=2, sort_keys=True)

    @property
    def hash(self) -> str:
        """Content hash of the configuration: a compiled module is valid for exactly this."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "K3Config":
        """A config.json. Dispatch on the top-level ``model_type`` (docs/model.md §8): ``kimi_k3`` is K3, either
        the release's multimodal wrapper (the text model in ``text_config``, whose own ``model_type``
        is "kimi_linear") or k3c's flat spelling; ``kimi_linear`` is Kimi Linear (kimi_linear.py). A
        config k3c wrote (``architectures`` [K3Model]) holds every field in k3c's spelling."""
        if not isinstance(raw, dict):
            raise ConfigError("config: expected a JSON object")
        model_type = raw.get("model_type", "kimi_k3")
        if raw.get("architectures") == [K3C_ARCHITECTURE]:
            return cls._from_fields(raw, model_type, "k3c")
        if model_type == "kimi_k3" and "text_config" in raw:
            text = raw["text_config"]
            need_type("text_config", text, "dict")
            ignored = unknown_keys(raw, WRAPPER_KEYS)
            quant = [q for q in (raw.get("quantization_config"), text.get("quantization_config")) if q is not None]
            if len(quant) == 2 and quant[0] != quant[1]:
                raise ConfigError("config field 'quantization_config': the top level and text_config disagree")
            if raw.get("tie_word_embeddings", False) != text.get("tie_word_embeddings", False):
                raise ConfigError("config field 'tie_word_embeddings': the top level and text_config disagree")
            return cls._from_fields({**text, "quantization_config": quant[0] if quant else None},
                                    model_type, "k3_release", ignored)
        if model_type == "kimi_linear":
            return cls._from_fields(kimi_linear_fields(raw), model_type, "kimi_linear")
        return cls._from_fields(raw, model_type, "k3c")

    @classmethod
    def _from_fields(cls, raw: dict[str, Any], model_type: Any, layout: str,
                     ignored: list[str] | None = None) -> "K3Config":
        """K3Config from a dict of its fields (aliases allowed), after the key checks: a key k3c
        reads but does not keep must hold the value k3c computes (FIXED); a key known not to change
        the math (IGNORED) is dropped; a key k3c has never heard of is dropped and listed in
        ``ignored_keys`` (``ignored``: the wrapper's). Inside the math-bearing groups
        (``linear_attn_config``, ``quantization_config``) an unknown key is refused (``validate``).
        Every problem is reported in one ConfigError."""
        need_type("model_type", model_type, "str")
        raw = dict(raw)
        for alias, name in ALIASES.items():
            if alias in raw:
                value = raw.pop(alias)
                raw.setdefault(name, value)
        names = {f.name for f in dataclasses.fields(cls)} - {"layout", "ignored_keys"}
        ignored = [*(ignored or []), *unknown_keys(raw, names | FIXED.keys() | IGNORED)]
        problems = []
        for key, value in raw.items():
            if key in FIXED and FIXED[key] is not None and not any(
                    type(value) is type(v) and value == v for v in FIXED[key]):
                allowed = " or ".join(json.dumps(v) for v in FIXED[key])
                problems.append(f"config field '{key}': k3c implements {allowed} only, got {json.dumps(value)}")
        kv_heads = raw.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != raw.get("num_attention_heads", cls.num_attention_heads):
            problems.append(f"config field 'num_key_value_heads': must equal num_attention_heads, got {kv_heads!r}")
        if raw.get("use_grouped_topk") and (raw.get("num_expert_group", 1), raw.get("topk_group", 1)) != (1, 1):
            problems.append("config field 'use_grouped_topk': k3c implements one expert group only")
        kwargs = {k: v for k, v in raw.items() if k in names and k != "model_type"}
        try:
            cfg = cls(**kwargs, model_type=model_type, layout=layout, ignored_keys=tuple(ignored))
        except ConfigError as e:
            problems.append(str(e))
        refuse(problems)
        return cfg

    @classmethod
    def from_hf(cls, path: str | Path) -> "K3Config":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        p = Path(path)
        try:
            if p.is_dir():
                p = p / "config.json"
            if not p.is_file():
                raise ConfigError(f"config: no config.json at {p}")
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"config: cannot read {p} ({e.strerror})") from None
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise ConfigError(f"config: {p} is not valid JSON ({where})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config: {p} does not hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def preset(cls, name: str) -> "K3Config":
        from .presets import PRESETS  # the presets are K3Configs: that module imports this one
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
        return PRESETS[name]()


