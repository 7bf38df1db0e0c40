"""Build a bundle: checkpoint -> export -> passes -> iree-compile -> pack -> reference outputs -> sealed bundle.

The compiled module depends only on the config, the stored dtypes, the target and the compiler
inputs, never on weight values, so it is cached by a hash of those (``K3C_CACHE``, default
``~/.cache/k3c``) and shared by every checkpoint of the same config. The model is never built with
its weights to compile it: export runs on the meta device, the pack step streams the checkpoint
(artifacts/pack.py), and only the reference outputs need the float32 model, computed when it fits
in memory (docs/bundle.md §6). ``attach_weights`` makes a bundle of a module compiled with
``--no-weights`` and a checkpoint, without compiling again.

The compile chain (export, passes, iree.compiler) is imported by the functions that run it:
attaching weights and running a bundle need iree-base-runtime alone (docs/bundle.md).
"""
from __future__ import annotations

import hashlib
import json
import re
import resource
import shutil
import time
from math import prod
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..errors import K3Error
from . import DEFAULT_MAX_PROMPT
from ..model import K3Config, K3Model
from ..model.checkpoint import TORCH_DTYPES, checkpoint_dir, load_checkpoint, open_checked
from ..model.accounting import published_dtype
from ..model.shapes import memory_shortfall, require_memory
from ..model.stacking import to_checkpoint
from ..model.convert import save_checkpoint
from ..model.init import init_weights
from ..compiler.targets import Target, compile_mlir
from ..exporter.entry_points import Pool
from ..utils.files import atomic_dir, cache_dir, cache_lock, check_output, hash_dir, seal_entry, verified_entry
from ..artifacts.archive import ParameterTable, first_table_difference, read_archive, verify_archive
from ..artifacts.pack import checkpoint_table, pack
from ..artifacts.bundle import (ARCHIVE, FORMAT, MODULE, REFERENCE, Bundle, Manifest, check_archive_fits,
                                first_difference, module_facts, open_bundle, open_module, package_versions, seal)
from ..runtimes.device_fit import STATE_TENSOR, dtype_bytes, mib
from ..runtimes.tokenizer import TOKENIZER_FILES, load_tokenizer, write_byte_level_tokenizer

# The validation prompt (prefill in one call, then DECODE_STEPS greedy steps): 600 tokens cross the
# KDA prefill's blocks on every target (the CPU's 256-token blocks: two whole and a partial third).
PROMPT_LEN = 600
DECODE_STEPS = 8
EXPORT_SOURCES = ("ops", "model", "exporter")           # what shapes the exported torch-dialect module
COMPILE_SOURCES = ("ops", "model", "exporter", "passes")  # ... and the compiled one


@dataclass
class Compiled:
    vmfb: bytes
    entry_points: dict
    parameters: ParameterTable     # what the module reads (``module_parameters``)
    key: str


def source_hash(dirs: tuple[str, ...] = COMPILE_SOURCES) -> str:
    """Hash of the code in ``dirs`` (the code and the MLIR templates that shape a cached module), so a
    change misses the cache."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for d in dirs:
        for f in sorted(p for pattern in ("*.py", "*.mlir", "*.c") for p in (root / d).rglob(pattern)):
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(**parts) -> str:
    """A short hash of ``parts`` (JSON-serialisable): the name of a cache entry."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def export_cached(model: K3Model, dtypes: dict[str, torch.dtype], *, max_prompt: int, batch: int = 1,
                  devices: int = 1, pool: Pool | None = None, log=print):
    """The torch-dialect module (before passes) and its entry points, from the cache when the config,
    dtypes, shapes, device count, sequence pool, k3c sources and package versions match; exported
    (and cached) otherwise."""
    cached = cache_dir() / "export" / cache_key(
        config=model.cfg.hash, dtypes={k: str(v) for k, v in sorted(dtypes.items())}, max_prompt=max_prompt,
        batch=batch, source=source_hash(EXPORT_SOURCES), versions=package_versions(),
        **({"devices": devices} if devices > 1 else {}), **({"pool": pool.to_dict()} if pool else {}))
    with cache_lock(cached, log):
        if verified_entry(cached, ("torch.mlir", "entry_points.json"), log):
            log(f"exported module found in cache ({cached})")
            from iree.compiler import ir
            module = ir.Module.parse((cached / "torch.mlir").read_text(), context=ir.Context())
            return module, json.loads((cached / "entry_points.json").read_text())
        from ..exporter.export import export_model
        exported = export_model(model, dtypes, batch=batch, max_prompt=max_prompt, devices=devices, pool=pool,
                                log=log)
        with atomic_dir(cached) as tmp:
            (tmp / "torch.mlir").write_text(exported.text)
            (tmp / "entry_points.json").write_text(json.dumps(exported.entry_points))
            seal_entry(tmp)
    return exported.module, exported.entry_points


