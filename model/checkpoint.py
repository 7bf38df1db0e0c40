"""Reading checkpoint directories (Hugging Face layout) into a K3Model (docs/model.md §0-5); convert.py writes them.

A directory holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000i-of-0000N.safetensors`` listed by ``model.safetensors.index.json``. Tensors carry
K3Model's state_dict names (Kimi Linear checkpoints map through ``kimi_linear.k3_parts``). Trunk
tensors may be bf16, f16 or f32 (convert.py writes bf16, and f32 where docs/model.md §1 and §4 say so: short-conv
weights, ``dt_bias``, ``A_log``, ``o_norm``, ``e_score_correction_bias``). Routed experts are
MXFP4, ``experts.{e}.w{1,3,2}.weight_packed`` u8 [out, in/2] + ``.weight_scale`` u8 [out, in/32]
(w1 gate, w3 up, w2 down), or a float ``.weight`` when the config has no ``quantization_config``.

Also read: routed experts in the gpt-oss layout (docs/model.md §5), four stacked tensors per layer,
    ``model.layers.N.block_sparse_moe.experts.gate_up_proj_blocks`` u8 [E, 2I, L/32, 16]
    ``model.layers.N.block_sparse_moe.experts.gate_up_proj_scales`` u8 [E, 2I, L/32]
    ``model.layers.N.block_sparse_moe.experts.down_proj_blocks``    u8 [E, L, I/32, 16]
    ``model.layers.N.block_sparse_moe.experts.down_proj_scales``    u8 [E, L, I/32]
with gate and up rows interleaved (row 2i = w1 row i, row 2i + 1 = w3 row i); they are presented as
the per-expert K3 tensors and read one expert at a time.

Which files a checkpoint is (``checkpoint_files``, the one rule): exactly ``model.safetensors``, or
the shards the index's ``weight_map`` names, inside the directory; any other ``*.safetensors`` beside
them is never read. The K3 release (docs/model.md §8) names every text tensor under ``language_model.`` and
stores the vision tower and projector (``vision_tower.*``, ``mm_projector.*``) in the same shards:
the prefix is dropped, the others skipped with one log line. What is stored must agree with the
config's ``quantization_config``, tensor by tensor (``check_quantization``). Float tensors are
checked for NaN and Inf as they are read.

Reading is lazy and memory-mapped (``safe_open``, never pickle) into a model built on the meta
device, so no tensor is ever held twice. Every problem is a K3Error naming the tensor and file.
"""
from __future__ import annotations

import contextlib
import errno
import json
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from rich.console import Console
from rich.progress import track
from safetensors import SafetensorError, safe_open

from ..errors import K3Error
from ..ops import mxfp4
from .config import K3Config
from .kimi_linear import k3_parts
from .model import DecoderLayer, K3Model
from .shapes import require_memory
from .stacking import from_checkpoint, to_checkpoint

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
FP32_SUFFIXES = ("conv1d.weight", ".dt_bias", ".A_log", ".o_norm.weight", ".e_score_correction_bias")
FLOAT_DTYPES = ("F32", "BF16", "F16")
# safetensors' dtype names, in the order its writer lays tensors out (then by name)
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
PROGRESS = Console(stderr=True)
GPT_OSS = re.compile(r"(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)_(?P<part>blocks|scales)")
TEXT_PREFIX = "language_model."                      # the K3 release's text tensors (docs/model.md §8)
NOT_TEXT = ("vision_tower.", "mm_projector.")         # stored beside them, skipped
FLOAT_EXPERT = re.compile(r".*\.experts\.\d+\.w[123]\.weight")
MXFP4_SUFFIXES = (".weight_packed", ".weight_scale", "_blocks", "_scales")
_SKIP_LOGGED: set[Path] = set()


def progress(items: Iterable, what: str) -> Iterable:
    """A rich progress bar on stderr while iterating ``items``, shown only on a terminal."""
    return track(items, what, transient=True, console=PROGRESS, disable=not PROGRESS.is_terminal)


def to_model_name(name: str) -> str:
    """Checkpoint tensor name -> K3Model checkpoint-layout name: K3's names are the checkpoint's,
    under ``language_model.`` in the release. Kimi Linear names then map through ``kimi_linear.k3_parts``."""
    return name.removeprefix(TEXT_PREFIX)


def stored_dtype(name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype a tensor is written in: u8 stays, the spec's f32 tensors f32, the rest bf16."""
    if t.dtype == torch.uint8:
        return torch.uint8
    return torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16


@dataclass(frozen=True)
class Entry:
    """One K3Model tensor in a checkpoint: the stored tensor ``key`` of ``file``, or the part of it
    that ``part`` reads from its safetensors slice (gpt-oss experts). ``shape`` is the K3Model shape."""
    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]
    part: Callable[[Any], torch.Tensor] | None = None

    def read(self, f) -> torch.Tensor:
        return f.get_tensor(self.key) if self.part is None else self.part(f.get_slice(self.key))


