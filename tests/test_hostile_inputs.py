"""Hostile or clumsy input that must end in one ``error:`` line (or work), never a traceback or
unbounded work: sampling options, text that is not UTF-8, chat templates, tokenizer and generation
files of the wrong types, deep JSON, reference archives that claim more than they hold, device counts.
None of these compiles anything."""
from __future__ import annotations

import base64
import json
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from k3c.artifacts.bundle import open_bundle
from k3c.errors import K3Error
from k3c.interface.validate import load_reference
from k3c.runtimes import chat
from k3c.runtimes.chat import read_turn, render_chat
from k3c.runtimes.sampling import Sampler
from k3c.runtimes.session import Generation
from k3c.runtimes.tokenizer import MAX_TEMPLATE_BYTES, load_tokenizer, write_byte_level_tokenizer

from test_cli_errors import assert_one_line_error, k3c_in_process

MESSAGES = [{"role": "user", "content": "hi"}]


# ---- command-line values ----------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--temperature", "nan"], ["--temperature nan"]),
    (["--temperature", "inf"], ["--temperature inf"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--prompt", "a\udcff"], ["--prompt", "UTF-8"]),
    (["--system", "\udcff", "--chat"], ["--system", "UTF-8"]),
    (["--stop", "\udcff"], ["--stop", "UTF-8"]),
])
def test_bad_generation_values_fail_before_the_bundle_is_read(args, words, tmp_path):
    prompt = [] if "--prompt" in args else ["--prompt", "hi"]
    assert_one_line_error(*k3c_in_process("run", tmp_path / "none", *prompt, *args), *words)


@pytest.mark.parametrize("value", ["nan", "inf", "1e308", "-1"])
def test_device_memory_must_be_a_finite_size(value):
    assert_one_line_error(*k3c_in_process("inspect", "--preset", "k3-tiny", "--devices", "2",
                                          "--device-memory", value), "--device-memory")


def test_devices_beyond_the_experts_are_refused_before_any_row_is_made():
    assert_one_line_error(*k3c_in_process("inspect", "--preset", "k3", "--devices", str(10**30)),
                          "--devices", "896 routed experts")


def test_compile_devices_are_bounded_before_the_flags_are_made(tmp_path):
    assert_one_line_error(*k3c_in_process("compile", "--devices", str(10**12), "-o", tmp_path / "b"),
                          "--devices must be from 1 to")


