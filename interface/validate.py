"""Validation: run a bundle's prompt through the compiled module and compare with reference.npz.

Decode steps are teacher-forced with the reference's greedy ids, so one flipped argmax cannot
hide the error of every later step. A step passes when its max abs error is within the target's
tolerance and its top-1 token agrees.
"""
from __future__ import annotations

import math
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from numpy.lib import format as npy

from ..artifacts.bundle import Bundle
from ..errors import K3Error
from ..runtimes.session import Session
from ..compiler.targets import TargetStatus, target_statuses

# max abs logit error allowed per target kind; fp32 everywhere, GPUs reassociate reductions more
TOLERANCE = {"llvm-cpu": 1e-4, "vulkan-spirv": 5e-4, "cuda": 5e-4, "rocm": 5e-4}


@dataclass
class StepResult:
    step: str             # "prefill" (all prompt positions) or "decode i"
    max_abs: float
    max_rel: float        # max abs error / max |reference|
    cosine: float
    top1: float           # fraction of positions whose argmax agrees
    top5: float           # mean overlap of the top-5 sets
    passed: bool
    finite: bool = True   # every compiled logit is finite
    non_finite_layer: int | None = None   # prefill: the first layer whose output holds NaN/Inf


@dataclass
class LayerResult:
    layer: int
    kind: str
    max_abs: float
    max_rel: float


def compare(step: str, got: np.ndarray, ref: np.ndarray, tol: float) -> StepResult:
    """A position whose compiled logits hold NaN/Inf agrees on no token (argmax would pick the NaN)."""
    got, ref = np.atleast_2d(got).astype(np.float64), np.atleast_2d(ref).astype(np.float64)
    err = np.abs(got - ref).max()
    cos = float((got * ref).sum() / (np.linalg.norm(got) * np.linalg.norm(ref) + 1e-30))
    rows = np.isfinite(got).all(-1)
    top1 = float(((got.argmax(-1) == ref.argmax(-1)) & rows).mean())
    g5, r5 = np.argsort(-got, -1)[:, :5], np.argsort(-ref, -1)[:, :5]
    top5 = float(np.mean([len(set(a) & set(b)) / 5 * ok for a, b, ok in zip(g5, r5, rows)]))
    finite = bool(rows.all())
    return StepResult(step, float(err), float(err / np.abs(ref).max()), cos, top1, top5,
                      bool(finite and err <= tol and top1 == 1.0), finite)


def first_non_finite(steps: list[StepResult]) -> str | None:
    """Where the compiled outputs first hold NaN/Inf: the step, and for prefill the layer."""
    bad = next((s for s in steps if not s.finite), None)
    if bad is None:
        return None
    layer = "" if bad.non_finite_layer is None else f", first in the output of layer {bad.non_finite_layer}"
    return f"non-finite logits: first at step {bad.step}{layer}"


REFERENCE_ARRAYS = {"prompt_ids": (1, "iu"), "prefill_logits": (2, "f"), "decode_ids": (1, "iu"),
                    "decode_logits": (2, "f")}


REFERENCE_SLACK_ROWS = 64   # rows beyond max_prompt a reference's logits may have (its decode steps)


def check_reference_members(path: Path, max_bytes: int) -> None:
    """Before numpy allocates anything: every member of the archive unpacks to at most ``max_bytes``
    (a zip bomb is refused by its declared size, which zipfile also holds the reading to), and the
    shape its .npy header claims fits in the bytes it unpacks to."""
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.file_size > max_bytes:
                raise K3Error(f"validate: {path}: member {info.filename} unpacks to {info.file_size:,} bytes, "
                              f"more than a reference of this bundle holds ({max_bytes:,})")
            with z.open(info) as f:
                read = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(npy.read_magic(f))
                if read is None:
                    raise ValueError(f"member {info.filename} is not a .npy array of format 1.0 or 2.0")
                shape, _, dtype = read(f)
            if math.prod(shape) * dtype.itemsize > info.file_size:
                raise K3Error(f"validate: {path}: array {info.filename} claims shape {shape}, more than its "
                              f"{info.file_size:,} bytes hold")


