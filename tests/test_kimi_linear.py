"""Kimi Linear checkpoints in K3Model against transformers' KimiLinearForCausalLM (docs/model.md §7).

transformers builds a tiny random model in fp32 (its pure-PyTorch KDA and conv paths on CPU) and saves
it; k3c reads the directory through K3Config.from_hf and load_checkpoint and must reproduce its logits
and its cached greedy generation. The weights are redrawn N(0, 1/fan_in): at transformers' own init
(std 0.02) the KDA output sits below o_norm's eps and the layers barely contribute.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from k3c.model.stacking import from_checkpoint
from k3c.model import ConfigError, K3Config, K3Model
from k3c.model.checkpoint import load_checkpoint
from k3c.model.kimi_linear import to_k3

PROMPT, NEW = 72, 8  # a full 64-token KDA chunk and a partial one; 8 decode steps
TOLERANCE = 1e-4


def tiny_config() -> KimiLinearConfig:
    """Layers KDA, KDA, MLA, KDA (1-indexed lists); layer 0 dense, then MoE with 8 experts, top-2."""
    return KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_renormalize=True,
        routed_scaling_factor=2.446, first_k_dense_replace=1, hidden_act="silu", rms_norm_eps=1e-5,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,  # no eos: generation runs all NEW steps
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 16,
                            "short_conv_kernel_size": 4})


@pytest.fixture(scope="module")
def hf_model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(tiny_config()).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue  # transformers draws these in the released models' ranges
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            else:
                std = 1.0 if "embed_tokens" in name else t.shape[-1] ** -0.5
                t.copy_(std * torch.randn(t.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(2))


def test_config_gives_transformers_layer_plan(hf_model, saved):
    cfg, hf = K3Config.from_hf(saved), hf_model.config
    assert cfg.layer_kinds == ["mla" if t == "full_attention" else "kda" for t in hf.layer_types]
    assert [cfg.is_moe(i) for i in range(hf.num_hidden_layers)] == [t == "sparse" for t in hf.mlp_layer_types]
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.routed_scaling_factor) == (8, 2, 2.446)
    assert cfg.gate_lower_bound is None and not cfg.uses_attn_res and not cfg.is_latent_moe
    assert not cfg.mla_use_output_gate and cfg.hidden_act == "silu"


def test_logits_match_transformers(hf_model, saved, prompt):
    kda_out = []  # KDA output before o_norm: its variance must dwarf the eps for the test to bite
    hooks = [layer.self_attn.o_norm.register_forward_pre_hook(lambda m, a: kda_out.append(a[0].pow(2).mean(-1)))
             for layer in hf_model.model.layers if hasattr(layer.self_attn, "o_norm")]
    with torch.no_grad():
        want = hf_model(input_ids=prompt, use_cache=False).logits
        got = load_checkpoint(saved)(prompt)
    for h in hooks:
        h.remove()
    assert min(v.median().item() for v in kda_out) > 30 * hf_model.config.rms_norm_eps
    assert want.std() > 0.5
    assert (got - want).abs().max().item() < TOLERANCE


def test_transformers_module_names_load(hf_model, prompt):
    """The in-memory transformers names: forget_gate.*, packed conv1d, merged experts, mlp.* for MoE."""
    cfg = K3Config.from_dict(hf_model.config.to_dict())
    model = K3Model(cfg).eval()
    state = dict(kv for name, t in hf_model.state_dict().items() for kv in to_k3(name, t, cfg))
    model.load_state_dict(from_checkpoint(state), strict=True)
    with torch.no_grad():
        diff = (model(prompt) - hf_model(input_ids=prompt, use_cache=False).logits).abs().max().item()
    assert diff < TOLERANCE


def test_prefill_decode_matches_cached_generate(hf_model, saved, prompt):
    model = load_checkpoint(saved)
    with torch.no_grad():
        want = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                 do_sample=False, use_cache=True)[0, PROMPT:].tolist()
        logits, state = model.prefill(prompt)
        got = []
        for _ in range(NEW):
            token = logits[:, -1].argmax(-1, keepdim=True)
            got.append(token.item())
            logits, state = model.decode(token, state)
    assert len(want) == NEW and got == want


def test_unknown_model_type_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="model_type"):
        K3Config.from_hf(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "gelu"),
    ("num_key_value_heads", 1),
    ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"]),
    ("layer_types", ["linear_attention"] * 3),
])
def test_unsupported_kimi_linear_config_names_the_field(hf_model, field, value):
    raw = {**hf_model.config.to_dict(), field: value}
    with pytest.raises(ConfigError, match=field):
        K3Config.from_dict(raw)
