"""Quantile Balancing and the sign rule (docs/model.md §4): hand-derived updates on tiny cases, QB balancing
a skewed 896-expert router within 3 updates, and the `k3c balance-demo` command."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from k3c.cli import main
from k3c.model.balance import (SyntheticRouter, expert_load, load_cv, quantile_balance, route, sign_rule,
                               upper_quantile)

# n = 4 experts, k = 1, m = 5 tokens: expert 0 wins every token at zero bias.
SCORES = torch.tensor([[0.9, 0.8, 0.1, 0.2],
                       [0.7, 0.6, 0.3, 0.1],
                       [0.8, 0.2, 0.5, 0.4],
                       [0.6, 0.5, 0.4, 0.3],
                       [0.9, 0.3, 0.2, 0.7]])


@pytest.mark.parametrize("bias, expected", [
    # alpha (2nd biased score) = .8 .6 .5 .5 .7; the 0.75-quantile of 5 margins is the 2nd largest:
    # expert 0: s - alpha = .1 .1 .3 .1 .2 -> .2;  1: 0 0 -.3 0 -.4 -> 0;  2: -.7 -.3 0 -.1 -.5 -> -.1;
    # 3: -.6 -.5 -.1 -.2 0 -> -.1.  b_hat = (-.2, 0, .1, .1), mean 0.
    ([0.0, 0.0, 0.0, 0.0], [-0.2, 0.0, 0.1, 0.1]),
    # bias +.35 on expert 3 moves alpha to .8 .6 .75 .6 .9 (bias enters only through alpha):
    # 2nd largest of s - alpha: .1, 0, -.25, -.3 -> b_hat = (-.1, 0, .25, .3), mean .1125.
    ([0.0, 0.0, 0.0, 0.35], [-0.2125, -0.1125, 0.1375, 0.1875]),
])
def test_quantile_balance_by_hand(bias, expected):
    new = quantile_balance(SCORES, torch.tensor(bias), k=1)
    torch.testing.assert_close(new, torch.tensor(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("m, frac", [(1001, 16 / 896), (16384, 16 / 896), (37, 0.3), (5, 0.25)])
def test_upper_quantile_equals_torch_quantile(m, frac):
    x = torch.randn(m, 7, generator=torch.Generator().manual_seed(m))
    torch.testing.assert_close(upper_quantile(x, frac), torch.quantile(x, 1 - frac, dim=0))


def test_sign_rule_and_cv_by_hand():
    load = torch.tensor([3.0, 1.0, 0.0, 0.0])  # mean 1, variance (4 + 0 + 1 + 1) / 4
    assert load_cv(load) == pytest.approx(1.5 ** 0.5)
    new = sign_rule(load, torch.tensor([0.5, 0.0, 0.0, -0.5]), gamma=0.1)
    torch.testing.assert_close(new, torch.tensor([0.4, 0.0, 0.1, -0.4]))


def test_quantile_balancing_evens_a_skewed_router_in_3_updates():
    router = SyntheticRouter(seed=0)
    bias = torch.zeros(router.n)
    cvs = []
    for step in range(4):
        s = router.scores(16384, step)
        cvs.append(load_cv(expert_load(route(s, bias, router.k), router.n)))
        bias = quantile_balance(s, bias, router.k)
    assert cvs[0] > 2.0            # strongly skewed at zero bias
    assert cvs[3] <= 0.10          # after 3 updates, on a batch no update has seen


def test_balance_demo_prints_every_rule():
    result = CliRunner().invoke(main, ["balance-demo", "--steps", "3", "--tokens", "4096"])
    assert result.exit_code == 0, result.output
    for rule in ("QB", "γ=0.0001", "γ=0.001", "γ=0.01", "γ=0.1"):
        assert rule in result.output
    rows = [line.split("│")[1].strip() for line in result.output.splitlines() if line.startswith("│")]
    assert rows == ["0", "1", "2", "3"]
