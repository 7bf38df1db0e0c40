"""Weights apart from the module (docs/bundle.md §5-6): the packed archive and its description, k3c
attach of a --no-weights module, every mismatch refused in one line, and a checkpoint too large for
memory compiled without reference outputs.

The archive is checked against the checkpoint's tensors stacked here by hand from the safetensors
file (not through pack.py's own grouping); attached bundles against the compiled bundle of the same
weights and the PyTorch reference outputs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli_errors import assert_one_line_error, flip_byte, k3c_in_process
from test_release_layouts import release_layout

from k3c.artifacts.archive import META, read_archive, verify_archive
from k3c.artifacts.pack import pack
from k3c.errors import K3Error
from k3c.model import K3Config, K3Model
from k3c.model.shapes import MEMORY_LIMIT, memory_shortfall, model_memory
from k3c.model.convert import save_checkpoint
from k3c.model.init import init_weights
from k3c.utils.files import hash_dir

TINY = K3Config.preset("k3-tiny")


def write_checkpoint(path: Path, cfg: K3Config = TINY, seed: int = 0) -> Path:
    return save_checkpoint(init_weights(K3Model(cfg), seed), path)


def archive_entries(path: Path) -> dict[str, tuple[bytes, bytes]]:
    """Every entry of an archive as IREE reads it: name -> (bytes, metadata)."""
    import iree.runtime as rt
    index = rt.ParameterIndex()
    index.load(str(path))
    return {key: (bytes(e.file_view), e.metadata) for key, e in index.items()}


def stacked_by_hand(checkpoint: Path, cfg: K3Config) -> dict[str, np.ndarray]:
    """The program's parameters (docs/pipeline.md §5) from the safetensors file: each per-layer tensor
    stacked over the layers of the same attention and FFN kind, routed experts over their number."""
    tensors = load_file(checkpoint / "model.safetensors")
    group = [f"{cfg.layer_kinds[i]}_{'moe' if cfg.is_moe(i) else 'dense'}" for i in range(cfg.num_hidden_layers)]
    slots: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for name, t in tensors.items():
        if not name.startswith("model.layers."):
            slots[name] = {(0, 0): t}
            continue
        _, _, layer, rest = name.split(".", 3)
        expert = 0
        if ".experts." in rest and rest.split(".experts.")[1][0].isdigit():
            head, tail = rest.split(".experts.")
            expert, tail = tail.split(".", 1)
            rest = f"{head}.experts.{tail}"
        i = int(layer)
        program = f"layers.{group[i]}.{rest}"
        slots.setdefault(program, {})[(group[:i].count(group[i]), int(expert))] = t
    out = {}
    for program, parts in slots.items():
        if not program.startswith("layers."):
            out[program] = parts[(0, 0)]
            continue
        layers = sorted({k[0] for k in parts})
        experts = sorted({k[1] for k in parts})
        rows = [torch.stack([parts[(l, e)] for e in experts]) if len(experts) > 1 else parts[(l, 0)] for l in layers]
        out[program] = torch.stack(rows)
    return {k: v.contiguous().view(-1).view(torch.uint8).numpy() for k, v in out.items()}


# ---- the archive -----------------------------------------------------------------------------------
def test_archive_item_sizes_are_the_stored_dtypes():
    """The torch-free reader's item sizes (artifacts/archive.py) are torch's, for every stored dtype."""
    from k3c.artifacts.archive import ITEMSIZE
    from k3c.model.checkpoint import TORCH_DTYPES
    assert ITEMSIZE == {str(d).removeprefix("torch."): d.itemsize for d in TORCH_DTYPES.values()}


def test_archive_holds_the_checkpoint_stacked_and_describes_it(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", seed=3)
    pack(ckpt, tmp_path / "w.irpa", log=lambda _: None)
    entries = archive_entries(tmp_path / "w.irpa")
    want = stacked_by_hand(ckpt, TINY)
    assert entries.keys() - {META} == want.keys() and len(want) == 90
    for name, raw in want.items():
        data, meta = entries[name]
        assert data == raw.tobytes(), name
        desc = json.loads(meta)
        assert desc["sha256"] == hashlib.sha256(raw.tobytes()).hexdigest()
        assert np.prod(desc["shape"]) * {"bfloat16": 2, "float32": 4, "uint8": 1}[desc["dtype"]] == raw.size
    meta = json.loads(entries[META][0])
    assert (meta["config_hash"], meta["checkpoint_hash"], meta["format"]) == (TINY.hash, hash_dir(ckpt), 1)
    experts = json.loads(entries["layers.kda_moe.block_sparse_moe.experts.w1.weight_packed"][1])
    assert experts["dtype"] == "uint8" and experts["shape"][:2] == [3, TINY.num_experts]   # layers 1, 2, 4


def test_release_layout_packs_as_the_plain_checkpoint(tmp_path):
    plain = write_checkpoint(tmp_path / "plain")
    release = release_layout(plain, tmp_path / "release")
    a, b = (archive_entries(pack(d, tmp_path / f"{d.name}.irpa", log=lambda _: None).path) for d in (plain, release))
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if k != META)
    assert json.loads(a[META][0])["checkpoint_hash"] != json.loads(b[META][0])["checkpoint_hash"]


def test_damaged_archives_are_named(tmp_path):
    import iree.runtime as rt
    ckpt = write_checkpoint(tmp_path / "ckpt")
    good = pack(ckpt, tmp_path / "good.irpa", log=lambda _: None).path
    verify_archive(read_archive(good), log=lambda _: None)
    flipped = Path(shutil.copy(good, tmp_path / "flipped.irpa"))
    flip_byte(flipped)
    with pytest.raises(K3Error, match=r"parameter '.+' does not match its sha256 \(damaged\)"):
        verify_archive(read_archive(flipped), log=lambda _: None)
    cut = tmp_path / "cut.irpa"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(K3Error, match="not a readable IREE parameter archive .*out of range"):
        read_archive(cut)
    bare = rt.ParameterIndex()
    for key, (data, _) in archive_entries(good).items():
        if key != META:
            bare.add_buffer(key, np.frombuffer(data, dtype=np.uint8).copy())
    bare.create_archive_file(str(tmp_path / "bare.irpa"))
    with pytest.raises(K3Error, match="no k3c.archive entry: it was not written by k3c pack"):
        read_archive(tmp_path / "bare.irpa")
    with pytest.raises(K3Error, match="does not exist"):
        read_archive(tmp_path / "nowhere.irpa")


def test_pack_refuses_one_parameter_of_two_dtypes(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.2.input_layernorm.weight"        # a kda_moe layer; layers 1 and 4 stay bf16
    tensors[name] = tensors[name].float()
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(K3Error, match=rf"'{name}' is stored F32, the other tensors of parameter "
                                      r"layers.kda_moe.input_layernorm.weight .* BF16"):
        pack(ckpt, tmp_path / "w.irpa", log=lambda _: None)
    assert not (tmp_path / "w.irpa").exists()


def test_memory_estimate_and_its_limit(monkeypatch):
    model = K3Model(TINY)
    need = sum(t.numel() * (1 if t.dtype == torch.uint8 else 4) for t in model.state_dict().values())
    assert model_memory(TINY, torch.float32) == need
    monkeypatch.delenv(MEMORY_LIMIT, raising=False)
    assert memory_shortfall(TINY, torch.float32) is None
    monkeypatch.setenv(MEMORY_LIMIT, str(need))
    assert memory_shortfall(TINY, torch.float32) is None
    monkeypatch.setenv(MEMORY_LIMIT, str(need - 1))
    why = memory_shortfall(TINY, torch.float32)
    assert why is not None and "float32" in why and MEMORY_LIMIT in why
    monkeypatch.setenv(MEMORY_LIMIT, "2GB")
    with pytest.raises(K3Error, match="number of bytes"):
        memory_shortfall(TINY, torch.float32)


# ---- attach ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def module_dir(tiny_bundle, k3c_cache, tmp_path_factory) -> Path:
    """k3-tiny compiled with --no-weights: the published dtypes are the ones tiny_bundle's checkpoint
    stores, so this is tiny_bundle's module, from the cache."""
    from k3c.compiler.targets import parse_target
    from k3c.interface.build import build_module_only
    lines = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("K3C_CACHE", str(k3c_cache))
        out = build_module_only(tmp_path_factory.mktemp("module") / "k3-tiny-module", TINY, parse_target("cpu"),
                                max_prompt=tiny_bundle.manifest.max_prompt, force=False, log=lines.append)
    assert any("compiled module found in cache" in line for line in lines), lines
    return out