def gpt_oss_entries(file: Path, key: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Entry] | None:
    """The per-expert K3 tensors inside one stacked gpt-oss tensor (module docstring), or None if
    ``key`` is not a gpt-oss expert tensor."""
    m = GPT_OSS.fullmatch(key)
    if m is None:
        return None
    blocks = m["part"] == "blocks"
    if len(shape) != (4 if blocks else 3) or (blocks and shape[-1] != 16):
        want = "[E, rows, in/32, 16]" if blocks else "[E, rows, in/32]"
        raise K3Error(f"{file}: tensor '{key}' has shape {list(shape)}, gpt-oss layout needs {want}")
    E, rows, groups = shape[:3]
    if m["proj"] == "down_proj":
        parts, n = {"w2": slice(None)}, rows
    elif rows % 2:
        raise K3Error(f"{file}: tensor '{key}' has {rows} rows; interleaved gate/up rows must be even")
    else:
        parts, n = {"w1": slice(0, None, 2), "w3": slice(1, None, 2)}, rows // 2
    k3_shape = (n, groups * 16 if blocks else groups)

    def part(e: int, r: slice) -> Callable[[Any], torch.Tensor]:
        return lambda s: mxfp4.from_gpt_oss(s[e, r]) if blocks else s[e, r]

    suffix = "weight_packed" if blocks else "weight_scale"
    return {f"{m['prefix']}.{e}.{w}.{suffix}": Entry(file, key, dtype, k3_shape, part(e, r))
            for e in range(E) for w, r in parts.items()}


STACKED_EXPERTS = re.compile(r"(?P<head>.*\.experts)\.(?P<tail>w[123]\.weight(_packed|_scale)?)")


def stacked_expert_entries(file: Path, key: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Entry] | None:
    """The per-expert tensors inside one tensor of K3Model's own layout, experts stacked [E, ...]
    (what ``save_checkpoint(..., module_layout=True)`` writes, e.g. for ONNX external data), or None."""
    m = STACKED_EXPERTS.fullmatch(key)
    if m is None or not shape:
        return None

    def part(e: int) -> Callable[[Any], torch.Tensor]:
        return lambda s: s[e]

    return {f"{m['head']}.{e}.{m['tail']}": Entry(file, key, dtype, tuple(shape[1:]), part(e)) for e in range(shape[0])}


@dataclass
class Checkpoint:
    """The tensors of a checkpoint directory, from the safetensors headers only (no data read).

    ``stored``: file -> {key: (dtype, shape)} as stored (text tensors only); ``entries``: K3Model
    name -> Entry."""
    directory: Path
    listing: Path                 # the index, or the single file: what names the tensors
    stored: dict[Path, dict[str, tuple[str, tuple[int, ...]]]]
    entries: dict[str, Entry]


def checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory, resolved; a missing one or a symlink loop is a one-line error."""
    try:
        directory = Path(path).resolve(strict=True)
    except (OSError, RuntimeError) as e:   # RuntimeError: a symlink loop (Python 3.11)
        why = "a symlink loop" if isinstance(e, RuntimeError) or e.errno == errno.ELOOP else "does not exist"
        raise K3Error(f"checkpoint {path}: {why}") from None
    if not directory.is_dir():
        raise K3Error(f"checkpoint {path}: not a directory")
    return directory


def _read_index(directory: Path) -> tuple[Path, dict[str, Path]]:
    """The listing (index or single file) and, for a sharded checkpoint, each tensor's shard. Every
    shard must lie inside the directory (no absolute path, no ``..`` out of it, no symlink out)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        single = directory / SINGLE_FILE
        if not single.is_file():
            raise K3Error(f"checkpoint {directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        return single, {}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise K3Error(f"{index}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise K3Error(f"{index}: weight_map must be an object of tensor name -> shard file name")
    root = directory.resolve()
    shard_of = {}
    for key, shard in sorted(weight_map.items()):
        path = directory / shard
        if Path(shard).is_absolute() or not _inside(path, root):
            raise K3Error(f"{index}: tensor '{key}' is in shard {shard}, outside the checkpoint directory")
        if not path.is_file():
            raise K3Error(f"{index}: tensor '{key}' is in shard {shard}, which does not exist")
        shard_of[key] = path
    return index, shard_of


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except (OSError, RuntimeError):   # a symlink loop
        return False


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The safetensors files a checkpoint is: ``model.safetensors``, or the shards its index names."""
    return _files(*_read_index(checkpoint_dir(directory)))


def _files(listing: Path, shard_of: dict[str, Path]) -> list[Path]:
    return sorted(set(shard_of.values())) if shard_of else [listing]


def _cut_tensor(path: Path) -> str | None:
    """The first tensor whose data lies past the end of a cut-short safetensors file (from its
    header: u64 length, then JSON with each tensor's data_offsets), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
        try:
            header = json.loads(f.read(n)) if 8 + n <= size else {}
            ends = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
            cut = [k for k, (_, end) in ends.items() if 8 + n + end > size]
            return min(cut, key=lambda k: ends[k][0]) if cut else None
        except (ValueError, TypeError, KeyError, AttributeError):   # not a header of that structure
            return None


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a safetensors file: name -> (dtype, shape), from its header."""
    try:
        with safe_open(path, framework="pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        cut = _cut_tensor(path)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        what = f"tensor '{cut}' is cut short (truncated file)" if cut else f"unreadable safetensors file ({why})"
        raise K3Error(f"{path}: {what}") from None


def _text_tensors(header: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[dict, int]:
    """The header without the vision tower and projector (docs/model.md §8), and how many were left out."""
    text = {k: v for k, v in header.items() if not k.startswith(NOT_TEXT)}
    return text, len(header) - len(text)


def check_quantization(cfg: K3Config, path: Path, key: str, name: str) -> None:
    """What a tensor is stored as must be what ``quantization_config`` says (docs/model.md §8): MXFP4 pairs
    only for routed experts the config quantises, float ``.weight`` for the rest."""
    where = f"{path}: tensor '{key}'"
    if name.endswith(MXFP4_SUFFIXES):
        if not cfg.experts_mxfp4:
            raise K3Error(f"{where} is stored MXFP4, but the config has no quantization_config")
        if cfg.quantization_ignores(name):
            raise K3Error(f"{where} is stored MXFP4, but quantization_config.ignore names it")
    elif cfg.experts_mxfp4 and FLOAT_EXPERT.fullmatch(name):
        raise K3Error(f"{where} is a float routed expert, but quantization_config says "
                      f"{cfg.quantization_config.get('format')} (weight_packed + weight_scale)")


def open_checkpoint(directory: str | Path, cfg: K3Config | None = None) -> Checkpoint:
    """List a checkpoint's tensors from the index and the safetensors headers (docs/model.md §0-5, §8)."""
    directory = checkpoint_dir(directory)
    listing, shard_of = _read_index(directory)
    stored, skipped = {}, 0
    for path in _files(listing, shard_of):
        stored[path], n = _text_tensors(read_header(path))
        skipped += n
    if skipped and directory not in _SKIP_LOGGED:
        _SKIP_LOGGED.add(directory)
        print(f"{directory}: skipped {skipped} vision_tower / mm_projector tensors (not the text model)",
              file=sys.stderr)
    return Checkpoint(directory, listing, stored, stored_entries(stored, shard_of, listing, cfg))


def stored_entries(stored: dict[Path, dict[str, tuple[str, tuple[int, ...]]]], shard_of: dict[str, Path],
                   listing: Path, cfg: K3Config | None) -> dict[str, Entry]:
    """K3Model name -> Entry for the text tensors of each file's header (``stored``), checked
    against the index (``shard_of``, empty for a single file) and, given ``cfg``, against its
    quantization_config; Kimi Linear's tensors are translated to K3's (kimi_linear.k3_parts)."""
    for key, path in shard_of.items():
        if key not in stored[path] and not key.startswith(NOT_TEXT):
            raise K3Error(f"{path}: tensor '{key}' listed in {listing.name} is not in the file")
    entries: dict[str, Entry] = {}
    for path, header in stored.items():
        for key, (dtype, shape) in header.items():
            if shard_of and shard_of.get(key) != path:
                raise K3Error(f"{path}: tensor '{key}' is also stored in {shard_of[key].name}, which "
                              f"{listing.name} names; remove the copy" if key in shard_of else
                              f"{path}: tensor '{key}' is not listed in {listing.name}")
            name = to_model_name(key)
            if cfg is not None:
                check_quantization(cfg, path, key, name)
            if cfg is not None and cfg.layout == "kimi_linear":
                expanded = {k: Entry(path, key, dtype, s, part=part) for k, s, part in k3_parts(name, shape, cfg)}
            else:
                expanded = (gpt_oss_entries(path, key, dtype, shape) or stacked_expert_entries(path, key, dtype, shape)
                            or {name: Entry(path, key, dtype, shape)})
            for k, entry in expanded.items():
                k = to_model_name(k)
                if k in entries:
                    raise K3Error(f"{path}: tensor '{key}' holds '{k}', which '{entries[k].key}' "
                                  f"({entries[k].file.name}) holds too")
                entries[k] = entry
    return entries


def check_entries(ckpt: Checkpoint, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor the model needs is present with its shape and an accepted dtype, and nothing else."""
    missing = sorted(expected.keys() - ckpt.entries.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise K3Error(f"{ckpt.listing}: tensor '{missing[0]}' is missing{more}")
    for name in sorted(ckpt.entries):
        e = ckpt.entries[name]
        where = f"{e.file}: tensor '{e.key}'" + (f" (as '{name}')" if name != e.key else "")
        if name not in expected:
            raise K3Error(f"{where} is not part of the model {ckpt.directory / CONFIG_FILE} describes")
        want = expected[name]
        if e.shape != tuple(want.shape):
            raise K3Error(f"{where} has shape {list(e.shape)}, expected {list(want.shape)}")
        accepted = ("U8",) if want.dtype == torch.uint8 else FLOAT_DTYPES
        if e.dtype not in accepted:
            raise K3Error(f"{where} has dtype {e.dtype}, expected {' or '.join(accepted)}")


def is_scale(e: Entry) -> bool:
    return e.key.endswith(("weight_scale", "_scales"))


def check_scale(name: str, e: Entry, t: torch.Tensor) -> None:
    if is_scale(e) and bool((t == mxfp4.SCALE_NAN).any()):
        where = f" (as '{name}')" if name != e.key else ""
        raise K3Error(f"{e.file}: tensor '{e.key}'{where} holds the MXFP4 NaN scale 0xFF")


def check_finite(name: str, e: Entry, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        where = f" (as '{name}')" if name != e.key else ""
        raise K3Error(f"{e.file}: tensor '{e.key}'{where} holds NaN or Inf")


def open_checked(directory: str | Path) -> tuple[K3Model, Checkpoint]:
    """The model a checkpoint's config describes (on the meta device) and the checkpoint's tensors,
    checked against it by name, shape and dtype (headers only, no data read)."""
    cfg = K3Config.from_hf(directory)
    ckpt = open_checkpoint(directory, cfg)
    with torch.device("meta"):
        model = K3Model(cfg)
    check_entries(ckpt, to_checkpoint(model.state_dict()))
    return model, ckpt


def read_entries(ckpt: Checkpoint, names: Iterable[str], what: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the named tensors one at a time (MXFP4 scales checked for NaN), with progress."""
    with contextlib.ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, framework="pt")) for p in ckpt.stored}
        for name in progress(list(names), what):
            e = ckpt.entries[name]
            t = e.read(handles[e.file])
            check_scale(name, e, t)
            check_finite(name, e, t)
            yield name, t


