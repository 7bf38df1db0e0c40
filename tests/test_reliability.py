"""Nothing lost, nothing trusted unchecked. Output directories k3c did not write are never
replaced; killed runs leave nothing behind that the next run does not tidy; bundles are verified down
to the manifest itself (paths inside the bundle, facts the module was compiled for); bad input gives
one ``error:`` line. CLI cases run the installed console script (what a user sees), except where a
failure has to be injected in process."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli_errors import assert_one_line_error, flip_byte, k3c_in_process, k3c_script

from k3c.artifacts.bundle import MANIFEST, Manifest, seal
from k3c.utils.files import MARKER, atomic_dir, hash_dir, seal_entry, verified_entry

K3C = Path(sys.executable).with_name("k3c")


def assert_error_after_progress(code: int, stderr: str, *words: str) -> None:
    """Progress lines, then one ``error:`` line naming the problem; no traceback."""
    assert code != 0 and "Traceback" not in stderr, stderr
    assert_one_line_error(code, stderr.strip().splitlines()[-1], *words)


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def copy_cache(cache: Path, to: Path) -> Path:
    """The run's compile cache as it is now, without what is being written (hidden temporary
    directories and lock files: another pytest-xdist worker may be writing)."""
    return Path(shutil.copytree(cache, to, ignore=shutil.ignore_patterns(".*")))


def dead_pid() -> int:
    """The pid of a process that has exited (a writer killed earlier)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_bundle.root, tmp_path / "bundle"))


# ---- 1. output directories ------------------------------------------------------------------
def test_directory_k3c_did_not_write_is_never_replaced(tmp_path):
    p = tmp_path / "p"
    (p / "sub").mkdir(parents=True)
    (p / "thesis.txt").write_text("x")
    before = tree(p)
    assert_one_line_error(*k3c_script("init-checkpoint", "--preset", "k3-tiny", "--force", p), "not written by k3c")
    assert_one_line_error(*k3c_script("compile", "--preset", "k3-tiny", "--force", "-o", p), "not written by k3c")
    assert tree(p) == before and (p / "sub").is_dir()


def test_replacing_k3c_output_needs_force(tiny_checkpoint, tmp_path):
    out = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, out)
    (out / "model.safetensors").write_bytes(b"stale")
    assert_one_line_error(*k3c_script("init-checkpoint", "--preset", "k3-tiny", out), "--force")
    assert (out / "model.safetensors").read_bytes() == b"stale"
    code, err = k3c_script("init-checkpoint", "--preset", "k3-tiny", "--force", out)
    assert code == 0, err
    assert tree(out) == tree(tiny_checkpoint)


@pytest.mark.parametrize("args", [
    ("compile", "--checkpoint", "{D}", "-o", "{D}"),
    ("compile", "--checkpoint", "{D}", "-o", "{D}/bundle"),
    ("compile", "--checkpoint", "{D}/..", "-o", "{D}/../b"),
    ("quantize", "{D}", "{D}"),
    ("export", "--format", "onnx", "--checkpoint", "{D}", "-o", "{D}/onnx"),
], ids=["same", "inside", "holds", "quantize", "export"])
def test_input_and_output_may_not_nest(tiny_checkpoint, tmp_path, args):
    d = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ck"))
    before = tree(d)
    code, err = k3c_script(*[a.format(D=d) for a in args])
    assert_one_line_error(code, err, "same or one holds the other")
    assert tree(d) == before


