"""Checkpoints as released (docs/model.md §8): the K3 release layout, Kimi-Linear-48B-A3B's Hub layout and
transformers' save_pretrained, through inspect, load, compile and validate.

The published configs are written here from docs/model.md §0 / §8 (release_layouts.py). The counts they must
give are the published ones; the tiny checkpoints are checked against the plain k3c layout of the same
weights (bit for bit) and against what their safetensors headers hold.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from release_layouts import KIMI_LINEAR_48B, k3_release_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_kimi_linear import tiny_config
from transformers import KimiLinearForCausalLM

from k3c.cli import main
from k3c.model import K3Config, checkpoint
from k3c.model.checkpoint import load_checkpoint

K3C = Path(sys.executable).with_name("k3c")
VISION = {"vision_tower.blocks.0.attn.qkv.weight": torch.ones(24, 8, dtype=torch.bfloat16),
          "vision_tower.patch_embed.proj.bias": torch.zeros(8, dtype=torch.bfloat16),
          "mm_projector.proj.0.weight": torch.ones(64, 8, dtype=torch.bfloat16)}


def inspect_json(directory: Path) -> dict:
    r = CliRunner().invoke(main, ["inspect", "--config", str(directory), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def write_config(directory: Path, raw: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


# ---- inspect on the published configs ------------------------------------------------------------
def test_k3_release_config_gives_the_published_figures(tmp_path):
    f = inspect_json(write_config(tmp_path, k3_release_config()))
    assert f["params_total"] == 2_779_484_478_208
    assert f["params_active_per_token"] == 104_189_614_848
    # bytes in the published dtypes (docs/model.md §8): bf16 trunk; fp32 A_log [128], dt_bias, convs, o_norm
    # (and the router bias, docs/model.md §4); MXFP4 experts as packed + scale bytes
    experts = 92 * 896
    f32 = 69 * (3 * 12288 * 4 + 12288 + 128 + 128) + 92 * 896
    trunk = 2_779_484_478_208 - experts * 33_030_144
    assert f["bytes_total"] == 2 * (trunk - f32) + 4 * f32 + experts * 17_547_264


def test_kimi_linear_48b_config_counts_what_the_checkpoint_stores(tmp_path):
    f = inspect_json(write_config(tmp_path, KIMI_LINEAR_48B))
    assert f["params_total"] == 49_122_681_728          # docs/model.md §8: A_log as its 32 stored values
    kda_layers, H, K = 20, 32, 128
    f32 = kda_layers * (H + H * K)                      # A_log, dt_bias; the rest bf16 (docs/model.md §8)
    assert f["bytes_total"] == 2 * (49_122_681_728 - f32) + 4 * f32


@pytest.mark.parametrize("field, value", [("num_experts", 1_000_000), ("num_hidden_layers", 1_000_000)])
def test_huge_configs_are_inspected_from_shapes_and_fail_compile_at_once(tmp_path, field, value):
    """inspect reads shapes only; compile --checkpoint of the config alone (no weights) fails in one
    line at once: it reads the safetensors headers before building anything."""
    text = json.loads(json.dumps(k3_release_config()["text_config"]))
    text.update({"hidden_size": 64, "vocab_size": 512, "intermediate_size": 128, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                 "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32,
                 "routed_expert_hidden_size": 32, "num_experts": 8, "num_experts_per_token": 2, field: value})
    text["linear_attn_config"].update(num_heads=2, head_dim=32)
    if field == "num_hidden_layers":
        text["linear_attn_config"].update(full_attn_layers=[value], kda_layers=list(range(1, value)))
    d = write_config(tmp_path / "huge", k3_release_config(text))
    script = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
              f"r = subprocess.run([{str(K3C)!r}, 'inspect', '--config', {str(d)!r}, '--json'], "
              "capture_output=True, text=True); "
              "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode); "
              "print(r.stderr, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    seconds, peak_kib, code = r.stdout.split()
    assert code == "0", r.stderr
    assert float(seconds) < 60 and int(peak_kib) < 2 * 2**20, (seconds, peak_kib)  # under 2 GiB
    t = time.perf_counter()
    c = subprocess.run([str(K3C), "compile", "--checkpoint", str(d), "-o", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=300)
    lines = c.stderr.strip().splitlines()
    assert c.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), c.stderr
    assert "no model.safetensors" in lines[0]
    assert time.perf_counter() - t < 120
    assert not (tmp_path / "b").exists()


# ---- the K3 release layout -----------------------------------------------------------------------
def release_layout(plain: Path, out: Path) -> Path:
    """A k3c checkpoint rewritten as the K3 release (docs/model.md §8): the wrapper config, every text tensor
    under ``language_model.``, vision tower and projector tensors in the last of two shards."""
    cfg = K3Config.from_hf(plain)
    text = {**cfg.to_dict(), "model_type": "kimi_linear", "num_key_value_heads": cfg.num_attention_heads,
            "topk_method": "noaux_tc", "use_grouped_topk": True, "num_nextn_predict_layers": 0}
    write_config(out, k3_release_config(text))
    tensors = {"language_model." + k: v for k, v in load_file(plain / "model.safetensors").items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": dict((k, tensors[k]) for k in names[: len(names) // 2]),
              "model-00002-of-00002.safetensors": {**{k: tensors[k] for k in names[len(names) // 2:]}, **VISION}}
    for shard, part in shards.items():
        save_file(part, out / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, part in shards.items() for k in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.fixture(scope="module")
def release_dir(tiny_bundle, tmp_path_factory) -> Path:
    return release_layout(tiny_bundle.checkpoint_dir, tmp_path_factory.mktemp("release") / "k3-tiny")


@pytest.mark.slow
def test_release_layout_reads_as_the_plain_checkpoint(release_dir, tiny_bundle, capfd, monkeypatch):
    monkeypatch.setattr(checkpoint, "_SKIP_LOGGED", set())
    got, want = load_checkpoint(release_dir), load_checkpoint(tiny_bundle.checkpoint_dir)
    assert got.cfg.layout == "k3_release" and got.cfg.hash == want.cfg.hash
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    skipped = [line for line in capfd.readouterr().err.splitlines() if "vision_tower" in line]
    assert len(skipped) == 1 and "skipped 3 vision_tower / mm_projector tensors" in skipped[0]


@pytest.mark.slow
def test_release_layout_compiles_validates_and_gives_the_plain_logits(release_dir, tiny_bundle, k3c_cache,
                                                                       tmp_path, monkeypatch):
    """Same config and stored dtypes as tiny_bundle: the compiled module comes from its cache."""
    from k3c.interface.build import build_bundle
    from k3c.compiler.targets import parse_target
    from k3c.interface.validate import validate
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    lines = []
    bundle = build_bundle(tmp_path / "release-cpu", parse_target("cpu"), checkpoint=release_dir,
                          max_prompt=tiny_bundle.manifest.max_prompt,
                          log=lines.append)
    assert any("compiled module found in cache" in line for line in lines), lines
    assert bundle.checkpoint_dir == release_dir.resolve() and not (bundle.root / "checkpoint").exists()
    steps, _ = validate(bundle)
    assert all(s.passed for s in steps), steps
    got, want = np.load(bundle.reference_path), np.load(tiny_bundle.reference_path)
    for key in ("prompt_ids", "prefill_logits", "decode_ids", "decode_logits"):
        assert np.array_equal(got[key], want[key]), key
    from k3c.runtimes.session import Session
    compiled = [Session(b).prefill(want["prompt_ids"])[0] for b in (bundle, tiny_bundle)]
    assert np.array_equal(*compiled)              # the same module on the same weights, packed from either layout


def test_quantize_keeps_the_vision_tensors_of_the_release(tmp_path):
    from k3c.model import K3Model
    from k3c.model.convert import quantize_checkpoint, save_checkpoint
    from k3c.model.init import init_weights
    tiny = K3Config.preset("k3-tiny")
    plain = save_checkpoint(init_weights(K3Model(type(tiny)(**{**tiny.to_dict(), "quantization_config": None})), 1),
                            tmp_path / "plain")
    release = release_layout(plain, tmp_path / "release")
    report = quantize_checkpoint(release, tmp_path / "quantized")
    assert len(report) == 5 * 8 * 3   # every float expert matrix of the 5 MoE layers
    last = load_file(tmp_path / "quantized" / "model-00002-of-00002.safetensors")
    assert all(torch.equal(last[k], v) for k, v in VISION.items())
    quantize_checkpoint(plain, tmp_path / "plain-quantized")
    got = load_checkpoint(tmp_path / "quantized").state_dict()
    want = load_checkpoint(tmp_path / "plain-quantized").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


# ---- Kimi Linear: transformers' save_pretrained and the Hub layout --------------------------------
@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory) -> Path:
    """transformers 5.24 KimiLinearForCausalLM(cfg).save_pretrained, weights redrawn N(0, 1/fan_in)
    so every layer contributes (see test_kimi_linear.py)."""
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(tiny_config()).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias", "norm.weight")):
                t.copy_(torch.randn(t.shape, generator=gen) * (1.0 if "embed" in name else t.shape[-1] ** -0.5))
    path = tmp_path_factory.mktemp("kimi_linear") / "hf"
    model.save_pretrained(path)
    return path


def hub_layout(saved: Path, out: Path) -> Path:
    """transformers' checkpoint as Kimi-Linear-48B-A3B stores it (docs/model.md §8): A_log [1, 1, H, 1]; conv
    weights, o_norm and the router bias in bf16; the dense layer under ``mlp.``."""
    out.mkdir(parents=True)
    (out / "config.json").write_text((saved / "config.json").read_text())
    tensors = {}
    for k, t in load_file(saved / "model.safetensors").items():
        if k.endswith(("conv1d.weight", "o_norm.weight", "e_score_correction_bias")):
            t = t.to(torch.bfloat16)
        tensors[k.replace("layers.0.block_sparse_moe.", "layers.0.mlp.")] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_hub_layout_loads_as_the_transformers_checkpoint_rounded(hf_saved, tmp_path):
    hub = load_checkpoint(hub_layout(hf_saved, tmp_path / "hub")).state_dict()
    ref = load_checkpoint(hf_saved).state_dict()
    assert hub.keys() == ref.keys()
    for k in ref:
        rounded = k.endswith(("conv1d.weight", "o_norm.weight", "e_score_correction_bias"))
        want = ref[k].to(torch.bfloat16).float() if rounded else ref[k]
        assert torch.equal(hub[k], want), k


def test_inspect_of_a_checkpoint_counts_its_headers(hf_saved, tmp_path):
    hub = hub_layout(hf_saved, tmp_path / "hub")
    with safe_open(hub / "model.safetensors", "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]
    data_bytes = (hub / "model.safetensors").stat().st_size - 8 - int.from_bytes(
        (hub / "model.safetensors").read_bytes()[:8], "little")
    f = inspect_json(hub)
    assert f["params_total"] == sum(int(np.prod(s)) for s in shapes)
    assert f["bytes_total"] == data_bytes


@pytest.mark.slow
def test_transformers_checkpoint_compiles_validates_and_gives_transformers_logits(hf_saved, k3c_cache, tmp_path,
                                                                                 monkeypatch):
    """Packed as transformers saved it (no converted copy in the bundle); the compiled logits match
    transformers' own KimiLinearForCausalLM on the same directory."""
    from k3c.interface.build import build_bundle
    from k3c.compiler.targets import parse_target
    from k3c.interface.validate import TOLERANCE, validate
    from k3c.runtimes.session import Session
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    bundle = build_bundle(tmp_path / "kl-cpu", parse_target("cpu"), checkpoint=hf_saved, max_prompt=32,
                          log=lambda _: None)
    assert bundle.manifest.config["model_type"] == "kimi_linear"
    assert bundle.checkpoint_dir == hf_saved.resolve() and not (bundle.root / "checkpoint").exists()
    steps, _ = validate(bundle)
    assert all(s.passed for s in steps), steps
    ref = np.load(bundle.reference_path)
    assert ref["prefill_logits"].std() > 0.5   # the weights are not degenerate
    hf = KimiLinearForCausalLM.from_pretrained(hf_saved).float().eval()
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ref["prompt_ids"])[None], use_cache=False).logits[0].numpy()
    got, _ = Session(bundle).prefill(ref["prompt_ids"])
    # compiled vs PyTorch (TOLERANCE) plus K3Model vs transformers (test_kimi_linear.py: 1e-4)
    assert np.abs(got - want).max() < TOLERANCE["llvm-cpu"] + 1e-4


@pytest.mark.slow
def test_hub_layout_runs_a_module_compiled_from_its_config(hf_saved, k3c_cache, tmp_path, monkeypatch):
    """Kimi Linear as the Hub stores it (docs/model.md §8: bf16 but for A_log and dt_bias): a module
    compiled with --no-weights from the config alone (the published dtypes) takes the checkpoint
    through attach, packed as stored, and validates."""
    from k3c.interface.build import attach_weights, build_module_only
    from k3c.compiler.targets import parse_target
    from k3c.interface.validate import validate
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    hub = hub_layout(hf_saved, tmp_path / "hub")
    tensors = {k: t if k.endswith(("A_log", "dt_bias")) else t.to(torch.bfloat16)
               for k, t in load_file(hub / "model.safetensors").items()}
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    module = build_module_only(tmp_path / "module", K3Config.from_hf(hub), parse_target("cpu"), max_prompt=32,
                               force=False, log=lambda _: None)
    bundle = attach_weights(module, hub, tmp_path / "bundle", log=lambda _: None)
    assert bundle.checkpoint_dir == hub.resolve()
    steps, _ = validate(bundle)
    assert all(s.passed for s in steps), steps
