"""The presets (docs/model.md §0): the published K3 and two seeded-random sizes for tests and benchmarks."""
from __future__ import annotations

from typing import Any

from .config import K3Config, every_fourth_and_last


def _small_plan(num_layers: int) -> dict[str, Any]:
    full = every_fourth_and_last(num_layers)
    return {"full_attn_layers": full,
            "kda_layers": [i for i in range(1, num_layers + 1) if i not in full]}


def _k3_tiny() -> K3Config:
    """CI size: dense layer 0, MLA at layers 4 and 6 (1-indexed), 2 AttnRes blocks, 8 experts top-2."""
    return K3Config(
        hidden_size=64, num_hidden_layers=6, vocab_size=512, max_position_embeddings=4096,
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