@pytest.mark.slow
def test_attach_makes_the_bundle_compile_makes(module_dir, tiny_bundle, tmp_path):
    from k3c.interface.build import attach_weights
    from k3c.interface.validate import validate
    from k3c.runtimes.session import Session
    bundle = attach_weights(module_dir, tiny_bundle.checkpoint_dir, tmp_path / "attached", log=lambda _: None)
    assert bundle.module_path.read_bytes() == tiny_bundle.module_path.read_bytes()
    assert bundle.manifest.parameters == tiny_bundle.manifest.parameters
    assert (bundle.root / "weights.irpa").read_bytes() == (tiny_bundle.root / "weights.irpa").read_bytes()
    ref = np.load(tiny_bundle.reference_path)
    got = np.load(bundle.reference_path)
    assert all(np.array_equal(got[k], ref[k]) for k in ref.files)
    steps, _ = validate(bundle)
    assert all(s.passed for s in steps), steps
    assert np.array_equal(Session(bundle).prefill(ref["prompt_ids"])[0], Session(tiny_bundle).prefill(ref["prompt_ids"])[0])


@pytest.mark.slow
def test_attach_an_archive_of_the_release_layout_by_path(module_dir, tiny_bundle, tmp_path):
    """The K3 release layout packed once with k3c pack, attached without a copy; the bundle gives the
    plain bundle's logits and is refused once the archive is damaged."""
    from k3c.artifacts.bundle import open_bundle
    from k3c.runtimes.session import Session
    release = release_layout(tiny_bundle.checkpoint_dir, tmp_path / "release")
    assert k3c_in_process("pack", release, "-o", tmp_path / "w.irpa")[0] == 0
    code, _ = k3c_in_process("attach", module_dir, "--checkpoint", release, "--weights", tmp_path / "w.irpa",
                             "-o", tmp_path / "bundle")
    assert code == 0
    bundle = open_bundle(tmp_path / "bundle")
    assert bundle.archive_path == (tmp_path / "w.irpa").resolve() and not (tmp_path / "bundle" / "weights.irpa").exists()
    ref = np.load(tiny_bundle.reference_path)
    logits, _ = Session(bundle).prefill(ref["prompt_ids"])
    assert np.array_equal(logits, Session(tiny_bundle).prefill(ref["prompt_ids"])[0])
    assert np.abs(logits - ref["prefill_logits"]).max() < 1e-4
    flip_byte(tmp_path / "w.irpa")
    assert_one_line_error(*k3c_in_process("run", tmp_path / "bundle", "--prompt-ids", "1,2"),
                          "w.irpa", "does not match its sha256")