def test_output_current_directory(tiny_checkpoint, tmp_path):
    work = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ck"))
    before = tree(work)
    r = subprocess.run([str(K3C), "init-checkpoint", "--preset", "k3-tiny", "--force", "."], cwd=work,
                       capture_output=True, text=True, timeout=300)
    assert_one_line_error(r.returncode, r.stderr, "current directory")
    assert tree(work) == before


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left"), (errno.EROFS, "read-only")])
def test_full_or_read_only_disk_is_one_line(tmp_path, monkeypatch, code, words):
    """The disk fills (or turns read-only) while the checkpoint is written: one line, nothing left."""
    import k3c.model.convert as convert

    def fail(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(convert, "write_safetensors", fail)
    out = tmp_path / "ck"
    assert_error_after_progress(*k3c_in_process("init-checkpoint", "--preset", "k3-tiny", out), words, str(out))
    assert list(tmp_path.iterdir()) == []


def test_read_only_place_fails_before_any_work(tmp_path, monkeypatch):
    import k3c.utils.files as files

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(files.tempfile, "mkdtemp", refuse)
    code, err = k3c_in_process("init-checkpoint", "--preset", "k3-tiny", tmp_path / "ck")
    assert_one_line_error(code, err, "read-only")  # one line: the 'initialised' progress line never came


# ---- 7. what killed writers leave ------------------------------------------------------------
def test_leftovers_of_killed_writers_are_tidied(tiny_checkpoint, tmp_path):
    out = tmp_path / "ck"
    temp = tmp_path / f".ck.k3c-{dead_pid()}-x1y2"
    (temp / "sub").mkdir(parents=True)
    (temp / "sub" / "half.safetensors").write_bytes(b"half")
    old = tmp_path / f".ck.k3c-{dead_pid()}-old"
    (old / "stale").mkdir(parents=True)
    live = subprocess.Popen(["sleep", "60"])
    try:
        busy = tmp_path / f".ck.k3c-{live.pid}-busy"   # a writer still running: left alone
        busy.mkdir()
        shutil.copytree(tiny_checkpoint, out)
        code, err = k3c_script("init-checkpoint", "--preset", "k3-tiny", "--force", out)
        assert code == 0, err
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([busy.name, "ck"])
    finally:
        live.kill()


def test_kill_between_the_two_renames_loses_nothing(bundle_copy, tmp_path):
    """A writer killed after moving the old bundle aside and before renaming the new one in: the
    next reader puts the old one back."""
    aside = bundle_copy.with_name(f".{bundle_copy.name}.k3c-{dead_pid()}-old")
    os.rename(bundle_copy, aside)
    code, err = k3c_script("run", bundle_copy, "--prompt-ids", "1,2", "-n", "2")
    assert code == 0, err
    assert bundle_copy.is_dir() and not aside.exists()


def _child_iree_compile(pid: int) -> int | None:
    """The pid of ``pid``'s iree-compile child, from /proc/*/stat ("pid (comm) state ppid ...")."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, rest = stat.read_text().split("(", 1)[1].rsplit(")", 1)
        except (OSError, IndexError, ValueError):
            continue
        if int(rest.split()[1]) == pid and comm.startswith("iree-compile"):
            return int(stat.parent.name)
    return None


def _gone(pid: int, seconds: float = 20) -> bool:
    """Whether ``pid`` exits (or is a zombie) within ``seconds``."""
    import time
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_kill_during_iree_compile(tiny_bundle, k3c_cache, tmp_path, sig):
    """k3c killed while iree-compile runs: the compiler dies with it; SIGTERM also removes the
    temporary bundle (exit 143); what SIGKILL leaves is tidied by the next writer."""
    import signal
    import time

    cache = copy_cache(k3c_cache, tmp_path / "cache")
    for entry in cache.iterdir():       # keep the export, drop the compiled module
        if (entry / "module.vmfb").is_file():
            shutil.rmtree(entry)
    out = tmp_path / "b"
    env = {**os.environ, "K3C_CACHE": str(cache)}
    k3c = subprocess.Popen([str(K3C), "compile", "--preset", "k3-tiny", "-o", str(out)],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while (child := _child_iree_compile(k3c.pid)) is None and k3c.poll() is None:
            assert time.monotonic() < deadline, "iree-compile never started"
            time.sleep(0.2)
        assert child is not None, k3c.stderr.read()
        k3c.send_signal(getattr(signal, sig))
        k3c.wait(timeout=60)
        assert _gone(child), f"iree-compile {child} outlived k3c"
    finally:
        k3c.kill()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.")]
    if sig == "SIGTERM":
        assert k3c.returncode == 143 and left == [] and not out.exists()
        assert "Traceback" not in k3c.stderr.read()
    else:
        assert left, "expected the killed writer's temporary directory"
        code, err = k3c_script("init-checkpoint", "--preset", "k3-tiny", out)
        assert code == 0, err
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.")]


# ---- 2. the cache ----------------------------------------------------------------------------
def test_damaged_cache_entry_is_discarded(tmp_path):
    entry = tmp_path / "entry"
    with atomic_dir(entry) as tmp:
        (tmp / "module.vmfb").write_bytes(bytes(range(256)) * 10)
        seal_entry(tmp)
    assert verified_entry(entry, ("module.vmfb",), log=lambda m: None) == entry
    flip_byte(entry / "module.vmfb")
    said = []
    assert verified_entry(entry, ("module.vmfb",), log=said.append) is None
    assert not entry.exists() and len(said) == 1 and "damaged" in said[0]


def test_digest_record_holds_only_while_the_file_is_unchanged(tmp_path, monkeypatch):
    """sha256_file answers from its record while size, mtime and ctime are the recorded ones (a
    record edited to another digest is believed then: that is what spares the read), and reads the
    file again once it was written, even with its mtime put back."""
    import hashlib
    import k3c.utils.files as files

    monkeypatch.setenv("K3C_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(files, "RACY_NS", 20_000_000)  # 20 ms, past any clock tick of file timestamps
    f = tmp_path / "weights.bin"
    f.write_bytes(bytes(range(256)) * 64)
    time.sleep(0.05)
    assert files.sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    [record] = (tmp_path / "cache" / files.DIGESTS).iterdir()
    record.write_text(json.dumps({**json.loads(record.read_text()), "sha256": "0" * 64}))
    assert files.sha256_file(f) == "0" * 64
    st = f.stat()
    flip_byte(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert files.sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest() != "0" * 64


def test_file_hashed_as_it_is_written_is_not_recorded(tmp_path, monkeypatch):
    """A file hashed within the timestamps' resolution of its last write could change again without
    moving them: it is read again next time."""
    import k3c.utils.files as files

    monkeypatch.setenv("K3C_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "module.vmfb"
    f.write_bytes(b"module")
    files.sha256_file(f)
    assert not (tmp_path / "cache" / files.DIGESTS).exists()


def test_corrupt_cache_is_rebuilt(tiny_bundle, k3c_cache, tmp_path):
    """A flipped byte in the cached module.vmfb and a truncated cached torch.mlir: the next compile
    rebuilds both and its bundle runs as the original does (the one whole-model compile here)."""
    cache = copy_cache(k3c_cache, tmp_path / "cache")
    modules = list(cache.glob("*/module.vmfb"))
    exports = list(cache.glob("export/*/torch.mlir"))
    assert modules and exports
    for m in modules:
        flip_byte(m)
    for e in exports:
        e.write_text(e.read_text()[: len(e.read_text()) // 2])
    env = {**os.environ, "K3C_CACHE": str(cache)}
    out = tmp_path / "b"
    r = subprocess.run([str(K3C), "compile", "--preset", "k3-tiny", "-o", str(out)],  # as tiny_bundle is compiled
                       env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("damaged") == 2
    runs = [subprocess.run([str(K3C), "run", str(b), "--prompt-ids", "1,2,3", "-n", "6"], capture_output=True,
                           text=True, timeout=300) for b in (out, tiny_bundle.root)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout


# ---- 4, 5. the manifest ----------------------------------------------------------------------
def edit_manifest(bundle: Path, edit) -> None:
    raw = json.loads((bundle / MANIFEST).read_text())
    edit(raw)
    (bundle / MANIFEST).write_text(json.dumps(raw))


def reseal(bundle: Path) -> None:
    """Rewrite every hash of the bundle, as someone who edits it on purpose would."""
    manifest = Manifest(**json.loads((bundle / MANIFEST).read_text()))
    manifest.checkpoint_hash = hash_dir(bundle / "checkpoint")
    seal(bundle, manifest)


def _hostname_entry(raw):
    import hashlib
    raw["files"]["/etc/hostname"] = hashlib.sha256(Path("/etc/hostname").read_bytes()).hexdigest()


EDITS = {
    "checkpoint-escapes": (lambda m: m.update(checkpoint="../../other/checkpoint"), "not a directory inside the bundle"),
    "checkpoint-etc": (lambda m: m.update(checkpoint="/etc"), "not a checkpoint (no config.json)"),
    "files-absolute": (_hostname_entry, "outside the bundle"),
    "files-dotdot": (lambda m: m["files"].update({"../x": "0" * 64}), "outside the bundle"),
    "files-empty": (lambda m: m.update(files={}), "does not list module.vmfb"),
    "files-absent": (lambda m: m.pop("files"), "does not list module.vmfb"),
    "files-no-reference": (lambda m: m["files"].pop("reference.npz"), "does not list reference.npz"),
    "files-a-list": (lambda m: m.update(files=[]), "field 'files' is a JSON array, expected object"),
    "batch-a-string": (lambda m: m.update(batch="1"), "field 'batch' is a JSON string"),
    "max_prompt-bool": (lambda m: m.update(max_prompt=True), "field 'max_prompt' is a JSON boolean"),
    "target-a-number": (lambda m: m.update(target=5), "field 'target' is a JSON number"),
    "target-flags": (lambda m: m["target"].update(flags="x"), "'flags'"),
    "unknown-field": (lambda m: m.update(signature="x"), "'signature' is not a manifest field"),
    "missing-field": (lambda m: m.pop("config_hash"), "'config_hash' is missing"),
    "max_prompt": (lambda m: m.update(max_prompt=m["max_prompt"] * 2), "compiled for max_prompt 1024"),
    "target-name": (lambda m: m["target"].update(name="cpu:x86-64"), 'target name "cpu"'),
    "target-backend": (lambda m: m["target"].update(backend="vulkan-spirv"), 'target backend "llvm-cpu"'),
    "batch": (lambda m: m.update(batch=2), "compiled for batch 1"),
}


@pytest.mark.parametrize("name", EDITS)
def test_edited_manifest_is_refused(bundle_copy, name):
    edit, words = EDITS[name]
    edit_manifest(bundle_copy, edit)
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--prompt-ids", "1,2"), words)


@pytest.mark.parametrize("name", ["max_prompt", "target-name", "target-backend"])
def test_edited_and_resealed_manifest_is_refused(bundle_copy, name):
    """Even with every sha256 rewritten, the module's own reflection metadata disagrees."""
    edit, words = EDITS[name]
    edit_manifest(bundle_copy, edit)
    reseal(bundle_copy)
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--prompt-ids", "1,2"), words)


def test_absolute_checkpoint_elsewhere_is_not_hashed(bundle_copy, tmp_path, monkeypatch):
    """A manifest pointing at a directory that is not a checkpoint fails before any file is hashed."""
    import k3c.artifacts.bundle as bundle

    hashed = []
    monkeypatch.setattr(bundle, "hash_dir", lambda p: hashed.append(p) or "")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "data.bin").write_bytes(b"x" * 1000)
    edit_manifest(bundle_copy, lambda m: m.update(checkpoint=str(tmp_path / "big")))
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--prompt-ids", "1"), "no config.json")
    assert hashed == []


