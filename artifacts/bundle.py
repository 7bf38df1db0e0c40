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

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from ..errors import K3Error

MANIFEST = "manifest.json"
FORMAT = 1
PACKAGES = ("k3c", "torch", "torch-mlir", "iree-base-compiler", "iree-base-runtime")


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


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


def hash_dir(path: Path) -> str:
    """sha256 over the sorted (relative name, file sha256) pairs of a directory tree."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(target: Path):
    """Yield a temporary directory beside ``target``; rename it to ``target`` on success, remove it
    on any failure (including KeyboardInterrupt). An existing ``target`` is replaced."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like any new directory
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
