"""MXFP4 (docs/model.md §5): the E2M1 table, nibble order, OCP quantisation, and the k3::mxfp4_moe op
against a dense computation written out here."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import k3c.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3c.ops.mxfp4 import dequantize, pack_nibbles, quantize, unpack_nibbles

SPEC_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def reference_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[o, i] = TABLE[nibble(o, i)] * 2^(scale[o, i // 32] - 127); element 2j is byte j's low nibble."""
    codes = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.long)
    codes[..., 0::2] = packed.long() % 16
    codes[..., 1::2] = packed.long() // 16
    exponent = scale.double().repeat_interleave(32, dim=-1) - 127
    return (torch.tensor(SPEC_TABLE, dtype=torch.float64)[codes] * torch.pow(2.0, exponent)).float()


def test_all_sixteen_codes_decode_to_the_table():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)              # one 32-element group
    for scale_byte, factor in ((127, 1.0), (128, 2.0), (125, 0.25)):
        w = dequantize(pack_nibbles(codes)[None], torch.tensor([[scale_byte]], dtype=torch.uint8))[0]
        assert w.tolist() == [v * factor for v in SPEC_TABLE] * 2
        assert torch.signbit(w[8]) and not torch.signbit(w[0])         # 0x8 is -0


def test_low_nibble_first():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x72
    assert unpack_nibbles(packed)[0, :2].tolist() == [2, 7]
    w = dequantize(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert w[0, :2].tolist() == [1.0, 6.0] and not w[0, 2:].any()
    assert pack_nibbles(torch.tensor([2, 7], dtype=torch.uint8)).item() == 0x72


def test_quantize_hand_derived_groups():
    """Group 1: amax 15, shared_exp = floor(log2 15) - 2 = 1 (byte 128), elements v / 2 rounded to
    nearest with ties to the even code, saturated at 6. Group 2: amax 0.75, shared_exp -3 (byte 124),
    elements 8 v. Group 3: all zero, the exponent clamps to its minimum (byte 0)."""
    #          v/2:  5 tie  5.5  7.5 sat  0.5  0.25 tie  0.75 tie  -1.25 tie  1.75 tie  2.5 tie  3.5 tie
    group1 = [10.0, 11.0, 15.0, 1.0, 0.5, 1.5, -2.5, 3.5, 5.0, 7.0,
              -0.0, 0.0, 0.2, 0.6, -6.0, 2.9, 9.0, 13.0, -0.3] + [0.0] * 13
    codes1 = [6, 7, 7, 1, 0, 2, 10, 4, 4, 6,
              8, 0, 0, 1, 13, 3, 6, 7, 8] + [0] * 13      # -0.0 and -0.3 (-> -0.15 -> -0) give 0x8
    group2 = [0.75, 0.1, -0.25] + [0.0] * 29               # x8: 6, 0.8 -> 1.0, -2
    codes2 = [7, 2, 12] + [0] * 29
    packed, scale = quantize(torch.tensor([group1 + group2 + [0.0] * 32]))
    assert scale.tolist() == [[128, 124, 0]]
    assert unpack_nibbles(packed)[0].tolist() == codes1 + codes2 + [0] * 32
    assert packed[0, :10].tolist() == [0x76, 0x17, 0x20, 0x4A, 0x64, 0x08, 0x10, 0x3D, 0x76, 0x08]
    assert packed[0, 16:18].tolist() == [0x27, 0x0C]


def random_codes(rows: int, cols: int, gen: torch.Generator, max_magnitude_code: bool) -> torch.Tensor:
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    if max_magnitude_code:  # one element per group at |code| 4 or 6, a random place and sign
        top = torch.randint(6, 8, (rows, cols // 32), generator=gen, dtype=torch.uint8)
        top += 8 * torch.randint(0, 2, top.shape, generator=gen, dtype=torch.uint8)
        place = torch.arange(0, cols, 32) + torch.randint(0, 32, (rows, cols // 32), generator=gen)
        codes.scatter_(1, place, top)
        keep = (codes % 8).unflatten(1, (-1, 32)).amax(-1)
        assert (keep >= 6).all()
    return codes


def test_encode_decode_bytes_exact_where_scale_is_unique():
    """OCP picks shared_exp = floor(log2 amax) - 2, so a group comes back byte for byte exactly when
    its largest magnitude is code 4 or 6 (amax / 2^e in [4, 8)). Scale bytes stop at 252: with
    byte 253, 4 * 2^126 = 2^128 is past fp32's range."""
    gen = torch.Generator().manual_seed(0)
    codes = random_codes(64, 128, gen, max_magnitude_code=True)
    scale = torch.randint(0, 253, (64, 4), generator=gen, dtype=torch.uint8)
    scale[0] = torch.tensor([0, 1, 251, 252], dtype=torch.uint8)      # the ends of the range
    packed = pack_nibbles(codes)
    w = dequantize(packed, scale)
    assert torch.isfinite(w).all()
    packed2, scale2 = quantize(w)
    assert torch.equal(scale2, scale)
    assert torch.equal(packed2, packed)


def test_encode_decode_values_exact_for_any_group():
    """A group whose amax is a smaller code gets a smaller scale (other bytes), but every value of the
    E2M1 grid times a power of two still comes back exactly, sign of zero included."""
    gen = torch.Generator().manual_seed(1)
    codes = random_codes(64, 128, gen, max_magnitude_code=False)
    scale = torch.randint(0, 253, (64, 4), generator=gen, dtype=torch.uint8)
    w = dequantize(pack_nibbles(codes), scale)
    w2 = dequantize(*quantize(w))
    assert torch.equal(w2, w) and torch.equal(torch.signbit(w2), torch.signbit(w))


def test_dequantize_matches_reference():
    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (8, 32), generator=gen, dtype=torch.uint8)
    scale = torch.randint(100, 150, (8, 2), generator=gen, dtype=torch.uint8)
    assert torch.equal(dequantize(packed, scale), reference_dequantize(packed, scale))


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_mxfp4_moe_matches_dense_per_token_loop(act):
    """k3::mxfp4_moe == dequantise every expert, then per token and per picked expert
    y += w * W2 act(W1 z, W3 z), with the activation written out here."""
    E, L, I, N, k = 5, 64, 32, 6, 2
    beta1, beta2 = 4.0, 25.0
    gen = torch.Generator().manual_seed(3)
    weights = {name: quantize(torch.randn(E, *shape, generator=gen) * shape[1] ** -0.5)
               for name, shape in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I)))}
    z = torch.randn(N, L, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=gen)
    y = torch.ops.k3.mxfp4_moe(z, idx, w, *weights["w1"], *weights["w3"], *weights["w2"], act, beta1, beta2)

    dense = {name: reference_dequantize(*pair) for name, pair in weights.items()}
    expected = torch.zeros(N, L)
    for n in range(N):
        for slot in range(k):
            e = idx[n, slot].item()
            g, u = dense["w1"][e] @ z[n], dense["w3"][e] @ z[n]
            if act == "situ":
                h = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * beta2 * torch.tanh(u / beta2)
            else:
                h = F.silu(g) * u
            expected[n] += w[n, slot] * (dense["w2"][e] @ h)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert not math.isclose(y.abs().max().item(), 0.0)
