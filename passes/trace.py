"""Trace a PyTorch function to linalg-on-tensors MLIR text: how an op's implementation is written.

Op implementations are PyTorch functions (often the very reference in model/), traced with static
or dynamic shapes by torch-mlir and handed over as text to IREE's MLIR context, where rewrite.py
calls them in place of the ``torch.k3.*`` operators.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.export import Dim

from ..exporter.export import leafspec_deprecation_silenced

_ELEMENT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
            "i64": torch.int64, "i32": torch.int32, "i8": torch.uint8, "i1": torch.bool}
_VTENSOR_ELEMENT = {"f32": "f32", "f16": "f16", "bf16": "bf16", "f64": "f64",
                    "si64": "i64", "si32": "i32", "ui8": "i8", "si8": "i8", "i1": "i1"}


@dataclass(frozen=True)
class TensorType:
    """A builtin tensor type: shape with None for a dynamic dim, and an element type name."""
    shape: tuple[int | None, ...]
    element: str

    @classmethod
    def from_vtensor(cls, text: str) -> "TensorType":
        m = re.fullmatch(r"!torch\.vtensor<\[([^\]]*)\],(\w+)>", text)
        if not m:
            raise ValueError(f"not a ranked torch value tensor: {text}")
        dims = [d for d in m.group(1).split(",") if d]
        return cls(tuple(None if d == "?" else int(d) for d in dims), _VTENSOR_ELEMENT[m.group(2)])

    def __str__(self) -> str:
        return "tensor<" + "".join(("?" if d is None else str(d)) + "x" for d in self.shape) + self.element + ">"

    def with_dim(self, index: int, size: int | None) -> "TensorType":
        shape = list(self.shape)
        shape[index] = size
        return TensorType(tuple(shape), self.element)

    def example(self, dynamic_size: int, high: int = 4) -> torch.Tensor:
        shape = [dynamic_size if d is None else d for d in self.shape]
        dtype = _ELEMENT[self.element]
        if dtype.is_floating_point:
            return torch.randn(shape, dtype=dtype)
        return torch.randint(0, high, shape, dtype=dtype)


def trace_to_linalg(fn, types: list[TensorType], func_name: str, *, int_high: int = 4,
                    dynamic_max: int = 1 << 20) -> str:
    """MLIR text of a module holding ``func @func_name`` that computes ``fn(*tensors)``.
    Dynamic dims (None) at the same index share one symbolic size; integer inputs get example
    values in [0, int_high) (e.g. valid expert ids)."""
    from torch_mlir import fx

    class Body(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    dims: dict[int, Dim] = {}
    spec = []
    for t in types:
        spec.append({i: dims.setdefault(i, Dim(f"d{i}", min=2, max=dynamic_max))
                     for i, d in enumerate(t.shape) if d is None} or None)
    examples = [t.example(3, int_high) for t in types]
    with leafspec_deprecation_silenced():
        module = fx.export_and_import(Body(), *examples, dynamic_shapes=(tuple(spec),) if dims else None,
                                      output_type="linalg-on-tensors", func_name=func_name)
    return str(module)
