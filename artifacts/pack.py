"""The pack step: a checkpoint -> an IREE parameter archive (.irpa) in the program's layout
(docs/bundle.md §5).

Every program parameter (model/stacking.py) is written once: tensors outside the layers as stored,
each per-layer tensor kind stacked over the layers of its group, routed experts stacked over E
within a layer (the release stores one tensor per expert, in name order: experts.10 before
experts.2; here they are ordered by number). Tensors keep their stored dtypes (bf16 trunk, u8 MXFP4).
Any layout k3c reads (its own, the K3 release, Kimi Linear from the Hub or transformers) is packed
straight from its files (model/checkpoint.py presents each as K3Model tensors), never converted first.

The archive describes itself (artifacts/archive.py reads the description), so a module can be
checked against an archive and an archive against damage and against the checkpoint it came from.

Streaming: each stacked tensor is assembled slice by slice (one checkpoint tensor at a time) into a
scratch file beside the output (its space reserved first, so a full disk is an error, not a fault in
a mapped write), so memory stays at one slice whatever the model's size; IREE then writes the
archive from that file into a temporary file, linked into place when complete (never over a file
that appeared meanwhile). Scratch and temporary names carry the process id.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import K3Error
from .archive import FORMAT, ITEMSIZE, META, ParameterTable
from ..model.checkpoint import TORCH_DTYPES, Checkpoint, open_checked, read_entries
from ..model.config import K3Config
from ..model.placement import expert_ranges
from ..model.stacking import EXPERT, place, program_name, shard_name
from ..utils.files import hash_dir, sha256_file



@dataclass
class Packed:
    path: Path
    sha256: str
    parameters: int
    bytes: int
    seconds: float


def program_members(cfg: K3Config, ckpt: Checkpoint, devices: int = 1) -> dict[str, list[str]]:
    """Program parameter -> the checkpoint tensors it stacks, layer-major then expert-major. For a
    program over several ``devices`` each device's range of the experts is a parameter of its own
    (model/stacking.py ``shard_name``)."""
    places = place(cfg)
    device_of = {e: d for d, r in enumerate(expert_ranges(cfg.num_experts, devices)) for e in r}
    members: dict[str, list[tuple[int, int, str]]] = {}
    for name in ckpt.entries:
        m = EXPERT.fullmatch(name)
        program, index = program_name(places, f"{m['head']}.{m['tail']}" if m else name)
        if m and devices > 1:
            program = shard_name(program, device_of[int(m["e"])])
        members.setdefault(program, []).append((index or 0, int(m["e"]) if m else 0, name))
    return {p: [name for *_, name in sorted(v)] for p, v in sorted(members.items())}


def _stacked_shape(ckpt: Checkpoint, program: str, names: list[str]) -> tuple[int, ...]:
    first = ckpt.entries[names[0]]
    if not program.startswith("layers."):
        return tuple(first.shape)
    layers = len({n.split(".")[2] for n in names})
    experts = len(names) // layers
    return (layers, experts, *first.shape) if EXPERT.fullmatch(names[0]) else (layers, *first.shape)


def checkpoint_table(cfg: K3Config, ckpt: Checkpoint, devices: int = 1) -> ParameterTable:
    """The program parameters a checkpoint packs into (for a program over ``devices`` devices), from
    its headers: the tensors stacked into one parameter must share a stored dtype (else a K3Error
    naming the one that differs)."""
    table = {}
    for program, names in program_members(cfg, ckpt, devices).items():
        dtypes = {ckpt.entries[n].dtype for n in names}
        if len(dtypes) > 1:
            first = ckpt.entries[names[0]].dtype
            odd = next(ckpt.entries[n] for n in names if ckpt.entries[n].dtype != first)
            raise K3Error(f"{odd.file}: tensor '{odd.key}' is stored {odd.dtype}, the other tensors of "
                          f"parameter {program} (e.g. '{ckpt.entries[names[0]].key}') {first}: one parameter "
                          "is read at one dtype")
        dtype = str(TORCH_DTYPES[dtypes.pop()]).removeprefix("torch.")
        table[program] = [dtype, list(_stacked_shape(ckpt, program, names))]
    return table


def pack(checkpoint: Path, out: Path, *, checkpoint_hash: str | None = None, devices: int = 1,
         log=print) -> Packed:
    """Write the archive for the checkpoint at ``checkpoint`` to ``out`` (atomically), in the layout
    of a program over ``devices`` devices; ``checkpoint_hash`` (utils.files.hash_dir of it) when the
    caller has it already."""
    import iree.runtime as rt  # deferred heavy import (~1.5 s): only packing writes an archive

    t0 = time.perf_counter()
    model, ckpt = open_checked(checkpoint)
    out = Path(out)
    if out.resolve().is_relative_to(ckpt.directory):
        raise K3Error(f"pack: {out} lies inside the checkpoint {ckpt.directory}, which packing reads; write it elsewhere")
    cfg = model.cfg
    members, table = program_members(cfg, ckpt, devices), checkpoint_table(cfg, ckpt, devices)
    meta = json.dumps({"format": FORMAT, "config": cfg.to_dict(), "config_hash": cfg.hash,
                       "checkpoint_hash": checkpoint_hash or hash_dir(ckpt.directory)}, sort_keys=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch, tmp = (out.with_name(f".{out.name}.{os.getpid()}.{kind}") for kind in ("scratch", "tmp"))
    layout, offset = {}, 0
    for program, (dtype, shape) in table.items():
        layout[program] = (offset, math.prod(shape) * ITEMSIZE[dtype])
        offset += layout[program][1]
    try:
        with open(scratch, "wb") as f:
            if offset:   # the space reserved now: a full disk is ENOSPC here, never SIGBUS in the mapped writes
                os.posix_fallocate(f.fileno(), 0, offset)
        with open(scratch, "r+b") as f, mmap.mmap(f.fileno(), max(offset, 1)) as view:
            program_of = {name: program for program, names in members.items() for name in names}
            cursor = {program: start for program, (start, _) in layout.items()}
            digests = {program: hashlib.sha256() for program in layout}
            for name, t in read_entries(ckpt, [n for names in members.values() for n in names], "packing"):
                raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                program = program_of[name]
                view[cursor[program]:cursor[program] + len(raw)] = raw
                cursor[program] += len(raw)
                digests[program].update(raw)
            index = rt.ParameterIndex()
            for program, (start, nbytes) in layout.items():
                dtype, shape = table[program]
                index.add_buffer(program, memoryview(view)[start:start + nbytes], metadata=json.dumps(
                    {"dtype": dtype, "shape": shape, "sha256": digests[program].hexdigest()}))
            index.add_buffer(META, meta.encode())
            try:
                index.create_archive_file(str(tmp))
            except RuntimeError as e:   # the archive writer's failures, a full disk among them
                why = str(e).splitlines()[0].rsplit("; ", 1)[-1]
                raise K3Error(f"pack: cannot write {out}: {why}") from None
            finally:
                del index   # its buffers are views of the mapped scratch file, closed next
        digest = sha256_file(tmp)
        os.link(tmp, out)   # never over a file: another writer's archive that appeared meanwhile stays
    except FileExistsError:
        raise K3Error(f"pack: {out} appeared while this archive was written (another k3c pack?); "
                      "k3c does not replace it") from None
    except OSError as e:
        raise K3Error(f"pack: cannot write {out}: {e.strerror}") from None
    finally:
        for f in (scratch, tmp):
            f.unlink(missing_ok=True)
    packed = Packed(out, digest, len(layout), offset, time.perf_counter() - t0)
    log(f"packed {packed.parameters} parameters ({packed.bytes / 1e6:.1f} MB) into {out} in {packed.seconds:.1f}s")
    return packed
