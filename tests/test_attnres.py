"""Block Attention Residuals (docs/model.md §3): the direct softmax, its online-softmax form, and where
blocks close, checked on the config and through the model."""
from __future__ import annotations

import pytest
import torch

import k3c.model.model as model_module
from k3c.model import K3Config, K3Model
from k3c.model.attnres import attn_res, attn_res_online, bank_summary
from k3c.model.init import init_weights

D = 16


def rows(m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    bank = [torch.randn(2, 3, D, generator=gen) * (j + 1) for j in range(m)]  # rows of unequal scale
    p = torch.randn(2, 3, D, generator=gen)
    w, gamma = torch.randn(1, D, generator=gen), torch.rand(D, generator=gen) + 0.5
    return bank, p, w, gamma


def test_attn_res_is_the_spec_formula():
    """s_j = (w * gamma) . V_j / sqrt(mean(V_j^2) + 1e-5); alpha = softmax(s); h = sum_j alpha_j V_j,
    written out row by row."""
    bank, p, w, gamma = rows(3, 0)
    V = [*bank, p]
    s = torch.stack([(v * (w[0] * gamma)).sum(-1) / torch.sqrt(v.pow(2).mean(-1) + 1e-5) for v in V])
    e = (s - s.max(0).values).exp()
    expected = sum(e[j, ..., None] * V[j] for j in range(len(V))) / e.sum(0)[..., None]
    torch.testing.assert_close(attn_res(bank, p, w, gamma), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 8])
def test_online_softmax_equals_direct(m):
    bank, p, w, gamma = rows(m, m)
    summary = bank_summary(bank, w, gamma)
    torch.testing.assert_close(attn_res_online(summary, p, w, gamma), attn_res(bank, p, w, gamma),
                               rtol=1e-6, atol=1e-6)


def test_online_softmax_survives_large_scores():
    """Scores far beyond exp's fp32 range on both sides of the merge stay finite and exact."""
    bank, p, _, _ = rows(3, 4)
    w, gamma = torch.full((1, D), 40.0), torch.ones(D)  # |s| up to ~40 * D
    direct = attn_res(bank, p, w, gamma)
    online = attn_res_online(bank_summary(bank, w, gamma), p, w, gamma)
    assert torch.isfinite(online).all()
    torch.testing.assert_close(online, direct, rtol=1e-5, atol=1e-5)


def test_blocks_close_at_multiples_of_block_size():
    cfg = K3Config()  # the published config: 93 layers, block 12
    assert [l for l in range(cfg.num_hidden_layers) if cfg.closes_block(l)] == [0, 12, 24, 36, 48, 60, 72, 84]
    tiny = K3Config.preset("k3-tiny")
    assert [l for l in range(tiny.num_hidden_layers) if tiny.closes_block(l)] == [0, 3]
    plain = K3Config(attn_res_block_size=None)
    assert not any(plain.closes_block(l) for l in range(plain.num_hidden_layers))


def bank_sizes(model: K3Model, monkeypatch) -> list[int]:
    """Run the model and record the bank length seen by every AttnRes, in call order."""
    seen: list[int] = []

    def recording_attn_res(bank, p, w, gamma):
        seen.append(len(bank))
        return attn_res(bank, p, w, gamma)

    monkeypatch.setattr(model_module, "attn_res", recording_attn_res)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    return seen


def expected_bank_sizes(num_layers: int, block: int) -> list[int]:
    """Hand-derived: before layer l's attention the bank holds the blocks closed at layers < l (no
    AttnRes at l = 0); before its MLP, those closed at layers <= l; the output sees all of them."""
    sizes = []
    for l in range(num_layers):
        if l > 0:
            sizes.append((l - 1) // block + 1)
        sizes.append(l // block + 1)
    return sizes + [(num_layers - 1) // block + 1]


def test_bank_rows_through_tiny_model(tiny_model, monkeypatch):
    seen = bank_sizes(tiny_model, monkeypatch)
    assert seen == expected_bank_sizes(6, 3)
    assert seen[-1] == 2  # >= 2 blocks: embedding and layers 0-2


def test_bank_rows_with_published_layer_plan(monkeypatch):
    """k3's 93 layers and block size 12 at toy width: the final AttnRes mixes 8 bank rows plus the
    partial sum, 9 sources."""
    cfg = K3Config(hidden_size=32, vocab_size=16, intermediate_size=32, num_attention_heads=1,
                   q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                   num_experts=2, num_experts_per_token=1, num_shared_experts=0, moe_intermediate_size=32,
                   routed_expert_hidden_size=32, quantization_config=None,
                   linear_attn_config={**K3Config().linear_attn_config, "num_heads": 1, "head_dim": 8})
    seen = bank_sizes(init_weights(K3Model(cfg), seed=1).eval(), monkeypatch)
    assert seen == expected_bank_sizes(93, 12)
    assert seen[-1] + 1 == 9 and max(seen) == 8


def test_final_hidden_is_attn_res_over_embedding_and_block_ends(tiny_model):
    """k3-tiny (block 3): logits == lm_head(norm(AttnRes([embedding, p after layer 2], p after
    layer 5))), with the partial sums read from the model's per-layer record."""
    tokens = torch.tensor([[5, 17, 300, 2, 99]])
    m = tiny_model.model
    hidden: list[torch.Tensor] = []
    with torch.no_grad():
        logits, _ = tiny_model.layers_forward(tokens, tiny_model.init_state(), decode=False, hidden=hidden)
        bank = [m.embed_tokens(tokens), hidden[2]]
        h = attn_res(bank, hidden[5], m.output_attn_res_proj.weight, m.output_attn_res_norm.weight)
        expected = tiny_model.lm_head(m.norm(h))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
