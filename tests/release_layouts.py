"""The published configs: the Kimi K3 release's multimodal wrapper, read from its verbatim copy beside
the repository (../shared/real/kimi-k3/config.json) where it is there, else written from
docs/model.md §0 and §8; and the Kimi-Linear-48B-A3B config."""
from __future__ import annotations

import copy
import json
from pathlib import Path

FULL_ATTN_93 = [*range(4, 93, 4), 93]
K3_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "scale_dtype": "torch.uint8", "dynamic": False}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}
K3_TEXT = {  # docs/model.md §0
    "model_type": "kimi_linear",
    "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "max_position_embeddings": 1_048_576,
    "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True, "full_attn_layers": FULL_ATTN_93,
                           "kda_layers": [i for i in range(1, 94) if i not in FULL_ATTN_93]},
    "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "mla_use_output_gate": True,
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
    "first_k_dense_replace": 1, "intermediate_size": 33792, "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "moe_renormalize": True, "routed_scaling_factor": 1.0,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 12, "quantization_config": K3_QUANTIZATION,
}
VISION = {"model_type": "kimi_k3_vision", "hidden_size": 1152, "num_hidden_layers": 27}  # not read by k3c


REAL_K3 = Path(__file__).resolve().parents[1].parent / "shared" / "real" / "kimi-k3" / "config.json"


def k3_release_config(text: dict | None = None) -> dict:
    """The K3 release's config.json (docs/model.md §8): the text model in ``text_config``. From the
    verbatim file where it is there: as published, or with ``text``'s keys over its text model's
    (every other key, the generic transformers ones included, as released)."""
    if REAL_K3.is_file():
        raw = json.loads(REAL_K3.read_text())
        if text is not None:
            raw["text_config"] = {**raw["text_config"], **copy.deepcopy(text)}
        return raw
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config"},
            "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
            "media_placeholder_token_id": 163605, "tie_word_embeddings": False,
            "text_config": copy.deepcopy(K3_TEXT if text is None else text), "vision_config": dict(VISION)}


KIMI_LINEAR_FULL = [4, 8, 12, 16, 20, 24, 27]
KIMI_LINEAR_48B = {  # the Hub config.json of moonshotai/Kimi-Linear-48B-A3B (docs/model.md §7, §8)
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"},
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "dtype": "bfloat16",
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27, "vocab_size": 163840,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "model_max_length": 1_048_576,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "rope_theta": 10000.0, "rope_scaling": None,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                           "full_attn_layers": KIMI_LINEAR_FULL,
                           "kda_layers": [i for i in range(1, 28) if i not in KIMI_LINEAR_FULL]},
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "use_cache": True, "initializer_range": 0.02,
    "transformers_version": "4.56.2",
}
