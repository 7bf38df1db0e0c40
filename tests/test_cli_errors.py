"""Bad input to ``k3c`` -> one line ``error: ...`` naming the problem, a non-zero exit, no traceback.
Some cases run the installed console script in a process of its own (what a user sees), the rest
run in process through click's test runner (no second torch import)."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3c.artifacts.bundle import MANIFEST, open_bundle, seal
from k3c.cli import main
from k3c.model import K3Config, K3Model
from k3c.model.convert import save_checkpoint
from k3c.model.init import init_weights

K3C = Path(sys.executable).with_name("k3c")  # the console script installed beside this interpreter


def assert_one_line_error(code: int, stderr: str, *words: str) -> None:
    lines = stderr.strip().splitlines()
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


def k3c_script(*args) -> tuple[int, str]:
    """Run the real console script: (exit code, stderr)."""
    r = subprocess.run([str(K3C), *map(str, args)], capture_output=True, text=True, timeout=300)
    return r.returncode, r.stderr


def k3c_in_process(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stderr


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_bundle.root, tmp_path / "bundle"))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_unknown_target():
    assert_one_line_error(*k3c_script("compile", "--preset", "k3-tiny", "--target", "tpu"), "unknown target", "'tpu'")


@pytest.mark.slow  # tiny_bundle
def test_token_id_outside_vocab(tiny_bundle):
    vocab = tiny_bundle.manifest.config["vocab_size"]
    assert_one_line_error(*k3c_script("run", tiny_bundle.root, "--prompt-ids", f"1,2,{vocab}"),
                          f"token id {vocab}", f"vocab_size {vocab}")


@pytest.mark.slow  # tiny_bundle
def test_prompt_longer_than_the_context(tiny_bundle):
    """Longer than the compiled prefill is fine (pieces through extend); longer than the context is not."""
    limit = tiny_bundle.manifest.config["max_position_embeddings"]
    ids = ",".join(["1"] * (limit + 1))
    assert_one_line_error(*k3c_in_process("run", tiny_bundle.root, "--prompt-ids", ids),
                          f"prompt has {limit + 1} tokens", f"context holds {limit}")


@pytest.mark.slow  # tiny_bundle
def test_prompt_ids_not_integers(tiny_bundle):
    assert_one_line_error(*k3c_in_process("run", tiny_bundle.root, "--prompt-ids", "1,2.5,3"), "--prompt-ids", "'2.5'")


@pytest.mark.slow  # tiny_bundle
def test_flipped_byte_in_module(bundle_copy):
    flip_byte(bundle_copy / "module.vmfb")
    assert_one_line_error(*k3c_script("run", bundle_copy, "--prompt-ids", "1,2"), "module.vmfb", "sha256")


@pytest.mark.slow  # tiny_bundle
def test_flipped_byte_in_checkpoint(bundle_copy):
    flip_byte(bundle_copy / "checkpoint" / "model.safetensors")
    assert_one_line_error(*k3c_in_process("validate", bundle_copy), "checkpoint/model.safetensors", "sha256")


@pytest.mark.slow  # tiny_bundle
def test_checkpoint_of_another_config_resealed(bundle_copy):
    """A checkpoint of another config put in the bundle and every hash rewritten: the config check
    still refuses it."""
    manifest = open_bundle(bundle_copy).manifest
    other = dataclasses.replace(K3Config.preset("k3-tiny"), num_experts_per_token=1)
    shutil.rmtree(bundle_copy / "checkpoint")
    save_checkpoint(init_weights(K3Model(other), 0), bundle_copy / "checkpoint")
    seal(bundle_copy, manifest)
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--prompt-ids", "1,2"),
                          f"compiled for config {manifest.config_hash}", f"has config {other.hash}")


@pytest.mark.slow  # tiny_bundle
def test_manifest_config_edited(bundle_copy):
    raw = json.loads((bundle_copy / MANIFEST).read_text())
    raw["config"]["vocab_size"] *= 2
    (bundle_copy / MANIFEST).write_text(json.dumps(raw))
    assert_one_line_error(*k3c_in_process("validate", bundle_copy), "compiled for config", "has config")


@pytest.mark.slow  # tiny_bundle
@pytest.mark.parametrize("name", ["tokenizer/chat_template.jinja", "tokenizer/generation_config.json",
                                  "tokenizer/tiktoken.model", "notes.txt"])
def test_a_file_the_manifest_does_not_list_is_refused(bundle_copy, name):
    """Nothing unlisted is read: a template dropped into tokenizer/ would otherwise be rendered."""
    (bundle_copy / name).write_text("INJECTED {{ messages[0].content }}")
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--chat", "--prompt", "hi"), name, "not listed")


@pytest.mark.slow  # tiny_bundle
@pytest.mark.parametrize("link", ["tokenizer/tokenizer_config.json", "tokenizer"])
def test_a_symbolic_link_in_the_bundle_is_refused_even_resealed(bundle_copy, tmp_path, link):
    """A file or the tokenizer directory replaced by a link to a copy outside, every hash rewritten."""
    outside = tmp_path / "outside"
    shutil.copytree(bundle_copy / "tokenizer", outside)
    manifest = open_bundle(bundle_copy).manifest
    target = bundle_copy / link
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    target.symlink_to(outside if link == "tokenizer" else outside / target.name)
    seal(bundle_copy, manifest)
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--chat", "--prompt", "hi"), link, "symbolic link")


def test_missing_bundle_directory(tmp_path):
    assert_one_line_error(*k3c_in_process("run", tmp_path / "nowhere", "--prompt-ids", "1"), "nowhere", "does not exist")


def test_directory_that_is_not_a_bundle(tmp_path):
    (tmp_path / "notes.txt").write_text("not a bundle")
    assert_one_line_error(*k3c_in_process("validate", tmp_path), MANIFEST, "not a k3c bundle")

