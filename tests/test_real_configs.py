"""The config.json files Kimi K3 and Kimi-Linear-48B were released with (verbatim copies in
../shared/real/, beside the repository): read as published, with the published parameter counts,
and the key policy on edited copies: keys that cannot change the math ignored, a key k3c has never
heard of said in one line and ignored outside the math-bearing groups, refused inside them, every
problem of a file in one message."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3c.cli import main

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "real"
pytestmark = pytest.mark.skipif(not REAL.is_dir(), reason=f"no released config files at {REAL}")
K3, KIMI_LINEAR = REAL / "kimi-k3", REAL / "kimi-linear-48b-a3b-instruct"


def inspect(config: Path):
    r = CliRunner().invoke(main, ["inspect", "--config", str(config), "--json"])
    return r, (json.loads(r.stdout) if r.exit_code == 0 else None)


def edited(tmp_path: Path, source: Path, edit) -> Path:
    raw = json.loads((source / "config.json").read_text())
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("config, total, active", [(K3, 2_779_484_478_208, 104_189_614_848),
                                                   (KIMI_LINEAR, 49_122_681_728, None)], ids=["kimi-k3", "kimi-linear-48b"])
def test_released_config_is_read_with_the_published_figures(config, total, active):
    r, figures = inspect(config)
    assert r.exit_code == 0, r.output
    assert figures["params_total"] == total
    assert active is None or figures["params_active_per_token"] == active
    assert r.stderr == ""   # every key of the release is known: nothing to say


def test_every_generic_transformers_key_is_known():
    """What transformers' PretrainedConfig writes into every config.json (the oracle for the list)."""
    transformers = pytest.importorskip("transformers")
    from k3c.model.config_keys import IGNORED

    assert set(transformers.PretrainedConfig().to_dict()) - IGNORED == set()


def test_unknown_keys_outside_the_math_are_said_once_and_ignored(tmp_path):
    def edit(raw):
        raw["wrapper_extra"] = 1
        raw["text_config"]["some_new_flag"] = True

    r, figures = inspect(edited(tmp_path, K3, edit))
    assert r.exit_code == 0 and figures["params_total"] == 2_779_484_478_208, r.output
    assert r.stderr.splitlines() == [
        "note: config: ignored keys k3c does not know (outside the model's math): wrapper_extra, some_new_flag"]


def test_unknown_keys_in_math_groups_are_refused_with_every_problem_in_one_line(tmp_path):
    def edit(raw):
        text = raw["text_config"]
        text["linear_attn_config"]["gate_kind"] = "new"
        text["quantization_config"]["config_groups"]["group_0"]["weights"]["codebook"] = [1]
        text["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8}
        text["mla_use_nope"] = False

    r = CliRunner().invoke(main, ["inspect", "--config", str(edited(tmp_path, K3, edit))])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    for field in ("'linear_attn_config.gate_kind'", "'quantization_config.config_groups.group_0.weights.codebook'",
                  "'quantization_config.config_groups.group_0.input_activations'", "'mla_use_nope'"):
        assert field in lines[0], lines[0]


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_transformers_view_of_kimi_linear_is_read_with_the_same_figures(tmp_path):
    """What transformers' KimiLinearConfig writes for the release (layer_types, mlp_layer_types,
    linear_* widths, rope_parameters, ... beside or instead of the file's own spelling)."""
    transformers = pytest.importorskip("transformers")
    transformers.KimiLinearConfig.from_pretrained(KIMI_LINEAR).save_pretrained(tmp_path)
    r, figures = inspect(tmp_path)
    assert r.exit_code == 0 and figures["params_total"] == 49_122_681_728, r.output
    assert r.stderr == ""


def test_transformers_view_of_kimi_k3_is_read_with_the_same_figures(tmp_path):
    """transformers' KimiK3Config view of the release (SOURCES.md beside the file): a top-level copy
    of quantization_config, text_config.head_dim 74, rope_parameters and rope_theta, and no
    generation defaults."""
    generation = ("do_sample", "num_beams", "temperature", "top_k", "top_p", "repetition_penalty", "max_length",
                  "min_length", "length_penalty", "no_repeat_ngram_size", "num_return_sequences", "early_stopping")

    def view(raw):
        text = raw["text_config"]
        raw["quantization_config"] = json.loads(json.dumps(text["quantization_config"]))
        text.update(head_dim=74, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        for key in generation:
            text.pop(key, None)

    r, figures = inspect(edited(tmp_path, K3, view))
    assert r.exit_code == 0, r.output
    assert (figures["params_total"], figures["params_active_per_token"]) == (2_779_484_478_208, 104_189_614_848)
    assert r.stderr == ""
