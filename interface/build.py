"""Build a bundle: checkpoint -> export -> passes -> iree-compile -> reference outputs -> sealed bundle.

The compiled module depends only on the config, the stored dtypes, the target and the compiler
inputs, never on weight values, so it is cached by a hash of those (``K3C_CACHE``, default
``~/.cache/k3c``) and shared by every checkpoint of the same config.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import K3Error
from ..model import K3Config, K3Model
from ..model.checkpoint import TORCH_DTYPES, checkpoint_dir, load_checkpoint, open_checked, stored_dtype
from ..model.accounting import require_memory
from ..model.stacking import to_checkpoint
from ..model.convert import save_checkpoint
from ..model.init import init_weights
from ..compiler.targets import Target, compile_mlir
from ..utils.files import atomic_dir, check_output, hash_dir, seal_entry, verified_entry
from ..artifacts.pack import pack
from ..artifacts.bundle import ARCHIVE, ENTRY_POINTS, Bundle, Manifest, module_facts, open_bundle, package_versions, seal, stored_dtypes

PROMPT_LEN = 24
DECODE_STEPS = 8
EXPORT_SOURCES = ("model", "exporter")                 # what shapes the exported torch-dialect module
COMPILE_SOURCES = ("model", "exporter", "passes")      # ... and the compiled one


@dataclass
class Compiled:
    vmfb: bytes
    entry_points: dict
    key: str


def cache_dir() -> Path:
    return Path(os.environ.get("K3C_CACHE", Path.home() / ".cache" / "k3c"))


def source_hash(dirs: tuple[str, ...] = COMPILE_SOURCES) -> str:
    """Hash of the code in ``dirs`` (the code that shapes a cached module), so a change misses the cache."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for d in dirs:
        for f in sorted((root / d).rglob("*.py")):
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(**parts) -> str:
    """A short hash of ``parts`` (JSON-serialisable): the name of a cache entry."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def export_cached(model: K3Model, dtypes: dict[str, torch.dtype], *, max_prompt: int, batch: int = 1, log=print):
    """The torch-dialect module (before passes) and its entry points, from the cache when the config,
    dtypes, shapes, k3c sources and package versions match; exported (and cached) otherwise."""
    from iree.compiler import ir

    from ..exporter.export import export_model

    cached = cache_dir() / "export" / cache_key(
        config=model.cfg.hash, dtypes={k: str(v) for k, v in sorted(dtypes.items())}, max_prompt=max_prompt,
        batch=batch, source=source_hash(EXPORT_SOURCES), versions=package_versions())
    if verified_entry(cached, ("torch.mlir", "entry_points.json"), log):
        log(f"exported module found in cache ({cached})")
        module = ir.Module.parse((cached / "torch.mlir").read_text(), context=ir.Context())
        return module, json.loads((cached / "entry_points.json").read_text())
    exported = export_model(model, dtypes, batch=batch, max_prompt=max_prompt, log=log)
    with atomic_dir(cached) as tmp:
        (tmp / "torch.mlir").write_text(exported.text)
        (tmp / "entry_points.json").write_text(json.dumps(exported.entry_points))
        seal_entry(tmp)
    return exported.module, exported.entry_points


def compile_model(model: K3Model, dtypes: dict[str, torch.dtype], target: Target, *, max_prompt: int,
                  batch: int = 1, log=print) -> Compiled:
    """Export (once per config, shared by every target), lower and compile ``model`` for ``target``,
    or fetch the compiled module from the cache."""
    from ..passes.pipeline import Pipeline

    key = cache_key(config=model.cfg.hash, dtypes={k: str(v) for k, v in sorted(dtypes.items())},
                    target=target.to_dict(), max_prompt=max_prompt, batch=batch, source=source_hash(),
                    versions=package_versions())
    cached = cache_dir() / key
    if verified_entry(cached, ("module.vmfb", "entry_points.json"), log):
        log(f"compiled module found in cache ({cached})")
        return Compiled((cached / "module.vmfb").read_bytes(), json.loads((cached / "entry_points.json").read_text()), key)
    module, entry_points = export_cached(model, dtypes, max_prompt=max_prompt, batch=batch, log=log)
    Pipeline.for_target(target).run(module, log=log)
    stamp(module, module_facts(model.cfg.hash, dtypes, target.to_dict(), max_prompt, batch))
    vmfb = compile_mlir(str(module), target, log=log)
    with atomic_dir(cached) as tmp:
        (tmp / "module.vmfb").write_bytes(vmfb)
        (tmp / "entry_points.json").write_text(json.dumps(entry_points))
        seal_entry(tmp)
    return Compiled(vmfb, entry_points, key)


def stamp(module, facts: dict[str, str]) -> None:
    """Put ``facts`` (bundle.module_facts) into the reflection metadata of the module's entry points,
    where iree-compile keeps them and the verifier of a bundle reads them back (bundle.check_module)."""
    from iree.compiler import ir

    with module.context:
        attr = ir.DictAttr.get({k: ir.StringAttr.get(v) for k, v in facts.items()})
        for op in module.body.operations:
            if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value in ENTRY_POINTS:
                op.attributes["iree.reflection"] = attr


def reference_outputs(model: K3Model, prompt: np.ndarray, n_decode: int) -> dict[str, np.ndarray]:
    """PyTorch outputs for the validation prompt: every prefill position, then greedy decode steps
    (decode_ids[i] is the argmax of the logits before it; decode_logits[i] the logits after it)."""
    with torch.no_grad():
        logits, state = model.prefill(torch.from_numpy(prompt)[None])
        ids, steps = [], []
        last = logits[0, -1]
        for _ in range(n_decode):
            ids.append(int(last.argmax()))
            out, state = model.decode(torch.tensor([[ids[-1]]]), state)
            last = out[0, -1]
            steps.append(last)
    return {"prompt_ids": prompt.astype(np.int64), "prefill_logits": logits[0].float().numpy(),
            "decode_ids": np.array(ids, dtype=np.int64), "decode_logits": torch.stack(steps).float().numpy()}


def validation_prompt(cfg: K3Config, length: int = PROMPT_LEN, seed: int = 0) -> np.ndarray:
    return torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).numpy()


def build_bundle(out: Path, target: Target, *, preset: str | None = None, checkpoint: Path | None = None,
                 seed: int = 0, max_prompt: int = 128, force: bool = True, log=print) -> Bundle:
    """Write a sealed bundle at ``out``. With ``preset``, a random checkpoint (``seed``) is created
    inside the bundle; with ``checkpoint``, the bundle refers to it by absolute path and hash (a
    checkpoint whose names or shapes differ from the module's parameters, such as Kimi Linear's or
    the K3 release's, is converted once into k3c's layout inside the bundle). ``out`` follows
    utils.files.check_output (``force``: replace a bundle written before)."""
    if (preset is None) == (checkpoint is None):
        raise K3Error("compile: give exactly one of --preset and --checkpoint")
    checkpoint = None if checkpoint is None else checkpoint_dir(checkpoint)
    out = check_output(out, force=force, inputs=(checkpoint,))
    t_start = time.perf_counter()
    with atomic_dir(out, force=force) as tmp:
        if preset is not None:
            cfg = K3Config.preset(preset)
            require_memory(cfg, torch.float32, f"compile --preset {preset} (use --no-weights for the module alone)")
            t0 = time.perf_counter()
            save_checkpoint(init_weights(K3Model(cfg), seed), tmp / "checkpoint")
            log(f"wrote random {preset} checkpoint (seed {seed}) in {time.perf_counter() - t0:.1f}s")
            ck_dir, ck_ref = tmp / "checkpoint", "checkpoint"
        else:
            ck_dir = checkpoint_dir(checkpoint)
            ck_ref, cfg = str(ck_dir), K3Config.from_hf(ck_dir)
        t0 = time.perf_counter()
        model = load_checkpoint(ck_dir, dtype=torch.float32)
        log(f"loaded checkpoint in {time.perf_counter() - t0:.1f}s")
        carry_tokenizer(tmp / "tokenizer", None if preset is not None else ck_dir, cfg.vocab_size, log)
        if not open_checked(ck_dir)[1].in_model_layout:  # the module reads K3Model's names and shapes
            save_checkpoint(model, tmp / "checkpoint")       # k3c's layout: read back as it is written
            ck_dir, ck_ref = tmp / "checkpoint", "checkpoint"
            model = load_checkpoint(ck_dir, dtype=torch.float32)  # the reference runs what the module reads
            log("converted the checkpoint to k3c tensor names inside the bundle")
        compiled = compile_model(model, stored_dtypes(ck_dir), target, max_prompt=max_prompt, log=log)
        pack(ck_dir, tmp / ARCHIVE, log=log)
        _seal_bundle(tmp, model, ck_dir, ck_ref, compiled.vmfb, compiled.entry_points, target, max_prompt, log)
    log(f"bundle written to {out} in {time.perf_counter() - t_start:.1f}s")
    return open_bundle(out)


def meta_model(cfg: K3Config) -> K3Model:
    """K3Model of ``cfg`` on the meta device: what export needs (shapes, never weights)."""
    with torch.device("meta"):
        return K3Model(cfg).eval()


def published_dtypes(cfg: K3Config) -> dict[str, torch.dtype]:
    """Checkpoint tensor name -> the dtype a checkpoint of ``cfg`` stores it in (model/checkpoint.py
    ``stored_dtype``), for a module compiled without a checkpoint."""
    return {k: stored_dtype(k, t) for k, t in to_checkpoint(meta_model(cfg).state_dict()).items()}


def export_mlir(out: Path, cfg: K3Config, target: Target, *, dtypes: dict[str, torch.dtype] | None = None,
                max_prompt: int, force: bool, log=print) -> None:
    """``out``/torch.mlir (the exported module) and lowered.mlir (after ``target``'s passes, what
    iree-compile gets), from shapes only: the model is built on the meta device."""
    from ..passes.pipeline import Pipeline

    check_output(out, force=force)
    peak0, t0 = _peak_rss(), time.perf_counter()
    module, _ = export_cached(meta_model(cfg), dtypes or published_dtypes(cfg), max_prompt=max_prompt, log=log)
    before = str(module)
    Pipeline.for_target(target).run(module, log=log)
    with atomic_dir(out, force=force) as tmp:
        (tmp / "torch.mlir").write_text(before)
        (tmp / "lowered.mlir").write_text(str(module))
    log(f"wrote {out / 'torch.mlir'} (before passes) and {out / 'lowered.mlir'} (after, for {target.name}) "
        f"in {time.perf_counter() - t0:.1f}s, peak RSS {max(peak0, _peak_rss()) / 2**20:.0f} MiB")


def build_module_only(out: Path, cfg: K3Config, target: Target, *, max_prompt: int, force: bool,
                      log=print) -> Path:
    """``k3c compile --no-weights``: the module and a manifest, no checkpoint, archive or reference
    outputs; compiled from shapes only (the meta device), with the published stored dtypes."""
    check_output(out, force=force)
    t0 = time.perf_counter()
    dtypes = published_dtypes(cfg)
    compiled = compile_model(meta_model(cfg), dtypes, target, max_prompt=max_prompt, log=log)
    with atomic_dir(out, force=force) as tmp:
        (tmp / "module.vmfb").write_bytes(compiled.vmfb)
        manifest = Manifest(config=cfg.to_dict(), config_hash=cfg.hash, checkpoint_hash="", checkpoint="",
                            target=target.to_dict(), entry_points=compiled.entry_points, batch=1,
                            max_prompt=max_prompt)
        seal(tmp, manifest)
    log(f"module for {cfg.num_hidden_layers} layers written to {out} in {time.perf_counter() - t0:.1f}s, "
        f"peak RSS {_peak_rss() / 2**20:.0f} MiB (this process; iree-compile's own is logged above)")
    return out


def _peak_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def carry_tokenizer(dest: Path, checkpoint: Path | None, vocab_size: int, log) -> None:
    """The bundle's tokenizer/ (sealed with every other file): the tokenizer files of ``checkpoint``
    (runtimes/tokenizer.TOKENIZER_FILES), or for a preset (``checkpoint`` None) a byte-level
    tokenizer. Loaded once here, so a corrupt file fails the build before the compile."""
    from ..runtimes.tokenizer import TOKENIZER_FILES, load_tokenizer, write_byte_level_tokenizer
    if checkpoint is None:
        write_byte_level_tokenizer(dest, vocab_size)
        tokenizer = load_tokenizer(dest, vocab_size)
    else:
        present = [name for name in TOKENIZER_FILES if (checkpoint / name).is_file()]
        if not any(name in present for name in ("tiktoken.model", "tokenizer.json")):
            log(f"no tiktoken.model or tokenizer.json in {checkpoint}: the bundle takes token ids only")
            return
        tokenizer = load_tokenizer(checkpoint, vocab_size, checkpoint / "config.json")
        dest.mkdir()
        for name in present:
            shutil.copy2(checkpoint / name, dest / name)
    log(f"tokenizer: {', '.join(tokenizer.files)} (EOS ids {sorted(tokenizer.eos_ids) or 'none'}"
        f"{', chat template' if tokenizer.chat_template else ''})")


def _seal_bundle(tmp: Path, model: K3Model, ck_dir: Path, ck_ref: str, vmfb: bytes, entry_points: dict,
                 target: Target, max_prompt: int, log) -> None:
    """Write the module and the PyTorch reference outputs of ``model`` into ``tmp`` and seal it."""
    cfg = model.cfg
    (tmp / "module.vmfb").write_bytes(vmfb)
    t0 = time.perf_counter()
    prompt = validation_prompt(cfg, min(PROMPT_LEN, max_prompt))
    np.savez(tmp / "reference.npz", **reference_outputs(model, prompt, DECODE_STEPS))
    log(f"computed PyTorch reference outputs in {time.perf_counter() - t0:.1f}s")
    manifest = Manifest(config=cfg.to_dict(), config_hash=cfg.hash, checkpoint_hash=hash_dir(ck_dir),
                        checkpoint=ck_ref, target=target.to_dict(), entry_points=entry_points,
                        batch=1, max_prompt=max_prompt)
    seal(tmp, manifest)


def build_bundle_from_onnx(out: Path, target: Target, onnx_dir: Path, force: bool = True, log=print) -> Bundle:
    """A sealed bundle from an ONNX export directory (exporter/onnx_export.py): its models imported
    (exporter/onnx_import.py) and lowered by the same passes as the torch front end, its checkpoint
    carried into the bundle, reference.npz from the PyTorch model on that checkpoint."""
    from ..exporter.onnx_import import import_onnx
    from ..passes.pipeline import Pipeline

    out, onnx_dir = check_output(out, force=force, inputs=(onnx_dir,)), Path(onnx_dir)
    t_start = time.perf_counter()
    imported = import_onnx(onnx_dir, log=log)
    source = imported.manifest
    ck_src = onnx_dir / source["checkpoint"]
    if not ck_src.is_dir() or hash_dir(ck_src) != source["checkpoint_hash"]:
        raise K3Error(f"compile: checkpoint {ck_src} of {onnx_dir} is missing or changed since the export")
    with atomic_dir(out, force=force) as tmp:
        shutil.copytree(ck_src, tmp / "checkpoint")
        model = load_checkpoint(tmp / "checkpoint", dtype=torch.float32)
        Pipeline.for_target(target).run(imported.module, log=log)
        stamp(imported.module, module_facts(model.cfg.hash, stored_dtypes(tmp / "checkpoint"),
                                            target.to_dict(), source["max_prompt"]))
        vmfb = compile_mlir(str(imported.module), target, log=log)
        entry_points = {**source["entry_points"],
                        "front_end": f"onnx {onnx_dir.resolve()} (opsets {source['opset_imports']})"}
        _seal_bundle(tmp, model, tmp / "checkpoint", "checkpoint", vmfb, entry_points, target,
                     source["max_prompt"], log)
    log(f"bundle written to {out} in {time.perf_counter() - t_start:.1f}s")
    return open_bundle(out)