def test_a_tiny_temperature_is_greedy_without_warnings():
    logits = np.array([1.0, 3.0, 2.0, -5.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Sampler(1e-320)(logits) == 1
        np.testing.assert_array_equal(Sampler(1e-320, top_k=2, top_p=0.5).probabilities(logits), [0, 1, 0, 0])


def test_no_decode_step_reports_no_rate(capsys):
    from k3c.cli import _report
    gen = Generation(ids=[5], n_prompt=2, prefill_s=0.5, finish_reason="length")
    assert gen.decode_tok_s is None
    _report(gen, SimpleNamespace(max_context=16))
    assert capsys.readouterr().err.strip().endswith("decode 0 tokens")


# ---- chat input and templates -------------------------------------------------------------------
class _Tok:
    def text_limit(self, max_tokens):
        return 4 * max_tokens


@pytest.mark.parametrize("data, words", [
    (b"ok\xff\n", ["not valid UTF-8"]),
    (b"a" * 10_000 + b"\n", ["more than 64 bytes", "16 tokens"]),
])
def test_chat_lines_are_bounded_and_utf8(data, words):
    import io
    stream = io.BytesIO(data)
    with pytest.raises(K3Error) as e:
        read_turn(stream, _Tok(), 16)
    assert all(w in str(e.value) for w in words)
    assert stream.tell() <= 64 + 2   # read no further than the longest line that could fit


def test_a_chat_line_that_fits_is_read():
    import io
    assert read_turn(io.BytesIO("héllo\nnext\n".encode()), _Tok(), 16) == "héllo\n"


@pytest.mark.parametrize("template, words", [
    ("{{ 1/0 }}", ["ZeroDivisionError"]),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ["RecursionError"]),
    ("{{ messages + 1 }}", ["TypeError"]),
    ("{{ 'a' * 10**12 }}", ["repeats a sequence"]),
    ("{{ 2 ** (10 ** 9) }}", ["to the power"]),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", ["more than 1,000 characters"]),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", ["longer than"]),
])
def test_chat_templates_are_bounded_and_fail_in_one_error(template, words, monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    with pytest.raises(K3Error) as e:
        render_chat(template, MESSAGES, {}, max_chars=1000)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert render_chat("{{ messages[0].content }}", MESSAGES, {}, max_chars=1000) == "hi"


# ---- tokenizer and generation files ---------------------------------------------------------
@pytest.fixture
def tok_dir(tmp_path) -> Path:
    write_byte_level_tokenizer(tmp_path / "tok", 512)
    return tmp_path / "tok"


def _edit_config(directory: Path, **fields) -> None:
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("template", [5, ["a"], {"a": 1}, [{"name": "default", "template": 3}]])
def test_chat_template_of_the_wrong_type(tok_dir, template):
    _edit_config(tok_dir, chat_template=template)
    with pytest.raises(K3Error, match="chat_template"):
        load_tokenizer(tok_dir, 512)


@pytest.mark.parametrize("content, words", [
    (b"\xff{{ messages }}", ["not UTF-8"]),
    (b"x" * (MAX_TEMPLATE_BYTES + 1), ["larger than"]),
])
def test_chat_template_file_unreadable_or_huge(tok_dir, content, words):
    (tok_dir / "chat_template.jinja").write_bytes(content)
    with pytest.raises(K3Error) as e:
        load_tokenizer(tok_dir, 512)
    assert all(w in str(e.value) for w in words)


def test_deeply_nested_tokenizer_config(tok_dir):
    (tok_dir / "tokenizer_config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(K3Error, match="nested too deeply"):
        load_tokenizer(tok_dir, 512)


@pytest.mark.parametrize("value", ['"abc"', "[null]", "1e400", "true", "[1, 2.5]"])
def test_eos_token_id_of_the_wrong_type(tok_dir, value):
    (tok_dir / "generation_config.json").write_text('{"eos_token_id": %s}' % value)
    with pytest.raises(K3Error, match="generation_config.json: eos_token_id"):
        load_tokenizer(tok_dir, 512)


@pytest.mark.parametrize("decoder", [{"x": "<a>"}, {"300": 5}, {"300": {"content": None}}, ["<a>"]])
def test_added_tokens_decoder_of_the_wrong_type(tmp_path, decoder):
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n"
                                                     for b in range(256)))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    with pytest.raises(K3Error, match="added_tokens_decoder"):
        load_tokenizer(tmp_path, 320)


# ---- manifest and reference -----------------------------------------------------------------
def test_deeply_nested_manifest(tmp_path):
    (tmp_path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(K3Error, match="nested too deeply"):
        open_bundle(tmp_path)


def test_integer_field_given_as_a_float(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 3.0}))
    with pytest.raises(K3Error, match="expected integer|missing"):
        open_bundle(tmp_path)


def _reference_bundle(path: Path):
    manifest = SimpleNamespace(no_reference="", max_prompt=16, config={"vocab_size": 512})
    return SimpleNamespace(manifest=manifest, reference_path=path)


