"""MXFP4 (OCP Microscaling): E2M1 elements, E8M0 scales, groups of 32 along the input dim (docs/model.md §5).

K3 layout (compressed-tensors ``mxfp4-pack-quantized``): ``weight_packed`` u8 [out, in/2] holds
element 2j in the low nibble and 2j+1 in the high nibble; ``weight_scale`` u8 [out, in/32] holds
the biased exponent X of 2^(X-127). gpt-oss layout: ``*_blocks`` u8 [E, rows, in/32, 16] and
``*_scales`` u8 [E, rows, in/32], the same bytes in another shape.
"""
from __future__ import annotations

import torch

GROUP = 32
SCALE_BIAS = 127
SCALE_NAN = 0xFF
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0


def e2m1_table(device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """u8 [..., n/2] -> codes u8 [..., n], low nibble first."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes u8 [..., n] (n even) -> u8 [..., n/2], element 2j in the low nibble."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """W[o, i] = E2M1[nibble(o, i)] * 2^(scale[o, i // 32] - 127)."""
    values = e2m1_table(packed.device)[unpack_nibbles(packed).long()]
    exps = scale.to(torch.float32) - SCALE_BIAS
    w = values.unflatten(-1, (-1, GROUP)) * torch.exp2(exps).unsqueeze(-1)
    return w.flatten(-2).to(dtype)


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Code of the nearest E2M1 value, ties to the even code (the one with mantissa bit 0).

    The magnitudes are sorted, so the nearest one is found by bucketing against the midpoints;
    a value exactly on a midpoint lands in both neighbouring buckets and takes the even code."""
    mags = e2m1_table(x.device)[:8]
    midpoints = (mags[1:] + mags[:-1]) / 2
    a = x.abs().float().clamp(max=E2M1_MAX).contiguous()
    lower = torch.bucketize(a, midpoints, right=False)   # on a midpoint: the smaller code
    upper = torch.bucketize(a, midpoints, right=True)    # on a midpoint: the larger code
    code = torch.where(lower % 2 == 0, lower, upper)
    sign = (x < 0) | ((x == 0) & torch.signbit(x))
    return (code + 8 * sign.long()).to(torch.uint8)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [..., in] -> (packed u8 [..., in/2], scale u8 [..., in/32]) per OCP §6.3:
    shared_exp = floor(log2(amax)) - 2; elements = v / 2^shared_exp rounded to nearest even, saturated."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}, got {w.shape[-1]}")
    groups = w.to(torch.float32).unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(dim=-1)
    shared = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -SCALE_BIAS))
    shared = shared.clamp(-SCALE_BIAS, SCALE_BIAS)
    codes = _round_to_e2m1(groups / torch.exp2(shared).unsqueeze(-1))
    scale = (shared + SCALE_BIAS).to(torch.uint8)
    return pack_nibbles(codes.flatten(-2)), scale


def from_gpt_oss(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss ``*_blocks`` u8 [..., rows, in/32, 16] -> K3 ``weight_packed`` u8 [..., rows, in/2].

    The same bytes in another shape: byte j of group g holds elements 32g + 2j (low nibble) and
    32g + 2j + 1 (high nibble) of a row, as in K3. ``*_scales`` u8 [..., rows, in/32] already are
    K3's ``weight_scale``. (transformers dequantises blocks to [..., rows, in], then transposes.)"""
    return blocks.flatten(-2)