def compile_model(model: K3Model, dtypes: dict[str, torch.dtype], target: Target, *, max_prompt: int,
                  batch: int = 1, pool: Pool | None = None, log=print) -> Compiled:
    """Export (once per config, shared by every target), lower and compile ``model`` (its weights
    unread: the meta device will do) for ``target`` (with a sequence ``pool`` for serving: the
    entry points of exporter/entry_points.Pool), or fetch the compiled module from the cache."""
    key = cache_key(config=model.cfg.hash, dtypes={k: str(v) for k, v in sorted(dtypes.items())},
                    target=target.to_dict(), max_prompt=max_prompt, batch=batch, source=source_hash(),
                    versions=package_versions(), bundle_format=FORMAT, **({"pool": pool.to_dict()} if pool else {}))
    cached = cache_dir() / key
    files = ("module.vmfb", "entry_points.json", "parameters.json")
    with cache_lock(cached, log):
        if verified_entry(cached, files, log):
            log(f"compiled module found in cache ({cached})")
            return Compiled(*(f.read_bytes() if f.suffix == ".vmfb" else json.loads(f.read_text())
                              for f in (cached / name for name in files)), key)
        module, entry_points = export_cached(model, dtypes, max_prompt=max_prompt, batch=batch,
                                             devices=target.devices, pool=pool, log=log)
        from ..passes.pipeline import Pipeline
        Pipeline.for_target(target).run(module, log=log)
        parameters = module_parameters(module)
        stamp(module, module_facts(model.cfg.hash, parameters, target.to_dict(), max_prompt, batch,
                                   pool.to_dict() if pool else {}))
        vmfb = compile_mlir(str(module), target, log=log)
        with atomic_dir(cached) as tmp:
            (tmp / "module.vmfb").write_bytes(vmfb)
            (tmp / "entry_points.json").write_text(json.dumps(entry_points))
            (tmp / "parameters.json").write_text(json.dumps(parameters))
            seal_entry(tmp)
    return Compiled(vmfb, entry_points, parameters, key)


_PARAMETER = re.compile(r'#flow\.parameter\.named<"[^"]*"::"(?P<name>[^"]+)">')
_ELEMENT = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i8": "uint8", "ui8": "uint8"}


def module_parameters(module) -> ParameterTable:
    """What a lowered module reads: each ``util.global`` initialised from a named parameter, as
    [dtype, shape] (archive.ParameterTable), from the module itself."""
    from iree.compiler import ir
    table = {}
    with module.context:
        for op in module.body.operations:
            init = op.attributes["initial_value"] if "initial_value" in op.attributes else None
            m = _PARAMETER.match(str(init)) if init is not None else None
            if m:
                t = ir.RankedTensorType(ir.TypeAttr(op.attributes["type"]).value)
                table[m["name"]] = [_ELEMENT[str(t.element_type)], list(t.shape)]
    return dict(sorted(table.items()))


def stamp(module, facts: dict[str, str]) -> None:
    """Put ``facts`` (bundle.module_facts) into the reflection metadata of the module's public
    functions (its entry points), where iree-compile keeps them and the verifier of a bundle reads
    them back (bundle.check_module)."""
    from iree.compiler import ir
    with module.context:
        attr = ir.DictAttr.get({k: ir.StringAttr.get(v) for k, v in facts.items()})
        for op in module.body.operations:
            if op.operation.name == "func.func" and ("sym_visibility" not in op.attributes or
                                                     ir.StringAttr(op.attributes["sym_visibility"]).value == "public"):
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


def checkpoint_reference(checkpoint: Path, max_prompt: int) -> dict[str, np.ndarray] | str:
    """The reference outputs (``reference_outputs``) of the float32 model on ``checkpoint``, or, when
    that model does not fit in memory (estimated first: model.shapes.memory_shortfall), why not."""
    cfg = K3Config.from_hf(checkpoint)
    if (why := memory_shortfall(cfg, torch.float32)) is not None:
        return why
    model = load_checkpoint(checkpoint, dtype=torch.float32)
    return reference_outputs(model, validation_prompt(cfg, min(PROMPT_LEN, max_prompt)), DECODE_STEPS)


