"""K3Model (docs/model.md §1-4): decode continues a prefill exactly; configs validate and presets hold the
layer plans the spec and CI rely on."""
from __future__ import annotations

import pytest
import torch

from k3c.errors import K3Error
from k3c.model import ConfigError, K3Config


def incremental(model, tokens: torch.Tensor, n_decode: int):
    """Prefill all but the last n_decode tokens, then decode them one at a time."""
    T = tokens.shape[1]
    state = model.init_state(tokens.shape[0])
    logits = []
    if T > n_decode:
        out, state = model.prefill(tokens[:, :T - n_decode], state)
        logits.append(out)
    for t in range(T - n_decode, T):
        out, state = model.decode(tokens[:, t:t + 1], state)
        logits.append(out)
    return torch.cat(logits, dim=1), state


def all_state(state) -> list[torch.Tensor]:
    return [*state.kda_conv, *state.kda_S, *state.mla_cache]


TOKENS = torch.randint(0, 512, (2, 130), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("T, n_decode", [
    (100, 10),   # prefill 90: a padded second chunk, then decode across position 96
    (130, 2),    # prefill spans three chunks
    (64, 3),     # prefill 61, decode into and past the chunk boundary
    (5, 4),      # prefill of 1 token: the conv state still holds initial zeros
    (6, 6),      # decode from the empty state
])
def test_decode_continues_prefill_float64(tiny_model64, T, n_decode):
    """In float64, full prefill == prefill + decode steps to 1e-10 in logits and in every state
    tensor (KDA conv and S, MLA latent cache): any error in chunk padding, conv state, the MLA
    causal offset or the AttnRes bank would show at the 1e-2 level."""
    tokens = TOKENS[:, :T]
    with torch.no_grad():
        full, full_state = tiny_model64.prefill(tokens)
        inc, inc_state = incremental(tiny_model64, tokens, n_decode)
    assert full.dtype == torch.float64
    torch.testing.assert_close(inc, full, rtol=0, atol=1e-10)
    assert inc_state.position == full_state.position == T
    for a, b in zip(all_state(inc_state), all_state(full_state), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_decode_continues_prefill_float32(tiny_model, tiny_model64):
    """fp32: one decode step after a 99-token prefill matches the full forward to 1e-5. Over several
    steps the two fp32 paths drift apart by ~1e-5; the float64 run shows this is rounding, not a bug:
    the fp32 error of the chunk form (the same as fla's naive_chunk_kda) is amplified up to ~300x by
    each KDA head's o_norm, whose inputs have RMS ~1e-3 under random weights. So: the decoded logits
    must be as close to float64 as the full fp32 forward is, and the paths within twice that."""
    tokens = TOKENS[:, :100]
    with torch.no_grad():
        full = tiny_model.prefill(tokens)[0]
        one_step = incremental(tiny_model, tokens, 1)[0]
        ten_steps = incremental(tiny_model, tokens, 10)[0]
        exact = tiny_model64.prefill(tokens)[0]
    torch.testing.assert_close(one_step, full, rtol=0, atol=1e-5)
    fp32_error = (full.double() - exact).abs().max().item()
    assert fp32_error < 1e-4
    assert (ten_steps[:, 90:].double() - exact[:, 90:]).abs().max().item() <= fp32_error
    assert (ten_steps - full).abs().max().item() <= 2 * fp32_error


def test_float64_weights_are_the_float32_weights(tiny_model, tiny_model64):
    wide = tiny_model64.state_dict()
    for name, t in tiny_model.state_dict().items():
        assert torch.equal(t.double() if t.is_floating_point() else t, wide[name]), name


# ---- configuration -----------------------------------------------------------------------------
MXFP4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "group_size": 32}


@pytest.mark.parametrize("overrides, field", [
    ({"num_experts": 8, "num_experts_per_token": 9}, "num_experts_per_token"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama"}, "model_type"),
    ({"linear_attn_config": {**K3Config().linear_attn_config, "full_attn_layers": [4, 94]}},
     "linear_attn_config.full_attn_layers"),
    ({"linear_attn_config": {**K3Config().linear_attn_config, "full_attn_layers": [0, 4]}},
     "linear_attn_config.full_attn_layers"),
    ({"moe_intermediate_size": 48}, "moe_intermediate_size"),
    ({"routed_expert_hidden_size": 40}, "routed_expert_hidden_size"),
    ({"routed_expert_hidden_size": None, "hidden_size": 7176, "quantization_config": MXFP4}, "hidden_size"),
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        K3Config(**overrides)


def test_config_error_is_a_k3_error_from_dict_too():
    assert issubclass(ConfigError, K3Error)
    with pytest.raises(ConfigError, match="'model_type'"):
        K3Config.from_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="preset"):
        K3Config.preset("k4")


def test_k3_tiny_preset_covers_every_layer_kind(tiny_cfg, tiny_model):
    kinds = tiny_cfg.layer_kinds
    layers = tiny_model.model.layers
    assert hasattr(layers[0], "mlp") and not hasattr(layers[0], "block_sparse_moe")  # dense first layer
    assert all(hasattr(layer, "block_sparse_moe") for layer in layers[1:])
    assert "mla" in kinds[:-1]                                         # an MLA layer that is not the last
    assert sum(tiny_cfg.closes_block(l) for l in range(tiny_cfg.num_hidden_layers)) >= 2
    assert tiny_cfg.num_experts >= 8 and tiny_cfg.num_experts_per_token >= 2
    assert tiny_cfg.experts_mxfp4


def test_k3_layer_plan():
    cfg = K3Config.preset("k3")
    full = cfg.linear_attn_config["full_attn_layers"]
    assert full == [*range(4, 93, 4), 93]                              # 1-indexed: 4, 8, ..., 92, 93
    assert len(full) == 24
    kinds = cfg.layer_kinds
    assert kinds.count("mla") == 24 and kinds.count("kda") == 69
    assert [i for i, kind in enumerate(kinds) if kind == "mla"] == [i - 1 for i in full]
    assert kinds[0] == "kda" and kinds[3] == "mla" and kinds[92] == "mla" and kinds[91] == "mla"
