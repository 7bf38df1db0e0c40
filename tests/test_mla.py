"""Gated MLA with no positional encoding (docs/model.md §2): absorbed decode == naive attention == a
reference written out per head; NoPE makes attention blind to the order of earlier tokens."""
from __future__ import annotations

import pytest
import torch


def reference_attention(mla, q_nope, q_pe, cache):
    """docs/model.md §2 literally: key_h = [W_UK,h c ; k_pe], value_h = W_UV,h c, scores / sqrt(nope + rope),
    query i at absolute position L - T + i sees cache rows 0..L - T + i."""
    B, T, H, _ = q_nope.shape
    L = cache.shape[1]
    c, k_pe = cache.split((mla.rank, mla.rope), dim=-1)
    W = mla.kv_b_proj.weight.view(H, mla.nope + mla.dv, mla.rank)
    key = torch.cat((torch.einsum("hnr,blr->blhn", W[:, :mla.nope], c),
                     k_pe[:, :, None, :].expand(B, L, H, mla.rope)), dim=-1)
    value = torch.einsum("hvr,blr->blhv", W[:, mla.nope:], c)
    query = torch.cat((q_nope, q_pe), dim=-1)
    scores = torch.einsum("bthd,blhd->bhtl", query, key) / (mla.nope + mla.rope) ** 0.5
    position = torch.arange(L - T, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > position, float("-inf"))
    return torch.einsum("bhtl,blhv->bthv", scores.softmax(-1), value)


@pytest.fixture
def mla(tiny_model):
    layer = next(i for i, kind in enumerate(tiny_model.cfg.layer_kinds) if kind == "mla")
    return tiny_model.model.layers[layer].self_attn


@pytest.mark.parametrize("L, T", [(1, 1), (20, 1), (20, 5), (7, 7)])
def test_absorbed_equals_naive(mla, L, T):
    """Same cache, same queries; T > 1 with L > T exercises the causal offset L - T."""
    gen = torch.Generator().manual_seed(L * 100 + T)
    x = torch.randn(2, L, mla.kv_a_proj_with_mqa.in_features, generator=gen)
    with torch.no_grad():
        cache = mla.latent(x)
        q_nope, q_pe = mla.queries(x[:, L - T:])
        ref = reference_attention(mla, q_nope, q_pe, cache)
        naive = mla.attend_naive(q_nope, q_pe, cache)
        absorbed = mla.attend_absorbed(q_nope, q_pe, cache[:, :L - T], cache[:, L - T:])
    assert cache.shape == (2, L, mla.rank + mla.rope)
    torch.testing.assert_close(naive, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(absorbed, ref, rtol=0, atol=1e-5)


def test_layer_decode_equals_prefill_on_same_cache(mla):
    """The whole layer (gate and o_proj included) with a nonempty cache and T = 3 new tokens."""
    gen = torch.Generator().manual_seed(5)
    D = mla.kv_a_proj_with_mqa.in_features
    past, x = torch.randn(1, 9, D, generator=gen), torch.randn(1, 3, D, generator=gen)
    with torch.no_grad():
        cache = mla.latent(past)
        out_naive, rows_naive = mla(x, cache, decode=False)
        out_absorbed, rows_absorbed = mla(x, cache, decode=True)
        whole, _ = mla(torch.cat((past, x), dim=1), cache[:, :0], decode=False)
    torch.testing.assert_close(out_absorbed, out_naive, rtol=0, atol=1e-5)
    torch.testing.assert_close(out_naive, whole[:, 9:], rtol=0, atol=1e-5)
    assert torch.equal(rows_naive, rows_absorbed) and torch.equal(rows_naive, mla.latent(x))


def permuted_prefix_outputs(layer_call, T: int, D: int):
    """Output at the last position for x and for x with tokens 0..T-2 permuted."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, T, D, generator=gen)
    perm = torch.randperm(T - 1, generator=gen)
    assert not torch.equal(perm, torch.arange(T - 1))
    shuffled = torch.cat((x[:, perm], x[:, -1:]), dim=1)
    with torch.no_grad():
        return layer_call(x)[:, -1], layer_call(shuffled)[:, -1]


def test_nope_mla_ignores_order_of_earlier_tokens(mla):
    D = mla.kv_a_proj_with_mqa.in_features
    a, b = permuted_prefix_outputs(lambda x: mla(x, x.new_zeros(1, 0, mla.rank + mla.rope))[0], 12, D)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_kda_depends_on_order_of_earlier_tokens(tiny_model):
    cfg = tiny_model.cfg
    kda = tiny_model.model.layers[cfg.layer_kinds.index("kda")].self_attn
    HK, W = cfg.kda_heads * cfg.kda_head_dim, cfg.conv_size
    conv = tuple(torch.zeros(1, HK, W - 1) for _ in range(3))
    S0 = torch.zeros(1, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    a, b = permuted_prefix_outputs(lambda x: kda(x, conv, S0)[0], 12, cfg.hidden_size)
    assert (a - b).abs().max() > 1e-3
