"""`k3c inspect` (docs/model.md §6): the published K3 figures, k3-tiny counted by hand from the spec's tensor
tables, the one-layer-per-kind shortcut against a walk of the whole model, and bad --config input."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from k3c.cli import main
from k3c.model import K3Config, K3Model
from k3c.model.accounting import account

# docs/model.md §6, and §1 / §5 for the byte figures
K3_FIGURES = {
    "params_total": 2_779_484_478_208,
    "routed_experts": 82_432,
    "params_per_routed_expert": 33_030_144,
    "params_trunk": 55_569_242_880,
    "params_active_per_token": 104_189_614_848,
    "mxfp4_bytes_per_expert": 17_547_264,
    "mxfp4_bytes_per_token": 25_829_572_608,
    "kda_state_numbers": 108_527_616,
    "kda_state_bytes": 414 * 2**20,
    "mla_cache_numbers_per_token": 13_824,
    "mla_cache_bytes": 27 * 2**30,
    "crossover_tokens": 7_851,
}


def inspect(*args: str) -> dict:
    result = CliRunner().invoke(main, ["inspect", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_k3_figures_match_spec():
    f = inspect("--preset", "k3")
    assert {k: f[k] for k in K3_FIGURES} == K3_FIGURES
    assert f["mla_cache_over_kda_state"] == pytest.approx(134, abs=0.5)      # "134x larger"
    assert f["flops_per_token"]["weights"] == pytest.approx(208e9, rel=0.01)  # "~ 208 GFLOPs"
    # bytes as stored: bf16 trunk except the f32 tensors of §1 / §4, experts as packed + scale bytes
    trunk_numbers = 2_779_484_478_208 - 82_432 * 33_030_144
    f32_numbers = 69 * (3 * 12288 * 4 + 12288 + 128 + 128) + 92 * 896  # convs, dt_bias, A_log, o_norm; bias
    assert f["bytes_total"] == 2 * (trunk_numbers - f32_numbers) + 4 * f32_numbers + 82_432 * 17_547_264


def test_k3_tiny_by_hand():
    """k3-tiny: D 64, 6 layers (MLA at 1-indexed 4 and 6), vocab 512, KDA 2 heads x 32, MLA 2 heads,
    q_lora 32, kv_lora 32, nope 16, rope 8, v 16; 8 experts top-2, I = L = 32, 1 shared, dense 128."""
    f = inspect("--preset", "k3-tiny", "--context", "256")
    D, V, HK = 64, 512, 2 * 32
    kda = 3 * HK * D + 3 * HK * 4 + 32 * D + HK * 32 + HK + 32 + 2 * D + HK * D + 32 + D * HK
    mla = 32 * D + 32 + 2 * 24 * 32 + 40 * D + 32 + 2 * 32 * 32 + 2 * 16 * D + D * 2 * 16
    norms_attnres = 6 * D
    expert = 3 * 32 * 32
    moe = 8 * D + 8 + 32 * D + 32 + D * 32 + 3 * D * 32 + 8 * expert
    total = 4 * kda + 2 * mla + 6 * norms_attnres + 3 * D * 128 + 5 * moe + 2 * V * D + 3 * D
    assert f["params_per_routed_expert"] == expert
    assert f["routed_experts"] == 5 * 8
    assert f["params_total"] == total
    assert f["params_active_per_token"] == total - V * D - 5 * 8 * expert + 5 * 2 * expert
    assert f["mxfp4_bytes_per_expert"] == 3 * (32 * 16 + 32 * 1)
    assert f["kda_state_numbers"] == 4 * 2 * 32 * 32
    assert f["kda_conv_state_numbers"] == 4 * 3 * HK * 3
    assert f["mla_cache_numbers_per_token"] == 2 * (32 + 8)
    assert f["mla_cache_bytes"] == 2 * 80 * 256
    assert f["crossover_tokens"] == 103  # 8192 / 80 = 102.4
    assert f["flops_per_token"]["mla_attention"] == 2 * 2 * 2 * 256 * (2 * 32 + 8)


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-small"])
def test_one_layer_per_kind_equals_whole_model(preset):
    """account() builds one decoder layer per kind; a walk of the whole model gives the same count."""
    cfg = K3Config.preset(preset)
    with torch.device("meta"):
        model = K3Model(cfg)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    whole = sum(t.numel() * (2 if n.endswith("weight_packed") else 0 if n.endswith("weight_scale") else 1)
                for n, t in tensors)
    assert account(cfg)["params_total"] == whole
    if preset == "k3-small":
        assert 200e6 <= whole <= 400e6


def test_bad_config_dir_is_one_line_error(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(main, ["inspect", "--config", str(tmp_path / "missing")])
    assert missing.exit_code == 1
    assert missing.output.strip().splitlines() == [f"error: config: no config.json at {tmp_path / 'missing'}"]
    (tmp_path / "config.json").write_text("{not json")
    broken = runner.invoke(main, ["inspect", "--config", str(tmp_path)])
    assert broken.exit_code == 1
    [line] = broken.output.strip().splitlines()
    assert line.startswith("error: config:") and "not valid JSON" in line
