"""Writing checkpoints (docs/model.md §0-5): from a model (``save_checkpoint``) or by converting another
checkpoint's float routed experts to MXFP4 (``quantize_checkpoint``).

Both stream one tensor at a time into safetensors files laid out byte for byte as safetensors' own
writer would, inside a temporary directory renamed into place when complete, so an interrupted
write leaves nothing behind and the same inputs give the same bytes. Layout: see checkpoint.py.
"""
from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ..utils.files import atomic_dir
from ..errors import K3Error
from ..ops import mxfp4
from .checkpoint import (CONFIG_FILE, DTYPE_NAMES, FLOAT_DTYPES, INDEX_FILE, SINGLE_FILE, TORCH_DTYPES,
                         check_scales, open_checked, progress, read_header, stored_dtype)
from .config import K3Config
from .model import K3Model
from .stacking import to_checkpoint

Header = dict[str, tuple[str, tuple[int, ...]]]


def safetensors_order(header: Header) -> list[str]:
    """The order safetensors' own writer lays tensors out: by dtype (wider first), then by name."""
    rank = list(TORCH_DTYPES)
    return sorted(header, key=lambda k: (rank.index(header[k][0]), k))


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return TORCH_DTYPES[dtype].itemsize * torch.Size(shape).numel()


def write_safetensors(path: Path, header: Header, tensor: Callable[[str], torch.Tensor]) -> int:
    """Write one safetensors file a tensor at a time: ``header`` gives each name's (dtype, shape) up
    front, ``tensor(name)`` makes the data when it is written. safetensors' own ``save_file`` needs
    every tensor at once; the bytes written here are the ones it would write. Returns the data size."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in safetensors_order(header):
        end = offset + nbytes(*header[key])
        meta[key] = {"dtype": header[key][0], "shape": list(header[key][1]), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in progress(safetensors_order(header), f"writing {path.name}"):
            t = tensor(key)
            if (DTYPE_NAMES.get(t.dtype), tuple(t.shape)) != header[key]:
                raise K3Error(f"{path}: tensor '{key}' is {t.dtype} {list(t.shape)}, its header says {header[key]}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return offset


def shard_names(sizes: dict[str, int], shard_bytes: int | None) -> dict[str, str]:
    """Tensor name -> file: one ``model.safetensors``, or names in sorted order filled greedily
    into shards of at most ``shard_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name in sorted(sizes):
        if shard_bytes is not None and shards[-1] and filled + sizes[name] > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += sizes[name]
    if len(shards) == 1:
        return dict.fromkeys(shards[0], SINGLE_FILE)
    n = len(shards)
    return {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, names in enumerate(shards) for name in names}


