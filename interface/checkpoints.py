"""Checkpoints k3c writes: seeded random weights for a preset (``k3c init-checkpoint``) and the
MXFP4 conversion of a checkpoint's float experts (``k3c quantize``); model/convert.py writes them."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..model.config import K3Config
from ..model.convert import QuantizedTensor, quantize_checkpoint, save_checkpoint
from ..model.init import init_weights
from ..model.model import K3Model
from ..model.shapes import require_memory
from ..utils.files import MARKER, check_output


def init_checkpoint(preset: str, seed: int, out_dir: str | Path, shard_size: int | None, *, force: bool,
                    log=print) -> None:
    """A checkpoint of seeded random weights (the same seed gives the same bytes), refused up front
    where the model does not fit in the memory available here."""
    cfg = K3Config.preset(preset)
    check_output(out_dir, force=force)
    require_memory(cfg, torch.float32, "init-checkpoint")
    start = time.perf_counter()
    model = init_weights(K3Model(cfg), seed)
    log(f"initialised {preset} with seed {seed} in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    save_checkpoint(model, out_dir, shard_size)
    files = [f for f in sorted(Path(out_dir).iterdir()) if f.name != MARKER]
    log(f"wrote {out_dir}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB "
        f"in {time.perf_counter() - start:.1f} s")


def quantize(in_dir: str | Path, out_dir: str | Path, *, force: bool, log=print) -> list[QuantizedTensor]:
    """``in_dir``'s float routed experts as MXFP4 in ``out_dir``, every other tensor byte for byte;
    the error of each tensor converted."""
    check_output(out_dir, force=force, inputs=(in_dir,))
    start = time.perf_counter()
    report = quantize_checkpoint(in_dir, out_dir)
    log(f"quantised {len(report)} tensors into {out_dir} in {time.perf_counter() - start:.1f} s")
    return report
