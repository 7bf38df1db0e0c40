"""The pack step: a checkpoint -> an IREE parameter archive (.irpa) in the program's layout.

Every program parameter (model/stacking.py) is written once: tensors outside the layers as stored,
each per-layer tensor kind stacked over the layers of its group, routed experts stacked over E
within a layer (the release stores one tensor per expert, in name order: experts.10 before
experts.2; here they are ordered by number). Tensors keep their stored dtypes (bf16 trunk, u8 MXFP4).

Streaming: each stacked tensor is assembled slice by slice (one checkpoint tensor at a time) into a
scratch file beside the output, so memory stays at one slice whatever the model's size; IREE then
writes the archive from that file, which is renamed into place when complete.
"""
from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import K3Error
from ..model.checkpoint import TORCH_DTYPES, Checkpoint, open_checked, read_entries
from ..model.config import K3Config
from ..model.stacking import EXPERT, place, program_name
from ..utils.files import sha256_file

@dataclass
class Packed:
    path: Path
    sha256: str
    parameters: int
    bytes: int
    seconds: float


def program_members(cfg: K3Config, ckpt: Checkpoint) -> dict[str, list[str]]:
    """Program parameter -> the checkpoint tensors it stacks, layer-major then expert-major."""
    places = place(cfg)
    members: dict[str, list[tuple[int, int, str]]] = {}
    for name in ckpt.entries:
        m = EXPERT.fullmatch(name)
        program, index = program_name(places, f"{m['head']}.{m['tail']}" if m else name)
        members.setdefault(program, []).append((index or 0, int(m["e"]) if m else 0, name))
    return {p: [name for *_, name in sorted(v)] for p, v in sorted(members.items())}


def _stacked_shape(ckpt: Checkpoint, program: str, names: list[str]) -> tuple[int, ...]:
    first = ckpt.entries[names[0]]
    if not program.startswith("layers."):
        return tuple(first.shape)
    layers = len({n.split(".")[2] for n in names})
    experts = len(names) // layers
    return (layers, experts, *first.shape) if EXPERT.fullmatch(names[0]) else (layers, *first.shape)


def pack(checkpoint: Path, out: Path, log=print) -> Packed:
    """Write the archive for the checkpoint at ``checkpoint`` to ``out`` (atomically)."""
    import iree.runtime as rt

    t0 = time.perf_counter()
    model, ckpt = open_checked(checkpoint)
    members = program_members(model.cfg, ckpt)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch, tmp = out.with_name(f".{out.name}.scratch"), out.with_name(f".{out.name}.tmp")
    layout, offset = {}, 0
    for program, names in members.items():
        shape = _stacked_shape(ckpt, program, names)
        nbytes = math.prod(shape) * TORCH_DTYPES[ckpt.entries[names[0]].dtype].itemsize
        layout[program] = (offset, nbytes, names)
        offset += nbytes
    try:
        with open(scratch, "wb") as f:
            f.truncate(offset)
        with open(scratch, "r+b") as f, mmap.mmap(f.fileno(), max(offset, 1)) as view:
            order = {name: program for program, (_, _, names) in layout.items() for name in names}
            cursor = {program: start for program, (start, _, _) in layout.items()}
            for name, t in read_entries(ckpt, [n for names in members.values() for n in names], "packing"):
                raw = t.contiguous().view(-1).view(torch.uint8).numpy()
                at = cursor[order[name]]
                view[at:at + raw.size] = raw.tobytes()
                cursor[order[name]] = at + raw.size
            index = rt.ParameterIndex()
            for program, (start, nbytes, _) in layout.items():
                index.add_buffer(program, memoryview(view)[start:start + nbytes])
            index.create_archive_file(str(tmp))
            del index
        os.replace(tmp, out)
    except OSError as e:
        raise K3Error(f"pack: cannot write {out}: {e.strerror}") from None
    finally:
        for f in (scratch, tmp):
            f.unlink(missing_ok=True)
    packed = Packed(out, sha256_file(out), len(layout), offset, time.perf_counter() - t0)
    log(f"packed {packed.parameters} parameters ({packed.bytes / 1e6:.1f} MB) into {out} in {packed.seconds:.1f}s")
    return packed