def test_unlisted_file_in_checkpoint_is_refused(bundle_copy):
    shutil.copy(bundle_copy / "checkpoint" / "model.safetensors", bundle_copy / "checkpoint" / "aa-backup.safetensors")
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--prompt-ids", "1"),
                          "checkpoint/aa-backup.safetensors", "not listed")


def test_checkpoint_of_other_parameter_dtypes_is_refused(bundle_copy):
    """lm_head stored in f32 instead of bf16 (and the bundle resealed): the archive the module reads
    was packed from the checkpoint as it was, so the bundle is refused instead of validating one
    checkpoint and running another."""
    path = bundle_copy / "checkpoint" / "model.safetensors"
    tensors = load_file(path)
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    tensors["lm_head.weight"] = tensors["lm_head.weight"].float()
    save_file(tensors, path, metadata={"format": "pt"})
    reseal(bundle_copy)
    assert_one_line_error(*k3c_in_process("run", bundle_copy, "--prompt-ids", "1,2"), "packed from another checkpoint")


def test_config_mismatch_names_the_field_not_one_hash_twice(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["config"].update(rms_norm_eps=1e-3))
    code, err = k3c_in_process("validate", bundle_copy)
    assert_one_line_error(code, err, "rms_norm_eps = 1e-05", "rms_norm_eps = 0.001")
    config_hash = json.loads((bundle_copy / MANIFEST).read_text())["config_hash"]
    assert err.count(config_hash) <= 1


