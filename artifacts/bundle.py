"""The bundle: everything needed to run and re-validate a compiled model, verified on open (docs/bundle.md).

    BUNDLE/manifest.json   config and its hash, checkpoint hashes, target and flags, package
                           versions, entry points, the parameters the module reads, sha256 of every
                           file below
    BUNDLE/module.vmfb     the compiled module (weights are parameters, never constants)
    BUNDLE/checkpoint/     the checkpoint the bundle was built from (when the bundle owns it)
    BUNDLE/reference.npz   PyTorch outputs for the validation prompt (absent when the model did not
                           fit in memory at build time: ``no_reference`` says why)
    BUNDLE/weights.irpa    the checkpoint packed in the program's layout (artifacts/pack.py): what
                           the module's parameters are read from, unless ``weights`` names an
                           archive outside the bundle (``k3c attach --weights``); ONNX bundles read
                           the checkpoint

A module directory (``k3c compile --no-weights``) holds only the manifest and module.vmfb; ``k3c
attach`` makes a bundle of it with a checkpoint, without compiling again.

Bundles are written into a temporary sibling directory and renamed into place, so a reader never
sees a half-written bundle. Opening one checks, before anything runs: every manifest field's type;
every listed file (inside the bundle, module and reference among them) against its sha256; the
checkpoint (inside the bundle and exactly its listed files, or an absolute path to a directory with
a config.json whose hash matches); its config against the manifest's; the manifest against the
module itself, whose entry points carry the facts it was compiled for (``module_facts``: config,
parameter table, target, batch, max prompt) in their IREE reflection metadata, so an edited
manifest or a module compiled for other weights is refused; and the archive against all of these
(config, checkpoint, parameter names, dtypes and shapes; an archive outside the bundle also against
its sha256s), or, without an archive, the checkpoint's tensors against the parameters the module
reads. Opening a bundle with an archive imports no torch.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path

from ..errors import K3Error
from ..exporter.entry_points import ENTRY_POINTS, REQUIRED, Pool
from .archive import first_table_difference, read_archive, verify_archive
from ..model.config import K3Config
from ..utils.files import MARKER, digest_of, files_under, hash_dir, inside, recover, sha256_file

MANIFEST = "manifest.json"
FORMAT = 3          # 2: entry points carry module_facts; 3: parameter table, weights, no_reference
MODULE, REFERENCE, ARCHIVE = "module.vmfb", "reference.npz", "weights.irpa"
PACKAGES = ("k3c", "torch", "torch-mlir", "iree-base-compiler", "iree-base-runtime")


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


@dataclass
class Manifest:
    config: dict
    config_hash: str
    checkpoint_hash: str            # sha256 over the checkpoint's files (names and contents)
    checkpoint: str                 # "checkpoint" (inside the bundle) or an absolute path
    target: dict                    # Target fields: name, backend, driver, flags
    entry_points: dict              # name -> signature text
    batch: int
    max_prompt: int                 # longest prompt the prefill entry point accepts
    parameters: dict                # program parameter -> [dtype, shape]: what the module reads
    weights: str                    # "weights.irpa", an absolute path to an archive, or "" (the checkpoint's tensors)
    weights_digest: str = ""        # an archive outside the bundle: archive.Archive.digest
    no_reference: str = ""          # why there is no reference.npz ("" when there is one)
    pool: dict = field(default_factory=dict)         # the sequence pool (entry_points.Pool), {} for none
    files: dict = field(default_factory=dict)        # relative path -> sha256
    packages: dict = field(default_factory=package_versions)
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_raw(cls, raw) -> "Manifest":
        """K3Error naming the first field that is missing, unknown or of the wrong JSON type."""
        if not isinstance(raw, dict):
            raise K3Error(f"it is a JSON {_json_type(raw)}, not an object")
        types = {f.name: {"dict": dict, "str": str, "int": int}[f.type] for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - raw.keys())
        if missing:
            raise K3Error(f"field {missing[0]!r} is missing")
        for name, value in raw.items():
            want = types.get(name)
            if want is None:
                raise K3Error(f"field {name!r} is not a manifest field")
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                expected = "integer" if want is int else _json_type(want())
                raise K3Error(f"field {name!r} is a JSON {_json_type(value)}, expected {expected}")
        for key in ("name", "backend", "driver"):
            if not isinstance(raw["target"].get(key), str):
                raise K3Error(f"field 'target' has no string {key!r}")
        flags = raw["target"].get("flags")
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise K3Error("field 'target' has no list of strings 'flags'")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.get("files", {}).items()):
            raise K3Error("field 'files' must map file names to sha256 strings")
        pool = raw.get("pool", {})   # empty, or entry_points.Pool's fields
        if pool and (sorted(pool) != sorted(Pool.__dataclass_fields__)
                     or not all(type(v) is int and v >= 1 for v in pool.values())):
            raise K3Error(f"field 'pool' must be empty or hold positive integers "
                          f"{', '.join(sorted(Pool.__dataclass_fields__))}")
        return cls(**raw)


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}[type(value)]


def seal(root: Path, manifest: Manifest) -> None:
    """Record the sha256 of every file under ``root`` in the manifest and write it."""
    manifest.files = {name: sha256_file(f) for name, f in files_under(root).items() if name != MANIFEST}
    (root / MANIFEST).write_text(manifest.to_json())


def stored_dtypes(checkpoint: Path):
    """Parameter name -> torch dtype as stored in the checkpoint (headers only)."""
    from ..model.checkpoint import TORCH_DTYPES, open_checked  # deferred heavy import (torch, ~2 s): opening a bundle to run it loads no torch

    _, ckpt = open_checked(checkpoint)
    return {name: TORCH_DTYPES[e.dtype] for name, e in ckpt.entries.items()}


def module_facts(config_hash: str, parameters: dict, target: dict, max_prompt: int, batch: int = 1,
                 pool: dict | None = None) -> dict[str, str]:
    """What a compiled module is valid for, as strings: stamped into its entry points' reflection
    metadata at compile time (build.stamp) and compared with the manifest on open. ``parameters``:
    the table of what it reads (archive.ParameterTable); ``pool``: its sequence pool, if any."""
    table = json.dumps(parameters, sort_keys=True)
    return {"k3c.config": config_hash, "k3c.parameters": hashlib.sha256(table.encode()).hexdigest()[:16],
            "k3c.target": json.dumps(target, sort_keys=True), "k3c.batch": str(batch),
            "k3c.max_prompt": str(max_prompt), **({"k3c.pool": json.dumps(pool, sort_keys=True)} if pool else {})}


@dataclass
class Bundle:
    root: Path
    manifest: Manifest

    @property
    def module_path(self) -> Path:
        return self.root / MODULE

    @property
    def checkpoint_dir(self) -> Path:
        ck = Path(self.manifest.checkpoint)
        return ck if ck.is_absolute() else self.root / ck

    @property
    def reference_path(self) -> Path:
        return self.root / REFERENCE

    @property
    def archive_path(self) -> Path | None:
        """The parameter archive the module reads (None: an ONNX bundle reads its checkpoint)."""
        w = self.manifest.weights
        return None if not w else Path(w) if Path(w).is_absolute() else self.root / w

    @property
    def pool(self) -> Pool | None:
        """The module's sequence pool for serving (None: compiled without one)."""
        return Pool(**self.manifest.pool) if self.manifest.pool else None

    @property
    def entry_point_names(self) -> tuple[str, ...]:
        """The entry points a module of this bundle may have: every module's, and its pool's."""
        return ENTRY_POINTS + (self.pool.entry_points() if self.pool else ())

    @property
    def parameter_files(self) -> list[Path]:
        """What the module's parameters are read from: the packed archive, or (a bundle from ONNX,
        whose parameters are the checkpoint's own tensors) the checkpoint's safetensors files."""
        if self.archive_path:
            return [self.archive_path]
        from ..model.checkpoint import checkpoint_files  # deferred heavy import (torch, ~3 s): a bundle with an archive runs without torch
        return checkpoint_files(self.checkpoint_dir)