def _archive(tmp: Path, source: Path) -> Path:
    return pack(source, tmp / "w.irpa", log=lambda _: None).path


def _other_config(tmp: Path) -> Path:
    return write_checkpoint(tmp / "other", dataclasses.replace(TINY, num_experts_per_token=1))


def _f32_lm_head(tmp: Path, ckpt: Path) -> Path:
    copy = Path(shutil.copytree(ckpt, tmp / "f32"))
    tensors = load_file(copy / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].float()
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def _damaged(archive: Path) -> Path:
    flip_byte(archive)
    return archive


def _truncated(archive: Path) -> Path:
    archive.write_bytes(archive.read_bytes()[:4096])
    return archive


def _not_an_archive(tmp: Path) -> Path:
    (tmp / "w.irpa").write_bytes(b"not an archive" * 100)
    return tmp / "w.irpa"


def _edited_parameters(tmp: Path, module: Path) -> Path:
    copy = Path(shutil.copytree(module, tmp / "module"))
    raw = json.loads((copy / "manifest.json").read_text())
    raw["parameters"]["lm_head.weight"][0] = "float32"
    (copy / "manifest.json").write_text(json.dumps(raw))
    return copy


# case -> (the attach arguments from (tmp_path, module dir, checkpoint), words of the error line)
MISMATCHES = {
    "other-config": (lambda t, m, c: [m, "--checkpoint", _other_config(t)],
                     ["compiled for config", "num_experts_per_token: 2 vs 1"]),
    "stored-dtype": (lambda t, m, c: [m, "--checkpoint", _f32_lm_head(t, c)],
                     ["other parameters", "'lm_head.weight' as float32", "reads bfloat16"]),
    "archive-other-config": (lambda t, m, c: [m, "--checkpoint", c, "--weights", _archive(t, _other_config(t))],
                             ["archive", "packed for config", "num_experts_per_token"]),
    "archive-other-checkpoint": (lambda t, m, c: [m, "--checkpoint", c, "--weights",
                                                  _archive(t, write_checkpoint(t / "seed1", seed=1))],
                                 ["packed from another checkpoint"]),
    "archive-damaged": (lambda t, m, c: [m, "--checkpoint", c, "--weights", _damaged(_archive(t, c))],
                        ["does not match its sha256 (damaged)"]),
    "archive-truncated": (lambda t, m, c: [m, "--checkpoint", c, "--weights", _truncated(_archive(t, c))],
                          ["not a readable IREE parameter archive"]),
    "not-an-archive": (lambda t, m, c: [m, "--checkpoint", c, "--weights", _not_an_archive(t)],
                       ["not a readable IREE parameter archive"]),
    "module-edited": (lambda t, m, c: [_edited_parameters(t, m), "--checkpoint", c],
                      ["compiled for other parameters than its manifest.json"]),
}


