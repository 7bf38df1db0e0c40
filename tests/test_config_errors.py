"""Config and checkpoint input k3c must refuse in one line naming the problem:
fields of the wrong JSON type, values of keys k3c does not implement, quantization that disagrees with
what is stored, files that are not the checkpoint, paths out of it, broken headers, NaN weights."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from release_layouts import KIMI_LINEAR_48B, k3_release_config
from safetensors.torch import load_file, save_file
from test_cli_errors import assert_one_line_error, k3c_script

from k3c.cli import main
from k3c.errors import K3Error
from k3c.model import K3Config, K3Model
from k3c.model.checkpoint import checkpoint_files, load_checkpoint
from k3c.model.convert import save_checkpoint
from k3c.model.init import init_weights

SINGLE = "model.safetensors"


def test_configs_accept_the_activations_the_ops_compute():
    from k3c.model.config_keys import ACTIVATIONS as CONFIG_ACTIVATIONS
    from k3c.ops.numerics import ACTIVATIONS
    assert CONFIG_ACTIVATIONS == ACTIVATIONS


def write_config(directory: Path, raw: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def edited(raw: dict, path: str, value) -> dict:
    raw = json.loads(json.dumps(raw))
    *parents, leaf = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    node[leaf] = value
    return raw


def k3(path: str, value) -> dict:
    return edited(k3_release_config(), "text_config." + path, value)


def inspect_error(tmp_path: Path, raw: dict) -> str:
    r = CliRunner().invoke(main, ["inspect", "--config", str(write_config(tmp_path / "cfg", raw))])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


# ---- config fields ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, words", [
    (k3("hidden_size", True), ["'hidden_size'", "an integer", "true"]),
    (k3("linear_attn_config.gate_lower_bound", "abc"), ["'linear_attn_config.gate_lower_bound'", "a number"]),
    (k3("q_lora_rank", -5), ["'q_lora_rank'", "positive", "-5"]),
    (k3("quantization_config", "x"), ["'quantization_config'", "an object", '"x"']),
    (k3("rms_norm_eps", "x"), ["'rms_norm_eps'", "a number"]),
    (k3("num_experts", 8.5), ["'num_experts'", "an integer"]),
    (k3("linear_attn_config.full_attn_layers", "4,8"), ["full_attn_layers", "a list of integers"]),
    (edited(k3_release_config(), "text_config", "x"), ["'text_config'", "an object"]),
    (edited(KIMI_LINEAR_48B, "num_hidden_layers", True), ["'num_hidden_layers'"]),
    (edited(KIMI_LINEAR_48B, "linear_attn_config.num_heads", "32"), ["'linear_attn_config.num_heads'", "an integer"]),
], ids=["hidden_size-true", "gate_lower_bound-str", "q_lora_rank-negative", "quantization_config-str",
        "rms_norm_eps-str", "num_experts-float", "full_attn_layers-str", "text_config-str",
        "kimi-linear-layers-true", "kimi-linear-heads-str"])
def test_wrong_field_type_names_the_field_and_type(tmp_path, raw, words):
    line = inspect_error(tmp_path, raw)
    assert all(w in line for w in words), line


@pytest.mark.parametrize("raw, field", [
    (k3("mla_use_nope", False), "mla_use_nope"),
    (k3("latent_moe_use_norm", False), "latent_moe_use_norm"),
    (k3("num_nextn_predict_layers", 1), "num_nextn_predict_layers"),
    (k3("topk_method", "greedy"), "topk_method"),
    (edited(k3("num_expert_group", 8), "text_config.topk_group", 4), "use_grouped_topk"),
    (k3("moe_router_activation_func", "softmax"), "moe_router_activation_func"),
    (k3("attention_bias", True), "attention_bias"),
    (k3("moe_layer_freq", 2), "moe_layer_freq"),
    (k3("hidden_act", "gelu"), "hidden_act"),
    (k3("linear_attn_config.some_new_knob", 1), "linear_attn_config.some_new_knob"),
    (edited(k3_release_config(), "tie_word_embeddings", True), "tie_word_embeddings"),
    (k3("quantization_config.config_groups.group_0.weights.group_size", 64), "group_size"),
    (k3("quantization_config.format", "nvfp4-pack-quantized"), "quantization_config.format"),
    (k3("quantization_config.quant_method", "gptq"), "quantization_config.quant_method"),
    (edited(KIMI_LINEAR_48B, "mla_use_output_gate", True), "mla_use_output_gate"),
    (edited(KIMI_LINEAR_48B, "num_nextn_predict_layers", 2), "num_nextn_predict_layers"),
    (edited(KIMI_LINEAR_48B, "linear_attn_config.gate_lower_bound", -5.0), "linear_attn_config.gate_lower_bound"),
])
def test_unimplemented_value_is_refused_not_ignored(tmp_path, raw, field):
    line = inspect_error(tmp_path, raw)
    assert f"'{field}'" in line or f"'quantization_config.config_groups.group_0.weights.{field}'" in line, line


def test_quantization_config_is_read_wherever_it_sits():
    raw = k3_release_config()
    quant = raw["text_config"].pop("quantization_config")
    top = K3Config.from_dict({**raw, "quantization_config": quant})
    assert top.experts_mxfp4 and top.quantization_ignores("model.layers.3.self_attn.q_proj.weight_packed")
    assert not top.quantization_ignores("model.layers.3.block_sparse_moe.experts.7.w1.weight_packed")
    assert not K3Config.from_dict(raw).experts_mxfp4
    with pytest.raises(K3Error, match="disagree"):
        K3Config.from_dict({**raw, "quantization_config": quant, "text_config": {
            **raw["text_config"], "quantization_config": {**quant, "ignore": []}}})


def test_wrong_type_through_the_console_script(tmp_path):
    d = write_config(tmp_path / "cfg", k3("hidden_size", True))
    assert_one_line_error(*k3c_script("inspect", "--config", d), "'hidden_size'", "an integer")
    assert_one_line_error(*k3c_script("compile", "--checkpoint", d, "-o", tmp_path / "out"), "'hidden_size'")


# ---- which files a checkpoint is ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    model = init_weights(K3Model(K3Config.preset("k3-tiny")), seed=3)
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "k3-tiny")


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


def edit(directory: Path, change) -> None:
    tensors = load_file(directory / SINGLE)
    change(tensors)
    save_file(tensors, directory / SINGLE, metadata={"format": "pt"})


def shard(directory: Path, second: set[str], extra: dict | None = None) -> None:
    """Split model.safetensors into two shards (``second`` in the second) with an index;
    ``extra`` tensors are written into the second shard but left out of the index."""
    tensors = load_file(directory / SINGLE)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file({k: v for k, v in tensors.items() if k not in second}, directory / names[0])
    save_file({**{k: tensors[k] for k in second}, **(extra or {})}, directory / names[1])
    (directory / SINGLE).unlink()
    weight_map = {k: names[k in second] for k in tensors}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_stray_safetensors_file_is_never_read(ckpt, tiny_ckpt):
    save_file({"lm_head.weight": torch.zeros(512, 64, dtype=torch.bfloat16)}, ckpt / "aa-backup.safetensors")
    assert checkpoint_files(ckpt) == [ckpt.resolve() / SINGLE]
    assert torch.equal(load_checkpoint(ckpt).lm_head.weight, load_checkpoint(tiny_ckpt).lm_head.weight)


@pytest.mark.slow
def test_session_loads_only_the_checkpoint_files(tiny_bundle, tmp_path):
    """The runtime reads the files ``checkpoint_files`` names: a stray file with another lm_head
    changes nothing (or the bundle is refused as changed, never run on it)."""
    from k3c.artifacts.bundle import open_bundle
    from k3c.runtimes.session import Session
    copy = Path(shutil.copytree(tiny_bundle.root, tmp_path / "bundle"))
    save_file({"lm_head.weight": torch.zeros(512, 64, dtype=torch.bfloat16)},
              copy / "checkpoint" / "aa-backup.safetensors")
    try:
        session = Session(open_bundle(copy))
    except K3Error:
        return
    ref = np.load(tiny_bundle.reference_path)
    logits, _ = session.prefill(ref["prompt_ids"])
    assert np.abs(logits - ref["prefill_logits"]).max() < 1e-4


def test_a_tensor_in_two_shards_is_refused(ckpt):
    norm = load_file(ckpt / SINGLE)["model.norm.weight"]
    shard(ckpt, {"lm_head.weight"}, extra={"model.norm.weight": torch.zeros_like(norm)})
    with pytest.raises(K3Error, match=r"'model.norm.weight' is also stored in model-00001-of-00002"):
        load_checkpoint(ckpt)


def test_index_shards_must_stay_inside_the_directory(ckpt, tmp_path):
    shard(ckpt, {"lm_head.weight"})
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(ckpt / "model-00002-of-00002.safetensors", outside / "evil.safetensors")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../outside/evil.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(K3Error, match=r"'lm_head.weight' is in shard \.\./outside/evil.safetensors, outside"):
        load_checkpoint(ckpt)
    with pytest.raises(K3Error, match="outside the checkpoint directory"):
        checkpoint_files(ckpt)


def test_weight_map_as_a_list_is_one_line(ckpt):
    shard(ckpt, {"lm_head.weight"})
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = sorted(index["weight_map"].items())
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(*k3c_script("inspect", "--config", ckpt), "weight_map", "object")


def test_header_of_the_wrong_structure_is_one_line(ckpt):
    header = b'[{"dtype": "F32"}, 2]     '
    (ckpt / SINGLE).write_bytes(len(header).to_bytes(8, "little") + header)
    code, err = k3c_script("inspect", "--config", ckpt)
    assert_one_line_error(code, err, SINGLE, "unreadable safetensors file")


def test_symlink_loop_checkpoint_is_one_line(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    assert_one_line_error(*k3c_script("compile", "--checkpoint", loop, "-o", tmp_path / "out"), "symlink loop")
    with pytest.raises(K3Error, match="symlink loop"):
        checkpoint_files(loop)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_name_the_first_bad_tensor(ckpt, bad):
    name = "model.layers.1.self_attn.q_proj.weight"

    def poison(t):
        t[name][3, 5] = bad
    edit(ckpt, poison)
    with pytest.raises(K3Error, match=rf"tensor '{name}' holds NaN or Inf"):
        load_checkpoint(ckpt)


@pytest.mark.slow
def test_non_finite_weights_through_compile(ckpt, tmp_path):
    name = "model.layers.1.self_attn.q_proj.weight"
    edit(ckpt, lambda t: t[name].fill_(float("nan")))
    assert_one_line_error(*k3c_script("compile", "--checkpoint", ckpt, "-o", tmp_path / "out"), name, "NaN")


# ---- quantization: what is stored must be what the config says -----------------------------------
W1 = "model.layers.2.block_sparse_moe.experts.3.w1"


def float_expert(t):
    t.pop(W1 + ".weight_packed"), t.pop(W1 + ".weight_scale")
    t[W1 + ".weight"] = torch.zeros(32, 32, dtype=torch.bfloat16)


def packed_attention(t):
    q = "model.layers.1.self_attn.q_proj"
    t.pop(q + ".weight")
    t[q + ".weight_packed"] = torch.zeros(64, 32, dtype=torch.uint8)
    t[q + ".weight_scale"] = torch.full((64, 2), 127, dtype=torch.uint8)


@pytest.mark.parametrize("change, quantized, words", [
    (float_expert, True, [W1 + ".weight", "float routed expert", "mxfp4-pack-quantized"]),
    (packed_attention, True, ["self_attn.q_proj.weight_packed", "ignore names it"]),
    (lambda t: None, False, ["block_sparse_moe.experts.", "is stored MXFP4", "no quantization_config"]),
], ids=["float-expert-config-mxfp4", "packed-but-ignored", "packed-without-config"])
def test_stored_quantization_must_match_the_config(ckpt, change, quantized, words):
    edit(ckpt, change)
    if not quantized:
        raw = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**raw, "quantization_config": None}))
    with pytest.raises(K3Error) as e:
        load_checkpoint(ckpt)
    assert all(w in str(e.value) for w in words), str(e.value)