def open_bundle(path: str | Path) -> Bundle:
    """Read the manifest and verify the bundle (module docstring); K3Error names the first problem."""
    root = Path(path)
    if not root.is_dir():
        recover(root)  # a writer killed between its two renames leaves the old bundle aside
    if not root.is_dir():
        raise K3Error(f"bundle: directory {root} does not exist")
    raw = _manifest_json(root, "bundle", "not a k3c bundle")
    if isinstance(raw, dict) and raw.get("checkpoint") == "":
        raise K3Error(f"bundle: {root} was compiled with --no-weights (module and manifest only); give it "
                      f"weights with k3c attach {root} --checkpoint DIR")
    manifest = _read_manifest(root, raw)
    _check_files(root, manifest)
    bundle = Bundle(root, manifest)
    _check_checkpoint(bundle)
    config = K3Config.from_hf(bundle.checkpoint_dir)
    _check_config(bundle, config)
    _check_checkpoint_hash(bundle)
    check_module(bundle)
    if bundle.archive_path is None:
        check_checkpoint_parameters(bundle)
    else:
        _check_archive(bundle)
    return bundle


def open_module(path: str | Path) -> Bundle:
    """A module directory (``k3c compile --no-weights``): its manifest, module.vmfb against its
    sha256 and the facts stamped into it; K3Error names the first problem."""
    root = Path(path)
    raw = _manifest_json(root, "module", "not a module written by k3c compile --no-weights")
    if isinstance(raw, dict) and raw.get("checkpoint"):
        raise K3Error(f"module: {root} is a bundle with weights already (checkpoint {raw['checkpoint']}); "
                      "attach takes a module written by k3c compile --no-weights")
    manifest = _read_manifest(root, raw)
    _check_files(root, manifest, module_only=True)
    bundle = Bundle(root, manifest)
    check_module(bundle)
    return bundle


