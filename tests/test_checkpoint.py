"""Checkpoint I/O (docs/model.md §0-5): round trips, sharding, determinism, the gpt-oss expert layout,
quantisation, and a one-line error for each kind of bad checkpoint.

References independent of the code under test: safetensors' own writer and reader, transformers'
gpt-oss MXFP4 dequantiser, the dtype table of docs/model.md §1 and §4, and the MXFP4 rounding bound of
docs/model.md §5 derived by hand.
"""
import dataclasses
import hashlib
import json
import math
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from k3c.cli import main
from k3c.errors import K3Error
from k3c.model import K3Config, K3Model
from k3c.model import convert
from k3c.model.checkpoint import load_checkpoint
from k3c.model.convert import quantize_checkpoint, save_checkpoint, write_safetensors
from k3c.model.init import init_weights

TOKENS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
# docs/model.md §1 and §4: stored in f32; routed experts u8 (MXFP4); everything else bf16
SPEC_F32 = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log", "o_norm.weight",
            "e_score_correction_bias")
SHARD = 100_000


def tiny(**changes) -> K3Config:
    return dataclasses.replace(K3Config.preset("k3-tiny"), **changes)


def digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


@pytest.fixture(scope="module")
def model():
    return init_weights(K3Model(tiny()), seed=0)


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "k3-tiny")


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    """k3-tiny with bf16 routed experts (no quantization_config)."""
    return save_checkpoint(init_weights(K3Model(tiny(quantization_config=None)), seed=0),
                           tmp_path_factory.mktemp("float") / "k3-tiny-bf16")


# ---- round trips ----------------------------------------------------------------------------
def test_round_trip_gives_the_logits_of_the_bf16_rounded_model(model, ckpt):
    expected = K3Model(model.cfg)
    expected.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, t in expected.state_dict().items():
            if t.is_floating_point() and not name.endswith(SPEC_F32):
                t.copy_(t.to(torch.bfloat16))
    loaded = load_checkpoint(ckpt)
    assert K3Config.from_hf(ckpt) == model.cfg
    assert torch.equal(logits(loaded), logits(expected))