@pytest.mark.slow   # module_dir (tiny_bundle)
@pytest.mark.parametrize("case", MISMATCHES)
def test_attach_refuses_a_mismatch_in_one_line_and_writes_nothing(case, module_dir, tiny_bundle, tmp_path):
    make, words = MISMATCHES[case]
    args = make(tmp_path, module_dir, tiny_bundle.checkpoint_dir)
    assert_one_line_error(*k3c_in_process("attach", *args, "-o", tmp_path / "out"), *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow   # module_dir (tiny_bundle)
def test_modules_and_bundles_are_not_mistaken_for_each_other(module_dir, tiny_bundle, tmp_path):
    assert_one_line_error(*k3c_in_process("run", module_dir, "--prompt-ids", "1,2"), "--no-weights", "k3c attach")
    assert_one_line_error(*k3c_in_process("attach", tiny_bundle.root, "--checkpoint", tiny_bundle.checkpoint_dir,
                                          "-o", tmp_path / "out"), "a bundle with weights already")


# ---- a checkpoint larger than memory ---------------------------------------------------------------
@pytest.mark.slow   # tiny_bundle
def test_checkpoint_larger_than_memory_compiles_runs_and_validates_where_it_fits(tiny_bundle, k3c_cache, tmp_path,
                                                                                monkeypatch):
    """K3C_MEMORY_LIMIT one byte under the float32 model: the bundle is built from shapes and the
    streamed pack (no PyTorch model is loaded), says in one line that it has no reference outputs,
    and runs; validate refuses in one line under the limit (and validates layer by layer with
    --layers) and computes the reference above it."""
    import k3c.interface.build as build
    from k3c.compiler.targets import parse_target
    from k3c.interface.validate import validate
    from k3c.runtimes.session import Session
    monkeypatch.setenv("K3C_CACHE", str(k3c_cache))
    monkeypatch.setenv(MEMORY_LIMIT, str(model_memory(TINY, torch.float32) - 1))

    def no_model(*args, **kwargs):
        raise AssertionError("the float32 model was loaded")

    with monkeypatch.context() as m:
        m.setattr(build, "load_checkpoint", no_model)
        lines = []
        bundle = build.build_bundle(tmp_path / "big", parse_target("cpu"), checkpoint=tiny_bundle.checkpoint_dir,
                                    max_prompt=tiny_bundle.manifest.max_prompt, log=lines.append)
    said = [line for line in lines if "reference" in line]
    assert len(said) == 1 and said[0].startswith("no reference outputs: the model needs") and "--layers" in said[0]
    assert not bundle.reference_path.exists() and MEMORY_LIMIT in bundle.manifest.no_reference
    ref = np.load(tiny_bundle.reference_path)
    logits, _ = Session(bundle).prefill(ref["prompt_ids"])
    assert np.abs(logits - ref["prefill_logits"]).max() < 1e-4
    assert_one_line_error(*k3c_in_process("validate", bundle.root), "no reference outputs", "float32",
                          "k3c validate --layers")
    code, _ = k3c_in_process("validate", "--layers", bundle.root)    # under the limit: layer by layer
    assert code == 0
    monkeypatch.delenv(MEMORY_LIMIT)
    steps, _ = validate(bundle)
    assert all(s.passed for s in steps) and len(steps) == 1 + len(ref["decode_ids"]), steps
