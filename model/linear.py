"""The model's projections (docs/pipeline.md §6): ``nn.Linear`` without bias whose product is the
``k3::linear`` op (ops/linear.py), so that a compiled program reads each weight at the dtype it is
stored in and each target multiplies it its own way."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.linear import linear, reference


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T: exported, the op; run eagerly, the op's reference without a custom op's dispatch (which
    cost 2.4% of an eager k3-small decode step)."""
    return linear(x, weight) if torch.compiler.is_exporting() else reference(x, weight)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return project(x, self.weight)