def write_reference(dest: Path, checkpoint: Path, max_prompt: int, log) -> str:
    """Write reference.npz into ``dest``; "" when written, else why not (logged in one line)."""
    t0 = time.perf_counter()
    ref = checkpoint_reference(checkpoint, max_prompt)
    if isinstance(ref, str):
        log(f"no reference outputs: {ref}; validate it layer by layer (k3c validate --layers)")
        return f"{ref} when the bundle was built"
    np.savez(dest / REFERENCE, **ref)
    log(f"computed PyTorch reference outputs in {time.perf_counter() - t0:.1f}s")
    return ""


def build_bundle(out: Path, target: Target, *, preset: str | None = None, checkpoint: Path | None = None,
                 seed: int = 0, max_prompt: int = DEFAULT_MAX_PROMPT, pool: Pool | None = None,
                 force: bool = True, log=print) -> Bundle:
    """Write a sealed bundle at ``out``. With ``preset``, a random checkpoint (``seed``) is created
    inside the bundle; with ``checkpoint`` (any layout model/checkpoint.py reads), the bundle refers
    to it by absolute path and hash and packs it as it is (no converted copy). The model is compiled
    from shapes, so a checkpoint too large for memory is built too, without reference outputs; with
    a sequence ``pool`` for serving (exporter/entry_points.Pool). ``out`` follows
    utils.files.check_output (``force``: replace a bundle written before)."""
    if (preset is None) == (checkpoint is None):
        raise K3Error("compile: give exactly one of --preset and --checkpoint")
    checkpoint = None if checkpoint is None else checkpoint_dir(checkpoint)
    out = check_output(out, force=force, inputs=(checkpoint,))
    check_pool(pool, K3Config.preset(preset) if preset else K3Config.from_hf(checkpoint), target)
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
            ck_dir, ck_ref = checkpoint, str(checkpoint)
        model, ckpt = open_checked(ck_dir)          # headers only; the model is on the meta device
        table, ck_hash = checkpoint_table(model.cfg, ckpt, target.devices), hash_dir(ck_dir)
        pack(ck_dir, tmp / ARCHIVE, checkpoint_hash=ck_hash, devices=target.devices, log=log)  # reads every tensor: bad data fails first
        carry_tokenizer(tmp / "tokenizer", None if preset is not None else ck_dir, model.cfg.vocab_size, log)
        dtypes = {name: TORCH_DTYPES[e.dtype] for name, e in ckpt.entries.items()}
        compiled = compile_model(model.eval(), dtypes, target, max_prompt=max_prompt, pool=pool, log=log)
        log_pool(pool, compiled.entry_points, log)
        if problem := first_table_difference(compiled.parameters, table):
            raise K3Error(f"compile: checkpoint {ck_dir} {problem}")
        manifest = Manifest(config=model.cfg.to_dict(), config_hash=model.cfg.hash, checkpoint_hash=ck_hash,
                            checkpoint=ck_ref, target=target.to_dict(), entry_points=compiled.entry_points, batch=1,
                            max_prompt=max_prompt, parameters=compiled.parameters, weights=ARCHIVE,
                            pool=pool.to_dict() if pool else {})
        _assemble(tmp, compiled.vmfb, manifest, ck_dir, log)
    log(f"bundle written to {out} in {time.perf_counter() - t_start:.1f}s")
    return open_bundle(out)


def check_pool(pool: Pool | None, cfg: K3Config, target: Target) -> None:
    """A K3Error when ``pool`` does not fit the model or the target: a slot holds at most the
    model's context, and the pool is for one CPU device (docs/pipeline.md §8)."""
    if pool is None:
        return
    if target.devices > 1:
        raise K3Error(f"compile: --max-batch builds a sequence pool on one device; --devices {target.devices} "
                      "spans several")
    if target.backend != "llvm-cpu":
        raise K3Error(f"compile: --max-batch builds a sequence pool for the CPU targets only; {target.name} is "
                      "not one (docs/pipeline.md §8)")
    if not 2 <= pool.context <= cfg.max_position_embeddings:
        raise K3Error(f"compile: --slot-context {pool.context} must lie in [2, {cfg.max_position_embeddings}] "
                      "(the model's max_position_embeddings)")


def pool_bytes(entry_points: dict) -> int:
    """Bytes of the sequence pool's tensors as the ``pool`` signature lists them (0 without one)."""
    return sum(dtype_bytes(dtype) * prod(int(d) for d in dims.split(",") if d.strip())
               for dims, dtype in STATE_TENSOR.findall(entry_points.get("pool", "")))


def log_pool(pool: Pool | None, entry_points: dict, log) -> None:
    """Say what the sequence pool holds on the device (its size is set by --slot-context)."""
    if pool:
        log(f"sequence pool: {pool.max_batch} sequences of {pool.context:,} tokens, "
            f"{mib(pool_bytes(entry_points))} on the device")


