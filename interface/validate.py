"""Validation: run a bundle's prompt through the compiled module and compare with reference.npz.

Decode steps are teacher-forced with the reference's greedy ids, so one flipped argmax cannot
hide the error of every later step. A step passes when its max abs error is within the target's
tolerance and its top-1 token agrees.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..artifacts.bundle import Bundle
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


@dataclass
class LayerResult:
    layer: int
    kind: str
    max_abs: float
    max_rel: float


def compare(step: str, got: np.ndarray, ref: np.ndarray, tol: float) -> StepResult:
    got, ref = np.atleast_2d(got).astype(np.float64), np.atleast_2d(ref).astype(np.float64)
    err = np.abs(got - ref).max()
    cos = float((got * ref).sum() / (np.linalg.norm(got) * np.linalg.norm(ref) + 1e-30))
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    g5, r5 = np.argsort(-got, -1)[:, :5], np.argsort(-ref, -1)[:, :5]
    top5 = float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(g5, r5)]))
    finite = bool(np.isfinite(got).all())
    return StepResult(step, float(err), float(err / np.abs(ref).max()), cos, top1, top5,
                      finite and err <= tol and top1 == 1.0)


def validate(bundle: Bundle, per_layer: bool = False) -> tuple[list[StepResult], list[LayerResult]]:
    ref = np.load(bundle.reference_path)
    tol = TOLERANCE[bundle.manifest.target["backend"]]
    session = Session(bundle)
    logits, hidden = session.prefill(ref["prompt_ids"])
    steps = [compare("prefill", logits, ref["prefill_logits"], tol)]
    for i, token in enumerate(ref["decode_ids"]):
        steps.append(compare(f"decode {i}", session.decode(int(token)), ref["decode_logits"][i], tol))
    layers = layer_errors(bundle, ref["prompt_ids"], hidden) if per_layer else []
    return steps, layers


def layer_errors(bundle: Bundle, prompt: np.ndarray, hidden: np.ndarray) -> list[LayerResult]:
    """The residual stream after each layer, compiled vs the PyTorch model on the bundle's checkpoint."""
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
    from .build import build_bundle

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