def write_index(directory: Path, file_of: dict[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": file_of}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model: K3Model, directory: str | Path, shard_bytes: int | None = None,
                    module_layout: bool = False) -> Path:
    """Write ``config.json`` and the weights (module docstring), atomically and deterministically:
    routed experts one tensor per expert as released, or with ``module_layout`` stacked [E, ...] as
    K3Model holds them (one contiguous tensor each, which ONNX external data can point at)."""
    state = model.state_dict() if module_layout else to_checkpoint(model.state_dict())
    state = {k: v.detach() for k, v in state.items()}
    dtypes = {k: stored_dtype(k, t) for k, t in state.items()}
    header = {k: (DTYPE_NAMES[dtypes[k]], tuple(t.shape)) for k, t in state.items()}
    file_of = shard_names({k: dtypes[k].itemsize * t.numel() for k, t in state.items()}, shard_bytes)
    files = sorted(set(file_of.values()))
    with atomic_dir(Path(directory)) as tmp:
        (tmp / CONFIG_FILE).write_text(model.cfg.to_json() + "\n")
        total = sum(write_safetensors(tmp / file, {k: header[k] for k in file_of if file_of[k] == file},
                                      lambda k: state[k].to(dtypes[k])) for file in files)
        if len(files) > 1:
            write_index(tmp, file_of, total)
    return Path(directory)


# ---- quantize ----------------------------------------------------------------------------------
FLOAT_EXPERT = re.compile(r".*\.experts\.\d+\.w[123]\.weight")
MXFP4_CONFIG = K3Config.preset("k3").quantization_config


@dataclass(frozen=True)
class QuantizedTensor:
    name: str
    shape: tuple[int, ...]
    rel_rms_error: float      # ||dequantize(quantize(w)) - w|| / ||w||


def quantized_header(path: Path, header: Header) -> Header:
    """A file's header after quantisation: each float ``experts.{e}.w*.weight`` [out, in] becomes
    ``weight_packed`` u8 [out, in/2] + ``weight_scale`` u8 [out, in/32]; the rest is unchanged."""
    out: Header = {}
    for key, (dtype, shape) in header.items():
        if not FLOAT_EXPERT.fullmatch(key):
            out[key] = (dtype, shape)
            continue
        if dtype not in FLOAT_DTYPES or len(shape) != 2 or shape[1] % mxfp4.GROUP:
            raise K3Error(f"{path}: tensor '{key}' ({dtype} {list(shape)}) is not a float matrix "
                          f"whose input dim is a multiple of {mxfp4.GROUP}")
        out[key + "_packed"] = ("U8", (shape[0], shape[1] // 2))
        out[key + "_scale"] = ("U8", (shape[0], shape[1] // mxfp4.GROUP))
    unknown = [k for k, (dtype, _) in out.items() if dtype not in TORCH_DTYPES]
    if unknown:
        raise K3Error(f"{path}: tensor '{unknown[0]}' has dtype {out[unknown[0]][0]}, which k3c does not write")
    return out


def quantized_tensors(f, header: Header, report: list[QuantizedTensor]) -> Callable[[str], torch.Tensor]:
    """``tensor(name)`` for a quantised file: float experts are quantised when their packed half is
    asked for (safetensors order puts ``_packed`` right before ``_scale``), the rest read as stored."""
    scales: dict[str, torch.Tensor] = {}

    def tensor(name: str) -> torch.Tensor:
        if name in header:
            return f.get_tensor(name)
        if name in scales:
            return scales.pop(name)
        key = name.removesuffix("_packed")
        w = f.get_tensor(key).float()
        packed, scale = mxfp4.quantize(w)
        err = torch.linalg.vector_norm(mxfp4.dequantize(packed, scale) - w) / torch.linalg.vector_norm(w)
        report.append(QuantizedTensor(key, tuple(w.shape), float(err) if err.isfinite() else 0.0))
        scales[key + "_scale"] = scale
        return packed
    return tensor


def quantize_checkpoint(src: str | Path, dst: str | Path) -> list[QuantizedTensor]:
    """Convert a checkpoint's float routed experts to MXFP4 (docs/model.md §5), one tensor at a time.

    The input is checked as ``load_checkpoint`` checks it. Files without float experts are copied
    byte for byte, so quantising an MXFP4 checkpoint reproduces it; in the others every other
    tensor keeps its dtype and bytes. ``config.json`` gets the MXFP4 ``quantization_config`` (and the
    index the new names) when anything was quantised. Returns each quantised tensor's error."""
    src, dst = Path(src), Path(dst)
    _, ckpt = open_checked(src)
    check_scales(ckpt)
    report: list[QuantizedTensor] = []
    file_of: dict[str, str] = {}
    total = 0
    with atomic_dir(dst) as tmp:
        for path in ckpt.stored:
            header = read_header(path)   # every tensor of the file, the vision tower's too (docs/model.md §8)
            out = quantized_header(path, header)
            file_of.update(dict.fromkeys(out, path.name))
            if out == header:
                shutil.copyfile(path, tmp / path.name)
                total += sum(nbytes(*v) for v in out.values())
            else:
                with safe_open(path, framework="pt") as f:
                    total += write_safetensors(tmp / path.name, out, quantized_tensors(f, header, report))
        stored = {path.resolve() for path in ckpt.stored}
        for item in sorted(src.iterdir()):   # config, index, tokenizer and the like
            if item.resolve() not in stored:
                (shutil.copytree if item.is_dir() else shutil.copyfile)(item, tmp / item.name)
        if report:
            raw = json.loads((src / CONFIG_FILE).read_text())
            (raw.get("text_config") or raw)["quantization_config"] = MXFP4_CONFIG
            (tmp / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
            if (src / INDEX_FILE).is_file():
                write_index(tmp, file_of, total)
    return report