def _assemble(tmp: Path, vmfb: bytes, manifest: Manifest, ck_dir: Path, log) -> None:
    """Write the module and the reference outputs of ``ck_dir`` into ``tmp`` and seal it with ``manifest``."""
    (tmp / MODULE).write_bytes(vmfb)
    manifest.no_reference = write_reference(tmp, ck_dir, manifest.max_prompt, log)
    seal(tmp, manifest)


def attach_weights(module_dir: Path, checkpoint: Path, out: Path | None = None, *, weights: Path | None = None,
                   force: bool = False, log=print) -> Bundle:
    """``k3c attach``: a sealed bundle at ``out`` (default out/<checkpoint>-<target>, replaced
    without ``force``) of the module compiled with ``--no-weights`` at ``module_dir`` and
    ``checkpoint`` (any layout model/checkpoint.py reads), without compiling again: the checkpoint
    packed into the bundle, or ``weights``, an archive ``k3c pack`` made of it, named by path
    (docs/bundle.md §5). Every mismatch (config, names, shapes, stored dtypes, an archive of another
    config or checkpoint, or damaged) is a K3Error before anything is written."""
    t_start = time.perf_counter()
    module = open_module(module_dir)
    m = module.manifest
    ck_dir = checkpoint_dir(checkpoint)
    if out is None:
        out, force = Path("out") / f"{ck_dir.name}-{m.target['name'].replace(':', '-')}", True
    cfg = K3Config.from_hf(ck_dir)
    if cfg.hash != m.config_hash:
        key, ours, theirs = first_difference(m.config, cfg.to_dict())
        raise K3Error(f"attach: {module_dir} was compiled for config {m.config_hash}, checkpoint {ck_dir} has "
                      f"config {cfg.hash} ({key}: {ours} vs {theirs})")
    _, ckpt = open_checked(ck_dir)
    devices = m.target.get("devices", 1)
    if problem := first_table_difference(m.parameters, checkpoint_table(cfg, ckpt, devices)):
        raise K3Error(f"attach: {module_dir} was compiled for other parameters: checkpoint {ck_dir} {problem}")
    archive = None if weights is None else read_archive(weights)
    out = check_output(out, force=force, inputs=(ck_dir, module.root, weights))
    manifest = replace(m, checkpoint=str(ck_dir), checkpoint_hash=hash_dir(ck_dir), weights=ARCHIVE, files={})
    if archive is not None:
        check_archive_fits(archive, manifest, f"attach: {module_dir}")
        verify_archive(archive, log)
    with atomic_dir(out, force=force) as tmp:
        if archive is None:
            pack(ck_dir, tmp / ARCHIVE, checkpoint_hash=manifest.checkpoint_hash, devices=devices, log=log)
        else:
            manifest.weights, manifest.weights_digest = str(archive.path.resolve()), archive.digest
        carry_tokenizer(tmp / "tokenizer", ck_dir, cfg.vocab_size, log)
        _assemble(tmp, module.module_path.read_bytes(), manifest, ck_dir, log)
    log(f"bundle written to {out} in {time.perf_counter() - t_start:.1f}s")
    return open_bundle(out)


def meta_model(cfg: K3Config) -> K3Model:
    """K3Model of ``cfg`` on the meta device: what export needs (shapes, never weights)."""
    with torch.device("meta"):
        return K3Model(cfg).eval()


def published_dtypes(cfg: K3Config) -> dict[str, torch.dtype]:
    """Checkpoint tensor name -> the dtype the published layout of ``cfg`` (k3c's, the K3 release's,
    Kimi Linear's: model/accounting.py ``published_dtype``) stores it in, for a module compiled
    without a checkpoint."""
    return {k: published_dtype(cfg, k, t) for k, t in to_checkpoint(meta_model(cfg).state_dict()).items()}


def export_mlir(out: Path, cfg: K3Config, target: Target, *, dtypes: dict[str, torch.dtype] | None = None,
                max_prompt: int, force: bool, log=print) -> None:
    """``out``/torch.mlir (the exported module) and lowered.mlir (after ``target``'s passes, what
    iree-compile gets), from shapes only: the model is built on the meta device."""
    check_output(out, force=force)
    peak0, t0 = _peak_rss(), time.perf_counter()
    module, _ = export_cached(meta_model(cfg), dtypes or published_dtypes(cfg), max_prompt=max_prompt,
                              devices=target.devices, log=log)
    before = str(module)
    from ..passes.pipeline import Pipeline
    Pipeline.for_target(target).run(module, log=log)
    with atomic_dir(out, force=force) as tmp:
        (tmp / "torch.mlir").write_text(before)
        (tmp / "lowered.mlir").write_text(str(module))
    log(f"wrote {out / 'torch.mlir'} (before passes) and {out / 'lowered.mlir'} (after, for {target.name}) "
        f"in {time.perf_counter() - t0:.1f}s, peak RSS {max(peak0, _peak_rss()) / 2**20:.0f} MiB")


