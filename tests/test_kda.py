"""Kimi Delta Attention (docs/model.md §1) against fla-core's naive references and against itself.

fla's ``naive_recurrent_kda`` / ``naive_chunk_kda`` take q unscaled and apply ``scale`` themselves;
ours take q already scaled by K^-0.5 (docs/model.md §1 step 7), so every comparison feeds fla the
L2-normalised q and scale=K^-0.5.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from k3c.model.kda import lowerbound_gate, short_conv, softplus_gate
from k3c.ops.kda import kda_chunked, kda_recurrent, recurrent_one

H, K, V = 3, 16, 24  # V != K so a transposed state cannot pass
LOWER_BOUND = -5.0


def unit(x: torch.Tensor) -> torch.Tensor:
    """The spec's L2 norm (eps inside the root), written out here rather than imported."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gate_params(seed: int):
    """A_log padded like K3's [128], with junk after the H real values so that forgetting A_log[:H]
    shows; dt_bias [H*K]."""
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.full((H + 5,), 7.0)
    A_log[:H] = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    return A_log, torch.randn(H * K, generator=gen) * 0.5


def kda_inputs(T: int, seed: int):
    """Unscaled unit q, unit k, v, gate input z, beta in (0, 1), nonzero initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = unit(torch.randn(1, T, H, K, generator=gen))
    k = unit(torch.randn(1, T, H, K, generator=gen))
    v = torch.randn(1, T, H, V, generator=gen)
    z = torch.randn(1, T, H, K, generator=gen) * 2
    beta = torch.rand(1, T, H, generator=gen)
    S0 = torch.randn(1, H, K, V, generator=gen) * 0.5
    return q, k, v, z, beta, S0


def test_lowerbound_gate_matches_fla(fla_gates):
    A_log, dt_bias = gate_params(0)
    z = torch.randn(2, 5, H, K, generator=torch.Generator().manual_seed(0)) * 4
    ours = lowerbound_gate(z, A_log, dt_bias, LOWER_BOUND)
    ref = fla_gates["naive_kda_lowerbound_gate"](z, A_log[:H], dt_bias, lower_bound=LOWER_BOUND)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    assert ours.dtype == torch.float32
    assert (ours >= LOWER_BOUND).all() and (ours <= 0).all()  # (lb, 0), closed once fp32 saturates


def test_softplus_gate_matches_fla(fla_gates):
    A_log, dt_bias = gate_params(1)
    z = torch.randn(2, 5, H, K, generator=torch.Generator().manual_seed(1)) * 4
    ours = softplus_gate(z, A_log, dt_bias)
    ref = fla_gates["naive_kda_gate"](z, A_log[:H], dt_bias)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", [100, 130])
def test_chunked_equals_recurrent_and_fla(T, fla_naive, fla_gates):
    """T not a multiple of the 64-token chunk, nonzero initial state, fp32, within 1e-5."""
    q, k, v, z, beta, S0 = kda_inputs(T, seed=T)
    A_log, dt_bias = gate_params(T)
    g_fla = fla_gates["naive_kda_lowerbound_gate"](z, A_log[:H], dt_bias, lower_bound=LOWER_BOUND)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(q, k, v, g_fla, beta, scale=K ** -0.5,
                                                 initial_state=S0, output_final_state=True)
    g = lowerbound_gate(z, A_log, dt_bias, LOWER_BOUND)
    qs = q * K ** -0.5
    forms = {
        "kda_chunked": kda_chunked(qs, k, v, g, beta, S0),
        "k3::kda_chunk": torch.ops.k3.kda_chunk(qs, k, v, g, beta, S0),
        "kda_recurrent": kda_recurrent(qs, k, v, g, beta, S0),
    }
    for name, (o, S) in forms.items():
        assert o.shape == (1, T, H, V) and S.shape == (1, H, K, V), name
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-5, msg=lambda m: f"{name} output: {m}")
        torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-5, msg=lambda m: f"{name} state: {m}")


def test_one_token_step_equals_the_recurrence_and_fla(fla_naive, fla_gates):
    """recurrent_one (the CPU's decode step: two products with the state in one, the output from
    the update) is the recurrence's step, three sequences at once: in float64 the same numbers
    (a rearrangement of the same sums), and each sequence fla's recurrence within fp32 rounding
    (fla computes in fp32)."""
    steps = [kda_inputs(1, seed=s) for s in (1, 2, 3)]
    q, k, v, z, beta, S0 = (torch.cat(parts).double() for parts in zip(*steps))
    A_log, dt_bias = gate_params(4)
    g = lowerbound_gate(z, A_log, dt_bias, LOWER_BOUND)
    o, S = recurrent_one(q * K ** -0.5, k, v, g, beta, S0)
    o_rec, S_rec = kda_recurrent(q * K ** -0.5, k, v, g, beta, S0)
    torch.testing.assert_close(o, o_rec, rtol=0, atol=1e-13)
    torch.testing.assert_close(S, S_rec, rtol=0, atol=1e-13)
    for b in range(3):
        o_ref, S_ref = fla_naive.naive_recurrent_kda(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1],
                                                     scale=K ** -0.5, initial_state=S0[b:b + 1],
                                                     output_final_state=True)
        torch.testing.assert_close(o[b:b + 1], o_ref.double(), rtol=0, atol=1e-6)
        torch.testing.assert_close(S[b:b + 1], S_ref.double(), rtol=0, atol=1e-6)


def test_chunked_matches_fla_naive_chunk(fla_naive, fla_gates):
    T = 128
    q, k, v, z, beta, S0 = kda_inputs(T, seed=7)
    A_log, dt_bias = gate_params(7)
    g = fla_gates["naive_kda_lowerbound_gate"](z, A_log[:H], dt_bias, lower_bound=LOWER_BOUND)
    o_ref, S_ref = fla_naive.naive_chunk_kda(q, k, v, g, beta, scale=K ** -0.5, initial_state=S0,
                                             output_final_state=True, chunk_size=64)
    o, S = kda_chunked(q * K ** -0.5, k, v, g, beta, S0)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("drive", ["g_at_floor", "gate_saturated"])
def test_chunk_form_finite_at_gate_floor(drive):
    """Over 4096 tokens the in-chunk cumsum reaches 64 * -5 = -320: exp(+320) would overflow fp32,
    so the chunk form must never factor exp(G_i - G_j) as exp(G_i) exp(-G_j) (docs/model.md §1 numerics)."""
    T, h, d = 4096, 1, 8
    gen = torch.Generator().manual_seed(3)
    q = unit(torch.randn(1, T, h, d, generator=gen)) * d ** -0.5
    k = unit(torch.randn(1, T, h, d, generator=gen))
    v = torch.randn(1, T, h, d, generator=gen)
    beta = torch.rand(1, T, h, generator=gen)
    S0 = torch.randn(1, h, d, d, generator=gen)
    if drive == "g_at_floor":
        g = torch.full((1, T, h, d), LOWER_BOUND)
    else:  # a huge gate input drives sigmoid to 1, g to the bound
        g = lowerbound_gate(torch.full((1, T, h, d), 1e4), torch.zeros(h), torch.zeros(h * d), LOWER_BOUND)
        assert (g == LOWER_BOUND).all()
    o, S = kda_chunked(q, k, v, g, beta, S0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    o_rec, S_rec = kda_recurrent(q, k, v, g, beta, S0)
    torch.testing.assert_close(o, o_rec, rtol=0, atol=1e-5)
    torch.testing.assert_close(S, S_rec, rtol=0, atol=1e-5)


def test_short_conv_carries_state():
    """Two calls carrying the state == one causal conv (zero left padding) over the whole sequence."""
    C, W, T1, T2 = 6, 4, 2, 5  # T1 < W - 1: the state must keep part of the initial zeros
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(C, 1, W, generator=gen)
    x = torch.randn(1, T1 + T2, C, generator=gen)
    full = F.silu(F.conv1d(x.transpose(1, 2), weight, padding=W - 1, groups=C)[..., :T1 + T2]).transpose(1, 2)
    y1, state = short_conv(x[:, :T1], weight, torch.zeros(1, C, W - 1))
    y2, state = short_conv(x[:, T1:], weight, state)
    torch.testing.assert_close(torch.cat((y1, y2), dim=1), full, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, x[:, -(W - 1):].transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("decode", [False, True])
def test_kda_layer_matches_fla(decode, tiny_model, fla_naive, fla_gates):
    """A whole KimiDeltaAttention layer (k3-tiny layer 0) == projections + causal conv + fla gate +
    fla naive_recurrent_kda + per-head RMSNorm + sigmoid gate + o_proj, written out here."""
    attn = copy.deepcopy(tiny_model.model.layers[0].self_attn)
    h, d = attn.H, attn.K
    with torch.no_grad():
        attn.A_log[h:] = 3.0  # K3 stores A_log padded to 128: only the first H values count
    T, D = 70, tiny_model.cfg.hidden_size
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, T, D, generator=gen)
    S0 = torch.randn(1, h, d, d, generator=gen) * 0.5
    W = tiny_model.cfg.conv_size
    conv0 = tuple(torch.zeros(1, h * d, W - 1) for _ in range(3))
    with torch.no_grad():
        out, conv, S = attn(x, conv0, S0, decode=decode)

        def conv_silu(proj, conv1d):
            y = F.conv1d(proj(x).transpose(1, 2), conv1d.weight, padding=W - 1, groups=h * d)[..., :T]
            return F.silu(y).transpose(1, 2).reshape(1, T, h, d)

        q = unit(conv_silu(attn.q_proj, attn.q_conv1d))
        k = unit(conv_silu(attn.k_proj, attn.k_conv1d))
        v = conv_silu(attn.v_proj, attn.v_conv1d)
        g = fla_gates["naive_kda_lowerbound_gate"](attn.f_b_proj(attn.f_a_proj(x)).view(1, T, h, d),
                                                    attn.A_log[:h], attn.dt_bias, lower_bound=LOWER_BOUND)
        beta = torch.sigmoid(attn.b_proj(x))
        o, S_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=d ** -0.5, initial_state=S0,
                                                 output_final_state=True)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.o_norm.weight
        y = o * torch.sigmoid(attn.g_proj(x).view(1, T, h, d))
        ref = attn.o_proj(y.reshape(1, T, h * d))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-5)
    for c, proj in zip(conv, (attn.q_proj, attn.k_proj, attn.v_proj)):  # conv state = last W-1 inputs
        torch.testing.assert_close(c, proj(x)[:, -(W - 1):].transpose(1, 2), rtol=0, atol=0)