def load_reference(bundle: Bundle) -> dict[str, np.ndarray]:
    """reference.npz's arrays, each present, numeric (never pickled objects) and of its rank; for a
    bundle built without them (the model did not fit in memory), computed now where it fits."""
    if bundle.manifest.no_reference:
        from .build import checkpoint_reference
        ref = checkpoint_reference(bundle.checkpoint_dir, bundle.manifest.max_prompt)
        if isinstance(ref, str):
            raise K3Error(f"validate: {bundle.root} has no reference outputs and none can be computed here: {ref}; "
                          "validate it layer by layer (k3c validate --layers)")
        return ref
    path = bundle.reference_path
    m = bundle.manifest
    try:
        check_reference_members(path, 8 * (m.max_prompt + REFERENCE_SLACK_ROWS) * m.config["vocab_size"])
        with np.load(path, allow_pickle=False) as npz:
            missing = sorted(REFERENCE_ARRAYS.keys() - set(npz.files))
            if missing:
                raise K3Error(f"validate: {path} has no array {missing[0]!r}")
            ref = {key: npz[key] for key in REFERENCE_ARRAYS}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise K3Error(f"validate: {path} is not a reference of numeric arrays ({str(e).splitlines()[0]})") from None
    for key, (rank, kinds) in REFERENCE_ARRAYS.items():
        if ref[key].ndim != rank or ref[key].dtype.kind not in kinds:
            raise K3Error(f"validate: {path}: array {key!r} is {ref[key].dtype} of rank {ref[key].ndim}, "
                          f"expected rank {rank} of kind {kinds!r}")
    if len(ref["decode_logits"]) != len(ref["decode_ids"]) or len(ref["prefill_logits"]) != len(ref["prompt_ids"]):
        raise K3Error(f"validate: {path}: the logits and ids arrays differ in length")
    vocab = bundle.manifest.config["vocab_size"]
    if {ref["prefill_logits"].shape[1], ref["decode_logits"].shape[1]} != {vocab}:
        raise K3Error(f"validate: {path}: logits are not of the bundle's vocab_size {vocab}")
    return ref


def validate(bundle: Bundle, per_layer: bool = False) -> tuple[list[StepResult], list[LayerResult]]:
    """The prefill and decode steps against the reference; with a sequence pool also ``pooled``."""
    ref = load_reference(bundle)
    tol = TOLERANCE[bundle.manifest.target["backend"]]
    session = Session(bundle)
    logits, hidden = session.prefill(ref["prompt_ids"], hidden=True)
    prefilled = session.state, session.position
    steps = [compare("prefill", logits, ref["prefill_logits"], tol)]
    bad_layers = [i for i, h in enumerate(hidden) if not np.isfinite(h).all()]
    steps[0].non_finite_layer = bad_layers[0] if bad_layers else None
    for i, token in enumerate(ref["decode_ids"]):
        steps.append(compare(f"decode {i}", session.decode(int(token)), ref["decode_logits"][i], tol))
    steps += pooled(session, prefilled, ref, tol)
    layers = layer_errors(bundle, ref["prompt_ids"], hidden) if per_layer else []
    return steps, layers


def pooled(session: Session, prefilled: tuple, ref: dict[str, np.ndarray], tol: float) -> list[StepResult]:
    """The decode steps again through the sequence pool, at the largest batch: the prefilled
    state put into every slot, each row one copy of the sequence ("pooled i", every row against
    the reference). None without a pool, or where a slot holds fewer tokens than the
    prompt and its steps."""
    pool = session.pool
    n_steps = len(ref["decode_ids"])
    if pool is None or prefilled[1] + n_steps >= pool.context:
        return []
    n = pool.max_batch
    for slot in range(n):
        session.state, session.position = prefilled
        session.put(slot)
    out = []
    for i, token in enumerate(ref["decode_ids"]):
        got = session.decode_pooled([int(token)] * n, [prefilled[1] + i] * n)
        out.append(compare(f"pooled {i}", got, np.tile(ref["decode_logits"][i], (n, 1)), tol))
    return out


def layer_errors(bundle: Bundle, prompt: np.ndarray, hidden: np.ndarray) -> list[LayerResult]:
    """The residual stream after each layer, compiled vs the PyTorch model on the bundle's checkpoint."""
    # deferred heavy imports (torch, ~2 s): only --per-layer runs the PyTorch model here
    import torch

    from ..model.checkpoint import load_checkpoint

    model = load_checkpoint(bundle.checkpoint_dir, dtype=torch.float32)
    ref: list[torch.Tensor] = []
    with torch.no_grad():
        model.layers_forward(torch.from_numpy(prompt)[None], model.init_state(1), False, ref)
    out = []
    for i, (h, r) in enumerate(zip(hidden, ref)):
        r = r[0].numpy()
        err = float(np.abs(h - r).max())
        out.append(LayerResult(i, model.cfg.layer_kinds[i], err, err / float(np.abs(r).max())))
    return out


def first_divergent(layers: list[LayerResult], tol: float) -> LayerResult | None:
    return next((lr for lr in layers if lr.max_abs > tol), None)


def as_dicts(results) -> list[dict]:
    return [asdict(r) for r in results]


def validate_targets(preset: str, work: Path, log=print) -> list[TargetStatus]:
    """``k3c targets --validate``: build a ``preset`` bundle under ``work`` for every known target
    that runs here and validate it; the others keep their probe results."""
    from .build import build_bundle  # deferred heavy import (torch, the exporter): only --validate builds

    rows = target_statuses()
    for row in rows:
        t = row.target
        row.tolerance = TOLERANCE[t.backend]
        if row.compiles and row.runs:
            steps, _ = validate(build_bundle(work / t.name.replace(":", "-"), t, preset=preset, log=log))
            row.validated = "PASS" if all(s.passed for s in steps) else "FAIL"
            row.max_abs = max(s.max_abs for s in steps)
            log(f"{t.name}: {row.validated} (worst max abs {row.max_abs:.1e})")
    return rows