def test_onnx_manifest_paths_stay_inside(tmp_path):
    from k3c.errors import K3Error
    from k3c.exporter.onnx_import import check_files, read_manifest
    from k3c.exporter.onnx_export import MANIFEST as ONNX_MANIFEST

    base = {"checkpoint": "checkpoint", "checkpoint_hash": "", "config_hash": "", "max_prompt": 8,
            "entry_points": {}, "opset_imports": {}, "files": {}}
    for bad, words in [({"checkpoint": "../elsewhere"}, "outside"), ({"checkpoint": "/etc"}, "outside"),
                       ({"files": {"/etc/hostname": "0"}}, "outside"), ({"max_prompt": "8"}, "'max_prompt'")]:
        (tmp_path / ONNX_MANIFEST).write_text(json.dumps({**base, **bad}))
        with pytest.raises(K3Error, match=words):
            read_manifest(tmp_path)
    (tmp_path / "prefill.onnx").write_bytes(b"edited")
    with pytest.raises(K3Error, match="prefill.onnx .* sha256"):
        check_files(tmp_path, {"files": {"prefill.onnx": "0" * 64}})


# ---- 9. reference.npz ------------------------------------------------------------------------
@pytest.mark.parametrize("change, words", [
    (lambda ref: ref.pop("decode_ids"), "no array 'decode_ids'"),
    (lambda ref: ref.update(prompt_ids=np.array([1, "a", None], dtype=object)), "not a reference of numeric arrays"),
    (lambda ref: ref.update(decode_logits=ref["decode_logits"][:, :5]), "vocab_size"),
], ids=["missing", "object-array", "wrong-vocab"])
def test_bad_reference_is_one_line(bundle_copy, change, words):
    with np.load(bundle_copy / "reference.npz") as npz:
        ref = dict(npz)
    change(ref)
    np.savez(bundle_copy / "reference.npz", **ref)
    reseal(bundle_copy)
    assert_one_line_error(*k3c_in_process("validate", bundle_copy), "reference.npz", words)


