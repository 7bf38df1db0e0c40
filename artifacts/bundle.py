"""The bundle: everything needed to run and re-validate a compiled model, verified on open.

    BUNDLE/manifest.json   config and its hash, checkpoint hashes, target and flags, package
                           versions, entry points, sha256 of every file below
    BUNDLE/module.vmfb     the compiled module (weights are parameters, never constants)
    BUNDLE/checkpoint/     the checkpoint the parameters are read from (when the bundle owns it)
    BUNDLE/reference.npz   PyTorch outputs for the validation prompt

Bundles are written into a temporary sibling directory and renamed into place, so a reader never
sees a half-written bundle.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from ..errors import K3Error
from ..utils.files import hash_dir, sha256_file

MANIFEST = "manifest.json"
FORMAT = 1
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
    files: dict = field(default_factory=dict)        # relative path -> sha256
    packages: dict = field(default_factory=package_versions)
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def seal(root: Path, manifest: Manifest) -> None:
    """Record the sha256 of every file under ``root`` in the manifest and write it."""
    manifest.files = {f.relative_to(root).as_posix(): sha256_file(f)
                      for f in sorted(root.rglob("*")) if f.is_file() and f.name != MANIFEST}
    (root / MANIFEST).write_text(manifest.to_json())


@dataclass
class Bundle:
    root: Path
    manifest: Manifest

    @property
    def module_path(self) -> Path:
        return self.root / "module.vmfb"

    @property
    def checkpoint_dir(self) -> Path:
        ck = Path(self.manifest.checkpoint)
        return ck if ck.is_absolute() else self.root / ck

    @property
    def reference_path(self) -> Path:
        return self.root / "reference.npz"


def open_bundle(path: str | Path) -> Bundle:
    """Read the manifest and verify every file's sha256; K3Error names the first file that differs."""
    root = Path(path)
    if not root.is_dir():
        raise K3Error(f"bundle: directory {root} does not exist")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise K3Error(f"bundle: {root} has no {MANIFEST} (not a k3c bundle)")
    try:
        raw = json.loads(mpath.read_text())
        manifest = Manifest(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise K3Error(f"bundle: {mpath} is not a valid manifest ({e})") from None
    if manifest.format != FORMAT:
        raise K3Error(f"bundle: {root} has format {manifest.format}, this k3c reads format {FORMAT}")
    for rel, digest in manifest.files.items():
        f = root / rel
        if not f.is_file():
            raise K3Error(f"bundle: file {rel} listed in the manifest is missing from {root}")
        if sha256_file(f) != digest:
            raise K3Error(f"bundle: file {rel} in {root} does not match its sha256 in the manifest (tampered or corrupt)")
    bundle = Bundle(root, manifest)
    if not bundle.checkpoint_dir.is_dir():
        raise K3Error(f"bundle: checkpoint {bundle.checkpoint_dir} referenced by {root} is missing")
    if Path(manifest.checkpoint).is_absolute() and hash_dir(bundle.checkpoint_dir) != manifest.checkpoint_hash:
        raise K3Error(f"bundle: checkpoint {bundle.checkpoint_dir} changed since {root} was compiled")
    from ..model.config import K3Config
    config = K3Config.from_hf(bundle.checkpoint_dir)
    if config.hash != manifest.config_hash or config.to_dict() != manifest.config:
        raise K3Error(f"bundle: {root} was compiled for config {manifest.config_hash}, but its checkpoint "
                      f"{bundle.checkpoint_dir} has config {config.hash}")
    return bundle