def _manifest_json(root: Path, what: str, otherwise: str):
    """The parsed manifest.json of ``root`` (a bundle or a module directory: ``what``)."""
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise K3Error(f"{what}: {root} has no {MANIFEST} ({otherwise})")
    try:
        return json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise K3Error(f"{what}: {mpath} is not valid JSON ({e})") from None
    except RecursionError:
        raise K3Error(f"{what}: {mpath} is nested too deeply to be a manifest") from None


def _read_manifest(root: Path, raw) -> Manifest:
    if isinstance(raw, dict) and raw.get("format", FORMAT) != FORMAT:
        raise K3Error(f"bundle: {root} has format {raw['format']}, this k3c reads format {FORMAT} (compile it again)")
    try:
        return Manifest.from_raw(raw)
    except K3Error as e:
        raise K3Error(f"bundle: {root / MANIFEST} is not a valid manifest: {e}") from None


def _check_files(root: Path, manifest: Manifest, module_only: bool = False) -> None:
    """The bundle holds exactly its listed files (besides the manifest and k3c's marker), none of
    them, nor any directory below the root, a symbolic link; every listed file matches its
    sha256; the module and (unless ``no_reference`` says why not) the reference are listed. So
    nothing unlisted (a tokenizer file dropped in, a template linked from elsewhere) is ever read."""
    for required in (MODULE,) if module_only or manifest.no_reference else (MODULE, REFERENCE):
        if required not in manifest.files:
            raise K3Error(f"bundle: the manifest of {root} does not list {required} (a bundle lists every file it holds)")
    for rel, path in _entries(root):
        if path.is_symlink():
            raise K3Error(f"bundle: {rel} in {root} is a symbolic link (a bundle holds its own files; none is "
                          "read through a link)")
        if path.is_file() and rel not in manifest.files and rel not in (MANIFEST, MARKER):
            raise K3Error(f"bundle: file {rel} in {root} is not listed in the manifest (a bundle holds exactly "
                          "the files it lists)")
    for rel, digest in manifest.files.items():
        f = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not inside(f, root):
            raise K3Error(f"bundle: the manifest of {root} lists {rel}, which is outside the bundle")
        if not f.is_file():
            raise K3Error(f"bundle: file {rel} listed in the manifest is missing from {root}")
        if sha256_file(f) != digest:
            raise K3Error(f"bundle: file {rel} in {root} does not match its sha256 in the manifest (tampered or corrupt)")


