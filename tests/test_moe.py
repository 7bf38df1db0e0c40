"""SiTU-GLU and the sigmoid router (docs/model.md §4)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3c.model import K3Config
from k3c.model.moe import route, top_k_indices
from k3c.ops.numerics import situ

BETA1, BETA2 = 4.0, 25.0  # activation_situ_beta, activation_situ_linear_beta


def test_situ_hand_value():
    g, u = 2.0, 10.0
    expected = (BETA1 * math.tanh(g / BETA1) / (1 + math.exp(-g))) * (BETA2 * math.tanh(u / BETA2))
    assert situ(torch.tensor(g), torch.tensor(u), BETA1, BETA2).item() == pytest.approx(expected, rel=1e-6)


def test_situ_bounded_everywhere():
    """|SiTU| <= beta1 * beta2 = 100, including huge and infinite inputs, and the bound is reached."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 1.0, 10.0, 1e3, 1e8, 1e30])
    g = (torch.randn(6, 4096, generator=gen) * scales[:, None]).flatten()
    u = (torch.randn(6, 4096, generator=gen) * scales[:, None]).flatten()
    extremes = torch.tensor([float("inf"), -float("inf"), 3e38, -3e38, 0.0])
    g = torch.cat((g, extremes.repeat_interleave(5)))
    u = torch.cat((u, extremes.repeat(5)))
    out = situ(g, u, BETA1, BETA2)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= BETA1 * BETA2
    assert situ(torch.tensor(1e30), torch.tensor(1e30), BETA1, BETA2).item() == BETA1 * BETA2


def test_situ_tends_to_swiglu():
    gen = torch.Generator().manual_seed(1)
    g, u = torch.randn(1000, generator=gen) * 3, torch.randn(1000, generator=gen) * 3
    swiglu = F.silu(g) * u
    errors = [(situ(g, u, b, b) - swiglu).abs().max().item() for b in (10.0, 100.0, 1e3)]
    assert errors[0] > errors[1] > errors[2]
    # b tanh(x / b) = x (1 - x^2 / (3 b^2) + ...): at b = 1e4 and |x| <~ 12 that is < 5e-7 relative
    torch.testing.assert_close(situ(g, u, 1e4, 1e4), swiglu, rtol=1e-6, atol=1e-6)


def test_router_bias_picks_but_never_weighs():
    """Hand example: 4 experts, top-2. Scores s = sigmoid(logits); the bias moves expert 3 into the
    top-2, and the weights are the unbiased scores of the picked experts, renormalised."""
    cfg = K3Config(num_experts=4, num_experts_per_token=2, hidden_size=4, routed_scaling_factor=2.0,
                   quantization_config=None)
    x = torch.ones(1, 4)
    gate_weight = torch.diag(torch.tensor([2.0, 1.0, 0.0, -1.0]))     # logits = [2, 1, 0, -1]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9])                         # s3 + 0.9 = 1.169 > s1 = 0.731
    idx, w = route(cfg, x, gate_weight, bias)
    s = torch.sigmoid(torch.tensor([2.0, 1.0, 0.0, -1.0]))
    assert sorted(idx[0].tolist()) == [0, 3]
    expected = {0: s[0] / (s[0] + s[3]) * 2.0, 3: s[3] / (s[0] + s[3]) * 2.0}
    for e, weight in zip(idx[0].tolist(), w[0]):
        assert weight.item() == pytest.approx(expected[e].item(), rel=1e-6)


def test_router_single_expert_is_not_renormalised():
    cfg = K3Config(num_experts=4, num_experts_per_token=1, hidden_size=4, quantization_config=None)
    idx, w = route(cfg, torch.tensor([[0.5, 0, 0, 0]]), torch.eye(4), torch.zeros(4))
    assert idx.tolist() == [[0]] and w.item() == pytest.approx(torch.sigmoid(torch.tensor(0.5)).item())


@pytest.mark.parametrize("E,k", [(8, 2), (32, 4), (896, 16)])
def test_top_k_equals_torch_topk(E, k):
    torch.manual_seed(E)
    scores = torch.randn(64, E)
    assert torch.equal(top_k_indices(scores, k), torch.topk(scores, k).indices)


def test_top_k_ties_and_nan_as_argmax_rounds():
    """Ties go to the first index and a NaN counts as the largest score, as torch.argmax has it."""
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 2.0, float("nan"), 5.0],
                           [float("-inf")] * 4])
    want, s = [], scores.clone()
    for _ in range(3):
        i = s.argmax(-1, keepdim=True)
        want.append(i)
        s = s.scatter(-1, i, float("-inf"))
    assert torch.equal(top_k_indices(scores, 3), torch.cat(want, -1))
