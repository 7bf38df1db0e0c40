"""Trace a PyTorch function to linalg-on-tensors MLIR text: how the body of a lowering is written.

The bodies are PyTorch functions (often the very reference the op's eager path runs), traced with
static or named dynamic sizes by torch-mlir and handed over as text to IREE's MLIR context, where
passes/rewrite.py calls them in place of the ``torch.k3.*`` operators.
"""
from __future__ import annotations

import torch
from torch.export import Dim

from ..utils.quiet import leafspec_deprecation_silenced
from .base import TensorType


def example(t: TensorType, dynamic_size: int, int_high: int) -> torch.Tensor:
    """A tensor of type ``t``, each dynamic size ``dynamic_size``: floats uninitialised (tracing reads
    no value, and pages never touched cost no memory: K3's LM head is 2.3 GB), integers in
    [0, int_high) (e.g. valid expert ids)."""
    shape = [d if isinstance(d, int) else dynamic_size for d in t.shape]
    if t.dtype.is_floating_point:
        return torch.empty(shape, dtype=t.dtype)
    return torch.randint(0, int_high, shape, dtype=t.dtype)


def trace_to_linalg(fn, types: list[TensorType], func_name: str, *, int_high: int = 4,
                    dynamic_max: int = 1 << 20) -> str:
    """MLIR text of a module holding ``func @func_name`` that computes ``fn(*tensors)`` of ``types``.
    Every dynamic size must be named (``TensorType.with_dim(i, "N")``); sizes of one name are one
    symbolic size."""
    # deferred heavy import (~1.5 s, torch-mlir's own MLIR libraries): only lowering traces
    from torch_mlir import fx

    class Body(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    dims: dict[str, Dim] = {}
    spec = []
    for t in types:
        if None in t.shape:
            raise ValueError(f"trace_to_linalg: {func_name}: name every dynamic size, got {t.describe()}")
        spec.append({i: dims.setdefault(d, Dim(d, min=2, max=dynamic_max))
                     for i, d in enumerate(t.shape) if isinstance(d, str)} or None)
    examples = [example(t, 3, int_high) for t in types]
    with leafspec_deprecation_silenced():
        module = fx.export_and_import(Body(), *examples, dynamic_shapes=(tuple(spec),) if dims else None,
                                      output_type="linalg-on-tensors", func_name=func_name)
    return str(module)