def test_reference_member_claiming_a_huge_shape(tmp_path):
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = (10**6, 10**6)
    with zipfile.ZipFile(tmp_path / "reference.npz", "w") as z, z.open("prefill_logits.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 64)
    with pytest.raises(K3Error, match=r"claims shape \(1000000, 1000000\)"):
        load_reference(_reference_bundle(tmp_path / "reference.npz"))


def test_zip_bombed_reference(tmp_path):
    np.savez_compressed(tmp_path / "reference.npz", prefill_logits=np.zeros((4096, 512), np.float32))
    assert (tmp_path / "reference.npz").stat().st_size < 100_000
    with pytest.raises(K3Error, match="unpacks to 8,388,"):
        load_reference(_reference_bundle(tmp_path / "reference.npz"))


# ---- pack: the output policy -------------------------------------------------------------------
def test_pack_into_its_own_checkpoint_is_refused(tiny_checkpoint):
    before = sorted(p.name for p in tiny_checkpoint.iterdir())
    assert_one_line_error(*k3c_in_process("pack", tiny_checkpoint, "-o", tiny_checkpoint / "w.irpa"),
                          "inside the checkpoint")
    assert sorted(p.name for p in tiny_checkpoint.iterdir()) == before


def test_pack_never_replaces_an_archive_that_appeared_meanwhile(tiny_checkpoint, tmp_path, monkeypatch):
    """Another writer's archive lands at the output while this one is written: it stays, this
    one fails in one line and leaves no scratch or temporary file."""
    from k3c.artifacts import pack as pack_module
    out = tmp_path / "w.irpa"
    digest = pack_module.sha256_file

    def other_writer_finishes(path):
        out.write_bytes(b"the other archive")
        return digest(path)

    monkeypatch.setattr(pack_module, "sha256_file", other_writer_finishes)
    assert_one_line_error(*k3c_in_process("pack", tiny_checkpoint, "-o", out), "appeared while", "does not replace")
    assert out.read_bytes() == b"the other archive"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.irpa"]


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of request.param bytes (needs root and mount; skipped in one line where they are not
    there)."""
    import shutil
    import subprocess
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(disk)]
    if not shutil.which("mount") or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


# k3-tiny packs into about 650 KB: 300 KB fills while the weights are laid out, 1000 KB while the
# archive is written beside them
@pytest.mark.parametrize("small_disk", ["300k", "1000k"], indirect=True)
def test_pack_on_a_full_disk_is_one_error_and_leaves_nothing(tiny_checkpoint, small_disk):
    import subprocess
    from test_cli_errors import K3C
    r = subprocess.run([str(K3C), "pack", str(tiny_checkpoint), "-o", str(small_disk / "w.irpa")],
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error(r.returncode, r.stderr, "pack: cannot write", "space")
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("added_id, words", [(600, ["id 600", "outside", "vocab_size 512"]),
                                             (300, ["id 300 in the file", "gives it id 258"])])
def test_added_token_ids_are_read_as_the_file_gives_them(tok_dir, added_id, words):
    """tokenizers would renumber these tokens to 258 without a word."""
    path = tok_dir / "tokenizer.json"
    raw = json.loads(path.read_text())
    raw["added_tokens"].append({**raw["added_tokens"][-1], "id": added_id, "content": "<|extra|>"})
    path.write_text(json.dumps(raw))
    with pytest.raises(K3Error) as e:
        load_tokenizer(tok_dir, 512)
    assert all(w in str(e.value) for w in words), str(e.value)
    raw["added_tokens"][-1]["id"] = 258       # the next free id: read as given
    path.write_text(json.dumps(raw))
    assert load_tokenizer(tok_dir, 512).encode("<|extra|>", chat=True) == [258]


@pytest.mark.parametrize("error, name, line", [
    (RuntimeError("Error invoking function: <vm>:0: FAILED_PRECONDITION; Runtime assertion failed for expression "
                  "u5 <= 1 on node 'le_13'; \n[ 0] bytecode module@26:81 -"),
     "decode", "<vm>:0: FAILED_PRECONDITION; Runtime assertion failed for expression u5 <= 1 on node 'le_13';"),
    (ValueError("Error invoking function: INVALID_ARGUMENT; while invoking native function hal.device.queue.dealloca; "
                "while calling import; \n[ 1] bytecode module@16:87382 -\n[ 0] bytecode module@17:77 -"),
     "prefill", "INVALID_ARGUMENT; while invoking native function hal.device.queue.dealloca; while calling import;"),
], ids=["assertion", "invalid-argument"])
def test_a_failure_on_the_device_is_one_error_naming_the_function_and_step(error, name, line):
    """What IREE raises when a program's runtime assertion fails, the device is lost or a queue
    operation is refused (a RuntimeError or a ValueError, by status): one line."""
    from k3c.runtimes.readback import DeviceFunction

    class FailingContext:
        def invoke(self, function, inputs, outputs):
            raise error

    call = object.__new__(DeviceFunction)
    call.name, call.function, call._vm_context = name, None, FailingContext()
    with pytest.raises(K3Error) as e:
        call()
    assert str(e.value) == f"run: {name} failed on the device: {line}"
    with pytest.raises(K3Error) as e:
        call(at="token 12")
    assert str(e.value) == f"run: {name} at token 12 failed on the device: {line}"
