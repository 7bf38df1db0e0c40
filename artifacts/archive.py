"""An IREE parameter archive as ``k3c pack`` writes it (docs/bundle.md §5), read without torch:
opening a bundle to run it checks its archive and loads nothing of the model.

The archive describes itself: each parameter's IRPA metadata is JSON ``{"dtype", "shape",
"sha256"}`` (the sha256 of its bytes), and the entry ``k3c.archive`` holds JSON ``{"format",
"config", "config_hash", "checkpoint_hash"}``.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import K3Error

META = "k3c.archive"        # the archive's own description (module docstring)
FORMAT = 1
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}

# program parameter -> [dtype ("bfloat16", "float32", "float16", "uint8"), shape]: what a module reads
ParameterTable = dict[str, list]


@dataclass
class Archive:
    """What an archive says of itself (module docstring), read from its index without its data."""
    path: Path
    config: dict
    config_hash: str
    checkpoint_hash: str
    parameters: ParameterTable
    sha256: dict[str, str]           # parameter -> sha256 of its bytes

    @property
    def digest(self) -> str:
        """One hash naming the archive's contents: over its parameters' sha256."""
        return hashlib.sha256(json.dumps(self.sha256, sort_keys=True).encode()).hexdigest()


def _index(path: Path):
    import iree.runtime as rt

    if not path.is_file():
        raise K3Error(f"archive {path} does not exist")
    index = rt.ParameterIndex()
    try:
        index.load(str(path))
    except (IndexError, ValueError, RuntimeError) as e:
        why = str(e).split("; ", 1)[-1].splitlines()[0][:160]
        raise K3Error(f"archive {path} is not a readable IREE parameter archive ({why})") from None
    return index


def read_archive(path: str | Path) -> Archive:
    """The archive's description, each parameter's recorded size checked against the bytes it holds;
    a K3Error naming the first problem (not an archive, damaged index, not packed by k3c pack)."""
    path = Path(path)
    index = _index(path)
    entries = dict(index.items())
    if META not in entries:
        raise K3Error(f"archive {path} has no {META} entry: it was not written by k3c pack")
    try:
        meta = json.loads(bytes(entries.pop(META).file_view))
        if meta.get("format") != FORMAT:
            raise K3Error(f"archive {path} has format {meta.get('format')!r}, this k3c reads format {FORMAT} "
                          "(pack it again)")
        config, config_hash, checkpoint_hash = meta["config"], meta["config_hash"], meta["checkpoint_hash"]
        parameters, sha256 = {}, {}
        for name, e in entries.items():
            desc = json.loads(e.metadata)
            dtype, shape = desc["dtype"], [int(d) for d in desc["shape"]]
            if math.prod(shape) * ITEMSIZE[dtype] != e.length:
                raise K3Error(f"archive {path}: parameter '{name}' holds {e.length} bytes, its description "
                              f"says {dtype} {shape}")
            parameters[name], sha256[name] = [dtype, shape], desc["sha256"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise K3Error(f"archive {path}: its description is damaged ({type(e).__name__}: {e})") from None
    return Archive(path, config, config_hash, checkpoint_hash, parameters, sha256)


def verify_archive(archive: Archive, log=print) -> None:
    """Read every parameter's bytes and compare them with its recorded sha256 (a damaged archive is a
    K3Error naming the first parameter that differs)."""
    t0 = time.perf_counter()
    index = _index(archive.path)
    for name, e in index.items():
        if name != META and hashlib.sha256(e.file_view).hexdigest() != archive.sha256.get(name):
            raise K3Error(f"archive {archive.path}: parameter '{name}' does not match its sha256 (damaged)")
    log(f"verified {len(archive.sha256)} parameters of {archive.path} in {time.perf_counter() - t0:.1f}s")


def first_table_difference(want: ParameterTable, got: ParameterTable) -> str | None:
    """How ``got`` (what is provided) differs from ``want`` (what a module reads), as a clause naming
    the first parameter: missing, extra, or of another dtype or shape; None when equal."""
    for name in sorted(want.keys() | got.keys()):
        if name not in got:
            return f"has no parameter '{name}' ({want[name][0]} {want[name][1]})"
        if name not in want:
            return f"has a parameter '{name}' the module does not read"
        if got[name] != want[name]:
            return f"has '{name}' as {got[name][0]} {got[name][1]}, the module reads {want[name][0]} {want[name][1]}"
    return None