def test_stored_dtypes_follow_the_spec(ckpt):
    with safe_open(ckpt / "model.safetensors", framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    for name, dtype in dtypes.items():
        if ".experts." in name:
            want = "U8"
        else:
            want = "F32" if name.endswith(SPEC_F32) else "BF16"
        assert dtype == want, name
    assert sum(name.endswith("weight_packed") for name in dtypes) == 5 * 8 * 3  # MoE layers x experts x w1/w2/w3


def test_sharded_checkpoint_equals_unsharded(model, ckpt, tmp_path):
    sharded = save_checkpoint(model, tmp_path / "sharded", shard_bytes=SHARD)
    shards = sorted(sharded.glob("model-*.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) > 2
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    single = load_file(ckpt / "model.safetensors")
    merged = {}
    for s in shards:
        part = load_file(s)
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= SHARD
        assert all(index["weight_map"][k] == s.name for k in part)
        merged.update(part)
    assert merged.keys() == single.keys()
    assert all(torch.equal(merged[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    assert torch.equal(logits(load_checkpoint(sharded)), logits(load_checkpoint(ckpt)))


def test_same_seed_gives_the_same_bytes(ckpt, model, tmp_path):
    run = CliRunner().invoke(main, ["init-checkpoint", "--preset", "k3-tiny", "--seed", "0", str(tmp_path / "cli")])
    assert run.exit_code == 0, run.output
    assert digests(tmp_path / "cli") == digests(ckpt)
    run = CliRunner().invoke(main, ["init-checkpoint", "--preset", "k3-tiny", "--seed", "0", "--shard-size", "100KB",
                                    str(tmp_path / "cli-sharded")])
    assert run.exit_code == 0, run.output
    assert digests(tmp_path / "cli-sharded") == digests(save_checkpoint(model, tmp_path / "api", shard_bytes=SHARD))
    other = save_checkpoint(init_weights(K3Model(tiny()), seed=1), tmp_path / "seed1")
    assert digests(other)["model.safetensors"] != digests(ckpt)["model.safetensors"]


def test_streaming_writer_writes_the_bytes_of_safetensors_save_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5, generator=gen), "a.scalar": torch.tensor(2.0),
               "z.half": torch.randn(7, generator=gen).half(), "y.bf16": torch.randn(2, 3, generator=gen).bfloat16(),
               "c.packed": torch.randint(0, 256, (4, 6), generator=gen, dtype=torch.uint8),
               "a.packed": torch.randint(0, 256, (1,), generator=gen, dtype=torch.uint8)}
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8"}
    header = {k: (names[t.dtype], tuple(t.shape)) for k, t in tensors.items()}
    write_safetensors(tmp_path / "ours.safetensors", header, tensors.__getitem__)
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_random_init_keeps_the_residual_stream_bounded_after_bf16(ckpt):
    loaded = load_checkpoint(ckpt)
    hidden = []
    with torch.no_grad():
        out, _ = loaded.layers_forward(TOKENS, loaded.init_state(TOKENS.shape[0]), False, hidden)
    assert len(hidden) == loaded.cfg.num_hidden_layers
    for layer, h in enumerate(hidden):
        rms = h.float().pow(2).mean().sqrt().item()
        assert 0.05 <= rms <= 20, f"layer {layer}: residual RMS {rms}"
    assert out.isfinite().all()


# ---- gpt-oss expert layout ------------------------------------------------------------------
def to_gpt_oss(tensors: dict, cfg: K3Config) -> dict:
    """Stack each MoE layer's experts into gpt-oss tensors: blocks [E, rows, in/32, 16] + scales
    [E, rows, in/32], gate/up rows interleaved (row 2i = w1 row i, row 2i+1 = w3 row i)."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        p = f"model.layers.{layer}.block_sparse_moe.experts"

        def stack(w, part):
            return torch.stack([tensors[f"{p}.{e}.{w}.{part}"] for e in range(cfg.num_experts)])

        for part, name in (("weight_packed", "blocks"), ("weight_scale", "scales")):
            gate_up = torch.stack((stack("w1", part), stack("w3", part)), dim=2).flatten(1, 2)
            down = stack("w2", part)
            if name == "blocks":
                gate_up, down = gate_up.unflatten(-1, (-1, 16)), down.unflatten(-1, (-1, 16))
            out[f"{p}.gate_up_proj_{name}"] = gate_up.contiguous()
            out[f"{p}.down_proj_{name}"] = down.contiguous()
    return out


def test_gpt_oss_layout_reads_as_the_k3_layout_and_back(ckpt, tmp_path):
    cfg = K3Config.from_hf(ckpt)
    gpt = tmp_path / "gpt-oss"
    gpt.mkdir()
    shutil.copyfile(ckpt / "config.json", gpt / "config.json")
    stacked = to_gpt_oss(load_file(ckpt / "model.safetensors"), cfg)
    save_file(stacked, gpt / "model.safetensors", metadata={"format": "pt"})

    model = load_checkpoint(gpt)
    assert torch.equal(logits(model), logits(load_checkpoint(ckpt)))
    assert digests(save_checkpoint(model, tmp_path / "back")) == digests(ckpt)

    # transformers' gpt-oss dequantiser: [E, rows, in/32, 16] -> [E, in, rows], gate = even columns
    layer = 3
    p = f"model.layers.{layer}.block_sparse_moe.experts"
    gate_up = convert_moe_packed_tensors(stacked[f"{p}.gate_up_proj_blocks"], stacked[f"{p}.gate_up_proj_scales"],
                                         dtype=torch.float32)
    down = convert_moe_packed_tensors(stacked[f"{p}.down_proj_blocks"], stacked[f"{p}.down_proj_scales"],
                                      dtype=torch.float32)
    from k3c.ops.mxfp4 import dequantize
    experts = model.model.layers[layer].block_sparse_moe.experts
    for e in range(cfg.num_experts):
        w1, w3, w2 = (dequantize(w.weight_packed[e], w.weight_scale[e]) for w in (experts.w1, experts.w3, experts.w2))
        assert torch.equal(w1.t(), gate_up[e][:, 0::2])
        assert torch.equal(w3.t(), gate_up[e][:, 1::2])
        assert torch.equal(w2.t(), down[e])


# ---- quantize -------------------------------------------------------------------------------
def test_quantize_converts_float_experts_within_the_mxfp4_bound(float_ckpt, tmp_path):
    out = tmp_path / "mxfp4"
    run = CliRunner().invoke(main, ["quantize", str(float_ckpt), str(out)])
    assert run.exit_code == 0, run.output
    assert "rel. RMS error" in run.output
    src, dst = load_file(float_ckpt / "model.safetensors"), load_file(out / "model.safetensors")

    experts = {k for k in src if ".experts." in k}
    assert len(experts) == 5 * 8 * 3
    for k in src.keys() - experts:  # every other tensor: same dtype, same bytes
        assert src[k].dtype == dst[k].dtype and torch.equal(src[k].view(torch.uint8), dst[k].view(torch.uint8)), k
    report = {q.name: q.rel_rms_error for q in quantize_checkpoint(float_ckpt, tmp_path / "again")}
    assert report.keys() == experts
    for k in sorted(experts):
        w = src[k].float()
        packed, scale = dst[k + "_packed"], dst[k + "_scale"]
        # docs/model.md §5: shared exponent floor(log2 amax) - 2 per group of 32 along the input dim
        amax = w.unflatten(-1, (-1, 32)).abs().amax(-1)
        assert torch.equal(scale.long(), torch.floor(torch.log2(amax)).long() - 2 + 127), k
        s = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)
        deq = convert_moe_packed_tensors(packed.unflatten(-1, (-1, 16))[None], scale[None], dtype=torch.float32)[0].t()
        # rounding to the E2M1 grid: |error| <= s (half the widest step, 2s); beyond 6s it saturates
        assert ((deq - w).abs() <= torch.maximum(s, w.abs() - 6 * s)).all(), k
        rel = ((deq - w).norm() / w.norm()).item()
        assert math.isclose(report[k], rel, rel_tol=1e-5), k
    raw_in = json.loads((float_ckpt / "config.json").read_text())
    raw_out = json.loads((out / "config.json").read_text())
    assert raw_in["quantization_config"] is None
    assert raw_out.pop("quantization_config")["format"] == "mxfp4-pack-quantized"
    raw_in.pop("quantization_config")
    assert raw_out == raw_in
    assert load_checkpoint(out).cfg.experts_mxfp4 and logits(load_checkpoint(out)).isfinite().all()


def test_quantize_with_relative_paths_writes_the_quantised_experts(float_ckpt, tmp_path, monkeypatch):
    """The paths as a user types them, relative to the working directory: the experts written are
    the quantised ones, not the source's copied over them."""
    monkeypatch.chdir(float_ckpt.parent)
    run = CliRunner().invoke(main, ["quantize", float_ckpt.name, "mxfp4-relative"])
    assert run.exit_code == 0, run.output
    out = load_file(float_ckpt.parent / "mxfp4-relative" / "model.safetensors")
    assert any(k.endswith("_packed") for k in out) and not any(k.endswith("w1.weight") for k in out)
    quantize_checkpoint(float_ckpt, tmp_path / "absolute")
    assert digests(float_ckpt.parent / "mxfp4-relative") == digests(tmp_path / "absolute")


def test_quantize_is_idempotent(float_ckpt, ckpt, tmp_path):
    once = tmp_path / "once"
    quantize_checkpoint(float_ckpt, once)
    assert quantize_checkpoint(once, tmp_path / "twice") == []
    assert digests(tmp_path / "twice") == digests(once)
    quantize_checkpoint(ckpt, tmp_path / "mxfp4")
    assert digests(tmp_path / "mxfp4") == digests(ckpt)


# ---- atomic writes --------------------------------------------------------------------------
def test_interrupted_quantize_leaves_no_output(float_ckpt, tmp_path, monkeypatch):
    def interrupt(w):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert.mxfp4, "quantize", interrupt)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(float_ckpt, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_failed_save_leaves_the_old_checkpoint_untouched(model, ckpt, tmp_path, monkeypatch):
    target = shutil.copytree(ckpt, tmp_path / "target")
    before = digests(target)
    write = convert.write_safetensors
    written = []

    def fail_on_second_shard(path, header, tensor):
        if written:
            raise RuntimeError("disk full")
        written.append(path)
        return write(path, header, tensor)

    monkeypatch.setattr(convert, "write_safetensors", fail_on_second_shard)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(model, target, shard_bytes=SHARD)
    assert written and sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    assert digests(target) == before


# ---- bad checkpoints: one line naming the tensor and the file -------------------------------
def edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


W1 = "model.layers.2.block_sparse_moe.experts.3.w1"


def missing(d):
    edit_tensors(d, lambda t: t.pop("model.norm.weight"))
    return "model.norm.weight", "model.safetensors", "missing"


def unexpected(d):
    edit_tensors(d, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(4)}))
    return "model.layers.0.extra.weight", "model.safetensors", "not part of the model"


def wrong_shape(d):
    edit_tensors(d, lambda t: t.update({"model.norm.weight": torch.zeros(32, dtype=torch.bfloat16)}))
    return "model.norm.weight", "model.safetensors", "shape [32], expected [64]"


def float_packed(d):
    edit_tensors(d, lambda t: t.update({W1 + ".weight_packed": t[W1 + ".weight_packed"].float()}))
    return W1 + ".weight_packed", "model.safetensors", "dtype F32, expected U8"


def integer_trunk(d):
    edit_tensors(d, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.uint8)}))
    return "model.norm.weight", "model.safetensors", "dtype U8"


