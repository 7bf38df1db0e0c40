"""``k3c validate --layers`` (interface/validate_layers.py, docs/bundle.md §7): every layer's compiled
entry point against the eager PyTorch layer on that layer's weights alone, on the suite's k3-tiny
bundle. The reference is model/model.py's decoder_step on tensors read from the checkpoint, never
the exporter's layer bodies."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from k3c.model import K3Config
from test_cli_errors import assert_one_line_error, k3c_in_process

TINY = K3Config.preset("k3-tiny")


def test_layers_and_per_layer_exclude_each_other(tmp_path):
    assert_one_line_error(*k3c_in_process("validate", "--layers", "--per-layer", tmp_path), "--layers", "--per-layer")


@pytest.mark.slow   # tiny_bundle
def test_every_layer_passes_on_its_own_weights(tiny_bundle, tmp_path):
    from click.testing import CliRunner
    from k3c.cli import main
    out = tmp_path / "layers.json"
    r = CliRunner().invoke(main, ["validate", "--layers", str(tiny_bundle.root), "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().endswith("PASS") and "peak RSS" in r.stdout
    layers = json.loads(out.read_text())["layers"]
    assert [c["layer"] for c in layers] == list(range(TINY.num_hidden_layers))
    assert all(c["passed"] and c["finite"] and 0 < c["max_abs"] <= 1e-4 for c in layers), layers
    kinds = {c["kind"].split("_")[0] for c in layers}
    assert kinds == {"kda", "mla"}, kinds


def faulty_copy(checkpoint: Path, dest: Path, layer: int) -> Path:
    """The checkpoint with one tensor of ``layer`` changed (its input norm scaled by 1.5)."""
    shutil.copytree(checkpoint, dest)
    tensors = load_file(dest / "model.safetensors")
    name = f"model.layers.{layer}.input_layernorm.weight"
    tensors[name] = (tensors[name].float() * 1.5).to(tensors[name].dtype)
    save_file(tensors, dest / "model.safetensors")
    return dest


@pytest.mark.slow   # tiny_bundle
def test_a_fault_in_one_layer_is_caught_at_that_layer(tiny_bundle, tmp_path):
    """The compiled module reads the bundle's archive; the eager layers read a checkpoint whose layer 2
    differs: layer 2 fails, the layers before and after pass, and the command exits 1."""
    from k3c.interface.validate_layers import validate_layers
    bad = faulty_copy(tiny_bundle.checkpoint_dir, tmp_path / "faulty", 2)
    checks, peak = validate_layers(tiny_bundle, bad, log=lambda _: None)
    assert [c.passed for c in checks] == [i != 2 for i in range(TINY.num_hidden_layers)], checks
    assert checks[2].finite and checks[2].max_abs > 1e-2 and peak > 0
    code, _ = k3c_in_process("validate", "--layers", tiny_bundle.root, "--checkpoint", bad)
    assert code == 1


@pytest.mark.slow   # tiny_bundle
def test_a_checkpoint_of_another_config_is_refused(tiny_bundle, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_bundle.checkpoint_dir, other)
    raw = json.loads((other / "config.json").read_text())
    raw["rms_norm_eps"] = raw.get("rms_norm_eps", 1e-6) * 2
    (other / "config.json").write_text(json.dumps(raw))
    assert_one_line_error(*k3c_in_process("validate", "--layers", tiny_bundle.root, "--checkpoint", other),
                          "has config", "was compiled for")
    assert_one_line_error(*k3c_in_process("validate", "--layers", tiny_bundle.root, "--checkpoint", tmp_path / "no"),
                          "does not exist")


def _rss_file_kib() -> int:
    import re
    return int(re.search(r"RssFile:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def test_release_mapped_pages_gives_back_what_a_read_mapped_in(tmp_path):
    """utils/memory.py: 64 MiB of a mapped file read once count in this process's resident set;
    released, they no longer do, and the mapping still reads the file's bytes."""
    import mmap

    import numpy as np

    from k3c.utils.memory import release_mapped_pages
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    data.tofile(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        before = _rss_file_kib()
        total = int(view.sum(dtype=np.uint64))          # reads every page
        assert _rss_file_kib() - before > 60 << 10
        assert release_mapped_pages([path]) == 64 << 20
        assert _rss_file_kib() - before < 4 << 10
        assert int(view.sum(dtype=np.uint64)) == total == int(data.sum(dtype=np.uint64))
        del view
    assert release_mapped_pages([path]) == 0              # unmapped: nothing left to release