# ---- 8. non-finite outputs -------------------------------------------------------------------
def test_validate_names_first_non_finite_step_and_layer(bundle_copy):
    """NaN weights of layer 2 in what the module reads (the packed archive; reading a checkpoint
    already refuses them): validate names the prefill step and layer 2."""
    import iree.runtime as rt
    archive = bundle_copy / "weights.irpa"
    index = rt.ParameterIndex()
    index.load(str(archive))
    tensors = {key: np.frombuffer(bytes(e.file_view), dtype=np.uint8).copy() for key, e in index.items()}
    metadata = {key: e.metadata.decode() or None for key, e in index.items()}   # the archive's description
    del index
    norm = tensors["layers.kda_moe.input_layernorm.weight"].view(np.uint16).reshape(3, -1)  # layers 1, 2, 4 (bf16)
    norm[1] = 0x7FC0                                                                       # layer 2: bf16 NaN
    out = rt.ParameterIndex()
    for key, data in tensors.items():
        out.add_buffer(key, data, metadata=metadata[key])
    archive.unlink()
    out.create_archive_file(str(archive))
    reseal(bundle_copy)
    r = subprocess.run([str(K3C), "validate", str(bundle_copy)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "non-finite logits: first at step prefill, first in the output of layer 2" in r.stdout
    assert "│ 1.000 │" not in r.stdout.split("prefill", 1)[1].splitlines()[0]  # NaN rows agree on no token


def test_failed_step_writes_json():
    """A step over the tolerance with finite logits (the case numpy's comparison leaves a numpy
    bool in) is a FAIL that ``validate --json`` can write."""
    import json
    from dataclasses import asdict
    from k3c.interface.validate import compare
    ref = np.array([[1.0, 2.0, 3.0]])
    failed = compare("prefill", ref + 1e-3, ref, 1e-4)
    assert failed.passed is False and failed.max_abs == pytest.approx(1e-3)
    assert json.loads(json.dumps(asdict(failed)))["passed"] is False
    assert compare("prefill", ref + 1e-5, ref, 1e-4).passed is True


# ---- 9, 10. messages -------------------------------------------------------------------------
@pytest.mark.parametrize("ids, words", [("1,,2", "empty item"), ("99999999999999999999999", "not a token id"),
                                        ("", "empty item")])
def test_prompt_ids(tiny_bundle, ids, words):
    assert_one_line_error(*k3c_script("run", tiny_bundle.root, "--prompt-ids", ids), "--prompt-ids", words)


def test_incompatible_module_error_is_short():
    """The runtime's INCOMPATIBLE error for a module of another device quotes the whole target
    attribute (kilobytes); the line k3c prints names the backend and format."""
    import iree.runtime as rt

    from k3c.runtimes.session import iree_error_line
    from k3c.compiler.targets import PROBE, compile_mlir, parse_target

    vmfb = compile_mlir(PROBE, parse_target("cuda:sm_80"), log=lambda m: None)
    config = rt.Config("local-task")
    with pytest.raises(RuntimeError) as e:
        rt.load_vm_modules(rt.VmModule.copy_buffer(config.vm_instance, vmfb), config=config)
    line = iree_error_line(e.value)
    assert len(str(e.value)) > 500 and len(line) < 200, line
    assert "INCOMPATIBLE" in line and "cuda" in line and "\n" not in line


def test_marker_in_every_output(tiny_checkpoint, tiny_bundle):
    assert (tiny_checkpoint / MARKER).is_file() and (tiny_bundle.root / MARKER).is_file()


def test_a_cache_entry_is_built_by_one_process_while_another_waits(tmp_path):
    """A second process that needs an entry another one is building waits for its lock (saying so),
    then finds the entry built; a process that dies holding the lock releases it."""
    from k3c.utils.files import cache_lock
    entry = tmp_path / "cache" / "entry"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from k3c.utils.files import atomic_dir, cache_lock, seal_entry
with cache_lock(Path({str(entry)!r})):
    print("holding", flush=True)
    time.sleep(1.5)
    with atomic_dir(Path({str(entry)!r})) as tmp:
        (tmp / "module.vmfb").write_bytes(b"built once")
        seal_entry(tmp)
"""], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    said = []
    with cache_lock(entry, said.append):
        assert verified_entry(entry, ("module.vmfb",)) == entry
        assert (entry / "module.vmfb").read_bytes() == b"built once"
    assert holder.wait() == 0 and said == [f"waiting for another k3c process that is building {entry}"]
    killed = subprocess.Popen([sys.executable, "-c", f"""
import time
from pathlib import Path
from k3c.utils.files import cache_lock
with cache_lock(Path({str(entry)!r})):
    print("holding", flush=True)
    time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "holding"
    killed.kill()
    killed.wait()
    with cache_lock(entry):
        pass