def build_module_only(out: Path, cfg: K3Config, target: Target, *, max_prompt: int, pool: Pool | None = None,
                      force: bool, log=print) -> Path:
    """``k3c compile --no-weights``: the module and a manifest, no checkpoint, archive or reference
    outputs; compiled from shapes only (the meta device), with the published stored dtypes."""
    check_output(out, force=force)
    check_pool(pool, cfg, target)
    t0 = time.perf_counter()
    dtypes = published_dtypes(cfg)
    compiled = compile_model(meta_model(cfg), dtypes, target, max_prompt=max_prompt, pool=pool, log=log)
    log_pool(pool, compiled.entry_points, log)
    with atomic_dir(out, force=force) as tmp:
        (tmp / MODULE).write_bytes(compiled.vmfb)
        manifest = Manifest(config=cfg.to_dict(), config_hash=cfg.hash, checkpoint_hash="", checkpoint="",
                            target=target.to_dict(), entry_points=compiled.entry_points, batch=1,
                            max_prompt=max_prompt, parameters=compiled.parameters, weights="",
                            no_reference="compiled with --no-weights", pool=pool.to_dict() if pool else {})
        seal(tmp, manifest)
    log(f"module for {cfg.num_hidden_layers} layers written to {out} in {time.perf_counter() - t0:.1f}s, "
        f"peak RSS {_peak_rss() / 2**20:.0f} MiB (this process; iree-compile's own is logged above)")
    return out


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def carry_tokenizer(dest: Path, checkpoint: Path | None, vocab_size: int, log) -> None:
    """The bundle's tokenizer/ (sealed with every other file): the tokenizer files of ``checkpoint``
    (runtimes/tokenizer.TOKENIZER_FILES), or for a preset (``checkpoint`` None) a byte-level
    tokenizer. Loaded once here, so a corrupt file fails the build before the compile."""
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


def build_bundle_from_onnx(out: Path, target: Target, onnx_dir: Path, force: bool = True, log=print) -> Bundle:
    """A sealed bundle from an ONNX export directory (exporter/onnx_export.py): its models imported
    (exporter/onnx_import.py) and lowered by the same passes as the torch front end, its checkpoint
    carried into the bundle (the module reads its tensors), reference.npz from the PyTorch model on it."""
    from ..exporter.onnx_import import import_onnx  # deferred heavy optional import (onnx, ~1.3 s): ONNX only

    out, onnx_dir = check_output(out, force=force, inputs=(onnx_dir,)), Path(onnx_dir)
    t_start = time.perf_counter()
    imported = import_onnx(onnx_dir, log=log)
    source = imported.manifest
    ck_src = onnx_dir / source["checkpoint"]
    if not ck_src.is_dir() or hash_dir(ck_src) != source["checkpoint_hash"]:
        raise K3Error(f"compile: checkpoint {ck_src} of {onnx_dir} is missing or changed since the export")
    with atomic_dir(out, force=force) as tmp:
        shutil.copytree(ck_src, tmp / "checkpoint")
        cfg = K3Config.from_hf(tmp / "checkpoint")
        from ..passes.pipeline import Pipeline
        Pipeline.for_target(target).run(imported.module, log=log)
        parameters = module_parameters(imported.module)
        stamp(imported.module, module_facts(cfg.hash, parameters, target.to_dict(), source["max_prompt"]))
        vmfb = compile_mlir(str(imported.module), target, log=log)
        entry_points = {**source["entry_points"],
                        "front_end": f"onnx {onnx_dir.resolve()} (opsets {source['opset_imports']})"}
        manifest = Manifest(config=cfg.to_dict(), config_hash=cfg.hash, checkpoint_hash=hash_dir(tmp / "checkpoint"),
                            checkpoint="checkpoint", target=target.to_dict(), entry_points=entry_points, batch=1,
                            max_prompt=source["max_prompt"], parameters=parameters, weights="")
        _assemble(tmp, vmfb, manifest, tmp / "checkpoint", log)
    log(f"bundle written to {out} in {time.perf_counter() - t_start:.1f}s")
    return open_bundle(out)