def _entries(root: Path):
    """(relative posix name, path) of everything below ``root``, links not followed."""
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(directory, name)
            yield path.relative_to(root).as_posix(), path


def _check_checkpoint(bundle: Bundle) -> None:
    """An in-bundle checkpoint is a directory inside the bundle holding only listed files; an
    absolute one must look like a checkpoint (a config.json) before anything in it is read."""
    root, manifest, ck = bundle.root, bundle.manifest, bundle.checkpoint_dir
    if Path(manifest.checkpoint).is_absolute():
        if not ck.is_dir() or not (ck / "config.json").is_file():
            raise K3Error(f"bundle: checkpoint {ck} referenced by {root} is missing or not a checkpoint (no config.json)")
        return
    if ".." in Path(manifest.checkpoint).parts or not inside(ck, root) or ck.resolve() == root.resolve():
        raise K3Error(f"bundle: checkpoint {manifest.checkpoint!r} of {root} is not a directory inside the bundle")
    if not ck.is_dir():
        raise K3Error(f"bundle: checkpoint {ck} referenced by {root} is missing")
    stray = sorted(files_under(ck).keys() - _listed_checkpoint_files(manifest).keys())
    if stray:
        raise K3Error(f"bundle: file {Path(manifest.checkpoint, stray[0]).as_posix()} in {root} is not listed in the manifest")


def _listed_checkpoint_files(manifest: Manifest) -> dict[str, str]:
    prefix = Path(manifest.checkpoint).as_posix().rstrip("/") + "/"
    return {k[len(prefix):]: v for k, v in manifest.files.items() if k.startswith(prefix)}


def _check_checkpoint_hash(bundle: Bundle) -> None:
    """The checkpoint hashes as it did at compile time (an in-bundle one from its verified files)."""
    m, ck = bundle.manifest, bundle.checkpoint_dir
    absolute = Path(m.checkpoint).is_absolute()
    if (hash_dir(ck) if absolute else digest_of(_listed_checkpoint_files(m))) != m.checkpoint_hash:
        raise K3Error(f"bundle: checkpoint {ck} " + (f"changed since {bundle.root} was compiled" if absolute else
                      f"of {bundle.root} does not match its checkpoint_hash"))


def first_difference(a, b, prefix: str = "") -> tuple[str, str, str]:
    """The first key (dotted) at which two JSON values differ, and both values as JSON."""
    if isinstance(a, dict) and isinstance(b, dict):
        key = next(k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))
        return first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return prefix.rstrip("."), json.dumps(a), json.dumps(b)


def _check_config(bundle: Bundle, config) -> None:
    m = bundle.manifest
    if config.to_dict() == m.config and config.hash == m.config_hash:
        return
    if config.to_dict() == m.config:
        raise K3Error(f"bundle: {bundle.root} was compiled for config {m.config_hash}, but its checkpoint "
                      f"{bundle.checkpoint_dir} has config {config.hash}")
    key, ours, theirs = first_difference(m.config, config.to_dict())
    if config.hash != m.config_hash:
        raise K3Error(f"bundle: {bundle.root} was compiled for config {m.config_hash}, but its checkpoint "
                      f"{bundle.checkpoint_dir} has config {config.hash} ({key}: {ours} vs {theirs})")
    raise K3Error(f"bundle: {bundle.root} was compiled for config with {key} = {theirs}, but its {MANIFEST} "
                  f"has config with {key} = {ours} (edited)")