def check_scales(ckpt: Checkpoint) -> None:
    """Read every MXFP4 scale tensor (and nothing else) to check it holds no NaN (0xFF)."""
    for _ in read_entries(ckpt, [n for n, e in ckpt.entries.items() if is_scale(e)], "checking MXFP4 scales"):
        pass


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32) -> K3Model:
    """Read a checkpoint into a K3Model: float tensors cast to ``dtype`` (the spec's f32 tensors stay
    f32), MXFP4 tensors as stored. Built on the meta device and filled tensor by tensor."""
    require_memory(K3Config.from_hf(checkpoint_dir(directory)), dtype, "load the checkpoint")
    model, ckpt = open_checked(directory)
    loaded = {}
    for name, t in read_entries(ckpt, sorted(ckpt.entries), "loading"):
        if t.dtype != torch.uint8:
            t = t.to(torch.float32 if name.endswith(FP32_SUFFIXES) else dtype)
        loaded[name] = t.contiguous()
    model.load_state_dict(from_checkpoint(loaded), assign=True)
    return model.eval()


def load_layer(ckpt: Checkpoint, cfg: K3Config, layer: int, dtype: torch.dtype = torch.float32) -> DecoderLayer:
    """Decoder layer ``layer`` alone with its tensors read from ``ckpt`` (``open_checked``), cast as in
    ``load_checkpoint``: built on the meta device and filled, so memory holds this one layer."""
    prefix = f"model.layers.{layer}."
    loaded = {}
    for name, t in read_entries(ckpt, sorted(n for n in ckpt.entries if n.startswith(prefix)), f"loading layer {layer}"):
        if t.dtype != torch.uint8:
            t = t.to(torch.float32 if name.endswith(FP32_SUFFIXES) else dtype)
        loaded[name.removeprefix(prefix)] = t.contiguous()
    with torch.device("meta"):
        module = DecoderLayer(cfg, layer)
    module.load_state_dict(from_checkpoint(loaded), assign=True)
    return module.eval()
