"""Native kernels of the CPU levels: C sources in ``kernels/`` compiled by this machine's C compiler
for a CPU level (``-march=x86-64-v3``, compiler/cpu.py), linked by iree-compile into the dispatch
that calls them (IREE's executable objects, ``hal.executable.objects`` on a ``stream.executable``;
docs/pipeline.md §3). The object is built for the target's level, never for the build host, so a
module runs wherever its level's features are.

A kernel is written in C where IREE 3.13's code generation cannot produce the instruction it needs
(mxfp4_rows.c: a table lookup by ``vpermps``; a ``tensor.extract`` from a constant table is
scalarised). The object is built once per (source, compiler, flags) and kept in the cache
(``K3C_CACHE/objects/<key>/``, its sha256 checked on every use); iree-compile reads it by path.
``object_file`` returns None where there is no C compiler or the source does not build for the
level (it picks its variant from the compiler's ``__AVX512F__`` / ``__AVX2__`` and stops with
``#error`` below AVX2): the caller then emits its linalg kernel.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..utils.files import atomic_dir, cache_dir, cache_lock, seal_entry, verified_entry

KERNELS = Path(__file__).parent / "kernels"
# a freestanding position-independent object for IREE's embedded ELF linker: no libc, no stack
# protector or unwind tables (their symbols do not exist there)
FLAGS = ("-O2", "-fPIC", "-ffreestanding", "-fno-builtin", "-nostdlib",
         "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-c")


@functools.cache
def object_file(name: str, level: str) -> Path | None:
    """``kernels/<name>.c`` compiled for CPU ``level`` (cached), or None where it cannot be (see above)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    source = KERNELS / f"{name}.c"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    flags = (f"-march={level}", *FLAGS)
    key = hashlib.sha256(b"\0".join([source.read_bytes(), version, " ".join(flags).encode()])).hexdigest()[:24]
    entry = cache_dir() / "objects" / f"{name}-{level}-{key}"
    with cache_lock(entry):
        if verified_entry(entry, (f"{name}.o",)) is None:
            with tempfile.TemporaryDirectory() as scratch:
                built = Path(scratch) / f"{name}.o"
                try:
                    done = subprocess.run([cc, *flags, str(source), "-o", str(built)], capture_output=True,
                                          timeout=120)
                except (OSError, subprocess.SubprocessError):
                    return None
                if done.returncode != 0:
                    return None
                with atomic_dir(entry) as tmp:
                    shutil.copy(built, tmp / built.name)
                    seal_entry(tmp)
    return entry / f"{name}.o"