def check_module(bundle: Bundle) -> None:
    """The facts stamped into the module's entry points equal what the manifest says."""
    import iree.runtime as rt  # deferred heavy import (~1.5 s): only opening a bundle reads its module

    m = bundle.manifest
    want = module_facts(m.config_hash, m.parameters, m.target, m.max_prompt, m.batch, m.pool)
    try:
        module = rt.VmModule.copy_buffer(rt.VmInstance(), bundle.module_path.read_bytes())
        found = {name: module.lookup_function(name) for name in bundle.entry_point_names}
    except (RuntimeError, ValueError) as e:
        raise K3Error(f"bundle: {bundle.module_path} is not an IREE module ({str(e).splitlines()[0][:200]})") from None
    for name, fn in found.items():
        if fn is None and (name in REQUIRED or name not in ENTRY_POINTS):
            raise K3Error(f"bundle: {bundle.module_path} has no entry point {name!r}")
        if fn is None:
            continue
        got = fn.reflection
        for key, value in want.items():
            if got.get(key) == value:
                continue
            if key == "k3c.parameters":
                raise K3Error(f"bundle: {bundle.module_path} was compiled for other parameters than its "
                              f"{MANIFEST} lists (edited manifest or another module)")
            what, theirs, ours = key.removeprefix("k3c."), got.get(key, "(none)"), value
            if key == "k3c.target" and key in got:
                field_name, theirs, ours = first_difference(json.loads(got[key]), json.loads(value))
                what = f"target {field_name}"
            raise K3Error(f"bundle: {bundle.module_path} was compiled for {what} {theirs}, its {MANIFEST} "
                          f"says {ours} (edited manifest or another module)")


def check_checkpoint_parameters(bundle: Bundle) -> None:
    """A bundle without an archive (from ONNX) reads the checkpoint's own tensors: their headers give
    exactly the dtypes and shapes of the parameters the module reads. (A bundle with an archive needs
    no such check: the archive was packed from the checkpoint of ``checkpoint_hash``, each tensor
    checked against the parameter table then, and ``_check_archive`` holds it to both.)"""
    from ..model.checkpoint import TORCH_DTYPES, read_header

    m, ck = bundle.manifest, bundle.checkpoint_dir
    stored = {k: [str(TORCH_DTYPES[d]).removeprefix("torch."), list(s)]
              for f in bundle.parameter_files for k, (d, s) in read_header(f).items()}
    problem = first_table_difference(m.parameters, {k: v for k, v in stored.items() if k in m.parameters})
    if problem:
        raise K3Error(f"bundle: {bundle.module_path} was compiled for other parameter dtypes or shapes than its "
                      f"checkpoint {ck} stores: the checkpoint {problem}")


def _check_archive(bundle: Bundle) -> None:
    """The archive the module reads was packed from the bundle's checkpoint for its config and holds
    exactly the parameters the module reads; one outside the bundle is also read whole against its
    sha256s and must be the one attached (``weights_digest``)."""
    m, path = bundle.manifest, bundle.archive_path
    if not Path(m.weights).is_absolute():
        if m.weights not in m.files or ".." in Path(m.weights).parts:
            raise K3Error(f"bundle: the manifest of {bundle.root} does not list its archive {m.weights}")
    archive = read_archive(path)
    if Path(m.weights).is_absolute():
        verify_archive(archive, log=lambda _: None)
        if archive.digest != m.weights_digest:
            raise K3Error(f"bundle: archive {path} changed since it was attached to {bundle.root}")
    check_archive_fits(archive, m, f"bundle: {bundle.root}")


def check_archive_fits(archive, m: Manifest, where: str) -> None:
    """``archive`` (archive.Archive) is for the manifest's config, checkpoint and parameter table."""
    if archive.config_hash != m.config_hash:
        key, ours, theirs = first_difference(m.config, archive.config) if archive.config != m.config else ("", "", "")
        detail = f" ({key}: {ours} vs {theirs})" if key else ""
        raise K3Error(f"{where} was compiled for config {m.config_hash}, archive {archive.path} was packed for "
                      f"config {archive.config_hash}{detail}")
    if m.checkpoint_hash and archive.checkpoint_hash != m.checkpoint_hash:
        raise K3Error(f"{where}: archive {archive.path} was packed from another checkpoint than "
                      f"{m.checkpoint} (or it changed since)")
    if problem := first_table_difference(m.parameters, archive.parameters):
        raise K3Error(f"{where}: archive {archive.path} {problem}")