def nan_scale(d):
    def edit(t):
        t[W1 + ".weight_scale"][0, 0] = 0xFF
    edit_tensors(d, edit)
    return W1 + ".weight_scale", "model.safetensors", "NaN"


def truncated(d):
    path = d / "model.safetensors"
    os.truncate(path, path.stat().st_size - 1000)
    return "tensor 'model.layers.", "model.safetensors", "cut short"


def missing_shard(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (d / shard).unlink()
    first = min(k for k, v in index["weight_map"].items() if v == shard)
    return first, shard, "model.safetensors.index.json"


def unknown_model_type(d):
    raw = json.loads((d / "config.json").read_text())
    raw["model_type"] = "kimi_k9"
    (d / "config.json").write_text(json.dumps(raw))
    return "model_type", "kimi_k9"


def odd_gpt_oss_rows(d):
    key = "model.layers.1.block_sparse_moe.experts.gate_up_proj_blocks"
    edit_tensors(d, lambda t: t.update({key: torch.zeros(8, 63, 1, 16, dtype=torch.uint8)}))
    return key, "model.safetensors", "even"


def nan_scale_in_gpt_oss_layout(d):
    key = "model.layers.2.block_sparse_moe.experts.gate_up_proj_scales"

    def edit(t):
        stacked = to_gpt_oss(t, K3Config.from_hf(d))
        stacked[key][3, 5, 0] = 0xFF  # odd row 5: up (w3) row 2 of expert 3
        t.clear()
        t.update(stacked)
    edit_tensors(d, edit)
    return key, "model.safetensors", "NaN", "experts.3.w3.weight_scale"


@pytest.mark.parametrize("damage", [missing, unexpected, wrong_shape, float_packed, integer_trunk, nan_scale,
                                    truncated, missing_shard, unknown_model_type, odd_gpt_oss_rows,
                                    nan_scale_in_gpt_oss_layout])
def test_bad_checkpoint_gives_a_one_line_error(damage, ckpt, model, tmp_path):
    bad = tmp_path / "bad"
    if damage is missing_shard:
        save_checkpoint(model, bad, shard_bytes=SHARD)
    else:
        shutil.copytree(ckpt, bad)
    expected = damage(bad)

    with pytest.raises(K3Error) as raised:
        load_checkpoint(bad)
    assert all(s in str(raised.value) for s in expected), str(raised.value)

    run = CliRunner().invoke(main, ["quantize", str(bad), str(tmp_path / "out")])
    assert run.exit_code == 1 and isinstance(run.exception, SystemExit)  # handled, no traceback
    lines = run.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.output
    assert all(s in lines[0] for s in expected), lines[0]
    assert not (tmp_path / "out").exists()
